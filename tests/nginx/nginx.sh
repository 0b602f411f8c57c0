#!/bin/bash
# SPDX-License-Identifier: MIT
# ngx_http_tokenbucket_module in a real nginx: each group starts its own
# nginx (master and two workers, daemon off, its own prefix and
# configuration, a loopback port the kernel chose), sends requests with
# tbnginx-client, and stops it by pid.
#
#   nginx.sh GROUP MODULE_SO CLIENT
#
# Counts are checked against exact bounds: grants <= burst + floor(rate *
# elapsed) and not more than 2 below it.  Sleeps have generous margins.
# Without nginx: skip (77), a failure under TOKENBUCKET_NO_SKIP.
set -uo pipefail
group=$1 module=$2 client=$3
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=../skip.sh
. "$here/../skip.sh"
nginx_bin=${NGINX:-/usr/sbin/nginx}
[ -x "$nginx_bin" ] || skip "no nginx at $nginx_bin"
[ -f "$module" ] || skip "module $module not built"

prefix=$(mktemp -d "${TMPDIR:-/tmp}/tb-nginx.XXXXXX")
chmod 755 "$prefix"
master=
failures=0
cleanup() {
	# The pid file names the master too (the same one, unless it was replaced).
	if [ -z "$master" ] && [ -s "$prefix/nginx.pid" ]; then
		master=$(cat "$prefix/nginx.pid")
	fi
	if [ -n "$master" ] && kill -0 "$master" 2>/dev/null; then
		kill -QUIT "$master" 2>/dev/null
		for _ in $(seq 50); do kill -0 "$master" 2>/dev/null || break; sleep 0.1; done
		kill -KILL "$master" 2>/dev/null
	fi
	# nginx sends its workers' stderr to the error log: a sanitizer's report
	# there (.ci/sanitize asan) is shown, where the run's scan finds it.
	if grep -qE 'Sanitizer|runtime error:' "$prefix/error.log" 2>/dev/null; then
		echo "FAIL: a sanitizer report in the error log"
		failures=$((failures + 1))
	fi
	if [ "$failures" -ne 0 ]; then
		echo "--- error.log"; tail -60 "$prefix/error.log" 2>/dev/null
	fi
	rm -rf "$prefix"
	[ "$failures" -eq 0 ] || exit 1
}
trap cleanup EXIT

fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
ok() { echo "ok: $*"; }
check() { # check DESCRIPTION COMMAND...
	local what=$1
	shift
	if "$@"; then ok "$what"; else fail "$what"; fi
}

mkdir -p "$prefix/html" "$prefix/tmp"
echo hello >"$prefix/html/index.html"
for p in a b both a-only bytes delay slow dry flood open evict hot; do
	mkdir -p "$prefix/html/$p"
	echo hello >"$prefix/html/$p/index.html"
done
port=$("$client" port)

# write_conf ZONES LOCATIONS: the configuration for this group.
write_conf() {
	local user=""
	[ "$(id -u)" -eq 0 ] && user="user root root;"
	cat >"$prefix/nginx.conf" <<EOF
$user
daemon off;
master_process on;
worker_processes 2;
pid $prefix/nginx.pid;
error_log $prefix/error.log info;
load_module $module;
events { worker_connections 512; }
http {
	log_format tb '\$http_x_key \$status \$tokenbucket_status \$tokenbucket_remaining \$tokenbucket_retry_after';
	access_log $prefix/access.log tb;
	client_body_temp_path $prefix/tmp/body;
	proxy_temp_path $prefix/tmp/proxy;
	fastcgi_temp_path $prefix/tmp/fastcgi;
	uwsgi_temp_path $prefix/tmp/uwsgi;
	scgi_temp_path $prefix/tmp/scgi;
	keepalive_requests 100000;
$1
	server {
		listen 127.0.0.1:$port;
		root $prefix/html;
$2
	}
}
EOF
}

# Under .ci/sanitize asan the module and the library are instrumented and
# nginx is not: TBNGINX_PRELOAD names the runtime to load first, and
# nginx's own allocations at exit are not ours to report.
# run_nginx replaces the shell it runs in, so that "(run_nginx ...) &" gives
# nginx's own pid.
run_nginx() {
	if [ -n "${TBNGINX_PRELOAD:-}" ]; then
		LD_PRELOAD=$TBNGINX_PRELOAD ASAN_OPTIONS="${ASAN_OPTIONS:-}:detect_leaks=0" \
			exec "$nginx_bin" "$@"
	fi
	exec "$nginx_bin" "$@"
}

start_nginx() {
	(run_nginx -p "$prefix" -c "$prefix/nginx.conf" -e "$prefix/error.log") &
	master=$!
	for _ in $(seq 100); do
		if "$client" "$port" 1 0 /index.html >/dev/null 2>&1; then return 0; fi
		kill -0 "$master" 2>/dev/null || break
		sleep 0.1
	done
	fail "nginx did not start"
	exit 1
}

# get PATH N INTERVAL_US [HEADER ...]: the client's lines.
get() {
	local path=$1 n=$2 us=$3
	shift 3
	"$client" "$port" "$n" "$us" "$path" "$@"
}
count() { awk -v s="$1" '$2 == s { n++ } END { print n + 0 }'; }

# within_bound LINES BURST TOKENS PERIOD_NS [SLACK]: the 200s of a paced run
# are at most burst + floor(elapsed * tokens / period) for the elapsed time
# from the first request sent to the last response, and at least what an
# exact bucket grants the same requests at their send times, minus SLACK
# (default 2).
within_bound() {
	# The upper bound is the contract.  The lower one follows the clients:
	# one held up (a loaded machine, a killed worker's connections) lowers
	# it rather than failing the check; slack covers requests decided
	# later than sent.
	awk -v b="$2" -v p="$3" -v q="$4" -v slack="${5:-2}" '
		NR == 1 { first = $1; firstlat = $5; level = b; prev = $1 }
		{
			last = $1; lastlat = $5; if ($2 == 200) g++
			level += ($1 - prev) * p / q; if (level > b) level = b; prev = $1
			if (level >= 1) { level -= 1; model++ }
		}
		END {
			hi = b + int((last + lastlat - first) * p / q)
			lo = model - slack
			printf "  grants %d, bound [%d, %d]\n", g, lo, hi
			exit !(g <= hi && g >= lo)
		}' <<<"$1"
}

case $group in
basic)
	# Fractional rates, exact over time; the headers and the variables.
	write_conf "
	tokenbucket_zone zone=frac keys=1024 rate=7r/3s burst=3;
	tokenbucket_zone zone=slow:64k rate=6r/min burst=2;" "
		location /a/ { tokenbucket zone=frac key=\$http_x_key; }
		location /slow/ { tokenbucket zone=slow key=\$http_x_key; }
		location /dry/ { tokenbucket zone=slow key=\$http_x_key; tokenbucket_dry_run on; }"
	start_nginx
	out=$(get /a/ 300 20000 "X-Key: paced")
	check "7r/3s over 6 s within the exact bound" within_bound "$out" 3 7 3000000000
	out=$(get /slow/ 3 0 "X-Key: h")
	check "headers: remaining 1 then 0" test "$(awk '{ printf "%s,", $3 }' <<<"$out")" = "1,0,0,"
	check "refused with 429" test "$(tail -1 <<<"$out" | awk '{ print $2 }')" = 429
	retry=$(tail -1 <<<"$out" | awk '{ print $4 }')
	check "Retry-After $retry within (0, 10]" test "$retry" -ge 1 -a "$retry" -le 10
	hdrs=$(printf 'GET /slow/ HTTP/1.1\r\nHost: x\r\nX-Key: h2\r\nConnection: close\r\n\r\n' |
		timeout 5 bash -c "exec 3<>/dev/tcp/127.0.0.1/$port; cat >&3; cat <&3")
	check "RateLimit-Limit is the burst" grep -q $'^RateLimit-Limit: 2\r$' <<<"$hdrs"
	check "RateLimit-Reset present" grep -q '^RateLimit-Reset: [0-9]' <<<"$hdrs"
	out=$(get /dry/ 4 0 "X-Key: d")
	check "dry run serves everything" test "$(count 200 <<<"$out")" = 4
	sleep 0.5
	check "log: PASSED with remaining" grep -q '^h 200 PASSED 1 0$' "$prefix/access.log"
	check "log: REJECTED with retry-after" grep -q "^h 429 REJECTED 0 $retry\$" "$prefix/access.log"
	check "log: REJECTED_DRY_RUN" grep -q '^d 200 REJECTED_DRY_RUN 0 ' "$prefix/access.log"
	;;
zones)
	# Every zone must allow; a refusal by one takes nothing from the others.
	write_conf "
	tokenbucket_zone zone=perkey keys=1024 rate=1r/min burst=3;
	tokenbucket_zone zone=all keys=16 rate=1r/min burst=4;" "
		location /both/ {
			tokenbucket zone=perkey key=\$http_x_key;
			tokenbucket zone=all key=all;
		}
		location /a-only/ { tokenbucket zone=perkey key=\$http_x_key; }"
	start_nginx
	check "k1: 3 granted by perkey" test "$(get /both/ 4 0 "X-Key: k1" | count 200)" = 3
	check "k2: 1 granted, then all is empty" test "$(get /both/ 6 0 "X-Key: k2" | count 200)" = 1
	check "k2's refusals by 'all' took nothing from perkey" \
		test "$(get /a-only/ 4 0 "X-Key: k2" | count 200)" = 2
	;;
bytes)
	# A byte rate with a per-request cost; a cost above the burst never passes.
	write_conf "
	tokenbucket_zone zone=bytes keys=64 rate=2kB/s burst=4kB;
	tokenbucket_zone zone=slow keys=64 rate=1kB/min burst=4kB;" "
		location /bytes/ { tokenbucket zone=bytes key=\$http_x_key cost=\$http_x_cost; }
		location /slow/ { tokenbucket zone=slow key=\$http_x_key cost=\$http_x_cost; }"
	start_nginx
	check "4 x 1000 bytes granted, the 5th refused" \
		test "$(get /slow/ 5 0 "X-Key: b1" "X-Cost: 1000" | awk '{ printf "%s,", $2 }')" = \
		"200,200,200,200,429,"
	out=$(get /slow/ 1 0 "X-Key: b2" "X-Cost: 4001")
	check "cost above the burst: 429, no Retry-After" test "$(awk '{ print $2 $4 }' <<<"$out")" = "429-"
	out=$(get /bytes/ 200 20000 "X-Key: b3" "X-Cost: 100")
	check "100-byte requests within 40 + 20/s" within_bound "$out" 40 1 50000000
	;;
delay)
	write_conf "
	tokenbucket_zone zone=d keys=64 rate=10r/s burst=1;
	tokenbucket_zone zone=s keys=64 rate=6r/min burst=1;" "
		location /delay/ { tokenbucket zone=d key=\$http_x_key delay=5s; }
		location /slow/ { tokenbucket zone=s key=\$http_x_key delay=500ms; }"
	start_nginx
	t0=$(date +%s%N)
	out=$(get /delay/ 11 0 "X-Key: d1")
	t1=$(date +%s%N)
	check "11 delayed requests all served" test "$(count 200 <<<"$out")" = 11
	check "and no earlier than 1 s ($(((t1 - t0) / 1000000)) ms)" test $((t1 - t0)) -ge 990000000
	check "a wait beyond the bound is refused" \
		test "$(get /slow/ 2 0 "X-Key: s1" | awk '{ printf "%s,", $2 }')" = "200,429,"
	sleep 0.3
	check "log: DELAYED" grep -q '^d1 200 DELAYED ' "$prefix/access.log"
	;;
reload)
	# A reload under load keeps each key's level; a changed zone starts afresh.
	zones="
	tokenbucket_zone zone=keep keys=1024 rate=1r/min burst=5;
	tokenbucket_zone zone=hot keys=1024 rate=20r/s burst=10;"
	locs="
		location /slow/ { tokenbucket zone=keep key=\$http_x_key; }
		location /hot/ { tokenbucket zone=hot key=\$http_x_key; }"
	write_conf "$zones" "$locs"
	start_nginx
	check "k: 5 of 6 granted" test "$(get /slow/ 6 0 "X-Key: k" | count 200)" = 5
	get /hot/ 400 10000 "X-Key: h" >"$prefix/hot.out" &
	loader=$!
	sleep 1
	write_conf "$zones" "$locs
		location /index.html { }"
	kill -HUP "$master"
	for _ in $(seq 50); do
		grep -q 'reconfiguring' "$prefix/error.log" && break
		sleep 0.1
	done
	sleep 1
	check "after the reload, k is still empty" test "$(get /slow/ 1 0 "X-Key: k" | count 200)" = 0
	check "a new key is full" test "$(get /slow/ 5 0 "X-Key: n" | count 200)" = 5
	wait "$loader"
	check "the hot key under the reload within the bound" \
		within_bound "$(cat "$prefix/hot.out")" 10 1 50000000
	write_conf "$(sed 's/burst=5/burst=6/' <<<"$zones")" "$locs"
	kill -HUP "$master"
	sleep 2
	check "a zone whose burst changed starts afresh" \
		test "$(get /slow/ 7 0 "X-Key: k" | count 200)" = 6
	;;
kill)
	# A worker SIGKILLed under load: the master respawns it, the zone stays
	# consistent and the key's bound holds over both clients.
	write_conf "
	tokenbucket_zone zone=hot keys=1024 rate=50r/s burst=20;" "
		location /hot/ { tokenbucket zone=hot key=\$http_x_key; }"
	start_nginx
	get /hot/ 800 5000 "X-Key: k" >"$prefix/c1.out" &
	c1=$!
	get /hot/ 800 5000 "X-Key: k" >"$prefix/c2.out" &
	c2=$!
	for _ in 1 2 3; do
		sleep 1
		victim=$(pgrep -P "$master" | head -1)
		[ -n "$victim" ] && kill -KILL "$victim"
	done
	wait "$c1" "$c2"
	all=$(sort -n "$prefix/c1.out" "$prefix/c2.out")
	check "workers were killed and respawned" \
		test "$(grep -c 'exited on signal 9' "$prefix/error.log")" -ge 2
	check "two clients on one key within 20 + 50/s" within_bound "$all" 20 1 20000000 25
	check "served after the kills" test "$(get /index.html 3 0 | count 200)" = 3
	;;
flood)
	# Distinct keys against a small zone: the policy decides once it is full.
	write_conf "
	tokenbucket_zone zone=closed keys=64 rate=1r/min burst=1;
	tokenbucket_zone zone=open keys=64 rate=1r/min burst=1 full=open;
	tokenbucket_zone zone=evict keys=64 rate=1r/min burst=1 full=evict;" "
		location /flood/ { tokenbucket zone=closed key=\$http_x_key; }
		location /open/ { tokenbucket zone=open key=\$http_x_key; }
		location /evict/ { tokenbucket zone=evict key=\$http_x_key; }"
	start_nginx
	out=$(get /flood/ 1000 0 "X-Key: f%d")
	g=$(count 200 <<<"$out")
	check "full=closed: $g of 1000 keys served, at most 64, the rest 429" \
		test "$g" -ge 32 -a "$g" -le 64 -a "$(count 429 <<<"$out")" = $((1000 - g))
	sleep 0.3
	check "the refusals say the zone is full" grep -q 'the zone is full' "$prefix/error.log"
	check "full=open: every key served" \
		test "$(get /open/ 1000 0 "X-Key: f%d" | count 200)" = 1000
	check "full=evict: every new key served" \
		test "$(get /evict/ 1000 0 "X-Key: f%d" | count 200)" = 1000
	check "an old key is still limited (closed)" \
		test "$(get /flood/ 1 0 "X-Key: f0" | count 429)" = 1
	;;
config)
	# nginx -t refuses bad configuration, naming the directive and the value.
	bad() { # bad ZONES LOCATIONS EXPECTED...
		write_conf "$1" "$2"
		local msg
		msg=$(run_nginx -t -p "$prefix" -c "$prefix/nginx.conf" -e "$prefix/t.log" 2>&1)
		local rc=$?
		msg+=$(cat "$prefix/t.log" 2>/dev/null)
		shift 2
		if [ "$rc" -eq 0 ]; then fail "nginx -t accepted: $*"; return; fi
		for want in "$@"; do
			grep -qF -- "$want" <<<"$msg" || { fail "message lacks '$want': $msg"; return; }
		done
		ok "refused: $*"
	}
	z="tokenbucket_zone zone=z keys=10 rate=1r/s;"
	l="location / { tokenbucket zone=z key=\$http_x_key; }"
	bad "tokenbucket_zone zone=z keys=10 rate=10r/fortnight;" "" \
		tokenbucket_zone 'rate=10r/fortnight' 'unknown period'
	bad "tokenbucket_zone zone=z keys=10 rate=0r/s;" "" tokenbucket_zone 'rate=0r/s'
	bad "tokenbucket_zone zone=z keys=10 rate=1r/s burst=1.5;" "" tokenbucket_zone 'burst=1.5'
	bad "tokenbucket_zone zone=z keys=0 rate=1r/s;" "" tokenbucket_zone 'keys=0'
	bad "tokenbucket_zone zone=z:1 rate=1r/s;" "" tokenbucket_zone 'zone=z:1'
	bad "tokenbucket_zone zone=z:1m keys=5 rate=1r/s;" "" tokenbucket_zone 'zone=NAME:SIZE or keys=N'
	bad "tokenbucket_zone zone=z keys=10 rate=1r/s full=maybe;" "" tokenbucket_zone 'full=maybe'
	bad "tokenbucket_zone zone=z keys=10;" "" tokenbucket_zone 'no rate'
	bad "$z" "location / { tokenbucket zone=y key=\$http_x_key; }" tokenbucket 'unknown zone "y"'
	bad "$z" "location / { tokenbucket zone=z key=\$http_x_key delay=soon; }" tokenbucket 'delay=soon'
	bad "$z" "location / { tokenbucket zone=z; }" tokenbucket 'key='
	bad "$z" "$l tokenbucket_status 200;" tokenbucket_status '"200"' 'between 400 and 599'
	bad "$z $z" "" tokenbucket_zone '"z" is already defined'
	write_conf "$z" "$l"
	check "a good configuration passes nginx -t" \
		eval '(run_nginx -t -q -p "$prefix" -c "$prefix/nginx.conf" -e "$prefix/t.log")'
	;;
*)
	echo "unknown group $group" >&2
	exit 2
	;;
esac
[ "$failures" -eq 0 ]
