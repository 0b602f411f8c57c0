#!/bin/sh
# SPDX-License-Identifier: MIT
#
# usage: tbrate.sh GROUP TBRATE
#
# Runs the tbrate program on real pipes, files, named buckets and a private
# redis-server.  GROUP is one of pacing, shared, redis, signals, errors.
#
# Timing: a lower bound is what exactness guarantees (n tokens through a
# bucket of burst b at r per second take at least (n - b) / r seconds, and
# nothing can beat it); upper bounds are generous and scaled by
# CK_TIMEOUT_MULTIPLIER, as the Check suites scale theirs.
set -eu

if [ $# -ne 2 ]; then
	echo "usage: $0 GROUP TBRATE" >&2
	exit 2
fi
group=$1
# TBRATE_TEST_WRAPPER (words, e.g. a valgrind command line) runs before
# tbrate: .ci/sanitize valgrind checks tbrate that way, since this shell
# and the system's tools are not followed (ctest starts the script
# through env, and /usr/bin/* is not traced).
TB="${TBRATE_TEST_WRAPPER:-} $2"
here=$(cd "$(dirname "$0")" && pwd)
. "$here/../skip.sh"
M=${CK_TIMEOUT_MULTIPLIER:-1}
tmp=$(mktemp -d)
name=tbrate-test-$$
redis_pid=
cleanup() {
	[ -z "$redis_pid" ] || kill -9 "$redis_pid" 2>/dev/null || true
	rm -f "/dev/shm/tokenbucket.$name" "/dev/shm/tokenbucket.$name-junk"
	rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 1' INT TERM

failures=0
fail() {
	echo "FAIL [$group]: $*" >&2
	failures=$((failures + 1))
}
ok() {
	echo "ok [$group]: $*"
}
now_ns() {
	date +%s%N
}
# ms N: N milliseconds, as a number of ns.
ms() {
	echo $(($1 * 1000000))
}
# at_least WHAT ELAPSED_NS BOUND_NS
at_least() {
	if [ "$2" -lt "$3" ]; then
		fail "$1: took $(($2 / 1000000)) ms, exactness needs at least $(($3 / 1000000)) ms"
	else
		ok "$1: $(($2 / 1000000)) ms >= $(($3 / 1000000)) ms"
	fi
}
# at_most WHAT ELAPSED_NS BOUND_NS (the bound is scaled by M)
at_most() {
	if [ "$2" -gt $(($3 * M)) ]; then
		fail "$1: took $(($2 / 1000000)) ms, more than $(($3 * M / 1000000)) ms"
	fi
}
# expect_rc WHAT WANT GOT
expect_rc() {
	if [ "$3" -ne "$2" ]; then
		fail "$1: exit status $3, want $2"
	else
		ok "$1: exit status $3"
	fi
}
# expect_in WHAT FILE TEXT: FILE holds TEXT.
expect_in() {
	if grep -qF -- "$3" "$2"; then
		ok "$1: says \"$3\""
	else
		fail "$1: \"$3\" not in: $(cat "$2")"
	fi
}
size() {
	wc -c <"$1" | tr -d ' '
}

# A file of n zero bytes.
zeros() {
	head -c "$1" /dev/zero >"$2"
}

# pace WHAT N RATE_PER_S BURST [tbrate options...]: N bytes through tbrate,
# all of them out, no faster than exactness allows.
pace() {
	what=$1 n=$2 r=$3 b=$4
	shift 4
	zeros "$n" "$tmp/in"
	t0=$(now_ns)
	rc=0
	cat "$tmp/in" | $TB "$@" >"$tmp/out" || rc=$?
	el=$(($(now_ns) - t0))
	expect_rc "$what" 0 $rc
	[ "$(size "$tmp/out")" -eq "$n" ] || fail "$what: $(size "$tmp/out") bytes out of $n"
	at_least "$what" $el $(((n - b) * 1000000000 / r))
	at_most "$what" $el $(((n - b) * 1000000000 / r + 3000000000))
}

group_pacing() {
	# Splice (pipe to pipe) and read/write; the default burst is 20 ms of the rate.
	pace "bytes, splice" 20000 20000 400 -r 20k/s
	pace "bytes, read/write" 20000 20000 400 -r 20kB/s --no-splice
	pace "bits" 2500 2000 40 -r 16kbit/s
	pace "burst" 15000 10000 10000 -r 10k/s -b 10k

	# Data intact through both paths, and to a file (no splice into a pipe).
	seq 1 30000 >"$tmp/seq"
	$TB -r 4M/s <"$tmp/seq" | cmp -s - "$tmp/seq" || fail "splice path alters data"
	$TB -r 4M/s --no-splice <"$tmp/seq" | cmp -s - "$tmp/seq" || fail "copy path alters data"
	$TB -r unlimited <"$tmp/seq" >"$tmp/out"
	cmp -s "$tmp/out" "$tmp/seq" || fail "file to file alters data"
	ok "data intact"

	# Smooth: at 4000 B/s the output never runs ahead of burst (80) plus the
	# rate times the time since tbrate started (a 64 KiB chunk would).
	zeros 4000 "$tmp/in"
	t0=$(now_ns)
	$TB -r 4000/s <"$tmp/in" >"$tmp/out" &
	pid=$!
	sleep 0.3
	got=$(size "$tmp/out")
	el=$(($(now_ns) - t0))
	bound=$((80 + 4000 * el / 1000000000))
	[ "$got" -le "$bound" ] || fail "smooth: $got bytes after $((el / 1000000)) ms, bound $bound"
	ok "smooth: $got bytes after $((el / 1000000)) ms <= $bound"
	kill "$pid" 2>/dev/null || true
	wait "$pid" || true

	# Lines: one token per line, burst 1: 6 lines at 10/s take 0.5 s.
	seq 1 6 >"$tmp/lines"
	t0=$(now_ns)
	$TB -l -r 10/s <"$tmp/lines" >"$tmp/out"
	el=$(($(now_ns) - t0))
	cmp -s "$tmp/out" "$tmp/lines" || fail "lines: output differs"
	at_least "lines" $el $(ms 500)
	# A last line without a newline, and a line longer than the buffer.
	printf 'a\nb' | $TB -l -r 100/s >"$tmp/out"
	[ "$(cat "$tmp/out")" = "$(printf 'a\nb')" ] || fail "lines: last line without newline"
	head -c 100000 /dev/zero | tr '\0' x | $TB -l -r 100/s | wc -c | grep -qx 100000 ||
		fail "lines: a long line is cut"

	# Commands: {} is a line of standard input; 3 runs at 10/s take 0.2 s.
	t0=$(now_ns)
	printf 'a\nb c\nd\n' | $TB -r 10/s -- sh -c 'echo "<$1>"' sh '{}' >"$tmp/out"
	el=$(($(now_ns) - t0))
	[ "$(cat "$tmp/out")" = "$(printf '<a>\n<b c>\n<d>')" ] ||
		fail "command: output $(cat "$tmp/out")"
	at_least "command, {}" $el $(ms 200)
	# Without {}: -n runs, the first at once.
	t0=$(now_ns)
	$TB -r 20/s -n 5 -- sh -c 'echo run' >"$tmp/out" </dev/null
	el=$(($(now_ns) - t0))
	[ "$(grep -c run "$tmp/out")" -eq 5 ] || fail "command -n 5: $(cat "$tmp/out")"
	at_least "command, -n" $el $(ms 200)

	# Progress on standard error.
	seq 1 3 | $TB -l -r 100/s -p >/dev/null 2>"$tmp/err"
	expect_in "progress" "$tmp/err" "3 lines"

	# Several rates, all or nothing: a quota's default burst is its amount
	# over the written period (10 per 2 s holds 10).  30 lines at 100/s
	# under 10/2s: 10 at once, 20 more at 5/s take 4 s.
	t0=$(now_ns)
	seq 1 30 | $TB -l -r 100/s -r 10/2s >"$tmp/out"
	el=$(($(now_ns) - t0))
	[ "$(wc -l <"$tmp/out")" -eq 30 ] || fail "two rates: $(wc -l <"$tmp/out") lines of 30"
	at_least "two rates, the quota binds" $el $(ms 4000)
	at_most "two rates" $el $(ms 7000)
	# The first rate binds when the quota is large; -b pairs with its -r.
	t0=$(now_ns)
	seq 1 11 | $TB -l -r 20/s -r 1000/h -b 1 -b 1000 >"$tmp/out"
	el=$(($(now_ns) - t0))
	at_least "two rates, the pace binds" $el $(ms 500)
	# A quota spent stops the output: 5 an hour lets 5 lines through, then
	# the deadline ends tbrate (3) with nothing more written.
	rc=0
	seq 1 8 | $TB -l -r 1000/s -r 5/h -t 1 >"$tmp/out" || rc=$?
	expect_rc "quota spent" 3 $rc
	[ "$(wc -l <"$tmp/out")" -eq 5 ] || fail "quota spent: $(wc -l <"$tmp/out") lines of 5"
	# Bytes under a byte quota: 3000 bytes, 1000 of them at once, then 1 kB/s.
	pace "bytes, two rates" 3000 1000 1000 -r 1M/s -r 1kB/s -b 4k -b 1000
	# The statistics name every rate.  Signalled once its first lines are
	# out (the handlers are set by then, however slowly it started).
	rm -f "$tmp/out"
	seq 1 100 | $TB -l -r 50/s -r 1000/h -b 1 -b 7 >"$tmp/out" 2>"$tmp/err" &
	pid=$!
	await_output
	kill -USR1 "$pid"
	await_output "$tmp/err" "burst 7"
	kill "$pid" 2>/dev/null || true
	wait "$pid" || true
	expect_in "statistics, two rates" "$tmp/err" "burst 7"
}

# two WHAT SHARE_OPTIONS...: two tbrate processes on one bucket for 1 s
# each (-t), at 20000 B/s, burst 400: together no more than the bucket
# allows over the whole time, and each a fair part of it.
two() {
	what=$1
	shift
	zeros 1000000 "$tmp/big"
	t0=$(now_ns)
	$TB -r 20k/s -t 1 "$@" <"$tmp/big" >"$tmp/out1" &
	p1=$!
	$TB -r 20k/s -t 1 "$@" <"$tmp/big" >"$tmp/out2" &
	p2=$!
	rc1=0 rc2=0
	wait $p1 || rc1=$?
	wait $p2 || rc2=$?
	el=$(($(now_ns) - t0))
	expect_rc "$what: first, at the deadline" 3 $rc1
	expect_rc "$what: second, at the deadline" 3 $rc2
	a=$(size "$tmp/out1") b=$(size "$tmp/out2")
	bound=$((400 + 20000 * el / 1000000000))
	total=$((a + b))
	[ $total -le $bound ] || fail "$what: $a + $b bytes in $((el / 1000000)) ms, bound $bound"
	[ $a -gt 0 ] && [ $b -gt 0 ] || fail "$what: one made no progress ($a, $b)"
	[ $((a * 4)) -ge $total ] && [ $((b * 4)) -ge $total ] ||
		fail "$what: not shared fairly ($a, $b)"
	ok "$what: $a + $b = $total bytes in $((el / 1000000)) ms <= $bound"
}

group_shared() {
	two "shared" --shared "$name"
	# Joined as it is: the bucket's 20000/s, not the 1M/s asked.
	zeros 20000 "$tmp/in"
	t0=$(now_ns)
	$TB -r 1M/s --shared "$name" <"$tmp/in" >"$tmp/out" 2>"$tmp/err"
	el=$(($(now_ns) - t0))
	expect_in "shared, other rate" "$tmp/err" "joining it as it is"
	at_least "shared, other rate" $el $(((20000 - 400) * 1000000000 / 20000))
	rc=0
	$TB --shared "$name" --unlink || rc=$?
	expect_rc "unlink" 0 $rc
	[ ! -e "/dev/shm/tokenbucket.$name" ] || fail "unlink left the bucket"
}

start_redis() {
	command -v redis-server >/dev/null 2>&1 || skip "tbrate: redis-server is not installed"
	command -v redis-cli >/dev/null 2>&1 || skip "tbrate: redis-cli is not installed"
	mkdir -p "$tmp/redis"
	# A free loopback port: try a few, each one redis-server can bind.
	tries=0
	while :; do
		port=$((20000 + ($$ * 7 + tries * 131) % 30000))
		redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no \
			--dir "$tmp/redis" --logfile redis.log --daemonize no &
		redis_pid=$!
		i=0
		while [ $i -lt 50 ]; do
			if redis-cli -p "$port" ping 2>/dev/null | grep -q PONG; then
				return 0
			fi
			kill -0 "$redis_pid" 2>/dev/null || break
			sleep 0.1
			i=$((i + 1))
		done
		kill -9 "$redis_pid" 2>/dev/null || true
		wait "$redis_pid" 2>/dev/null || true
		redis_pid=
		tries=$((tries + 1))
		[ $tries -lt 10 ] || { fail "cannot start redis-server"; return 1; }
	done
}

# leased N RATE BURST [tbrate options...]: N processes share one key in Redis
# for a second, through their leases: together within BURST + RATE x elapsed
# (the exact bound, leases or not), each of them moving bytes.
leased() {
	procs=$1 rate=$2 burst=$3
	shift 3
	t0=$(now_ns)
	pids=
	i=0
	while [ $i -lt "$procs" ]; do
		$TB -r "$rate/s" -t 1 "$@" </dev/zero >"$tmp/lease$i" &
		pids="$pids $!"
		i=$((i + 1))
	done
	for p in $pids; do
		rc=0
		wait "$p" || rc=$?
		expect_rc "leases: a process at the deadline" 3 $rc
	done
	el=$(($(now_ns) - t0))
	total=0
	i=0
	while [ $i -lt "$procs" ]; do
		a=$(size "$tmp/lease$i")
		[ "$a" -gt 0 ] || fail "leases: process $i made no progress"
		total=$((total + a))
		i=$((i + 1))
	done
	bound=$((burst + rate * el / 1000000000))
	[ $total -le $bound ] || fail "leases: $procs x $rate/s: $total bytes in $((el / 1000000)) ms, bound $bound"
	ok "leases: $procs x $rate/s: $total bytes in $((el / 1000000)) ms <= $bound"
}

group_redis() {
	$TB --version | grep -q "Redis built in" || fail "tbrate built without Redis"
	start_redis
	url=redis://127.0.0.1:$port
	# Bytes go through leases: the small burst of the other groups, and
	# the default (a quarter second of the rate), with three processes.
	two "redis" -b 400 --redis "$url" --key "$name"
	leased 3 4000000 1000000 --redis "$url" --key "$name-lease"
	# A key idle for a second expires (it is full by then): keep it in use
	# while another rate joins it.
	$TB -r 20k/s -b 400 --redis "$url" --key "$name" <"$tmp/big" >"$tmp/keep" 2>&1 &
	keeper=$!
	i=0
	until [ -s "$tmp/keep" ]; do
		sleep 0.1
		i=$((i + 1))
		[ $i -lt $((100 * M)) ] || { fail "redis: the first process does not start"; break; }
	done
	redis-cli -p "$port" get "$name" | grep -qE '^tbl?1 ' || fail "redis: no bucket at the key"
	zeros 20000 "$tmp/in"
	t0=$(now_ns)
	$TB -r 1M/s --redis "$url" --key "$name" <"$tmp/in" >"$tmp/out" 2>"$tmp/err"
	el=$(($(now_ns) - t0))
	kill "$keeper" 2>/dev/null || true
	wait "$keeper" 2>/dev/null || true
	expect_in "redis, other rate" "$tmp/err" "joining it as it is"
	at_least "redis, other rate" $el $(((20000 - 400) * 1000000000 / 20000))
	# A key that holds something else, and a server that is gone.
	redis-cli -p "$port" set "$name-junk" hello >/dev/null
	rc=0
	$TB -r 1k/s --redis "$url" --key "$name-junk" </dev/null 2>"$tmp/err" || rc=$?
	expect_rc "redis, not a bucket" 4 $rc
	kill -9 "$redis_pid"
	wait "$redis_pid" 2>/dev/null || true
	redis_pid=
	rc=0
	$TB -r 1k/s --redis "$url" --key "$name" </dev/null 2>"$tmp/err" || rc=$?
	expect_rc "redis, no server" 4 $rc
}

# sig_start OPTIONS...: tbrate in the background on 1 MB, pid in $pid,
# once it has written something (its handlers are in place before that).
# await_output [FILE TEXT]: waits (at most 10 s, scaled by M) until
# $tmp/out has bytes, or until FILE holds TEXT.
await_output() {
	i=0
	while [ $i -lt $((100 * M)) ]; do
		if [ $# -eq 0 ]; then
			[ -s "$tmp/out" ] && return 0
		else
			grep -qF -- "$2" "$1" && return 0
		fi
		sleep 0.1
		i=$((i + 1))
	done
}

sig_start() {
	zeros 1000000 "$tmp/big"
	rm -f "$tmp/out"
	$TB "$@" <"$tmp/big" >"$tmp/out" 2>"$tmp/err" &
	pid=$!
	await_output
	sleep 0.2
}
sig_end() {
	rc=0
	wait "$pid" || rc=$?
}

group_signals() {
	sig_start -r 10k/s
	kill -USR1 "$pid"
	sleep 0.2
	kill -USR1 "$pid"
	sleep 0.2
	kill -TERM "$pid"
	sig_end
	expect_rc "SIGTERM" 143 $rc
	expect_in "SIGUSR1" "$tmp/err" "bytes in"
	[ "$(grep -c 'bytes in' "$tmp/err")" -eq 2 ] || fail "SIGUSR1: two signals, not two lines"
	expect_in "SIGUSR1" "$tmp/err" "rate 10000/s"

	sig_start -r 10k/s
	kill -INT "$pid"
	sig_end
	expect_rc "SIGINT" 130 $rc

	# SIGHUP: from 1000 B/s to 200000 B/s; far more than the old rate allows.
	echo 1000/s >"$tmp/rate"
	t0=$(now_ns)
	sig_start --rate-file "$tmp/rate" -t 1.5
	echo ' 200k/s ' >"$tmp/rate"
	kill -HUP "$pid"
	sig_end
	el=$(($(now_ns) - t0))
	expect_rc "SIGHUP, deadline" 3 $rc
	expect_in "SIGHUP" "$tmp/err" "rate now 200000/s"
	got=$(size "$tmp/out")
	old=$((20 + 1000 * el / 1000000000))
	[ "$got" -gt $((old * 4)) ] || fail "SIGHUP: $got bytes, no more than the old rate's $old"
	ok "SIGHUP: $got bytes, the old rate allowed $old"

	# A bad rate file on SIGHUP keeps the rate.
	sig_start --rate-file "$tmp/rate"
	echo '5 per second' >"$tmp/rate"
	kill -HUP "$pid"
	sleep 0.2
	kill -TERM "$pid"
	sig_end
	expect_in "SIGHUP, bad file" "$tmp/err" "keeping the rate"
	expect_rc "SIGHUP, bad file" 143 $rc

	# SIGTERM while a command runs: it is passed on, tbrate does not wait 10 s.
	t0=$(now_ns)
	rm -f "$tmp/out"
	$TB -r 10/s -n 1 -- sh -c 'echo started; exec sleep 10' </dev/null >"$tmp/out" &
	pid=$!
	await_output
	kill -TERM "$pid"
	sig_end
	el=$(($(now_ns) - t0))
	expect_rc "SIGTERM, command" 143 $rc
	at_most "SIGTERM, command" $el $(ms 5000)
}

group_errors() {
	for args in "-r 5Q/s" "-r" "-x" "-r 1/s -l -- true" "-r 1/s --redis redis://x" \
		"-r 1/s --key k" "-r 1/s -n 0 -- true" "-r 1/s -n 5" "-r 1/s -t 0" \
		"-r 1/s -b 1.5" "-l -r 1kB/s" "" "--rate-file /nonexistent" \
		"-r 1/s --shared a --redis redis://x --key k" "--unlink" "-r 1/s --shared a/b" \
		"-r 1/s -r 2/s --shared a" "-r 1/s -r 2/s --redis redis://x --key k" \
		"-r 1/s -b 1 -b 2" "-r 1/s -r 2/s -b 1 -b 2 -b 3" "-l -r 1/s -r 1kB/s" \
		"-r 1/s -r 1/s -r 1/s -r 1/s -r 1/s -r 1/s -r 1/s -r 1/s -r 1/s -r 1/s -r 1/s -r 1/s -r 1/s -r 1/s -r 1/s -r 1/s -r 1/s" \
		"-r 1/s -r 0/s" "-r 1/s --rate-file /dev/null"; do
		rc=0
		# shellcheck disable=SC2086 # the words are options
		$TB $args </dev/null >/dev/null 2>"$tmp/err" || rc=$?
		expect_rc "usage: tbrate $args" 2 $rc
	done
	rc=0
	$TB -r 1/x </dev/null 2>"$tmp/err" || rc=$?
	expect_in "bad period named" "$tmp/err" "unexpected \"x\""
	rc=0
	$TB --help >"$tmp/out" || rc=$?
	expect_rc "--help" 0 $rc
	expect_in "--help" "$tmp/out" "Exit status"
	$TB --version | grep -q "^tbrate [0-9]" || fail "--version"

	# 1: a run failed; the others still ran.
	rc=0
	printf '1\n0\n' | $TB -r 100/s -- sh -c 'echo ran; exit $1' sh '{}' >"$tmp/out" || rc=$?
	expect_rc "a command failed" 1 $rc
	[ "$(grep -c ran "$tmp/out")" -eq 2 ] || fail "a failed run stopped the others"

	# 3: the deadline, waiting for tokens and waiting for input.
	rc=0
	seq 1 100 | $TB -l -r 10/s -t 300ms >"$tmp/out" || rc=$?
	expect_rc "deadline, tokens" 3 $rc
	[ "$(wc -l <"$tmp/out")" -le 5 ] || fail "deadline: $(wc -l <"$tmp/out") lines in 0.3 s"
	# No input and no end of it: a writer that holds a fifo open and is silent.
	mkfifo "$tmp/fifo"
	sleep 1000 >"$tmp/fifo" &
	writer=$!
	rc=0
	$TB -r 1k/s -t 200ms <"$tmp/fifo" || rc=$?
	kill "$writer" 2>/dev/null || true
	wait "$writer" 2>/dev/null || true
	expect_rc "deadline, input" 3 $rc

	# 4: the shared bucket is not one, or is not there.
	printf 'not a bucket' >"/dev/shm/tokenbucket.$name-junk"
	rc=0
	$TB -r 1k/s --shared "$name-junk" </dev/null 2>"$tmp/err" || rc=$?
	expect_rc "shared, not a bucket" 4 $rc
	rc=0
	$TB --shared "$name-none" --unlink 2>"$tmp/err" || rc=$?
	expect_rc "unlink, no bucket" 4 $rc

	# 5: input or output errors.
	rc=0
	$TB -r 1k/s </ >/dev/null 2>"$tmp/err" || rc=$?
	expect_rc "read error" 5 $rc
	rc=0
	echo hello | $TB -r 1k/s >/dev/full 2>"$tmp/err" || rc=$?
	expect_rc "write error" 5 $rc

	# 6: the output closed.
	{
		r=0
		head -c 200000 /dev/zero | $TB -r 10M/s 2>"$tmp/err" || r=$?
		echo $r >"$tmp/rc"
	} | head -c 10 >/dev/null
	expect_rc "output closed" 6 "$(cat "$tmp/rc")"

	# 126, 127: the command cannot run.
	rc=0
	$TB -r 10/s -n 1 -- /dev/null </dev/null 2>"$tmp/err" || rc=$?
	expect_rc "cannot execute" 126 $rc
	rc=0
	$TB -r 10/s -n 1 -- tbrate-no-such-command </dev/null 2>"$tmp/err" || rc=$?
	expect_rc "not found" 127 $rc
	# A command that exits 127 itself is a failed run, not "not found".
	rc=0
	$TB -r 10/s -n 1 -- sh -c 'exit 127' </dev/null || rc=$?
	expect_rc "a run exiting 127" 1 $rc
}

case $group in
pacing | shared | redis | signals | errors) "group_$group" ;;
*)
	echo "unknown group $group" >&2
	exit 2
	;;
esac
if [ $failures -ne 0 ]; then
	echo "$group: $failures failures" >&2
	exit 1
fi
echo "$group: all passed"
