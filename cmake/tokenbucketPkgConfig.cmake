# SPDX-License-Identifier: MIT
#
# Writes libtokenbucket.pc for one install prefix.  Included both at configure
# time and at install time (where CMAKE_INSTALL_PREFIX is the prefix given to
# `cmake --install --prefix`).
#
# Input variables:
#   TOKENBUCKET_PC_IN, TOKENBUCKET_PC_OUT      template and output file
#   TOKENBUCKET_PC_PREFIX                      install prefix
#   TOKENBUCKET_PC_LIBDIR_RAW                  CMAKE_INSTALL_LIBDIR
#   TOKENBUCKET_PC_INCLUDEDIR_RAW              CMAKE_INSTALL_INCLUDEDIR
#   TOKENBUCKET_PC_VERSION, TOKENBUCKET_PC_LIBS_PRIVATE

# Sets out to dir expressed as ${prefix}/... where possible.
function(_tokenbucket_pc_dir out dir prefix)
  if(NOT IS_ABSOLUTE "${dir}")
    set(${out} "\${prefix}/${dir}" PARENT_SCOPE)
    return()
  endif()
  file(RELATIVE_PATH rel "${prefix}" "${dir}")
  if(rel STREQUAL "")
    set(${out} "\${prefix}" PARENT_SCOPE)
  elseif(IS_ABSOLUTE "${rel}" OR rel MATCHES "^\\.\\.(/|$)")
    set(${out} "${dir}" PARENT_SCOPE)
  else()
    set(${out} "\${prefix}/${rel}" PARENT_SCOPE)
  endif()
endfunction()

_tokenbucket_pc_dir(TOKENBUCKET_PC_LIBDIR "${TOKENBUCKET_PC_LIBDIR_RAW}" "${TOKENBUCKET_PC_PREFIX}")
_tokenbucket_pc_dir(TOKENBUCKET_PC_INCLUDEDIR "${TOKENBUCKET_PC_INCLUDEDIR_RAW}" "${TOKENBUCKET_PC_PREFIX}")
configure_file("${TOKENBUCKET_PC_IN}" "${TOKENBUCKET_PC_OUT}" @ONLY)
