#!/bin/sh
# SPDX-License-Identifier: MIT
#
# usage: lua-diff.sh DIFFGEN SCRIPT
#
# The differential outside Redis: DIFFGEN writes random sequences with the
# local library's answers, driver.lua runs SCRIPT on them under lua5.1.
# TOKENBUCKET_LUA_SEQUENCES sequences (default 50000) of 20 steps, in two
# halves run side by side; each step also runs with the script's common
# case turned off, which must change nothing.
set -eu
gen=$1
script=$2
. "$(dirname "$0")/../skip.sh"
command -v lua5.1 >/dev/null 2>&1 || skip "lua differential: lua5.1 (package lua5.1) is not installed"
total=${TOKENBUCKET_LUA_SEQUENCES:-50000}
half=$((total / 2))
driver=$(dirname "$0")/driver.lua
# The script with its common case turned off: the driver checks that both
# decide every step alike, stored value and expiry included.
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
general=$tmp/general.lua
gate='local common = op == "allow" or op == "reserve"'
[ "$(grep -cFx "$gate" "$script")" = 1 ] || { echo "lua-diff.sh: the common case's gate is not in $script" >&2; exit 1; }
sed 's/^local common = op == "allow" or op == "reserve"$/local common = false/' "$script" > "$general"
[ "$(grep -cFx 'local common = false' "$general")" = 1 ] || { echo "lua-diff.sh: could not turn the common case off" >&2; exit 1; }
"$gen" 1 "$half" 20 | lua5.1 "$driver" "$script" "$general" &
first=$!
status=0
"$gen" 2 "$((total - half))" 20 | lua5.1 "$driver" "$script" "$general" || status=1
wait $first || status=1
# Then hand-made steps the generator never writes: numbers with leading
# zeros, rate 0 per a period other than 1, times below 1 s.
lua5.1 "$driver" "$script" "$general" < "$(dirname "$0")/noncanonical.steps" || status=1
exit $status
