#!/bin/sh
# SPDX-License-Identifier: MIT
#
# usage: lease-rush.sh TB_LEASE_PROBE TB_INTERVAL_CHECK [MODULE]
#
# Hold, then rush (ctest redis-lease-rush): leases on one key, public API
# only, at 50/s, burst 10, window 500 ms, called 10 times a second for
# 1.5 s (each process) and then as fast as they are granted for 100 ms,
# through one leasing process and through four of four threads, in each engine: the
# script (a server without FCALL), the function library (Redis 7) and,
# with MODULE, the module.  Every interval [t, t + d] of the grants, not
# only those from the first call, must hold at most burst + rate × d
# (tb-interval-check --max-excess 0 on the grants' spans).  A real
# redis-server per engine, on a socket of its own, stopped at the end.
# About 2 s a run, 6 runs.
set -eu
probe=$1 check=$2 module=${3:-}
. "$(dirname "$0")/../skip.sh"
command -v redis-server >/dev/null 2>&1 || skip "lease rush: redis-server is not installed"
RATE=50 BURST=10 WINDOW_MS=500 HOLD_S=1.5 RUSH_MS=100
dir=$(mktemp -d "${TMPDIR:-/tmp}/tb-lease-rush.XXXXXX")
pid=
stop() {
	if [ -n "$pid" ]; then
		kill "$pid" 2>/dev/null || true
		wait "$pid" 2>/dev/null || true
		pid=
	fi
}
trap 'stop; rm -rf "$dir"' EXIT
status=0
for engine in script function ${module:+module}; do
	sock=$dir/redis.sock
	set -- --port 0 --unixsocket "$sock" --unixsocketperm 700 --save "" --appendonly no \
		--dir "$dir"
	case $engine in
	script) set -- "$@" --rename-command FCALL "" ;;
	module) set -- "$@" --loadmodule "$module" ;;
	esac
	# A sanitizer's runtime for an instrumented module in an uninstrumented
	# server (.ci/sanitize asan sets it); only the server gets it.
	preload=
	[ "$engine" = module ] && preload=${TOKENBUCKET_MODULE_PRELOAD:-}
	env ${preload:+LD_PRELOAD="$preload"} redis-server "$@" >"$dir/server.log" 2>&1 &
	pid=$!
	i=0
	until redis-cli -s "$sock" ping >/dev/null 2>&1; do
		i=$((i + 1))
		[ "$i" -lt 100 ] || { echo "FAIL: redis-server ($engine) did not start" >&2; cat "$dir/server.log" >&2; exit 1; }
		sleep 0.05
	done
	for shape in "1 2" "4 4"; do
		set -- $shape
		out=$dir/out
		rm -rf "$out"
		mkdir "$out"
		redis-cli -s "$sock" flushall >/dev/null
		line=$("$probe" "unix:$sock" "$out" rush "$1" "$2" "$RUSH_MS" "$HOLD_S" "$RATE" "$BURST" \
			"$WINDOW_MS") || { echo "FAIL $engine, $1 x $2: tb-lease-probe failed" >&2; status=1; continue; }
		cat "$out"/grants.* >"$out/all"
		rc=0
		verdict=$("$check" --spans --rate "$RATE" --burst "$BURST" --max-excess 0 "$out/all") || rc=$?
		grants=$(echo "$line" | awk '{ for (i = 1; i < NF; i += 2) if ($i == "grants") print $(i + 1) }')
		echo "lease rush, $engine, $1 process(es) x $2 threads: $grants grants; $verdict"
		if [ "$rc" -ne 0 ]; then
			echo "FAIL $engine, $1 x $2: an interval above burst + rate x d" >&2
			status=1
		fi
	done
	stop
done
exit "$status"
