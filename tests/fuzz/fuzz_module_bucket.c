/* SPDX-License-Identifier: MIT */
/*
 * The Redis module's arithmetic (src/redis/module/bucket.c), any bytes in:
 * through the checks of tests/redis/bucket_diff.c, which the
 * redis-module-bucket suite also runs.  Traps (after a line on stderr) on
 * a crash, an answer the documentation does not give, or a decision other
 * than the local library's on a value the library's own history produced.
 *
 * Encoding: byte 0 % 4 picks the check.
 *   0: a sequence of sequence.c's steps (bd_sequence): seed from bytes 1-8,
 *      1 + byte 9 % 64 steps; with bit 0x10 of byte 0, the first limit
 *      from bytes 10-33 (tokens, period, burst; any the API accepts).
 *   1: a sequence of allow_all (bd_set_sequence): seed from bytes 1-8,
 *      1 + byte 9 % 64 steps, at most 1 + byte 10 % 16 limits.
 *   2, 3: the bytes from 28 on as the stored value (bd_any_value): byte 1
 *      the op (% 7, 6 allow_all; bit 0x80 on the server's clock), byte 2
 *      the limit (% 8 of those below), bytes 3-10 now, byte 11 bit 0 n
 *      from bytes 12-19 (else byte 12 % 16), bytes 20-27 arg.
 *
 * Built with -DFUZZ_REPLAY_MAIN it gets a main() that replays files and
 * directories without libFuzzer (ctest fuzz-module-bucket-replay) and
 * writes the seed corpus (--make-seeds DIR).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bucket_diff.h"

#ifdef FUZZ_REPLAY_MAIN
#include "replay.h"
#endif

static const struct tokenbucket_redis_limit limits[8] = {
	{ 1, 1000, 10 },
	{ 7, 3000000000, 10 },
	{ 1000000000, 1000000000, 1000000000 },
	{ UINT64_MAX, INT64_MAX, TOKENBUCKET_BURST_MAX },
	{ 0, 1, 5 },
	{ 1, 1, 1 },
	{ 5, 7, TOKENBUCKET_BURST_MAX },
	{ 1, INT64_MAX, 1 },
};

static uint64_t le64(const uint8_t *p)
{
	uint64_t v = 0;
	for (int i = 7; i >= 0; i--)
		v = v << 8 | p[i];
	return v;
}

static void fail(const char *why)
{
	fprintf(stderr, "tokenbucket module fuzz: %s\n", why);
	__builtin_trap();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	char why[512];
	if (size < 11)
		return 0;
	unsigned which = data[0] % 4;
	uint64_t seed = le64(data + 1);
	int steps = 1 + data[9] % 64;
	if (which == 0) {
		struct tokenbucket_redis_limit first, *f = NULL;
		if ((data[0] & 0x10) && size >= 34) {
			first.tokens = le64(data + 10);
			first.period_ns = 1 + (int64_t)(le64(data + 18) % (uint64_t)INT64_MAX);
			first.burst = le64(data + 26) % (TOKENBUCKET_BURST_MAX + 1);
			f = &first;
		}
		if (!bd_sequence(seed, steps, f, why, sizeof(why)))
			fail(why);
	} else if (which == 1) {
		if (!bd_set_sequence(seed, steps, 1 + data[10] % 16, why, sizeof(why)))
			fail(why);
	} else if (size >= 28) {
		uint64_t n = data[11] & 1 ? le64(data + 12) : data[12] % 16;
		if (!bd_any_value((const char *)data + 28, size - 28, data[1] % 7,
				  (int64_t)le64(data + 3), (data[1] & 0x80) != 0, &limits[data[2] % 8],
				  n, (int64_t)le64(data + 20), why, sizeof(why)))
			fail(why);
	}
	return 0;
}

#ifdef FUZZ_REPLAY_MAIN
static void put64(uint8_t *p, uint64_t v)
{
	for (int i = 0; i < 8; i++, v >>= 8)
		p[i] = (uint8_t)v;
}

static int write_seed(const char *dir, const char *name, const uint8_t *b, size_t n)
{
	char path[4096];
	snprintf(path, sizeof(path), "%s/%s", dir, name);
	FILE *f = fopen(path, "wb");
	if (f == NULL || fwrite(b, 1, n, f) != n || fclose(f) != 0) {
		perror(path);
		return 1;
	}
	return 0;
}

/* A few of each check: sequences on the edge limits, sets, and stored values, good and bad. */
static int make_seeds(const char *dir)
{
	uint8_t b[160];
	int err = 0;
	char name[64];
	for (int i = 0; i < 4; i++) {
		memset(b, 0, sizeof(b));
		b[0] = (uint8_t)(i < 2 ? 0x10 : i == 2 ? 0 : 1);
		put64(b + 1, 0x5eed0000u + (uint64_t)i);
		b[9] = 63;
		b[10] = i == 3 ? 15 : 0;
		const struct tokenbucket_redis_limit *l = &limits[i == 0 ? 1 : 3];
		put64(b + 10, l->tokens);
		put64(b + 18, (uint64_t)l->period_ns - 1);
		put64(b + 26, l->burst);
		snprintf(name, sizeof(name), "sequence-%d", i);
		err |= write_seed(dir, name, b, 34);
	}
	static const struct {
		const char *name;
		uint8_t op, limit;
		const char *value;
	} values[] = {
		{ "value-allow", 0, 0, "tb1 1700000000000000000 5 123 1 1000 10" },
		{ "value-reserve", 1, 1, "tb1 1700000000000000000 -3 7 7 3000000000 10" },
		{ "value-cancel", 2, 1, "tb1 1700000000000000000 -3 7 7 3000000000 10" },
		{ "value-tokens", 3, 3,
		  "tb1 -5 -4611686018427387903 0 18446744073709551615 9223372036854775807 "
		  "4611686018427387904" },
		{ "value-reset", 4, 4, "tb1 1 5 0 0 1 5" },
		{ "value-refund", 5, 2, "tb1 1700000000000000000 -999 5 1000000000 1000000000 1000000000" },
		{ "value-allow-server-clock", 0x80, 1, "tb1 1700000000000000000 0 0 7 3000000000 10" },
		{ "value-all", 6, 0, "tbs1 1700000000000000000 5 0 1 1000 10" },
		{ "value-bad-level", 0, 0, "tb1 1700000000000000000 11 0 1 1000 10" },
		{ "value-bad-rem", 1, 0, "tb1 1700000000000000000 1 1000 1 1000 10" },
		{ "value-bad-long", 0, 0, "tb1 1700000000000000000 1 000000000000000000001 1 1000 10" },
		{ "value-bad-set", 6, 0, "tbs1 1700000000000000000 5 0 1 1000 10 3" },
	};
	for (size_t i = 0; i < sizeof(values) / sizeof(values[0]); i++) {
		memset(b, 0, sizeof(b));
		b[0] = 2;
		b[1] = values[i].op;
		b[2] = values[i].limit;
		put64(b + 3, UINT64_C(1700000000000000000) + 1000000 * i);
		b[12] = (uint8_t)(1 + i % 3);
		put64(b + 20, 1000000000);
		size_t n = strlen(values[i].value);
		memcpy(b + 28, values[i].value, n);
		err |= write_seed(dir, values[i].name, b, 28 + n);
	}
	return err;
}

int main(int argc, char **argv)
{
	return fuzz_replay_main(argc, argv, make_seeds, false, "");
}
#endif
