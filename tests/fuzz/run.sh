#!/bin/sh
# SPDX-License-Identifier: MIT
#
# Builds the differential fuzzer with clang (libFuzzer, ASan, UBSan), fuzzes
# for FUZZ_SECONDS (60) on a copy of tests/fuzz/corpus, then replays the
# corpus and tests/fuzz/regressions.  Then the same for the mapping fuzzer
# (fuzz_mapping.c: any bytes as a shared bucket or table) for MAPPING_SECONDS
# (30) on tests/fuzz/corpus-mapping, and the Redis reply decoders' fuzzer
# (fuzz_redis.c, where hiredis is installed) for REDIS_SECONDS (30) on
# tests/fuzz/corpus-redis, and the Redis module's arithmetic
# (fuzz_module_bucket.c) for MODULE_SECONDS (20) on tests/fuzz/corpus-module.
# Exits nonzero on any crash, divergence
# or call that loops.  Usage: tests/fuzz/run.sh [BUILD_DIR]   (default build-fuzz/)
# Extra libFuzzer options go in FUZZ_ARGS, e.g. FUZZ_ARGS="-jobs=4 -workers=4".
# Needs clang and libclang-rt-14-dev (Debian 12) besides the library's own
# build dependencies.
set -eu

here=$(cd "$(dirname "$0")" && pwd)
top=$(cd "$here/../.." && pwd)
build=${1:-build-fuzz}
mkdir -p "$build"
build=$(cd "$build" && pwd)
seconds=${FUZZ_SECONDS:-60}
CC=${CC:-clang}

bsd_cflags=$(pkg-config --cflags libbsd 2>/dev/null || true)
cflags="-g -O1 -std=gnu11 -D_GNU_SOURCE -I$top/include -I$top/src/common -I$top/src/core -I$top/src/shm -I$top/src/table $bsd_cflags
	-Wall -Wextra
	-fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all ${FUZZ_CFLAGS:-}"

echo "building $build/fuzz_tokenbucket with $CC"
# shellcheck disable=SC2086
$CC $cflags -o "$build/fuzz_tokenbucket" \
	"$here/fuzz_tokenbucket.c" "$here/model.c" "$top"/src/core/*.c "$top"/src/shm/*.c "$top"/src/table/*.c \
	-lm -lpthread

# Fuzz on a copy, so that what libFuzzer adds stays out of the source tree.
rm -rf "$build/corpus" "$build/artifacts"
mkdir -p "$build/corpus" "$build/artifacts"
cp "$here"/corpus/* "$build/corpus/"

status=0
echo "fuzzing for $seconds s (corpus: $build/corpus, crashes: $build/artifacts)"
# shellcheck disable=SC2086
"$build/fuzz_tokenbucket" -max_total_time="$seconds" -print_final_stats=1 \
	-artifact_prefix="$build/artifacts/" ${FUZZ_ARGS:-} "$build/corpus" || status=$?
echo "corpus: $(ls "$build/corpus" | wc -l) inputs"

# Replay: the seeds as committed, and every regression (running a file
# list makes libFuzzer execute each input once).
replay=$(find "$here/corpus" "$here/regressions" -type f ! -name '.*' | sort)
if [ -n "$replay" ]; then
	echo "replaying $(echo "$replay" | wc -l) committed inputs"
	# shellcheck disable=SC2086
	"$build/fuzz_tokenbucket" $replay || status=$?
fi

# Fuzzes $build/$1 for $2 s on a copy of tests/fuzz/$3 (crashes written
# with the prefix $4), then replays the committed $3.
fuzz_corpus() {
	rm -rf "${build:?}/$3"
	mkdir -p "$build/$3"
	cp "$here/$3"/* "$build/$3/"
	echo "fuzzing $1 for $2 s (corpus: $build/$3)"
	# shellcheck disable=SC2086
	"$build/$1" -max_total_time="$2" -timeout=10 -print_final_stats=1 \
		-artifact_prefix="$build/artifacts/$4" ${FUZZ_ARGS:-} "$build/$3" || status=$?
	echo "$3: $(ls "$build/$3" | wc -l) inputs"
	replay=$(find "$here/$3" -type f ! -name '.*' | sort)
	echo "replaying $(echo "$replay" | wc -l) committed inputs of $3"
	# shellcheck disable=SC2086
	"$build/$1" -timeout=10 $replay || status=$?
}

# The mapping fuzzer: the library's loops count their rounds
# (TB__FUZZ_ROUNDS) and the writer lock waits 1 ms, not 2 s.
echo "building $build/fuzz_mapping with $CC"
# shellcheck disable=SC2086
$CC $cflags -DTB__FUZZ_ROUNDS -DTB__LOCK_WAIT_NS=1000000 -o "$build/fuzz_mapping" \
	"$here/fuzz_mapping.c" "$top"/src/core/*.c "$top"/src/shm/*.c "$top"/src/table/*.c -lm -lpthread
fuzz_corpus fuzz_mapping "${MAPPING_SECONDS:-30}" corpus-mapping mapping-

# The Redis reply decoders (any bytes as a server's replies), on their
# sources and hiredis; skipped without hiredis, as the library is.
if pkg-config --exists hiredis; then
	echo "building $build/fuzz_redis with $CC"
	# shellcheck disable=SC2086
	$CC $cflags -I"$top/src/redis" $(pkg-config --cflags hiredis) -o "$build/fuzz_redis" \
		"$here/fuzz_redis.c" "$top"/src/redis/codec.c "$top"/src/redis/bounds.c \
		"$top"/src/redis/slots.c "$top"/src/redis/sentinel.c "$top"/src/redis/sigpipe.c \
		"$top"/src/core/*.c \
		$(pkg-config --libs hiredis) -lm -lpthread
	fuzz_corpus fuzz_redis "${REDIS_SECONDS:-30}" corpus-redis redis-
elif [ -n "${TOKENBUCKET_NO_SKIP:-}" ]; then
	echo "FAILED: no hiredis for the Redis reply fuzzer" >&2
	status=1
fi

# The Redis module's arithmetic (any bytes as a stored value, and the local
# library's own histories), on bucket.c, the core and the checks of the
# redis-module-bucket suite; skipped with the module (no 128-bit integers).
if echo 'unsigned __int128 x;' | $CC -x c -c -o /dev/null - 2>/dev/null; then
	echo "building $build/fuzz_module_bucket with $CC"
	# shellcheck disable=SC2086
	$CC $cflags -I"$top/tests/redis" -I"$top/src/redis/module" -o "$build/fuzz_module_bucket" \
		"$here/fuzz_module_bucket.c" "$top/tests/redis/bucket_diff.c" "$top/tests/redis/sequence.c" \
		"$top/src/redis/module/bucket.c" "$top"/src/core/*.c -lm -lpthread
	fuzz_corpus fuzz_module_bucket "${MODULE_SECONDS:-20}" corpus-module module-
fi

if [ "$status" -ne 0 ]; then
	echo "FAILED: a crash or a divergence; see above and $build/artifacts" >&2
	exit 1
fi
echo "no divergence"
