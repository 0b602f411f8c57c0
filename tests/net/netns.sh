#!/bin/sh
# SPDX-License-Identifier: MIT
#
# usage: netns.sh --delay-bin TB_DELAY [--delay-ms D] [--jitter-ms J] -- COMMAND [ARG...]
#
# Runs COMMAND in a network namespace of its own that reaches a
# redis-server, in another, only through tb-delay, in a third: each
# direction held D ms (default 0.5) plus a jitter of up to J ms (default
# 0) either way, so a round trip takes about 2 × D.
#
#   client ns (veth c) 10.213.0.2 --- 10.213.0.1 forwarder ns 10.214.0.1 --- 10.214.0.2 server ns
#
# COMMAND gets, in its environment: TB_NETNS_URL (the server through the
# forwarder), TB_NETNS_ADMIN (the server's unix socket, outside the delay:
# the namespaces share the file system), TB_NETNS_LINK (the client's veth,
# in COMMAND's namespace: "ip link set dev $TB_NETNS_LINK down" cuts it
# off).  The namespaces, their veths, the forwarder and the server are
# removed on any exit.  Needs root and ip(8); exits 77 (skip, or 1 with
# TOKENBUCKET_NO_SKIP) with the reason otherwise.  Exits with COMMAND's
# status.
set -eu

here=$(cd "$(dirname "$0")" && pwd)
. "$here/../skip.sh"

delay_bin= delay=0.5 jitter=0
while [ $# -gt 0 ]; do
	case $1 in
	--delay-bin) delay_bin=$2; shift 2 ;;
	--delay-ms) delay=$2; shift 2 ;;
	--jitter-ms) jitter=$2; shift 2 ;;
	--) shift; break ;;
	*) sed -n 's/^# usage: //p' "$0" >&2; exit 2 ;;
	esac
done
[ $# -gt 0 ] && [ -x "$delay_bin" ] || { sed -n 's/^# usage: //p' "$0" >&2; exit 2; }

[ "$(id -u)" -eq 0 ] || skip "network namespaces need root (uid $(id -u))"
command -v ip >/dev/null 2>&1 || skip "no ip(8) (iproute2)"
command -v redis-server >/dev/null 2>&1 || skip "no redis-server"
command -v redis-cli >/dev/null 2>&1 || skip "no redis-cli"

# Names of this run's namespaces: several runs may overlap.  Their
# addresses cannot meet (each namespace has its own).
cns=tbc$$ fns=tbf$$ sns=tbs$$
tmp=$(mktemp -d "${TMPDIR:-/tmp}/tb-netns.XXXXXX")
fwd= srv=
cleanup() {
	status=$?
	trap - EXIT INT TERM
	[ -n "$fwd" ] && kill "$fwd" 2>/dev/null && wait "$fwd" 2>/dev/null
	[ -n "$srv" ] && kill "$srv" 2>/dev/null && wait "$srv" 2>/dev/null
	for ns in $cns $fns $sns; do
		ip netns del "$ns" 2>/dev/null || :
	done
	rm -rf "$tmp"
	exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

ip netns add "$cns" 2>"$tmp/err" || skip "cannot make a network namespace: $(cat "$tmp/err")"
ip netns add "$fns"
ip netns add "$sns"
# Each pair made in the forwarder's namespace, one end then moved out.
ip -n "$fns" link add fc type veth peer name c
ip -n "$fns" link set c netns "$cns"
ip -n "$fns" link add fs type veth peer name s
ip -n "$fns" link set s netns "$sns"
ip -n "$fns" addr add "10.213.0.1/24" dev fc
ip -n "$cns" addr add "10.213.0.2/24" dev c
ip -n "$fns" addr add "10.214.0.1/24" dev fs
ip -n "$sns" addr add "10.214.0.2/24" dev s
for pair in "$cns c" "$fns fc" "$fns fs" "$sns s"; do
	ip -n "${pair% *}" link set "${pair#* }" up
done
for ns in $cns $fns $sns; do
	ip -n "$ns" link set lo up
done

ip netns exec "$sns" redis-server --port 6379 --bind "10.214.0.2" \
	--unixsocket "$tmp/redis.sock" --save '' --appendonly no --protected-mode no \
	--dir "$tmp" --logfile "$tmp/redis.log" --daemonize no &
srv=$!
ip netns exec "$fns" "$delay_bin" --listen "10.213.0.1:6379" --to "10.214.0.2:6379" \
	--delay-ms "$delay" --jitter-ms "$jitter" --seed "$$" &
fwd=$!
up=
for _ in $(seq 100); do
	kill -0 "$srv" 2>/dev/null && kill -0 "$fwd" 2>/dev/null || break
	if redis-cli -s "$tmp/redis.sock" ping >/dev/null 2>&1 &&
		ip netns exec "$cns" redis-cli -h "10.213.0.1" -p 6379 ping >/dev/null 2>&1; then
		up=1
		break
	fi
	sleep 0.1
done
[ -n "$up" ] || { echo "netns.sh: the server is not reachable through the forwarder" >&2; cat "$tmp/redis.log" >&2; exit 1; }

status=0
ip netns exec "$cns" env TB_NETNS_URL="redis://10.213.0.1:6379" \
	TB_NETNS_ADMIN="$tmp/redis.sock" TB_NETNS_LINK=c "$@" || status=$?
exit "$status"
