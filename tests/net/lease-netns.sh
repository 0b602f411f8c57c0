#!/bin/sh
# SPDX-License-Identifier: MIT
#
# usage: lease-netns.sh TB_DELAY TB_LEASE_PROBE TB_INTERVAL_CHECK
#
# Leases across hosts (ctest redis-lease-netns): tb-lease-probe in a
# network namespace of its own reaches redis-server through tb-delay
# (netns.sh), at a 1 ms and a 5 ms round trip with jitter, and through a
# partition of 2 s (the client's veth set down).  Asserted, as
# docs/leases.md promises today:
#
#   - over every interval [t, t + d], not only from the key's first call,
#     grants stay within burst + rate × d (tb-interval-check's
#     --max-excess 0), at every round trip;
#   - lease_allow never waits for the network: its longest call, across
#     the partition too, stays far below the 1 s command timeout;
#   - during the partition the lease grants at most what it held.
#
# Reported per round trip: the worst interval's excess over burst + rate
# × d (0 or below), efficiency (second-half grants over rate × time), round trips (script
# runs) per 10^3 decisions and lease_allow's mean wall time (ns/call).
# 20000 tokens/s (TB_NETNS_RATE), burst a tenth of it, window 50 ms;
# 2 processes x 2 threads for 3 s per round trip, a partition run of 6 s.
# TB_NETNS_LONG=1: 4 processes for 20 s each (TB_NETNS_SECONDS and
# TB_NETNS_PROCS set them one by one).  TB_NETNS_STEADY_ONLY=1
# leaves the partition out (bench/redis/lease-run).
set -eu

here=$(cd "$(dirname "$0")" && pwd)
. "$here/../skip.sh"

RATE=${TB_NETNS_RATE:-20000} WINDOW_MS=50
BURST=$((RATE / 10))
if [ "${1:-}" = --inside ]; then
	# In the client's namespace (netns.sh): one scenario, one row.
	shift
	probe=$1 check=$2 label=$3 mode=$4
	shift 4
	out=$(mktemp -d "${TMPDIR:-/tmp}/tb-lease-netns.XXXXXX")
	trap 'rm -rf "$out"' EXIT
	admin() { redis-cli -s "$TB_NETNS_ADMIN" "$@" | tr -d '\r'; }
	# The forwarder first: 128 kB there and back intact under jitter (a
	# reordered chunk garbles it), from 16 connections at once.
	head -c 65536 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$out/value"
	for i in $(seq 16); do
		redis-cli -u "$TB_NETNS_URL" -x SET "big$i" <"$out/value" >/dev/null &
	done
	wait
	for i in $(seq 16); do
		redis-cli -u "$TB_NETNS_URL" --no-raw GET "big$i" | tr -d '"\n' >"$out/back$i" &
	done
	wait
	for i in $(seq 16); do
		cmp -s "$out/value" "$out/back$i" || { echo "FAIL $label: tb-delay garbled a value" >&2; exit 1; }
	done
	admin FLUSHALL >/dev/null
	rm -f "$out"/back* "$out/value"
	# The round trip as measured: 200 PINGs on one connection.
	redis-cli -u "$TB_NETNS_URL" ping >/dev/null
	t0=$(date +%s%N)
	redis-cli -u "$TB_NETNS_URL" -r 200 ping >/dev/null
	rtt_us=$((($(date +%s%N) - t0) / 200000))
	admin CONFIG RESETSTAT >/dev/null
	line=$("$probe" "$TB_NETNS_URL" "$out" "$mode" "$@")
	calls=$(admin INFO commandstats | awk -F'[=,:]' '
		/^cmdstat_(eval|evalsha|fcall)/ { for (i = 1; i < NF; i++) if ($i == "calls") s += $(i + 1) }
		END { printf "%d", s }')
	get() { echo "$line" | awk -v k="$1" '{ for (i = 1; i < NF; i += 2) if ($i == k) print $(i + 1) }'; }
	cat "$out"/grants.* >"$out/all"
	bound=0
	verdict=$("$check" --spans --rate "$RATE" --burst "$BURST" --from "$(get first_ns)" \
		--max-first-excess 0 --max-excess 0 "$out/all") || bound=$?
	cget() { echo "$verdict" | awk -v k="$1" '{ for (i = 1; i < NF; i += 2) if ($i == k) print $(i + 1) }'; }
	run_s=$(awk -v s="$(get start_ns)" -v e="$(get end_ns)" 'BEGIN { print (e - s) / 1e9 }')
	awk -v l="$label" -v rtt="$rtt_us" -v d="$(get decisions)" -v g="$(get grants)" \
		-v late="$(get late_grants)" -v s="$run_s" -v r="$RATE" -v n="$calls" \
		-v ns="$(get allow_ns)" -v mx="$(get max_allow_ns)" \
		-v we="$(cget worst_excess)" -v wd="$(cget worst_d)" -v fe="$(cget first_excess)" 'BEGIN {
		printf "%-10s rtt %5.2f ms  ns/call %6.1f  RT/1e3 %7.3f  efficiency %.4f  worst_excess %8.1f (d %.4f s)  first_excess %8.1f  max_allow %.2f ms  grants %d\n",
			l, rtt / 1000, ns, n * 1000 / d, late / (r * s / 2), we, wd, fe, mx / 1e6, g
	}'
	status=0
	if [ "$bound" -ne 0 ]; then
		echo "FAIL $label: grants over an interval above burst + rate x d" >&2
		status=1
	fi
	if [ "$(get max_allow_ns)" -ge 500000000 ]; then
		echo "FAIL $label: a lease_allow took $(get max_allow_ns) ns" >&2
		status=1
	fi
	if [ "$(get errors)" -ne 0 ]; then
		echo "FAIL $label: $(get errors) lease_allow errors" >&2
		status=1
	fi
	if [ "$mode" = partition ]; then
		held=$(get held) pg=$(get partition_grants)
		after=$(awk -v u="$(get up_ns)" '$1 >= u { n++ } END { print n + 0 }' "$out/all")
		echo "           partition 2 s: held $held, granted $pg while cut off; $after grants after it healed"
		if [ "$pg" -gt "$held" ]; then
			echo "FAIL $label: $pg grants during the partition, $held held" >&2
			status=1
		fi
	fi
	exit "$status"
fi

[ $# -eq 3 ] || { sed -n 's/^# usage: //p' "$0" >&2; exit 2; }
delay=$1 probe=$2 check=$3
seconds=3 procs=2
if [ -n "${TB_NETNS_LONG:-}" ]; then
	seconds=20 procs=4
fi
seconds=${TB_NETNS_SECONDS:-$seconds} procs=${TB_NETNS_PROCS:-$procs}
status=0
# One scenario: a fresh namespace set, server and forwarder each.
scenario() {
	d=$1 j=$2
	shift 2
	sh "$here/netns.sh" --delay-bin "$delay" --delay-ms "$d" --jitter-ms "$j" -- \
		sh "$here/lease-netns.sh" --inside "$probe" "$check" "$@" || {
		rc=$?
		[ "$rc" -eq 77 ] && exit 77
		status=1
	}
}
scenario 0.5 0.2 "rtt-1ms" steady "$procs" 2 "$seconds" "$RATE" "$BURST" "$WINDOW_MS"
scenario 2.5 1.0 "rtt-5ms" steady "$procs" 2 "$seconds" "$RATE" "$BURST" "$WINDOW_MS"
[ -n "${TB_NETNS_STEADY_ONLY:-}" ] && exit "$status"
# Two threads paced at a quarter of the rate together, so that the lease
# holds tokens when cut off.
scenario 0.5 0.2 "partition" partition "$((8000000 / RATE))" "$((seconds + 3))" "$RATE" "$BURST" "$WINDOW_MS" 1.5 2
exit "$status"
