/* SPDX-License-Identifier: MIT */
/*
 * Replay without libFuzzer, shared by the fuzzers' FUZZ_REPLAY_MAIN
 * builds: each input goes once through LLVMFuzzerTestOneInput.
 */
#ifndef TOKENBUCKET_FUZZ_REPLAY_H
#define TOKENBUCKET_FUZZ_REPLAY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/*
 * Replays a file, or every regular file of a directory (not recursive,
 * names starting with '.' skipped) in name order; *count counts the inputs
 * run.  trace prints "== PATH" on stderr before each.  0, or -1 after
 * reporting a path that could not be read.
 */
int fuzz_replay(const char *path, int *count, bool trace);

/*
 * A replay main: "--make-seeds DIR" calls make_seeds(DIR); otherwise every
 * argument is replayed, and "N input(s) replayed<done>" printed.  Returns
 * the exit status.
 */
int fuzz_replay_main(int argc, char **argv, int (*make_seeds)(const char *dir), bool trace,
		     const char *done);

#endif
