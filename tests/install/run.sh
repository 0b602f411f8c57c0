#!/bin/sh
# SPDX-License-Identifier: MIT
#
# usage: run.sh BUILDDIR SRCDIR
#
# Installs the build tree BUILDDIR into a fresh temporary prefix, checks the
# installed layout, then builds and runs tests/install/consumer.c against it:
#   - through pkg-config, linked to the shared and to the static library;
#   - through find_package(tokenbucket) (tests/install/cmake);
#   - find_package(tokenbucket COMPONENTS redis) finds tokenbucket::redis, and
#     without its targets file (no libtokenbucket-redis-dev) fails naming that
#     package; an unknown component fails naming itself.
#
# Environment: CC, CMAKE, PKG_CONFIG (defaults cc, cmake, pkg-config) and
# TOKENBUCKET_INSTALL_CONFIG (the configuration, for multi-config builds).
# Exits 77 (skipped) if the build installs to absolute directories, which a
# temporary prefix cannot relocate.
set -eu

if [ $# -ne 2 ]; then
	echo "usage: $0 BUILDDIR SRCDIR" >&2
	exit 2
fi
builddir=$(cd "$1" && pwd)
srcdir=$(cd "$2" && pwd)
CC=${CC:-cc}
CMAKE=${CMAKE:-cmake}
PKG_CONFIG=${PKG_CONFIG:-pkg-config}
config=${TOKENBUCKET_INSTALL_CONFIG:-}

fail() {
	echo "install test: FAIL: $*" >&2
	exit 1
}
note() {
	echo "install test: $*"
}
# The value of a variable in the build's CMakeCache.txt.
cache_value() {
	sed -n "s/^$1:[A-Z]*=//p" "$builddir/CMakeCache.txt"
}
is_true() {
	case $(echo "$1" | tr '[:lower:]' '[:upper:]') in
	1 | ON | YES | TRUE | Y) return 0 ;;
	*) return 1 ;;
	esac
}
header_define() {
	sed -n "s/^#define[[:space:]]*$1[[:space:]]*\\([0-9]*\\).*/\\1/p" \
		"$srcdir/include/tokenbucket.h"
}
# Runs a consumer binary and checks what it prints.
run_consumer() {
	out=$("$@") || fail "$1 exited with status $?"
	[ "$out" = "consumer ok" ] || fail "$1 printed '$out'"
	note "$1: $out"
}
needed() {
	readelf -d "$1" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'
}

[ -f "$builddir/CMakeCache.txt" ] || fail "$builddir is not a CMake build tree"

libdir_rel=$(cache_value CMAKE_INSTALL_LIBDIR)
incdir_rel=$(cache_value CMAKE_INSTALL_INCLUDEDIR)
: "${libdir_rel:=lib}" "${incdir_rel:=include}"
for d in "$libdir_rel" "$incdir_rel"; do
	case $d in
	/*)
		note "SKIP: install directory $d is absolute"
		exit 77
		;;
	esac
done
static=no
if is_true "$(cache_value TOKENBUCKET_BUILD_STATIC)"; then
	static=yes
fi

major=$(header_define TOKENBUCKET_VERSION_MAJOR)
minor=$(header_define TOKENBUCKET_VERSION_MINOR)
patch=$(header_define TOKENBUCKET_VERSION_PATCH)
version=$major.$minor.$patch

tmp=$(mktemp -d "${TMPDIR:-/tmp}/tokenbucket-install.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
trap 'exit 1' HUP INT TERM
prefix=$tmp/prefix
libdir=$prefix/$libdir_rel
incdir=$prefix/$incdir_rel
consumer=$srcdir/tests/install/consumer.c

# ---- Install -----------------------------------------------------------

note "installing $builddir into $prefix"
if ! "$CMAKE" --install "$builddir" --prefix "$prefix" \
	${config:+--config "$config"} >"$tmp/install.log" 2>&1; then
	cat "$tmp/install.log" >&2
	fail "cmake --install failed"
fi

for f in "$incdir/tokenbucket.h" \
	"$libdir/libtokenbucket.so.$version" \
	"$libdir/pkgconfig/libtokenbucket.pc" \
	"$libdir/cmake/tokenbucket/tokenbucketConfig.cmake" \
	"$libdir/cmake/tokenbucket/tokenbucketConfigVersion.cmake" \
	"$libdir/cmake/tokenbucket/tokenbucketTargets.cmake"; do
	[ -f "$f" ] || fail "not installed: $f"
done
for f in "$libdir/libtokenbucket.so.$major" "$libdir/libtokenbucket.so"; do
	[ -L "$f" ] || fail "not installed as a symbolic link: $f"
done
if [ $static = yes ]; then
	[ -f "$libdir/libtokenbucket.a" ] || fail "not installed: $libdir/libtokenbucket.a"
fi
if grep -Eiq 'bsd|PkgConfig::' "$libdir"/cmake/tokenbucket/*.cmake; then
	fail "the installed CMake package refers to libbsd or pkg-config targets"
fi

if command -v readelf >/dev/null 2>&1; then
	so=$libdir/libtokenbucket.so.$version
	soname=$(readelf -d "$so" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
	[ "$soname" = "libtokenbucket.so.$major" ] || fail "SONAME is '$soname'"
	# Only the public API is exported.
	extra=$(nm -D --defined-only "$so" |
		awk '$2 != "A" { sub(/@.*/, "", $3); print $3 }' |
		grep -v '^tokenbucket_' || true)
	[ -z "$extra" ] || fail "exported symbols outside the API: $(echo "$extra" | tr '\n' ' ')"
fi

# ---- pkg-config ----------------------------------------------------------

PKG_CONFIG_PATH=$libdir/pkgconfig
export PKG_CONFIG_PATH

pc_version=$("$PKG_CONFIG" --modversion libtokenbucket)
[ "$pc_version" = "$version" ] || fail "pkg-config version is '$pc_version'"
pc_libdir=$("$PKG_CONFIG" --variable=libdir libtokenbucket)
[ "$pc_libdir" = "$libdir" ] || fail "pkg-config libdir is '$pc_libdir'"
pc_incdir=$("$PKG_CONFIG" --variable=includedir libtokenbucket)
[ "$pc_incdir" = "$incdir" ] || fail "pkg-config includedir is '$pc_incdir'"
for opt in --cflags "--static --cflags" --print-requires --print-requires-private; do
	# shellcheck disable=SC2086
	case $("$PKG_CONFIG" $opt libtokenbucket) in
	*bsd*) fail "pkg-config $opt libtokenbucket mentions libbsd" ;;
	esac
done

cflags=$("$PKG_CONFIG" --cflags libtokenbucket)
libs=$("$PKG_CONFIG" --libs libtokenbucket)
note "pkg-config --cflags --libs: $cflags $libs"
# shellcheck disable=SC2086
"$CC" -o "$tmp/consumer-pc-shared" "$consumer" $cflags $libs ||
	fail "building the consumer with pkg-config (shared) failed"
LD_LIBRARY_PATH=$libdir
export LD_LIBRARY_PATH
run_consumer "$tmp/consumer-pc-shared"
unset LD_LIBRARY_PATH
if command -v readelf >/dev/null 2>&1; then
	needed "$tmp/consumer-pc-shared" | grep -qx "libtokenbucket.so.$major" ||
		fail "consumer-pc-shared does not need libtokenbucket.so.$major"
fi

if [ $static = yes ]; then
	static_libs=
	for w in $("$PKG_CONFIG" --static --libs libtokenbucket); do
		if [ "$w" = -ltokenbucket ]; then
			w="-Wl,-Bstatic -ltokenbucket -Wl,-Bdynamic"
		fi
		static_libs="$static_libs $w"
	done
	note "static link flags:$static_libs"
	# shellcheck disable=SC2086
	"$CC" -o "$tmp/consumer-pc-static" "$consumer" $cflags $static_libs ||
		fail "building the consumer with pkg-config (static) failed"
	run_consumer "$tmp/consumer-pc-static"
	if command -v readelf >/dev/null 2>&1; then
		if needed "$tmp/consumer-pc-static" | grep -q libtokenbucket; then
			fail "consumer-pc-static needs the shared library"
		fi
	fi
fi
unset PKG_CONFIG_PATH

# ---- find_package ----------------------------------------------------------

generator=$(cache_value CMAKE_GENERATOR)
make_program=$(cache_value CMAKE_MAKE_PROGRAM)
cbuild=$tmp/cmake-build
note "building tests/install/cmake with find_package(tokenbucket)"
"$CMAKE" -S "$srcdir/tests/install/cmake" -B "$cbuild" \
	${generator:+-G "$generator"} \
	${make_program:+-DCMAKE_MAKE_PROGRAM="$make_program"} \
	${config:+-DCMAKE_BUILD_TYPE="$config"} \
	-DCMAKE_C_COMPILER="$CC" \
	-DCMAKE_PREFIX_PATH="$prefix" ||
	fail "configuring the find_package consumer failed"
found=$(sed -n 's/^tokenbucket_DIR:[A-Z]*=//p' "$cbuild/CMakeCache.txt")
if [ "$(cd "$found" 2>/dev/null && pwd -P)" != \
	"$(cd "$libdir/cmake/tokenbucket" && pwd -P)" ]; then
	fail "find_package found tokenbucket in '$found'"
fi
"$CMAKE" --build "$cbuild" ${config:+--config "$config"} ||
	fail "building the find_package consumer failed"

exe() {
	for e in "$cbuild/$1" "$cbuild/$config/$1"; do
		if [ -f "$e" ] && [ -x "$e" ]; then
			echo "$e"
			return 0
		fi
	done
	fail "$1 was not built"
}
e=$(exe consumer)
run_consumer "$e"
if [ $static = yes ]; then
	e=$(exe consumer_static)
	run_consumer "$e"
fi

# ---- find_package components -----------------------------------------------

# A project that asks for the components in TB_COMPONENTS and needs every
# target they name.
comp_src=$tmp/components
mkdir -p "$comp_src"
cat >"$comp_src/CMakeLists.txt" <<'CMAKE'
cmake_minimum_required(VERSION 3.16)
project(tokenbucket_components LANGUAGES C)
find_package(tokenbucket 1.0 REQUIRED COMPONENTS ${TB_COMPONENTS})
if("redis" IN_LIST TB_COMPONENTS AND NOT TARGET tokenbucket::redis)
  message(FATAL_ERROR "the redis component was found without tokenbucket::redis")
endif()
CMAKE
# configure_components NAME PREFIX COMPONENTS: configures it, output in
# $tmp/NAME.log.
configure_components() {
	"$CMAKE" -S "$comp_src" -B "$tmp/$1" -DCMAKE_C_COMPILER="$CC" \
		-DCMAKE_PREFIX_PATH="$2" "-DTB_COMPONENTS=$3" >"$tmp/$1.log" 2>&1
}
# expect_refusal NAME PREFIX COMPONENTS TEXT: configuring fails and says TEXT.
expect_refusal() {
	if configure_components "$1" "$2" "$3"; then
		fail "find_package(tokenbucket COMPONENTS $3) succeeded in $2"
	fi
	grep -qF "$4" "$tmp/$1.log" ||
		fail "find_package(tokenbucket COMPONENTS $3) failed without naming $4: $(cat "$tmp/$1.log")"
	note "find_package(tokenbucket COMPONENTS $3) in $(basename "$2"): refused, naming $4"
}
if [ -f "$libdir/cmake/tokenbucket/tokenbucket-redisTargets.cmake" ]; then
	configure_components redis-found "$prefix" redis ||
		fail "find_package(tokenbucket COMPONENTS redis) failed: $(cat "$tmp/redis-found.log")"
	note "find_package(tokenbucket COMPONENTS redis): tokenbucket::redis"
fi
# What libtokenbucket-dev installs without libtokenbucket-redis-dev.
cp -a "$prefix" "$tmp/no-redis"
rm -f "$tmp/no-redis/$libdir_rel"/cmake/tokenbucket/tokenbucket-redisTargets*.cmake
expect_refusal redis-absent "$tmp/no-redis" redis libtokenbucket-redis-dev
expect_refusal unknown "$prefix" nosuch 'unknown component "nosuch"'

note "all passed"
