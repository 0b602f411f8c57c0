#!/bin/sh
# SPDX-License-Identifier: MIT
#
# usage: abidiff.sh LIBRARY SRCDIR
#
# Compares the ABI of LIBRARY with the committed baseline
# SRCDIR/abi/libtokenbucket.so.1.abi and fails on:
#   - any change or removal of what the baseline holds (a function's
#     signature, a public struct's layout, a symbol's version node);
#   - any added function that is not in a new version node (one the baseline
#     does not know), or lacks its line in debian/libtokenbucket1.symbols or
#     its manual page man/man3/<function>.3.
# Additions that pass are reported; the change that makes them then refreshes
# the baseline with tests/abi/update-baseline.sh.
#
# Skips (tests/skip.sh) when abidiff is missing or LIBRARY has
# no debugging information (the types come from DWARF).
set -eu

if [ $# -ne 2 ]; then
	echo "usage: $0 LIBRARY SRCDIR" >&2
	exit 2
fi
lib=$1
src=$2
# The baseline and symbols file of the library named (libtokenbucket or
# libtokenbucket-redis).
case $(basename "$lib") in
libtokenbucket-redis.so*)
	baseline=$src/abi/libtokenbucket-redis.so.1.abi
	symbols=$src/debian/libtokenbucket-redis1.symbols
	;;
*)
	baseline=$src/abi/libtokenbucket.so.1.abi
	symbols=$src/debian/libtokenbucket1.symbols
	;;
esac
NM=${NM:-nm}

. "$(dirname "$0")/../skip.sh"
if ! command -v abidiff >/dev/null 2>&1; then
	skip "abidiff: abidiff (package abigail-tools) is not installed"
fi
if ! readelf -S "$lib" | grep -q '\.debug_info'; then
	skip "abidiff: $lib has no debugging information (build RelWithDebInfo)"
fi
[ -f "$baseline" ] || { echo "abidiff: FAIL: no baseline $baseline" >&2; exit 1; }

tmp=$(mktemp -d "${TMPDIR:-/tmp}/tokenbucket-abidiff.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

# abidiff's exit status is a bit mask: 1 error, 2 usage, 4 ABI change,
# 8 incompatible ABI change.  Additions are left out of this comparison and
# judged below, so any nonzero status is a failure.
rc=0
# The baseline holds only the public types (struct tokenbucket is opaque in
# it); the library's private definition of struct tokenbucket is not a change.
abidiff --no-added-syms "$baseline" "$lib" >"$tmp/report" 2>&1 || rc=$?
if [ $rc -ne 0 ]; then
	cat "$tmp/report" >&2
	if [ $((rc & 8)) -ne 0 ]; then
		echo "abidiff: FAIL: incompatible ABI change against $baseline" >&2
	elif [ $((rc & 4)) -ne 0 ]; then
		echo "abidiff: FAIL: the ABI of what $(basename "$baseline" .abi) already exports changed" >&2
	else
		echo "abidiff: FAIL: abidiff could not compare (status $rc)" >&2
	fi
	exit 1
fi

# Additions: "symbol@NODE" exported now but absent from the baseline.
sed -n "s/.*<elf-symbol name='\\([^']*\\)' version='\\([^']*\\)'.*/\\1@\\2/p" "$baseline" |
	sort -u >"$tmp/old"
sed 's/.*@//' "$tmp/old" | sort -u >"$tmp/old-nodes"
"$NM" -D --defined-only "$lib" | awk '$2 != "A" { sub(/@@/, "@", $3); print $3 }' |
	sort -u >"$tmp/new"
comm -13 "$tmp/old" "$tmp/new" >"$tmp/added"

status=0
while read -r sym; do
	[ -n "$sym" ] || continue
	fn=${sym%@*}
	node=${sym#*@}
	if grep -qx "$node" "$tmp/old-nodes"; then
		echo "abidiff: FAIL: $sym is added to $node, a node that has shipped; add a new node" >&2
		status=1
	fi
	if ! grep -q "^ $sym " "$symbols"; then
		echo "abidiff: FAIL: $sym has no line in $symbols" >&2
		status=1
	fi
	if [ ! -f "$src/man/man3/$fn.3" ]; then
		echo "abidiff: FAIL: $fn has no manual page man/man3/$fn.3" >&2
		status=1
	fi
done <"$tmp/added"

if [ $status -eq 0 ]; then
	if [ -s "$tmp/added" ]; then
		echo "abidiff: compatible; added, each in a new node with its symbols line and manual page:"
		sed 's/^/  /' "$tmp/added"
		echo "abidiff: refresh the baseline in the same change: tests/abi/update-baseline.sh $lib $src"
	else
		echo "abidiff: $lib matches $baseline"
	fi
fi
exit $status
