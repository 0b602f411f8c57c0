#!/bin/sh
# SPDX-License-Identifier: MIT
#
# Regenerates tests/fuzz/corpus: builds the replay harness against the
# library sources and runs its seed generator (see tests/fuzz/README).
# Usage: tests/fuzz/make-seeds.sh [BUILD_DIR]   (default build-fuzz/)
set -eu

here=$(cd "$(dirname "$0")" && pwd)
top=$(cd "$here/../.." && pwd)
build=${1:-build-fuzz}
mkdir -p "$build"
CC=${CC:-cc}

# shellcheck disable=SC2046
$CC -std=gnu11 -O1 -D_GNU_SOURCE -DFUZZ_REPLAY_MAIN -I"$top/include" -I"$top/src/common" -I"$top/src/core" -I"$top/src/shm" -I"$top/src/table" \
	$(pkg-config --cflags libbsd 2>/dev/null || true) \
	-o "$build/fuzz_replay" "$here/fuzz_tokenbucket.c" "$here/model.c" "$here/replay.c" \
	"$top"/src/core/*.c "$top"/src/shm/*.c "$top"/src/table/*.c \
	-lm -lpthread
rm -f "$here"/corpus/seed-*
mkdir -p "$here/corpus"
"$build/fuzz_replay" --make-seeds "$here/corpus"
"$build/fuzz_replay" "$here/corpus"
