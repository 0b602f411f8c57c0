#!/bin/sh
# SPDX-License-Identifier: MIT
#
# usage: exports.sh LIBRARY SRCDIR
#
# The public surface is written down in five places; this test fails on any
# difference between them (for libtokenbucket-redis, LIBRARY named
# libtokenbucket-redis.so*, read tokenbucket-redis.h, src/redis/
# tokenbucket-redis.map, debian/libtokenbucket-redis1.symbols and
# TOKENBUCKET_REDIS_M.N below):
#   - the functions declared TOKENBUCKET_API in include/tokenbucket.h;
#   - the dynamic symbols the built LIBRARY exports (nm -D), with their nodes;
#   - the version script src/tokenbucket.map;
#   - debian/libtokenbucket1.symbols;
#   - the manual pages man/man3/<function>.3.
# It also checks that every symbol's version node names the release it first
# appeared in (TOKENBUCKET_M.N for version M.N.x), which is what keeps a
# shipped node from being edited: a later addition to it would carry a later
# version in the symbols file.
set -eu

if [ $# -ne 2 ]; then
	echo "usage: $0 LIBRARY SRCDIR" >&2
	exit 2
fi
lib=$1
src=$2
NM=${NM:-nm}
case $(basename "$lib") in
libtokenbucket-redis.so*)
	header=include/tokenbucket-redis.h
	map=src/redis/tokenbucket-redis.map
	symbols=debian/libtokenbucket-redis1.symbols
	node_prefix=TOKENBUCKET_REDIS_
	;;
*)
	header=include/tokenbucket.h
	map=src/tokenbucket.map
	symbols=debian/libtokenbucket1.symbols
	node_prefix=TOKENBUCKET_
	;;
esac
tmp=$(mktemp -d "${TMPDIR:-/tmp}/tokenbucket-exports.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
status=0

fail() {
	echo "exports: FAIL: $*" >&2
	status=1
}

# Each list is sorted "symbol@NODE"; a version node itself is "NODE@NODE".
"$NM" -D --defined-only "$lib" |
	awk '$2 == "A" { print $3 "@" $3; next }
	     { sub(/@@/, "@", $3); print $3 }' | sort >"$tmp/nm"

# The version script without its comments.
perl -0777 -pe 's{/\*.*?\*/}{}gs' "$src/$map" |
	awk '/^[ \t]*[A-Za-z0-9_.]+[ \t]*\{/ { node = $1; sub(/\{.*/, "", node); print node "@" node; next }
	     /^[ \t]*(global|local):/ { sub(/^[ \t]*(global|local):/, "") }
	     /\}/ { next }
	     { n = split($0, word, /[ \t;]+/)
	       for (i = 1; i <= n; i++) if (word[i] != "" && word[i] != "*") print word[i] "@" node }' |
	sort >"$tmp/map"

sed -n 's/^ \([^ ]*\) .*/\1/p' "$src/$symbols" | sort >"$tmp/symbols"

compare() {
	if ! cmp -s "$tmp/$1" "$tmp/$2"; then
		fail "$3 and $4 differ (< only in $3, > only in $4):"
		diff "$tmp/$1" "$tmp/$2" | grep '^[<>]' >&2 || true
	fi
}
compare nm map "nm -D $lib" "$map"
compare nm symbols "nm -D $lib" "$symbols"

sed -n 's/^TOKENBUCKET_API[^(]*[^a-z0-9_]\(tokenbucket_[a-z0-9_]*\)(.*/\1/p' \
	"$src/$header" | sort >"$tmp/header"
sed -n 's/^\(tokenbucket_[a-z0-9_]*\)@.*/\1/p' "$tmp/nm" | sort >"$tmp/functions"
compare header functions "$header" "the exported functions"
[ -s "$tmp/header" ] || fail "no TOKENBUCKET_API declaration found in $header"

while read -r fn; do
	[ -f "$src/man/man3/$fn.3" ] || fail "no manual page man/man3/$fn.3"
done <"$tmp/functions"

# symbol@TOKENBUCKET_M.N must have appeared in version M.N.x.
while read -r sym version; do
	node=${sym#*@}
	case $node in
	"$node_prefix"[0-9]*) ;;
	*) fail "$sym: the version node is not named ${node_prefix}<major>.<minor>" ;;
	esac
	case $version in
	"${node#"$node_prefix"}".*) ;;
	*) fail "$sym is listed as new in $version, which is not a release of its node $node" ;;
	esac
done <<LINES
$(sed -n 's/^ \([^ ]*\) \([^ ]*\).*/\1 \2/p' "$src/$symbols")
LINES

if [ $status -eq 0 ]; then
	echo "exports: $(wc -l <"$tmp/functions") functions agree in the header, nm -D, the version script, the symbols file and man/man3 ($header)"
fi
exit $status
