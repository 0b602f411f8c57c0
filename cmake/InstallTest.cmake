# SPDX-License-Identifier: MIT
#
# The `install` test: installs this build tree into a temporary prefix and
# builds and runs tests/install/consumer.c against it, through pkg-config
# (shared and static) and through find_package(tokenbucket).

add_test(NAME install
  COMMAND ${CMAKE_COMMAND} -E env
          "CC=${CMAKE_C_COMPILER}"
          "CMAKE=${CMAKE_COMMAND}"
          "PKG_CONFIG=${PKG_CONFIG_EXECUTABLE}"
          "TOKENBUCKET_INSTALL_CONFIG=$<CONFIG>"
          sh "${CMAKE_CURRENT_SOURCE_DIR}/tests/install/run.sh"
             "${CMAKE_BINARY_DIR}" "${CMAKE_CURRENT_SOURCE_DIR}")
set_tests_properties(install PROPERTIES
  SKIP_RETURN_CODE 77
  TIMEOUT 600
  LABELS install)
