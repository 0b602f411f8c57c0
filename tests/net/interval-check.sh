#!/bin/sh
# SPDX-License-Identifier: MIT
#
# usage: interval-check.sh TB_INTERVAL_CHECK
#
# tb-interval-check on logs whose worst interval is known by hand: it must
# find the excess, where it is, and fail (exit 1) above --max-excess.
set -eu
check=$1
fails=0
# expect NAME "WORST FIRST" EXIT ARGS... < input
expect() {
	name=$1 want=$2 rc_want=$3
	shift 3
	rc=0
	got=$("$check" "$@") || rc=$?
	worst=$(echo "$got" | awk '{ for (i = 1; i < NF; i++) if ($i == "worst_excess") print $(i + 1) }')
	first=$(echo "$got" | awk '{ for (i = 1; i < NF; i++) if ($i == "first_excess") print $(i + 1) }')
	if [ "$worst $first" != "$want" ] || [ "$rc" -ne "$rc_want" ]; then
		echo "FAIL $name: got \"$worst $first\" exit $rc, want \"$want\" exit $rc_want ($got)"
		fails=$((fails + 1))
	fi
}
# Three at once against a burst of 2: one over.
printf '0\n0\n0\n' | expect "three at once" "1.000 1.000" 1 --rate 10 --burst 2 --max-excess 0
# The third 100 ms later, at 10/s: exactly the bound.
printf '100000000\n0\n0\n' | expect "refilled" "0.000 0.000" 0 --rate 10 --burst 2 --max-excess 0
# A rush after a quiet second: 4 tokens at t = 1 s over a burst of 2 (the
# hold-then-rush pattern); from a first call 1 s earlier, 6 within 2 + 20.
printf '0\n500000000\n1000000000 3\n1000000000\n' |
	expect "rush" "2.000 -11.000" 1 --rate 10 --burst 2 --from -1000000000 --max-excess 1.5
# Spans: where a grant fell within its span is not known, so only grants
# surely inside an interval count: [0, 50] and [40, 100] fit no interval
# shorter than 100 ns together.
printf '0 50\n40 100\n' | expect "spans" "0.000 0.000" 0 --spans --rate 10000000 --burst 1 --max-excess 0
printf '0 50\n40 100\n' | expect "spans, tighter" "1.000 1.000" 1 --spans --rate 0 --burst 1 --max-excess 0
# Bad input: out of a span's order, or not a number.
rc=0
printf '5 3\n' | "$check" --spans --rate 1 --burst 1 >/dev/null 2>&1 || rc=$?
[ "$rc" -eq 2 ] || { echo "FAIL: a span ending before it starts: exit $rc"; fails=$((fails + 1)); }
rc=0
printf 'x\n' | "$check" --rate 1 --burst 1 >/dev/null 2>&1 || rc=$?
[ "$rc" -eq 2 ] || { echo "FAIL: not a number: exit $rc"; fails=$((fails + 1)); }
[ "$fails" -eq 0 ] && echo "interval-check: all cases"
exit "$((fails > 0))"
