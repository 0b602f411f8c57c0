#!/bin/sh
# SPDX-License-Identifier: MIT
#
# usage: icount.sh DRIVER BASELINE [--print]
#
# Counts, with valgrind --tool=callgrind, the instructions one call of each
# hot path executes (inclusive of what it calls), and
# fails if any exceeds its figure in BASELINE (bench/BASELINE.md) by more
# than 10%.  A count, not a time: the same binary gives the same count on a
# busy machine.  --print shows the counts without comparing (to refresh the
# baseline after a deliberate change).
#
# Skips (tests/skip.sh) when valgrind is missing.
set -eu

if [ $# -lt 2 ]; then
	echo "usage: $0 DRIVER BASELINE [--print]" >&2
	exit 2
fi
driver=$1
baseline=$2
mode=${3:-compare}
calls=100000

. "$(dirname "$0")/../skip.sh"
command -v valgrind >/dev/null 2>&1 || skip "valgrind not installed"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# Instructions per call of WORKLOAD, counted only inside the named functions.
count() {
	workload=$1
	shift
	toggles=
	for fn in "$@"; do
		toggles="$toggles --toggle-collect=$fn"
	done
	# shellcheck disable=SC2086
	valgrind --tool=callgrind --callgrind-out-file="$tmp/$workload.out" \
		$toggles "$driver" "$workload" "$calls" >"$tmp/$workload.log" 2>&1 || {
		cat "$tmp/$workload.log" >&2
		echo "FAIL: $driver $workload did not run under callgrind" >&2
		exit 1
	}
	total=$(sed -n 's/^totals: *\([0-9]*\).*/\1/p' "$tmp/$workload.out")
	[ -n "$total" ] || total=$(sed -n 's/^summary: *\([0-9]*\).*/\1/p' "$tmp/$workload.out")
	echo $((total / calls))
}

# The baseline's figure for WORKLOAD: the table row "| `WORKLOAD` | N |".
expected() {
	sed -n "s/^| \`$1\` | *\([0-9][0-9]*\) *|.*/\1/p" "$baseline"
}

status=0
for spec in "allow_at tokenbucket_allow_at" \
	    "grab tokenbucket_grab" \
	    "reserve_cancel tokenbucket_reserve_at tokenbucket_cancel_at" \
	    "reserve_cancel_2 tokenbucket_reserve_all_at tokenbucket_cancel_all_at" \
	    "allow_result_at tokenbucket_allow_result_at" \
	    "allow_all_2 tokenbucket_allow_all_at" \
	    "table_warm tokenbucket_table_allow_at" \
	    "table_keys tokenbucket_table_allow_at"; do
	# shellcheck disable=SC2086
	set -- $spec
	workload=$1
	got=$(count "$@")
	if [ "$mode" = --print ]; then
		echo "$workload $got"
		continue
	fi
	want=$(expected "$workload")
	if [ -z "$want" ]; then
		echo "FAIL: no figure for $workload in $baseline" >&2
		status=1
		continue
	fi
	limit=$((want + want / 10))
	if [ "$got" -gt "$limit" ]; then
		echo "FAIL: $workload: $got instructions per call, baseline $want (limit $limit)"
		status=1
	else
		echo "ok: $workload: $got instructions per call, baseline $want (limit $limit)"
	fi
done
exit $status
