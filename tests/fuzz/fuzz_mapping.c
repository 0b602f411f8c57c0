/* SPDX-License-Identifier: MIT */
/*
 * Mapping fuzzing: the bytes of an input become the image of a shared
 * bucket or table, which is attached and then driven by a short sequence of
 * calls of both faces (or of the table).  Shared memory is input: whatever
 * the image holds, attach must refuse it with a documented error or every
 * call must return a documented value, with no crash, no sanitizer report
 * and no access outside the image.
 *
 * The watchdog counts rounds, not time: the library's loops over shared
 * words call tb__fuzz_round() (TB__ROUND, compiled in with -DTB__FUZZ_ROUNDS
 * only), and a call that passes ROUNDS_LIMIT traps at once, so a loop that
 * would never end is caught where it spins.  The writer lock's bounded wait
 * is shortened to 1 ms (-DTB__LOCK_WAIT_NS) for the same reason.
 *
 * Input: byte 0 bit 0 chooses a bucket (0) or a table (1); bytes 1-2 give
 * the image's length L (little-endian, cut to what follows); the next L
 * bytes are the image; the rest are calls, an op byte then its arguments.
 * Built with -DFUZZ_REPLAY_MAIN it gets a main() that replays files and
 * directories without libFuzzer and writes the seed corpus (--make-seeds).
 */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <tokenbucket.h>

#ifdef FUZZ_REPLAY_MAIN
#include "replay.h"
#endif

/* Rounds of loops over shared words one call may take: far above any valid bucket's few. */
#define ROUNDS_LIMIT 100000
/* Calls an input may make. */
#define MAX_CALLS 64
/* The largest image taken: a table of a few hundred slots. */
#define MAX_IMAGE 16384

static unsigned long rounds;
static const char *current = "attach";

void tb__fuzz_round(void);
void tb__fuzz_round(void)
{
	if (++rounds > ROUNDS_LIMIT) {
		fprintf(stderr, "tokenbucket mapping fuzz: %s looped past %d rounds\n", current,
			ROUNDS_LIMIT);
		__builtin_trap();
	}
}

static void fail(const char *what, long long got)
{
	fprintf(stderr, "tokenbucket mapping fuzz: %s returned %lld\n", what, got);
	__builtin_trap();
}

/* Starts a call: the watchdog's count begins again. */
static void call(const char *name)
{
	current = name;
	rounds = 0;
}

/* Whether err is 0 or one of the n negative errnos listed. */
static bool one_of(int err, int n, ...)
{
	if (err == 0)
		return true;
	va_list ap;
	va_start(ap, n);
	bool found = false;
	for (int i = 0; i < n && !found; i++)
		found = err == -va_arg(ap, int);
	va_end(ap);
	return found;
}

struct input {
	const uint8_t *p;
	size_t n;
};

static uint8_t u8(struct input *in)
{
	if (in->n == 0)
		return 0;
	in->n--;
	return *in->p++;
}

static uint64_t u64(struct input *in, int bytes)
{
	uint64_t v = 0;
	for (int i = 0; i < bytes; i++)
		v |= (uint64_t)u8(in) << (8 * i);
	return v;
}

/* A time: mostly a step forward from the last one, sometimes anywhere. */
static int64_t next_time(struct input *in, int64_t *t)
{
	uint8_t k = u8(in);
	/* Modulo 2^64: a step may wrap, as any int64_t a caller passes may be anything. */
	uint64_t u = (uint64_t)*t;
	switch (k & 3) {
	case 0:
		u += u64(in, 2) * 1000;
		break;
	case 1:
		u += u64(in, 4) * 1000;
		break;
	case 2:
		u -= u64(in, 2);
		break;
	default:
		u = u64(in, 8);
		break;
	}
	*t = (int64_t)u;
	return *t;
}

/* A token count: small, near the burst, or any. */
static uint64_t amount(struct input *in, uint64_t burst)
{
	uint8_t k = u8(in);
	switch (k & 3) {
	case 0:
		return k >> 2;
	case 1:
		return burst - (k >> 2);
	case 2:
		return burst + (k >> 2);
	default:
		return u64(in, 8);
	}
}

static void check_writer(const char *name, int err)
{
	if (!one_of(err, 5, EINVAL, ERANGE, EBADMSG, EDEADLK, ENOTSUP))
		fail(name, err);
}

static void check_tokens(const char *name, double x, uint64_t burst)
{
	if (!isnan(x) && x > (double)burst)
		fail(name, (long long)x);
}

static void run_bucket(void *mem, size_t size, struct input *in)
{
	struct tokenbucket *tb = NULL;
	call("attach_shared");
	int err = tokenbucket_attach_shared(&tb, mem, size);
	if (err) {
		if (!one_of(err, 4, EBADMSG, EPROTO, EAGAIN, EINVAL))
			fail("attach_shared", err);
		return;
	}
	int64_t t = 0;
	struct tokenbucket_reservation r = {0};
	uint64_t ticket = 0;
	for (int i = 0; i < MAX_CALLS && in->n > 0; i++) {
		uint64_t burst = tokenbucket_burst(tb);
		uint8_t op = u8(in);
		switch (op % 20) {
		case 0:
			call("allow_at");
			(void)tokenbucket_allow_at(tb, next_time(in, &t), amount(in, burst));
			break;
		case 1: {
			call("reserve_at");
			int64_t now = next_time(in, &t);
			uint64_t n = amount(in, burst);
			int64_t max_wait = (int64_t)u64(in, 8);
			err = tokenbucket_reserve_at(tb, now, n, max_wait, &r);
			if (!one_of(err, 4, E2BIG, ETIMEDOUT, EOVERFLOW, EBADMSG))
				fail("reserve_at", err);
			break;
		}
		case 2:
			call("cancel_at");
			tokenbucket_cancel_at(tb, &r, next_time(in, &t));
			break;
		case 3:
			call("tokens_at");
			check_tokens("tokens_at", tokenbucket_tokens_at(tb, next_time(in, &t)), burst);
			break;
		case 4: {
			call("allow_result_at");
			struct tokenbucket_result res;
			err = tokenbucket_allow_result_at(tb, next_time(in, &t), amount(in, burst),
							  &res);
			if (!one_of(err, 1, EBADMSG))
				fail("allow_result_at", err);
			break;
		}
		case 5:
			call("grab");
			ticket = tokenbucket_grab(tb, amount(in, burst));
			break;
		case 6:
			call("deficiency");
			(void)tokenbucket_deficiency(tb, ticket + u64(in, 1));
			break;
		case 7:
			call("replenish");
			tokenbucket_replenish(tb, next_time(in, &t));
			break;
		case 8:
			call("refund");
			tokenbucket_refund(tb, amount(in, burst));
			break;
		case 9:
			call("release");
			err = tokenbucket_release(tb, amount(in, burst));
			if (!one_of(err, 2, EINVAL, ENOTSUP))
				fail("release", err);
			break;
		case 10: {
			call("set_rate_at");
			static const double rates[] = {0, 1, 7, 1e9, 1e15, INFINITY, 0.001, 3e18};
			int64_t now = next_time(in, &t);
			check_writer("set_rate_at", tokenbucket_set_rate_at(tb, now, rates[u8(in) % 8]));
			break;
		}
		case 11: {
			call("set_rate_every_at");
			int64_t now = next_time(in, &t);
			uint64_t tokens = u64(in, 2);
			check_writer("set_rate_every_at",
				     tokenbucket_set_rate_every_at(tb, now, tokens, (int64_t)u64(in, 4)));
			break;
		}
		case 12: {
			call("set_burst_at");
			int64_t now = next_time(in, &t);
			check_writer("set_burst_at", tokenbucket_set_burst_at(tb, now, amount(in, burst)));
			break;
		}
		case 13: {
			call("reset_at");
			int64_t now = next_time(in, &t);
			check_writer("reset_at", tokenbucket_reset_at(tb, now, amount(in, burst)));
			break;
		}
		case 14:
			call("set_threshold");
			check_writer("set_threshold", tokenbucket_set_threshold(tb, amount(in, burst)));
			break;
		case 15:
			call("duration_for");
			(void)tokenbucket_duration_for(tb, amount(in, burst));
			(void)tokenbucket_rate(tb);
			break;
		case 16:
			call("allow");
			(void)tokenbucket_allow(tb, amount(in, burst));
			break;
		case 17:
			call("tokens");
			check_tokens("tokens", tokenbucket_tokens(tb), burst);
			break;
		case 18:
			/* A deadline already past: the call never sleeps long. */
			call("wait");
			err = tokenbucket_wait(tb, amount(in, burst), 0, -1);
			if (!one_of(err, 4, E2BIG, ETIMEDOUT, EOVERFLOW, EBADMSG))
				fail("wait", err);
			break;
		default:
			call("attach_shared again");
			err = tokenbucket_attach_shared(&tb, mem, size);
			if (!one_of(err, 1, EBADMSG))
				fail("attach_shared again", err);
			if (err)
				return;
			break;
		}
	}
}

static void run_table(void *mem, size_t size, struct input *in)
{
	struct tokenbucket_table *tt = NULL;
	call("table_attach_shared");
	int err = tokenbucket_table_attach_shared(&tt, mem, size);
	if (err) {
		if (!one_of(err, 4, EBADMSG, EPROTO, EAGAIN, EINVAL))
			fail("table_attach_shared", err);
		return;
	}
	struct tokenbucket_table_stats st;
	tokenbucket_table_stats(tt, &st);
	int64_t t = 0;
	struct tokenbucket_reservation r = {0};
	uint64_t burst = u64(in, 1);
	for (int i = 0; i < MAX_CALLS && in->n > 0; i++) {
		uint8_t op = u8(in);
		uint8_t key = u8(in);
		switch (op % 9) {
		case 0:
			call("table_allow_at");
			(void)tokenbucket_table_allow_at(tt, next_time(in, &t), &key, 1,
							 amount(in, burst));
			break;
		case 1: {
			call("table_allow_result_at");
			struct tokenbucket_result res;
			err = tokenbucket_table_allow_result_at(tt, next_time(in, &t), &key, 1,
								amount(in, burst), &res);
			if (!one_of(err, 3, ERANGE, EBADMSG, EDEADLK))
				fail("table_allow_result_at", err);
			break;
		}
		case 2: {
			call("table_reserve_at");
			int64_t now = next_time(in, &t);
			uint64_t n = amount(in, burst);
			err = tokenbucket_table_reserve_at(tt, now, &key, 1, n, (int64_t)u64(in, 8), &r);
			if (!one_of(err, 7, E2BIG, ETIMEDOUT, EOVERFLOW, EBUSY, ERANGE, EBADMSG, EDEADLK))
				fail("table_reserve_at", err);
			break;
		}
		case 3:
			call("table_cancel_at");
			tokenbucket_table_cancel_at(tt, &key, 1, &r, next_time(in, &t));
			break;
		case 4:
			call("table_tokens_at");
			(void)tokenbucket_table_tokens_at(tt, next_time(in, &t), &key, 1);
			break;
		case 5: {
			call("table_next");
			uint64_t cursor = 0;
			struct tokenbucket_table_entry e;
			int64_t now = next_time(in, &t);
			unsigned long steps = 0;
			while (tokenbucket_table_next(tt, &cursor, now, &e) == 0)
				if (++steps > st.capacity)
					fail("table_next: entries beyond capacity", (long long)steps);
			break;
		}
		case 6: {
			/* 1.2: a change of rate and burst, whatever the regimes and slots hold. */
			call("table_set_limit_at");
			int64_t now = next_time(in, &t);
			struct tokenbucket_limit lim = {u64(in, 1), (int64_t)u64(in, 4), 0};
			lim.burst = amount(in, burst);
			err = tokenbucket_table_set_limit_at(tt, now, &lim);
			if (!one_of(err, 4, EINVAL, ERANGE, EDEADLK, EBADMSG))
				fail("table_set_limit_at", err);
			break;
		}
		case 7: {
			call("table_get_limit");
			struct tokenbucket_limit lim;
			err = tokenbucket_table_get_limit(tt, &lim);
			if (!one_of(err, 1, EBADMSG))
				fail("table_get_limit", err);
			if (err == 0 && (lim.burst > TOKENBUCKET_TABLE_BURST_MAX || lim.period_ns <= 0))
				fail("table_get_limit: a limit no table has", (long long)lim.burst);
			break;
		}
		default:
			call("table_stats");
			err = tokenbucket_table_stats(tt, &st);
			if (err)
				fail("table_stats", err);
			break;
		}
	}
	tokenbucket_table_free(tt);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct input in = {data, size};
	bool table = u8(&in) & 1;
	size_t len = (size_t)u64(&in, 2);
	if (len > in.n)
		len = in.n;
	if (len > MAX_IMAGE)
		len = MAX_IMAGE;
	/* Exactly len bytes, so that any access past the image is reported. */
	void *mem = NULL;
	if (posix_memalign(&mem, TOKENBUCKET_TABLE_ALIGN, len ? len : 1) != 0)
		abort();
	memcpy(mem, in.p, len);
	in.p += len;
	in.n -= len;
	if (table)
		run_table(mem, len, &in);
	else
		run_bucket(mem, len, &in);
	free(mem);
	return 0;
}

#ifdef FUZZ_REPLAY_MAIN
/* ---- Replay and seed generation without libFuzzer ------------------------ */

/* Calls every seed runs after its image: each op of its kind, with plain arguments. */
static size_t seed_calls(uint8_t *p, bool table)
{
	size_t n = 0;
	int ops = table ? 9 : 20;
	for (int op = 0; op < ops; op++) {
		p[n++] = (uint8_t)op;
		if (table)
			p[n++] = (uint8_t)('a' + op % 3); /* the key */
		p[n++] = 0;                               /* a time: forward by... */
		p[n++] = (uint8_t)(op * 37);
		p[n++] = 0x10;                            /* ...about 4 ms */
		p[n++] = (uint8_t)(op & 3) * 4;           /* an amount: 0 to 3 */
		for (int k = 0; k < 8; k++)
			p[n++] = k == 3 ? 0x10 : 0; /* a max_wait or tokens/period */
	}
	return n;
}

static int write_seed(const char *dir, const char *name, bool table, const void *image,
		      size_t len)
{
	uint8_t *buf = malloc(len + 1024);
	if (buf == NULL)
		abort();
	size_t n = 0;
	buf[n++] = table;
	buf[n++] = (uint8_t)len;
	buf[n++] = (uint8_t)(len >> 8);
	memcpy(buf + n, image, len);
	n += len;
	n += seed_calls(buf + n, table);
	LLVMFuzzerTestOneInput(buf, n);
	char path[4096];
	snprintf(path, sizeof(path), "%s/%s", dir, name);
	FILE *f = fopen(path, "wb");
	int err = 0;
	if (f == NULL || fwrite(buf, 1, n, f) != n || fclose(f) != 0) {
		fprintf(stderr, "%s: %s\n", path, strerror(errno));
		err = 1;
	}
	free(buf);
	return err;
}

#define SEC INT64_C(1000000000)

/* Valid images of every kind of bucket and table, each with a run of calls after it. */
static int make_seeds(const char *dir)
{
	size_t size = tokenbucket_shared_size();
	void *mem = NULL;
	if (posix_memalign(&mem, tokenbucket_shared_align(), size) != 0)
		abort();
	struct tokenbucket *tb;
	int err = 0;
	struct {
		const char *name;
		double rate;
		uint64_t burst;
		unsigned flags;
	} kinds[] = {
		{"bucket-never-used", 7, 3, 0},
		{"bucket-finite", 7, 3, 0},
		{"bucket-rate0", 0, 10, 0},
		{"bucket-unlimited", INFINITY, 10, 0},
		{"bucket-capped-debt", 100, 10, TOKENBUCKET_CAPPED_RELEASE},
		{"bucket-huge-rate", 1e15, UINT64_C(1) << 62, 0},
		{"bucket-rate-changed", 7, 3, 0},
	};
	for (size_t k = 0; k < sizeof(kinds) / sizeof(kinds[0]); k++) {
		memset(mem, 0, size);
		if (tokenbucket_init_shared(&tb, mem, size, kinds[k].rate, kinds[k].burst,
					    kinds[k].flags) != 0)
			abort();
		if (k == 1 || k == 2 || k == 3 || k == 6)
			(void)tokenbucket_allow_at(tb, SEC, 2);
		if (k == 4) {
			(void)tokenbucket_grab(tb, 25); /* in debt, with work in flight */
			tokenbucket_replenish(tb, SEC);
		}
		if (k == 5)
			(void)tokenbucket_allow_at(tb, INT64_MAX / 2, 1);
		if (k == 6)
			(void)tokenbucket_set_rate_at(tb, 2 * SEC, 9);
		err |= write_seed(dir, kinds[k].name, false, mem, size);
	}
	free(mem);
	struct {
		const char *name;
		uint64_t capacity;
		unsigned flags;
		int keys;
		bool full;
	} tables[] = {
		{"table-empty", 16, 0, 0, false},
		{"table-keys", 16, 0, 5, false},
		{"table-full", 8, 0, 40, false},
		{"table-evict", 8, TOKENBUCKET_TABLE_EVICT, 40, false},
		{"table-fail-open", 8, TOKENBUCKET_TABLE_FAIL_OPEN, 40, true},
		{"table-rate-changed", 16, 0, 5, false},
		{"table-frozen", 16, 0, 5, false},
	};
	for (size_t k = 0; k < sizeof(tables) / sizeof(tables[0]); k++) {
		size_t tsize = tokenbucket_table_size(tables[k].capacity);
		if (posix_memalign(&mem, TOKENBUCKET_TABLE_ALIGN, tsize) != 0)
			abort();
		memset(mem, 0, tsize);
		struct tokenbucket_table *tt;
		if (tokenbucket_table_init_shared(&tt, mem, tsize, 5, SEC, 4, tables[k].capacity,
						  tables[k].flags) != 0)
			abort();
		for (int i = 0; i < tables[k].keys; i++) {
			uint8_t key = (uint8_t)('a' + i);
			(void)tokenbucket_table_allow_at(tt, SEC + i, &key, 1,
							 tables[k].full ? 1 : 4);
		}
		const struct tokenbucket_limit lim = {3, 7000, 6};
		if (k >= 5 && tokenbucket_table_set_limit_at(tt, 2 * SEC, &lim) != 0)
			abort();
		if (k == 6) {
			/*
			 * A change cut short: the next regime's rate and burst
			 * written, frozen (gen odd), the mutex free, as a writer
			 * killed after its freeze leaves it once its mutex is
			 * repaired.  Words at their offsets in the layout (3).
			 */
			uint64_t *w = (uint64_t *)((char *)mem + 128); /* gen, then slot[0], slot[1] */
			uint64_t gen = w[0];
			uint64_t *next = w + 1 + 7 * (((gen >> 1) + 1) & 1);
			next[0] = 3 * SEC; /* origin */
			next[1] = 0;       /* fine0 */
			next[2] = 1;       /* p */
			next[3] = 1000;    /* q */
			next[5] = 2;       /* burst */
			w[15] = 3 * SEC;   /* frozen_at */
			w[0] = gen + 1;
		}
		tokenbucket_table_free(tt);
		err |= write_seed(dir, tables[k].name, true, mem, tsize);
		free(mem);
	}
	if (err == 0)
		printf("seeds written to %s\n", dir);
	return err;
}

int main(int argc, char **argv)
{
	return fuzz_replay_main(argc, argv, make_seeds, false, "");
}
#endif
