#!/bin/sh
# SPDX-License-Identifier: MIT
#
# usage: update-baseline.sh LIBRARY SRCDIR
#
# Rewrites SRCDIR/abi/libtokenbucket.so.1.abi (or libtokenbucket-redis.so.1.abi
# for that library) from LIBRARY, which must be a
# build with debugging information (CMAKE_BUILD_TYPE=RelWithDebInfo).  Run it
# only in the change that adds a version node, together with that node's
# symbols-file lines and manual pages; abidiff.sh explains what it accepts.
#
# Only what include/ declares is recorded (struct tokenbucket stays opaque),
# without source locations or build paths, so that any machine writes the
# same file.
set -eu

if [ $# -ne 2 ]; then
	echo "usage: $0 LIBRARY SRCDIR" >&2
	exit 2
fi
lib=$1
src=$2
if ! readelf -S "$lib" | grep -q '\.debug_info'; then
	echo "$lib has no debugging information: build with CMAKE_BUILD_TYPE=RelWithDebInfo" >&2
	exit 1
fi
case $(basename "$lib") in
libtokenbucket-redis.so*) out=$src/abi/libtokenbucket-redis.so.1.abi ;;
*) out=$src/abi/libtokenbucket.so.1.abi ;;
esac
abidw --no-corpus-path --no-comp-dir-path --no-show-locs \
	--headers-dir "$src/include" --drop-private-types --drop-undefined-syms \
	--out-file "$out" "$lib"
# abidw still names each translation unit by its absolute path: keep only
# the part inside the source tree.
sed -i "s|path='[^']*/\(src/[^']*\)'|path='\1'|" "$out"
echo "wrote $out"
