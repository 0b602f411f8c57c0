# SPDX-License-Identifier: MIT
# Sourced by the test scripts that need an optional tool.
#
# skip MESSAGE: the tool is missing.  Exits 77 (ctest's SKIP_RETURN_CODE), or
# 1 where TOKENBUCKET_NO_SKIP is set (CI, which installs every tool).
skip() {
	echo "SKIP: $*"
	if [ -n "${TOKENBUCKET_NO_SKIP:-}" ]; then
		echo "(TOKENBUCKET_NO_SKIP is set: failing instead)" >&2
		exit 1
	fi
	exit 77
}
