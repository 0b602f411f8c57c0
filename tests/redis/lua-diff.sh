#!/bin/sh
# SPDX-License-Identifier: MIT
#
# usage: lua-diff.sh DIFFGEN SCRIPT [LIBRARY]
#
# The differential outside Redis: DIFFGEN writes random sequences with the
# local library's answers, driver.lua runs SCRIPT on them under lua5.1.
# TOKENBUCKET_LUA_SEQUENCES sequences (default 50000) of 20 steps, in two
# halves run side by side; each step also runs with the script's common
# case turned off, which must change nothing, and asking for the compact
# reply (8th argument "1"), which must store the same and say the same;
# with LIBRARY (the function library the build writes) every step also
# runs on its function and on the script, moved to the server's clock,
# and both must reply and store the same.  Then
# TOKENBUCKET_LUA_SET_SEQUENCES (default 2000) sequences of allow_all, keys
# of 1 to 4 limits, against local sets (driver-set.lua).
set -eu
gen=$1
script=$2
shift 2
# What remains: the driver's --function LIBRARY, or nothing.
[ $# -gt 0 ] && set -- --function "$1"
. "$(dirname "$0")/../skip.sh"
command -v lua5.1 >/dev/null 2>&1 || skip "lua differential: lua5.1 (package lua5.1) is not installed"
total=${TOKENBUCKET_LUA_SEQUENCES:-50000}
half=$((total / 2))
driver=$(dirname "$0")/driver.lua
# --general: every step also runs on the script with its common case
# turned off, and both must decide it alike, stored value and expiry included.
"$gen" 1 "$half" 20 | lua5.1 "$driver" "$script" --general "$@" &
first=$!
status=0
"$gen" 2 "$((total - half))" 20 | lua5.1 "$driver" "$script" --general "$@" || status=1
wait $first || status=1
# Then hand-made steps the generator never writes: numbers with leading
# zeros, rate 0 per a period other than 1, times below 1 s, the server's clock.
lua5.1 "$driver" "$script" --general "$@" < "$(dirname "$0")/noncanonical.steps" || status=1
# And products at and past 2^53 that the common cases take since 1.2
# (a byte rate, the thresholds, every number at 10^15 - 1), next to the
# API's largest rate and burst, which the general path takes.
lua5.1 "$driver" "$script" --general "$@" < "$(dirname "$0")/wide.steps" || status=1
"$gen" set 3 "${TOKENBUCKET_LUA_SET_SEQUENCES:-2000}" 20 |
	lua5.1 "$(dirname "$0")/driver-set.lua" "$script" "$@" || status=1
exit $status
