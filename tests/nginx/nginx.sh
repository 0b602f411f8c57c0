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
master2=
redis=
failures=0
# stop_pid PID: SIGQUIT (nginx's graceful stop; redis-server's exit), then SIGKILL.
stop_pid() {
	[ -n "$1" ] && kill -0 "$1" 2>/dev/null || return 0
	kill -QUIT "$1" 2>/dev/null
	for _ in $(seq 50); do kill -0 "$1" 2>/dev/null || break; sleep 0.1; done
	kill -KILL "$1" 2>/dev/null
	wait "$1" 2>/dev/null
}
cleanup() {
	stop_pid "$master2"
	stop_pid "$redis"
	grep -qE 'Sanitizer|runtime error:' "$prefix/b/error.log" 2>/dev/null &&
		cat "$prefix/b/error.log" >>"$prefix/error.log"
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

# page DIR: a page at /DIR/ (DIR/index.html under the root).
page() {
	mkdir -p "$prefix/html/$1"
	echo hello >"$prefix/html/$1/index.html"
}
mkdir -p "$prefix/tmp"
for p in "" a b both a-only bytes delay slow dry flood open evict hot rr rr2; do
	page "$p"
done
port=$("$client" port)

# write_conf ZONES LOCATIONS [PREFIX PORT]: the configuration for this
# group (of a second nginx, with PREFIX and PORT).
write_conf() {
	local user="" prefix=${3:-$prefix} port=${4:-$port}
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
	log_format tb '${log_vars:-\$http_x_key \$status \$tokenbucket_status \$tokenbucket_remaining \$tokenbucket_retry_after}';
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

# start_nginx [PREFIX PORT]: the group's nginx (or a second one, whose
# master is then master2).
start_nginx() {
	local prefix=${1:-$prefix} port=${2:-$port} pid
	(run_nginx -p "$prefix" -c "$prefix/nginx.conf" -e "$prefix/error.log") &
	pid=$!
	if [ -n "${1:-}" ]; then master2=$pid; else master=$pid; fi
	for _ in $(seq 100); do
		if "$client" "$port" 1 0 /index.html >/dev/null 2>&1; then return 0; fi
		kill -0 "$pid" 2>/dev/null || break
		sleep 0.1
	done
	fail "nginx did not start"
	exit 1
}

# start_redis: a redis-server on the loopback port $redis_port (chosen
# once, so that a restart finds the same address), without persistence.
redis_port=
start_redis() {
	command -v redis-server >/dev/null || skip "no redis-server"
	[ -n "$redis_port" ] || redis_port=$("$client" port)
	redis-server --bind 127.0.0.1 --port "$redis_port" --save '' --appendonly no \
		--dir "$prefix" --logfile "$prefix/redis.log" &
	redis=$!
	for _ in $(seq 100); do
		[ "$(redis-cli -p "$redis_port" ping 2>/dev/null)" = PONG ] && return 0
		kill -0 "$redis" 2>/dev/null || break
		sleep 0.1
	done
	fail "redis-server did not start"
	exit 1
}
rcli() { redis-cli -p "$redis_port" "$@"; }

# get PATH N INTERVAL_US [HEADER ...]: the client's lines.
get() {
	local path=$1 n=$2 us=$3
	shift 3
	"$client" "$port" "$n" "$us" "$path" "$@"
}
count() { awk -v s="$1" '$2 == s { n++ } END { print n + 0 }'; }
# tokens_left PATH KEY: the line of one request whose cost (X-Cost: 100000)
# is above PATH's burst: refused, it reports the key's tokens left.
tokens_left() { get "$1" 1 0 "X-Key: $2" "X-Cost: 100000"; }
# response PATH KEY: one request's whole response, headers included, raw.
response() {
	printf 'GET %s HTTP/1.1\r\nHost: x\r\nX-Key: %s\r\nConnection: close\r\n\r\n' "$1" "$2" |
		timeout 5 bash -c "exec 3<>/dev/tcp/127.0.0.1/$port; cat >&3; cat <&3"
}
plain_200() { grep -q '^HTTP/1.1 200' <<<"$1" && ! grep -qi '^RateLimit-' <<<"$1"; }
not_grep() { ! grep -qE "$1" <<<"$2"; }
not_in_log() { ! grep -qE "$1" "$prefix/error.log"; }

# reload_nginx ZONES LOCATIONS: a reload (SIGHUP) to the configuration with
# one more location, and a second for the new workers to take over.
reload_nginx() {
	local n
	n=$(grep -c 'reconfiguring' "$prefix/error.log")
	write_conf "$1" "$2
		location /index.html { }"
	kill -HUP "$master"
	for _ in $(seq 50); do
		[ "$(grep -c 'reconfiguring' "$prefix/error.log")" -gt "$n" ] && break
		sleep 0.1
	done
	sleep 1
}

# two_nginx ZONES LOCATIONS [DIR ...]: the group's nginx and a second one
# (prefix $prefix/b, port $port2) on the same configuration, each with
# DIR/index.html under its root.
two_nginx() {
	local zones=$1 locs=$2 d
	shift 2
	port2=$("$client" port)
	mkdir -p "$prefix/b/tmp"
	for d in "" "$@"; do
		mkdir -p "$prefix/html/$d" "$prefix/b/html/$d"
		echo hello >"$prefix/html/$d/index.html"
		echo hello >"$prefix/b/html/$d/index.html"
	done
	write_conf "$zones" "$locs"
	write_conf "$zones" "$locs" "$prefix/b" "$port2"
	sed -i "s|root $prefix/html|root $prefix/b/html|" "$prefix/b/nginx.conf"
	start_nginx
	start_nginx "$prefix/b" "$port2"
}

# both_clients PATH N INTERVAL_US HEADER: one client on each of two_nginx's
# at once; their lines in $prefix/c1.out and c2.out, and all sorted in $all.
both_clients() {
	local c1 c2
	get "$1" "$2" "$3" "$4" >"$prefix/c1.out" &
	c1=$!
	"$client" "$port2" "$2" "$3" "$1" "$4" >"$prefix/c2.out" &
	c2=$!
	wait "$c1" "$c2"
	all=$(sort -n "$prefix/c1.out" "$prefix/c2.out")
}

# many_clients C PATH N [HEADER ...]: C clients at once, each sending N
# requests back to back on its keep-alive connection; all their lines in
# $all.  Each waits for every response, so none is cut short.
many_clients() {
	local c=$1 path=$2 n=$3 i pids=()
	shift 3
	for i in $(seq "$c"); do
		get "$path" "$n" 0 "$@" >"$prefix/many.$i" &
		pids+=($!)
	done
	wait "${pids[@]}"
	all=$(cat "$prefix"/many.*)
	rm -f "$prefix"/many.*
}

# check_delays WHAT: 11 requests on /delay/ (10r/s, burst 1, delay=5s) are
# all served, and none before the rate made their tokens.
check_delays() {
	local t0 t1 out
	t0=$(date +%s%N)
	out=$(get /delay/ 11 0 "X-Key: d1")
	t1=$(date +%s%N)
	check "$1 all served" test "$(count 200 <<<"$out")" = 11
	check "and no earlier than 1 s ($(((t1 - t0) / 1000000)) ms)" test $((t1 - t0)) -ge 990000000
}

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
	# The draft's fields (a report variable is logged: the full report).
	hdrs=$(response /slow/ h2)
	check "RateLimit-Policy: the burst and its refill in seconds" \
		grep -q $'^RateLimit-Policy: "slow";q=2;w=20\r$' <<<"$hdrs"
	check "RateLimit: 1 left, full within (0, 10] s" \
		grep -qE $'^RateLimit: "slow";r=1;t=([1-9]|10)\r$' <<<"$hdrs"
	check "none of the older fields" not_grep '^RateLimit-(Limit|Remaining|Reset):' "$hdrs"
	hdrs=$(response /slow/ h2)
	check "RateLimit: 0 left, full within (10, 20] s" \
		grep -qE $'^RateLimit: "slow";r=0;t=(1[1-9]|20)\r$' <<<"$hdrs"
	check "a grant has no Retry-After" not_grep '^Retry-After:' "$hdrs"
	out=$(get /dry/ 4 0 "X-Key: d")
	check "dry run serves everything" test "$(count 200 <<<"$out")" = 4
	sleep 0.5
	check "log: PASSED with remaining" grep -q '^h 200 PASSED 1 0$' "$prefix/access.log"
	check "log: REJECTED with retry-after" grep -q "^h 429 REJECTED 0 $retry\$" "$prefix/access.log"
	check "log: REJECTED_DRY_RUN" grep -q '^d 200 REJECTED_DRY_RUN 0 ' "$prefix/access.log"
	;;
zones)
	# Every zone must allow; a refusal by one takes nothing from the others.
	# Nothing shows a report (no headers, no report variable): the last
	# limit takes the plain decision, and a refusal is decided again.
	log_vars='$http_x_key $status $tokenbucket_status'
	write_conf "
	tokenbucket_zone zone=perkey keys=1024 rate=1r/min burst=3;
	tokenbucket_zone zone=all keys=16 rate=1r/min burst=4;
	tokenbucket_zone zone=hd keys=64 rate=6r/min burst=2;" "
		tokenbucket_headers off;
		location /both/ {
			tokenbucket zone=perkey key=\$http_x_key;
			tokenbucket zone=all key=all;
		}
		location /a-only/ { tokenbucket zone=perkey key=\$http_x_key; }
		location /draft/ { tokenbucket zone=hd key=\$http_x_key; tokenbucket_headers on; }
		location /legacy/ { tokenbucket zone=hd key=\$http_x_key; tokenbucket_headers legacy; }
		location /draft2/ {
			tokenbucket_headers on;
			tokenbucket zone=perkey key=\$http_x_key;
			tokenbucket zone=hd key=\$http_x_key;
		}"
	start_nginx
	# The draft's fields as the plain decision sends them (nothing logs a
	# report), a refusal's from the report; the older fields.
	hdrs=$(response /draft/ z1)
	check "draft: RateLimit-Policy fixed" grep -q $'^RateLimit-Policy: "hd";q=2;w=20\r$' <<<"$hdrs"
	check "draft: 1 left, full within (0, 10] s" \
		grep -qE $'^RateLimit: "hd";r=1;t=([1-9]|10)\r$' <<<"$hdrs"
	check "draft: one RateLimit field, no older ones" \
		test "$(grep -ciE '^(RateLimit|RateLimit-Limit|RateLimit-Remaining|RateLimit-Reset|Retry-After):' <<<"$hdrs")" = 1
	hdrs=$(response /draft/ z1)
	check "draft: 0 left, full within (10, 20] s" \
		grep -qE $'^RateLimit: "hd";r=0;t=(1[1-9]|20)\r$' <<<"$hdrs"
	hdrs=$(response /draft/ z1)
	retry=$(sed -n 's/^Retry-After: \([0-9]*\)\r$/\1/p' <<<"$hdrs")
	check "draft: refused with Retry-After $retry within [1, 10]" \
		test "$(head -1 <<<"$hdrs" | cut -d' ' -f2)" = 429 -a "${retry:-0}" -ge 1 -a "${retry:-99}" -le 10
	t=$(sed -n 's/^RateLimit: "hd";r=0;t=\([0-9]*\)\r$/\1/p' <<<"$hdrs")
	check "draft: the refusal's reset $t is Retry-After + (0, 10] s" \
		test "${t:-0}" -gt "$retry" -a "${t:-0}" -le $((retry + 10))
	hdrs=$(response /legacy/ z2)
	check "legacy: RateLimit-Limit 2" grep -q $'^RateLimit-Limit: 2\r$' <<<"$hdrs"
	check "legacy: RateLimit-Remaining 1" grep -q $'^RateLimit-Remaining: 1\r$' <<<"$hdrs"
	check "legacy: RateLimit-Reset within [1, 10]" grep -qE $'^RateLimit-Reset: ([1-9]|10)\r$' <<<"$hdrs"
	check "legacy: no draft fields" not_grep '^RateLimit(-Policy)?:' "$hdrs"
	hdrs=$(response /draft2/ z3)
	check "two limits: a policy item each" \
		grep -q $'^RateLimit-Policy: "perkey";q=3;w=180, "hd";q=2;w=20\r$' <<<"$hdrs"
	check "two limits: RateLimit reports the one with fewer left" \
		grep -qE $'^RateLimit: "hd";r=1;t=([1-9]|10)\r$' <<<"$hdrs"
	check "k1: 3 granted by perkey" test "$(get /both/ 4 0 "X-Key: k1" | count 200)" = 3
	check "k2: 1 granted, then all is empty" test "$(get /both/ 6 0 "X-Key: k2" | count 200)" = 1
	check "k2's refusals by 'all' took nothing from perkey" \
		test "$(get /a-only/ 4 0 "X-Key: k2" | count 200)" = 2
	check "200 without RateLimit headers" plain_200 "$(response /a-only/ k3)"
	sleep 0.5
	check "log: PASSED and REJECTED" grep -q '^k2 429 REJECTED$' "$prefix/access.log"
	check "log: k1 PASSED" grep -q '^k1 200 PASSED$' "$prefix/access.log"
	unset log_vars
	;;
rates)
	# A zone of several rates: a request takes from every rate's table or
	# from none.  two: 1r/s burst 10 and a quota of 6 a minute (a later
	# rate's default burst: its amount over the period written).
	zones="
	tokenbucket_zone zone=two keys=1024 rate=1r/s burst=10 rate=6r/min;
	tokenbucket_zone zone=gate keys=64 rate=1r/min burst=2;
	tokenbucket_zone zone=pace:1m rate=1r/min burst=2 rate=100r/h;
	tokenbucket_zone zone=qp keys=64 rate=1r/h burst=5 rate=2r/s burst=1;"
	locs="
		location /a/ { tokenbucket zone=two key=\$http_x_key; }
		location /slow/ {
			tokenbucket zone=qp key=\$http_x_key;
			tokenbucket zone=two key=\$http_x_key;
		}
		location /open/ { tokenbucket zone=qp key=\$http_x_key cost=\$http_x_cost; }
		location /both/ {
			tokenbucket zone=two key=\$http_x_key;
			tokenbucket zone=gate key=\$http_x_key;
		}
		location /b/ { tokenbucket zone=pace key=\$http_x_key; }"
	write_conf "$zones" "$locs"
	start_nginx
	out=$(get /a/ 10 0 "X-Key: q1")
	check "the quota binds: 6 of 10" test "$(count 200 <<<"$out")" = 6
	check "granted first, then refused" test "$(awk '{ printf "%s", $2 == 200 ? "+" : "-" }' <<<"$out")" = "++++++----"
	retry=$(tail -1 <<<"$out" | awk '{ print $4 }')
	check "Retry-After $retry: the quota's next token, within [1, 10]" test "$retry" -ge 1 -a "$retry" -le 10
	hdrs=$(response /a/ q1)
	check "the refusal names the quota: 0 left of the zone" \
		grep -qE $'^RateLimit: "two";r=0;t=[0-9]+\r$' <<<"$hdrs"
	check "the policy gives the zone's first rate" \
		grep -q $'^RateLimit-Policy: "two";q=10;w=10\r$' <<<"$hdrs"
	check "the pace binds: 2 of 5" test "$(get /b/ 5 0 "X-Key: p1" | count 200)" = 2
	check "q3 through two and gate: gate's burst of 2" \
		test "$(get /both/ 5 0 "X-Key: q3" | count 200)" = 2
	check "gate's refusals took nothing from two: 4 left of the quota" \
		test "$(get /a/ 10 0 "X-Key: q3" | count 200)" = 4
	# qp reserves (it is not the last limit): a request its pace refuses
	# gives back what its quota gave.  A cost above the quota's burst is
	# refused by the quota, whose remaining tokens the refusal reports.
	granted=$(get /slow/ 4 0 "X-Key: r1" | count 200)
	left=$(tokens_left /open/ r1 | awk '{ print $2 "," $3 }')
	check "qp's quota lost only the $granted granted" test "$left" = "429,$((5 - granted))"
	reload_nginx "$zones" "$locs"
	check "after a reload, q1 is still out of quota" test "$(get /a/ 1 0 "X-Key: q1" | count 200)" = 0
	write_conf "$(sed 's|rate=6r/min;|rate=7r/min;|' <<<"$zones")" "$locs"
	kill -HUP "$master"
	sleep 2
	check "a zone whose second rate changed starts afresh" \
		test "$(get /a/ 8 0 "X-Key: q1" | count 200)" = 7
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
	check_delays "11 delayed requests"
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
	reload_nginx "$zones" "$locs"
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
reloads)
	# Reloads in a row under load, each kind of change and none: the
	# master survives them all, every response is 200 or 429, an unchanged
	# zone keeps its keys, a changed (resized, renamed, re-homed) one
	# starts full.
	start_redis
	for d in rc added; do
		mkdir -p "$prefix/html/$d"
		echo hello >"$prefix/html/$d/index.html"
	done
	base="
	tokenbucket_zone zone=keep keys=1024 rate=1r/h burst=3;
	tokenbucket_zone zone=hot keys=64 rate=100r/s burst=20;"
	locs="
		location /slow/ { tokenbucket zone=keep key=\$http_x_key; }
		location /hot/ { tokenbucket zone=hot key=\$http_x_key; }
		location /rc/ { tokenbucket zone=rc key=\$http_x_key; }"
	step() { # step NAME RC_ZONE_PARAMS [ZONES LOCATIONS]: reload to it
		reload_nginx "$base
	tokenbucket_zone zone=rc $2;${3:-}" "$locs${4:-}"
		check "$1: the master $master lives on" \
			test "$(cat "$prefix/nginx.pid" 2>/dev/null)" = "$master" -a -d "/proc/$master"
		check "$1: keep's drained key stays drained" \
			test "$(get /slow/ 1 0 "X-Key: k" | count 429)" = 1
	}
	# rc_has N WHAT: key k of rc grants N more, then refuses.
	rc_has() {
		check "rc $2: $1 left for k" test "$(get /rc/ $(($1 + 1)) 0 "X-Key: k" | count 200)" = "$1"
	}
	write_conf "$base
	tokenbucket_zone zone=rc keys=1024 rate=1r/h burst=4;" "$locs"
	start_nginx
	check "keep: 3 of 4 granted" test "$(get /slow/ 4 0 "X-Key: k" | count 200)" = 3
	rc_has 4 "at the start"
	: >"$prefix/load.out"
	loaders=()
	for p in /hot/ /rc/; do
		while [ ! -e "$prefix/stop" ]; do get $p 50 4000 "X-Key: load"; done >>"$prefix/load.out" &
		loaders+=($!)
	done
	step "rate changed" "keys=1024 rate=2r/h burst=4"
	rc_has 4 "changed: starts full"
	step "unchanged" "keys=1024 rate=2r/h burst=4"
	rc_has 0 "unchanged: keeps its level"
	step "a zone added" "keys=1024 rate=2r/h burst=4" "
	tokenbucket_zone zone=added keys=64 rate=1r/h burst=2;" "
		location /added/ { tokenbucket zone=added key=\$http_x_key; }"
	check "added: 2 of 3 granted" test "$(get /added/ 3 0 "X-Key: k" | count 200)" = 2
	step "renamed" "keys=1024 rate=2r/h burst=4" "
	tokenbucket_zone zone=renamed keys=64 rate=1r/h burst=2;" "
		location /added/ { tokenbucket zone=renamed key=\$http_x_key; }"
	check "renamed: a new zone, full" test "$(get /added/ 3 0 "X-Key: k" | count 200)" = 2
	step "a zone removed, rc resized" "zone=rc:1m rate=2r/h burst=4"
	rc_has 4 "resized: starts full"
	step "unchanged again" "zone=rc:1m rate=2r/h burst=4"
	rc_has 0 "unchanged: keeps its level"
	step "local to Redis" "redis=redis://127.0.0.1:$redis_port rate=2r/h burst=4"
	rc_has 4 "in Redis: starts full"
	step "Redis to local" "zone=rc:1m rate=2r/h burst=4"
	rc_has 4 "local again: starts full"
	step "unchanged after all" "zone=rc:1m rate=2r/h burst=4"
	rc_has 0 "unchanged: keeps its level"
	touch "$prefix/stop"
	wait "${loaders[@]}"
	check "every response under load was 200 or 429 ($(wc -l <"$prefix/load.out") of them)" \
		test "$(awk '$2 != 200 && $2 != 429' "$prefix/load.out" | wc -l)" = 0 -a \
		"$(count 200 <"$prefix/load.out")" -gt 0
	check "no worker crashed, no zone failed, no reload refused" \
		not_in_log 'exited on signal|zone "[^"]*" failed|\[emerg\]|\[alert\]'
	;;
kill | redis-kill)
	# A worker SIGKILLed under load: the master respawns it, the zone stays
	# consistent and the key's bound holds over both clients.  redis-kill:
	# the same with the zone in Redis (a killed worker's calls in flight
	# stay spent; its replacement opens a client of its own).
	where="keys=1024"
	if [ "$group" = redis-kill ]; then
		start_redis
		where="redis=redis://127.0.0.1:$redis_port"
	fi
	write_conf "
	tokenbucket_zone zone=hot $where rate=50r/s burst=20;" "
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
redis-share)
	# One Redis zone shared by two nginx (two workers each): every grant
	# across both within one bound; several zones; delays through Redis.
	start_redis
	r="redis=redis://127.0.0.1:$redis_port"
	zones="
	tokenbucket_zone zone=g $r rate=20r/s burst=10;
	tokenbucket_zone zone=all $r rate=1r/min burst=4;
	tokenbucket_zone zone=r1 $r rate=1r/min burst=5;
	tokenbucket_zone zone=d $r rate=10r/s burst=1;
	tokenbucket_zone zone=rr1 $r rate=1r/min burst=2;
	tokenbucket_zone zone=rr2 $r rate=1r/min burst=3;
	tokenbucket_zone zone=rs $r rate=6r/min burst=1;
	tokenbucket_zone zone=q2 $r rate=1r/s burst=10 rate=6r/min;
	tokenbucket_zone zone=perkey keys=1024 rate=1r/min burst=3;
	tokenbucket_zone zone=l1 keys=1024 rate=1r/min burst=1;"
	locs="
		location /a/ { tokenbucket zone=g key=\$http_x_key; }
		location /both/ {
			tokenbucket zone=perkey key=\$http_x_key;
			tokenbucket zone=all key=all;
		}
		location /a-only/ { tokenbucket zone=perkey key=\$http_x_key; }
		location /b/ {
			tokenbucket zone=r1 key=\$http_x_key;
			tokenbucket zone=l1 key=\$http_x_key;
		}
		location /bytes/ { tokenbucket zone=r1 key=\$http_x_key; }
		location /delay/ { tokenbucket zone=d key=\$http_x_key delay=5s; }
		location /rr/ {
			tokenbucket zone=rr2 key=\$http_x_key;
			tokenbucket zone=rr1 key=\$http_x_key;
		}
		location /rr2/ { tokenbucket zone=rr2 key=\$http_x_key; }
		location /flood/ { tokenbucket zone=q2 key=\$http_x_key; }
		location /open/ {
			tokenbucket zone=perkey key=\$http_x_key;
			tokenbucket zone=q2 key=\$http_x_key;
		}
		location /slow/ { tokenbucket zone=rs key=\$http_x_key delay=500ms; }"
	two_nginx "$zones" "$locs" a
	both_clients /a/ 150 20000 "X-Key: shared"
	# Decisions are made at Redis's time, up to a round trip after the send:
	# the lower bound allows a second's worth for a loaded machine.
	check "two nginx on one Redis key within 10 + 20/s" within_bound "$all" 10 20 1000000000 20
	check "both nginx were granted some" \
		test "$(count 200 <"$prefix/c1.out")" -gt 0 -a "$(count 200 <"$prefix/c2.out")" -gt 0
	check "no errors" test "$(awk '$2 != 200 && $2 != 429' <<<"$all" | wc -l)" = 0
	check "the key is in Redis under the zone's prefix" \
		test "$(rcli exists tokenbucket:g:shared)" = 1
	hdrs=$(response /a/ h)
	check "RateLimit-Policy: burst 10, refilled within 1 s" \
		grep -q $'^RateLimit-Policy: "g";q=10;w=1\r$' <<<"$hdrs"
	check "RateLimit: 9 left, full within 1 s" grep -q $'^RateLimit: "g";r=9;t=1\r$' <<<"$hdrs"
	# A table, then Redis: a refusal by Redis takes nothing from the table.
	check "k1: 3 granted by perkey" test "$(get /both/ 4 0 "X-Key: k1" | count 200)" = 3
	check "k2: 1 granted, then Redis's 'all' is empty" \
		test "$(get /both/ 6 0 "X-Key: k2" | count 200)" = 1
	check "k2's refusals by Redis took nothing from perkey" \
		test "$(get /a-only/ 4 0 "X-Key: k2" | count 200)" = 2
	# Redis, then a table: a refusal by the table gives Redis's tokens back.
	check "1 of 4 granted (l1 refuses the rest)" \
		test "$(get /b/ 4 0 "X-Key: k3" | count 200)" = 1
	check "r1 got its refused tokens back: 4 more granted, then 429" \
		test "$(get /bytes/ 5 0 "X-Key: k3" | awk '{ printf "%s,", $2 }')" = \
		"200,200,200,200,429,"
	check "nginx b sees the same bucket" \
		test "$("$client" "$port2" 1 0 /bytes/ "X-Key: k3" | count 429)" = 1
	# Two Redis zones: the second's refusals give the first's tokens back.
	check "2 of 4 granted by rr2 then rr1" test "$(get /rr/ 4 0 "X-Key: k4" | count 200)" = 2
	check "rr2 got the refused requests' tokens back: 1 left" \
		test "$(get /rr2/ 2 0 "X-Key: k4" | awk '{ printf "%s,", $2 }')" = "200,429,"
	# A zone of two rates in one Redis key: the quota of 6 binds, on both nginx.
	out=$(get /flood/ 10 0 "X-Key: q1")
	check "q2: the quota binds, 6 of 10" test "$(count 200 <<<"$out")" = 6
	check "q2: the refusal names the quota (remaining 0, Retry-After within [1, 10])" \
		test "$(tail -1 <<<"$out" | awk '{ print $3 }')" = 0 -a \
		"$(tail -1 <<<"$out" | awk '{ print $4 }')" -ge 1 -a "$(tail -1 <<<"$out" | awk '{ print $4 }')" -le 10
	check "q2: both rates in one value" test "$(rcli get tokenbucket:q2:q1 | cut -c1-5)" = "tbs1 "
	check "q2: nginx b sees the quota spent" \
		test "$("$client" "$port2" 1 0 /flood/ "X-Key: q1" | count 429)" = 1
	# perkey then q2: q2's refusals give perkey's tokens back.
	get /flood/ 6 0 "X-Key: k5" >/dev/null
	check "k5: q2's quota spent, /open/ refused" test "$(get /open/ 2 0 "X-Key: k5" | count 200)" = 0
	check "k5: perkey got its tokens back: 3 granted" \
		test "$(get /a-only/ 4 0 "X-Key: k5" | count 200)" = 3
	check_delays "11 requests delayed through Redis"
	out=$(get /slow/ 2 0 "X-Key: s1")
	check "a wait beyond the bound is refused" \
		test "$(awk '{ printf "%s,", $2 }' <<<"$out")" = "200,429,"
	retry=$(tail -1 <<<"$out" | awk '{ print $4 }')
	check "with Retry-After $retry within [9, 10]" test "$retry" -ge 9 -a "$retry" -le 10
	sleep 0.3
	check "log: DELAYED" grep -q '^d1 200 DELAYED ' "$prefix/access.log"
	check "log: REJECTED with remaining 0" grep -q '^k2 429 REJECTED 0 ' "$prefix/access.log"
	# A reload: new workers open their clients, the old ones close theirs;
	# the levels are Redis's.
	reload_nginx "$zones" "$locs"
	check "after a reload, k3 is still empty in r1" \
		test "$(get /bytes/ 1 0 "X-Key: k3" | count 429)" = 1
	check "a new key after the reload gets r1's burst" \
		test "$(get /bytes/ 6 0 "X-Key: k9" | count 200)" = 5
	for _ in $(seq 50); do
		[ "$(grep -c 'exited with code 0' "$prefix/error.log")" -ge 2 ] && break
		sleep 0.1
	done
	check "the old workers exited" test "$(grep -c 'exited with code 0' "$prefix/error.log")" -ge 2
	check "and left no socket open" not_in_log 'open socket|left in connection'
	;;
redis-lease)
	# A hot key of a Redis zone with lease=: two nginx (two workers each)
	# decide it from their leases, within the shared bound, with a fraction
	# of the round trips; Redis paused: the lease's refills fail and the
	# fallback decides.
	start_redis
	r="redis=redis://127.0.0.1:$redis_port timeout=300ms fallback=0.5"
	zones="
	tokenbucket_zone zone=h $r rate=400r/s burst=100 lease=100ms lease_hot=5;"
	locs="
		location /h/ { tokenbucket zone=h key=\$http_x_key; }"
	two_nginx "$zones" "$locs" h
	rcli config resetstat >/dev/null
	both_clients /h/ 1500 500 "X-Key: hot"
	calls=$(rcli info commandstats |
		awk -F'[:=,]' '/^cmdstat_(evalsha|eval|fcall|tokenbucket)/ { n += $3 } END { print n + 0 }')
	decisions=$(wc -l <<<"$all")
	echo "  $decisions decisions, $calls calls to Redis, $(count 200 <<<"$all") granted"
	# Each of the 4 workers holds at most 2 x 25 tokens unused (cap: a
	# quarter of the burst): the lower bound allows all of them, and the
	# first requests that made the key hot.
	check "leased grants of two nginx within 100 + 400/s" within_bound "$all" 100 400 1000000000 300
	check "no errors" test "$(awk '$2 != 200 && $2 != 429' <<<"$all" | wc -l)" = 0
	check "at most a quarter as many Redis calls as decisions" test $((calls * 4)) -le "$decisions"
	# Redis paused: a lease with tokens decides, then its refill times out
	# and the fallback decides call by call; no request fails.
	kill -STOP "$redis"
	out=$(get /h/ 15 20000 "X-Key: hot")
	kill -CONT "$redis"
	check "Redis paused: every request decided" \
		test "$(awk '$2 != 200 && $2 != 429' <<<"$out" | wc -l)" = 0
	check "Redis paused: some granted" test "$(count 200 <<<"$out")" -gt 0
	check "back: the leased key is decided again" \
		test "$(get /h/ 20 5000 "X-Key: hot" | awk '$2 != 200 && $2 != 429' | wc -l)" = 0
	check "log: no lease failed to open" not_in_log 'cannot open a lease'
	;;
redis-down)
	# Redis paused, then killed mid-run: the fallback decides (share 0.5 of
	# the limit per worker), a zone without fallback answers 500; then
	# Redis is back.
	start_redis
	r="redis=redis://127.0.0.1:$redis_port timeout=300ms"
	write_conf "
	tokenbucket_zone zone=f $r rate=20r/s burst=10 fallback=0.5;
	tokenbucket_zone zone=s $r rate=1r/min burst=10 fallback=0.5;
	tokenbucket_zone zone=n $r rate=1r/min burst=10;" "
		location /a/ { tokenbucket zone=f key=\$http_x_key; }
		location /slow/ { tokenbucket zone=s key=\$http_x_key; }
		location /b/ { tokenbucket zone=n key=\$http_x_key; }"
	start_nginx
	check "Redis decides: 10 of 12 granted" test "$(get /slow/ 12 0 "X-Key: k1" | count 200)" = 10
	check "the key is in Redis" test "$(rcli exists tokenbucket:s:k1)" = 1
	# Redis paused (SIGSTOP): each call ends at the timeout, on the
	# library's timer in nginx's loop, and the fallback decides.
	kill -STOP "$redis"
	out=$(get /slow/ 3 0 "X-Key: p1")
	nofb=$(get /b/ 1 0 "X-Key: p1")
	kill -CONT "$redis"
	check "Redis paused: the fallback grants" test "$(count 200 <<<"$out")" = 3
	check "Redis paused: without fallback, 500" test "$(count 500 <<<"$nofb")" = 1
	get /a/ 300 10000 "X-Key: k2" >"$prefix/run.out" &
	loader=$!
	sleep 1
	kill -KILL "$redis"
	wait "$redis" 2>/dev/null
	redis=
	wait "$loader"
	out=$(cat "$prefix/run.out")
	check "no errors while Redis went down" \
		test "$(awk '$2 != 200 && $2 != 429' <<<"$out" | wc -l)" = 0
	# Redis's bucket and then each worker's fallback bucket (5 + 10/s) may
	# grant: within 10 + 20/s + 2 x 5 + 2 x 10/s over the run.
	check "grants within Redis's bound plus both workers' fallback shares" \
		within_bound "$out" 20 40 1000000000 1000
	down=$(get /slow/ 12 0 "X-Key: k3")
	check "Redis down: a fresh key gets the fallback's burst (5 or 10 over 2 workers)" \
		test "$(count 200 <<<"$down")" -ge 5 -a "$(count 200 <<<"$down")" -le 10
	check "Redis down: refusals are 429" test "$(count 429 <<<"$down")" -ge 2
	check "without fallback: 500" test "$(get /b/ 2 0 "X-Key: k4" | count 500)" = 2
	sleep 0.3
	check "log: refusals decided by the fallback" grep -q 'decided by the fallback' "$prefix/error.log"
	start_redis
	for _ in $(seq 50); do
		get /b/ 1 0 "X-Key: probe" >/dev/null
		[ "$(rcli exists tokenbucket:n:probe)" = 1 ] && break
		sleep 0.2
	done
	check "Redis back: the zone without fallback decides again" \
		test "$(get /b/ 12 0 "X-Key: k5" | count 200)" = 10
	check "Redis back: a fresh key gets Redis's burst of 10" \
		test "$(get /slow/ 12 0 "X-Key: k6" | count 200)" = 10
	check "and Redis holds it" test "$(rcli exists tokenbucket:s:k6)" = 1
	;;
chain)
	# One key through two zones, A then B, from 32 clients at once (each on
	# its keep-alive connection, over two workers), in each order: table
	# then table, table then Redis, Redis then table.  B (1r/h, burst 5)
	# grants 5 and refuses every other request; a refused request takes
	# nothing from A.  A slow A (1r/h, burst 1000) makes it exact: A loses
	# what the chain granted.  A fast one (10r/s, burst 10) holds at least
	# what a lone A would after the same grants: burst - 5 plus what it has
	# made since the last of them, up to its burst (a table A only: a
	# Redis A's refunds are not awaited, and by the time they have surely
	# landed a fast A has refilled whatever they carried, so only the slow
	# one can tell).  A generous timeout: a call that times out (500) has
	# taken A's tokens in Redis.
	start_redis
	r="redis=redis://127.0.0.1:$redis_port timeout=10s"
	zones="
	tokenbucket_zone zone=ta keys=64 rate=1r/h burst=1000;
	tokenbucket_zone zone=ra $r rate=1r/h burst=1000;
	tokenbucket_zone zone=ta10 keys=64 rate=10r/s burst=10;
	tokenbucket_zone zone=tb keys=64 rate=1r/h burst=5;
	tokenbucket_zone zone=rb $r rate=1r/h burst=5;"
	runs="ta,tb ta,rb ra,tb ta10,tb ta10,rb"
	locs=
	for a in ta ra ta10; do # /qta/ and the like: A alone, the cost a header's
		locs+="
		location /q$a/ { tokenbucket zone=$a key=\$http_x_key cost=\$http_x_cost; }"
		page "q$a"
	done
	for run in $runs; do # /ta-tb/ and the like: A then B
		locs+="
		location /${run/,/-}/ {
			tokenbucket zone=${run%,*} key=\$http_x_key;
			tokenbucket zone=${run#*,} key=\$http_x_key;
		}"
		page "${run/,/-}"
	done
	write_conf "$zones" "$locs"
	start_nginx
	for run in $runs; do
		a=${run%,*} path=/${run/,/-}/ key=${run/,/-}
		many_clients 32 "$path" 200 "X-Key: $key"
		granted=$(count 200 <<<"$all")
		refused=$(count 429 <<<"$all")
		# A Redis A's refunds are not awaited: they land within a few
		# round trips, in the worker that started them (up to 3 s here; a
		# slow A makes nothing meanwhile, so waiting hides no loss).
		for _ in $(seq 30); do
			q=$(tokens_left "/q$a/" "$key")
			left=$(awk '{ print $2 "," $3 }' <<<"$q")
			[ "${a#r}" = "$a" ] || [ "$left" = "429,$((1000 - granted))" ] && break
			sleep 0.1
		done
		if [ "$a" = "${a%10}" ]; then
			floor=$((1000 - granted))
		else # the key's tokens made from the last grant's response to the query
			floor=$(awk -v g="$granted" -v q="${q%% *}" '
				$2 == 200 && $1 + $5 > end { end = $1 + $5 }
				END { f = 10 - g + int((q - end) * 10 / 1e9); print f < 10 ? f : 10 }' <<<"$all")
		fi
		echo "  $path: $granted granted, $refused refused of $(wc -l <<<"$all");" \
			"$a left: ${left#*,} (floor $floor)"
		check "$path: B's 5 granted, the other 6395 refused" \
			test "$granted" = 5 -a "$refused" = 6395
		if [ "$a" = "${a%10}" ]; then
			check "$path: $a lost only the $granted granted" test "$left" = "429,$floor"
		else
			check "$path: $a holds what it would alone, $floor or more" \
				test "${left%,*}" = 429 -a "${left#*,}" -ge "$floor" -a "${left#*,}" -le 10
		fi
	done
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
		tokenbucket_zone 'rate=10r/fortnight' 'unexpected "fortnight"'
	bad "tokenbucket_zone zone=z keys=10 rate=0r/s;" "" tokenbucket_zone 'rate=0r/s' 'must be positive'
	bad "tokenbucket_zone zone=z keys=10 rate=5MB/;" "" tokenbucket_zone 'rate=5MB/' 'incomplete'
	bad "tokenbucket_zone zone=z keys=10 rate=r/s;" "" tokenbucket_zone 'a number must come first'
	bad "tokenbucket_zone zone=z keys=10 rate=unlimited;" "" tokenbucket_zone 'a finite rate'
	bad "tokenbucket_zone zone=z keys=10 rate=1r/s burst=1.5;" "" \
		tokenbucket_zone 'burst=1.5' 'not a whole number of at least 1'
	bad "tokenbucket_zone zone=z keys=10 rate=1r/s burst=2Ti;" "" \
		tokenbucket_zone 'burst=2Ti' 'larger than 1099511627776'
	bad "tokenbucket_zone zone=z keys=0 rate=1r/s;" "" tokenbucket_zone 'keys=0'
	bad "tokenbucket_zone zone=z:1 rate=1r/s;" "" tokenbucket_zone 'zone=z:1'
	bad "tokenbucket_zone zone=z:1m keys=5 rate=1r/s;" "" tokenbucket_zone 'zone=NAME:SIZE or keys=N'
	bad "tokenbucket_zone zone=z keys=10 rate=1r/s full=maybe;" "" tokenbucket_zone 'full=maybe'
	bad "tokenbucket_zone zone=z keys=10;" "" tokenbucket_zone 'no rate'
	bad "$z" "location / { tokenbucket zone=y key=\$http_x_key; }" tokenbucket 'unknown zone "y"'
	bad "$z" "location / { tokenbucket zone=z key=\$http_x_key delay=soon; }" tokenbucket 'delay=soon'
	bad "$z" "location / { tokenbucket zone=z; }" tokenbucket 'key='
	bad "$z" "$l tokenbucket_status 200;" tokenbucket_status '"200"' 'between 400 and 599'
	bad "$z" "$l tokenbucket_headers draft;" 'invalid value "draft"'
	bad "$z $z" "" tokenbucket_zone '"z" is already defined'
	bad "$z tokenbucket_zone zone=z keys=20 rate=1r/s;" "" tokenbucket_zone '"z" is already defined'
	bad "tokenbucket_zone zone=z keys=10 rate=1r/s rate=2r/s rate=3r/s rate=4r/s rate=5r/s;" "" \
		tokenbucket_zone 'rate=5r/s' '4 rates at most'
	bad "tokenbucket_zone zone=z keys=10 rate=1r/s burst=2 burst=3;" "" \
		tokenbucket_zone '"z"' 'more burst= than rate='
	r2="tokenbucket_zone zone=r2 redis=redis://127.0.0.1:1 rate=1r/s rate=1r/h;"
	bad "$r2 $z" "location / { tokenbucket zone=r2 key=\$http_x_key; tokenbucket zone=z key=a; }" \
		tokenbucket '"r2"' 'must be the last limit, without delay='
	bad "$r2" "location / { tokenbucket zone=r2 key=\$http_x_key delay=1s; }" \
		tokenbucket '"r2"' 'must be the last limit, without delay='
	bad "tokenbucket_zone zone=r redis=redis://a rate=1r/s rate=1r/h lease=1s;" "" \
		tokenbucket_zone '"r"' 'lease= takes a zone of one rate='
	bad "tokenbucket_zone zone=r redis=http://x rate=1r/s;" "" tokenbucket_zone 'redis=http://x'
	bad "tokenbucket_zone zone=r cluster=redis://a:1,,redis://b:2 rate=1r/s;" "" \
		tokenbucket_zone 'cluster=redis://a:1,,redis://b:2' 'empty address'
	bad "tokenbucket_zone zone=r cluster=unix:/x rate=1r/s;" "" tokenbucket_zone 'cluster=unix:/x'
	bad "tokenbucket_zone zone=r redis=redis://a rate=1r/s fallback=2;" "" \
		tokenbucket_zone 'fallback=2' '(0, 1]'
	bad "tokenbucket_zone zone=r redis=redis://a rate=1r/s timeout=0;" "" \
		tokenbucket_zone 'timeout=0'
	bad "tokenbucket_zone zone=r redis=redis://a rate=1r/s keys=10;" "" \
		tokenbucket_zone '"r"' 'no size, keys= or full='
	bad "tokenbucket_zone zone=r redis=redis://a redis=redis://b rate=1r/s;" "" \
		tokenbucket_zone 'redis=redis://b' 'one redis= or cluster='
	bad "tokenbucket_zone zone=r keys=10 rate=1r/s fallback=0.5;" "" \
		tokenbucket_zone '"r"' 'need redis= or cluster='
	bad "tokenbucket_zone zone=r redis=redis://a rate=1r/s burst=5000000000000000000;" "" \
		tokenbucket_zone '"r"' 'burst'
	bad "tokenbucket_zone zone=r keys=10 rate=1r/s lease=1s;" "" \
		tokenbucket_zone '"r"' 'lease= need redis= or cluster='
	bad "tokenbucket_zone zone=r redis=redis://a rate=1r/s burst=10 lease_hot=3;" "" \
		tokenbucket_zone '"r"' 'need lease='
	bad "tokenbucket_zone zone=r redis=redis://a rate=100r/s burst=10 lease=1s;" "" \
		tokenbucket_zone '"r"' 'a burst or more in 3/8 of lease='
	bad "tokenbucket_zone zone=r redis=redis://a rate=1r/s burst=10 lease=100ms;" "" \
		tokenbucket_zone '"r"' 'less than a token'
	bad "tokenbucket_zone zone=r redis=redis://a rate=1r/s burst=10 lease=2h;" "" \
		tokenbucket_zone 'lease=2h' 'not a time in (0, 1h]'
	bad "tokenbucket_zone zone=r redis=redis://a rate=1r/s burst=10 lease=1s lease_share=0;" "" \
		tokenbucket_zone 'lease_share=0'
	bad "tokenbucket_zone zone=r redis=redis://a rate=1r/s burst=10 lease=1s lease_keys=0;" "" \
		tokenbucket_zone 'lease_keys=0'
	write_conf "$z" "$l"
	check "a good configuration passes nginx -t" \
		eval '(run_nginx -t -q -p "$prefix" -c "$prefix/nginx.conf" -e "$prefix/t.log")'
	write_conf "tokenbucket zone=late key=x; tokenbucket_zone zone=late keys=10 rate=1r/s;" ""
	check "a zone used before its tokenbucket_zone passes nginx -t" \
		eval '(run_nginx -t -q -p "$prefix" -c "$prefix/nginx.conf" -e "$prefix/t.log")'
	write_conf "$z tokenbucket_zone zone=r redis=redis://127.0.0.1:1 rate=2.5r/min burst=3
		\"prefix={api}:\" fallback=0.25 timeout=50ms;
	tokenbucket_zone zone=hl redis=redis://127.0.0.1:1 rate=100r/s burst=50 lease=200ms
		lease_share=0.5 lease_hot=3 lease_keys=16;
	tokenbucket_zone zone=c cluster=redis://127.0.0.1:1,redis://127.0.0.1:2 rate=1MB/s;" \
		"$l location /r/ { tokenbucket zone=r key=\$http_x_key; tokenbucket zone=c key=x; }"
	check "Redis zones pass nginx -t (no server needed)" \
		eval '(run_nginx -t -q -p "$prefix" -c "$prefix/nginx.conf" -e "$prefix/t.log")'
	;;
*)
	echo "unknown group $group" >&2
	exit 2
	;;
esac
[ "$failures" -eq 0 ]
