/* SPDX-License-Identifier: MIT */
/*
 * 1.2: a table's rate and burst change.  Every key stays exactly the single
 * bucket it was, across raises, cuts, rate 0 and fractional rates, in debt,
 * full or never used; a raised burst brings back nothing; threads taking
 * while the limit changes never get more than a key's bound; a change cut
 * short by the death of its process is finished by the next call; a storm
 * of SIGKILLed changers and takers on a shared table leaves every key within
 * its bound; a table's wait sleeps on when a change holds its tokens back.
 */
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check_tb.h"
#include "../on_valgrind.h"
#include "storm.h"
#include "table.h"

static int slowdown(void)
{
	const char *slow = getenv("CK_TIMEOUT_MULTIPLIER");
	int m = slow ? atoi(slow) : 1;
	return m > 1 ? m : 1;
}

static uint64_t rng_state;
static uint64_t rnd(void)
{
	rng_state ^= rng_state << 13;
	rng_state ^= rng_state >> 7;
	rng_state ^= rng_state << 17;
	return rng_state;
}

static struct tokenbucket_table *table_of(const struct tokenbucket_limit *lim, uint64_t capacity)
{
	struct tokenbucket_table *t = NULL;
	ck_assert_int_eq(tokenbucket_table_create_limit(&t, lim, capacity, 0), 0);
	return t;
}

static void *shared_anon(size_t size)
{
	void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	ck_assert(p != MAP_FAILED);
	memset(p, 0, size);
	return p;
}

/* ---- Exactness against single buckets across changes ------------------------ */

/* The limits a run moves through: raises, cuts, rate 0, fractions, a burst of 1. */
static const struct tokenbucket_limit limits[] = {
	{1, 1 * MS, 5},   {3, 7 * US, 10},   {0, 1, 10},      {1, 1 * MS, 2},
	{5, 3 * MS, 20},  {1000, 1 * US, 1}, {7, 3 * MS, 1000}, {2, 3 * US, 7},
	{0, 5, 3},        {11, 13 * US, 40},
};
#define NLIMITS (int)(sizeof(limits) / sizeof(limits[0]))

enum { KEYS = 16, FRESH = 4 };

static void key_name(char *key, size_t size, int k)
{
	snprintf(key, size, "key-%d", k);
}

/* One call on key k of the table and its reference bucket, compared. */
static void step(struct tokenbucket_table *t, struct tokenbucket *ref, int k, int64_t now,
		 uint64_t burst, struct tokenbucket_reservation *rt,
		 struct tokenbucket_reservation *rr)
{
	char key[16];
	key_name(key, sizeof(key), k);
	size_t len = strlen(key);
	uint64_t n = rnd() % (burst + 2);
	switch (rnd() % 6) {
	case 0: {
		struct tokenbucket_result a, b;
		ck_assert_int_eq(tokenbucket_table_allow_result_at(t, now, key, len, n, &a), 0);
		ck_assert_int_eq(tokenbucket_allow_result_at(ref, now, n, &b), 0);
		ck_assert_int_eq(a.allowed, b.allowed);
		ck_assert_uint_eq(a.remaining, b.remaining);
		ck_assert_uint_eq(a.limit, b.limit);
		ck_assert_int_eq(a.retry_after_ns, b.retry_after_ns);
		ck_assert_int_eq(a.reset_after_ns, b.reset_after_ns);
		break;
	}
	case 1:
		ck_assert_int_eq(tokenbucket_table_allow_at(t, now, key, len, n),
				 tokenbucket_allow_at(ref, now, n));
		break;
	case 2: {
		/* Into debt as deep as a few bursts. */
		int64_t max_wait = rnd() % 2 ? TOKENBUCKET_NEVER : (int64_t)(rnd() % (5 * MS));
		struct tokenbucket_reservation a = {0}, b = {0};
		int ea = tokenbucket_table_reserve_at(t, now, key, len, n, max_wait, &a);
		int eb = tokenbucket_reserve_at(ref, now, n, max_wait, &b);
		ck_assert_int_eq(ea, eb);
		if (ea == 0) {
			ck_assert_int_eq(a.time_to_act, b.time_to_act);
			ck_assert_uint_eq(a.tokens, b.tokens);
			*rt = a;
			*rr = b;
		}
		break;
	}
	case 3:
		tokenbucket_table_cancel_at(t, key, len, rt, now);
		tokenbucket_cancel_at(ref, rr, now);
		break;
	default: {
		double a = tokenbucket_table_tokens_at(t, now, key, len);
		double b = tokenbucket_tokens_at(ref, now);
		ck_assert_msg(a == b, "key %d at %lld: table %.17g, bucket %.17g", k, (long long)now,
			      a, b);
		break;
	}
	}
}

/*
 * Random calls on KEYS keys at advancing times, and every few dozen calls
 * a change of rate and burst for the table and every reference bucket at
 * the same time.  Every key took (and gave back) a token at the origin, so
 * it holds a slot, as a bucket that has seen a call; FRESH keys never do
 * anything but read, and read full at the burst in force.
 */
static void regime_run(int seed, int steps)
{
	rng_state = 0x9e3779b97f4a7c15u + (uint64_t)seed * 7919;
	int cur = seed % NLIMITS;
	struct tokenbucket_table *t = table_of(&limits[cur], 4096);
	const int64_t origin = 5 * SEC;
	struct tokenbucket *ref[KEYS];
	struct tokenbucket_reservation rt[KEYS], rr[KEYS];
	memset(rt, 0, sizeof(rt));
	memset(rr, 0, sizeof(rr));
	ck_assert_double_eq(tokenbucket_table_tokens_at(t, origin, "", 0),
			    (double)limits[cur].burst);
	for (int k = 0; k < KEYS; k++) {
		ck_assert_int_eq(tokenbucket_create_limit(&ref[k], &limits[cur], 0), 0);
		char key[16];
		key_name(key, sizeof(key), k);
		struct tokenbucket_reservation a, b;
		if (limits[cur].burst == 0)
			continue;
		ck_assert_int_eq(tokenbucket_table_reserve_at(t, origin, key, strlen(key), 1, 0, &a), 0);
		ck_assert_int_eq(tokenbucket_reserve_at(ref[k], origin, 1, 0, &b), 0);
		tokenbucket_table_cancel_at(t, key, strlen(key), &a, origin);
		tokenbucket_cancel_at(ref[k], &b, origin);
	}
	int64_t now = origin;
	int changes = 0;
	for (int i = 0; i < steps; i++) {
		const struct tokenbucket_limit *lim = &limits[cur];
		uint64_t span = lim->period_ns > 0 && lim->period_ns < 10 * US
					? 5 * US
					: (uint64_t)(lim->period_ns > 0 ? 2 * lim->period_ns : MS);
		now += (int64_t)(rnd() % span);
		if (rnd() % 40 == 0) {
			cur = (int)(rnd() % NLIMITS);
			lim = &limits[cur];
			ck_assert_int_eq(tokenbucket_table_set_limit_at(t, now, lim), 0);
			for (int k = 0; k < KEYS; k++)
				ck_assert_int_eq(tokenbucket_set_limit_at(ref[k], now, lim), 0);
			struct tokenbucket_limit a, b;
			ck_assert_int_eq(tokenbucket_table_get_limit(t, &a), 0);
			ck_assert_int_eq(tokenbucket_get_limit(ref[0], &b), 0);
			ck_assert_uint_eq(a.tokens, b.tokens);
			ck_assert_int_eq(a.period_ns, b.period_ns);
			ck_assert_uint_eq(a.burst, lim->burst);
			changes++;
		}
		int k = (int)(rnd() % (KEYS + FRESH));
		if (k >= KEYS) {
			char key[16];
			snprintf(key, sizeof(key), "fresh-%d", k);
			ck_assert_double_eq(tokenbucket_table_tokens_at(t, now, key, strlen(key)),
					    (double)lim->burst);
			continue;
		}
		step(t, ref[k], k, now, lim->burst, &rt[k], &rr[k]);
	}
	ck_assert_int_gt(changes, steps / 80);
	struct tokenbucket_table_stats s;
	ck_assert_int_eq(tokenbucket_table_stats(t, &s), 0);
	ck_assert_uint_eq(s.lossless + s.lossy + s.refused, 0); /* every key kept its slot */
	for (int k = 0; k < KEYS; k++) {
		char key[16];
		key_name(key, sizeof(key), k);
		now += SEC;
		double a = tokenbucket_table_tokens_at(t, now, key, strlen(key));
		ck_assert(a == tokenbucket_tokens_at(ref[k], now));
		tokenbucket_free(ref[k]);
	}
	tokenbucket_table_free(t);
}

START_TEST(exact_across_changes)
{
	regime_run(_i, 20000 / slowdown());
}
END_TEST

/* A change at a time before some key's clock happens at that clock, for every key. */
START_TEST(change_at_latest_clock)
{
	const struct tokenbucket_limit a = {1, 1 * MS, 10}, b = {1, 2 * MS, 10};
	struct tokenbucket_table *t = table_of(&a, 64);
	struct tokenbucket *early, *late;
	ck_assert_int_eq(tokenbucket_create_limit(&early, &a, 0), 0);
	ck_assert_int_eq(tokenbucket_create_limit(&late, &a, 0), 0);
	ck_assert(tokenbucket_table_allow_at(t, SEC, "early", 5, 10));
	ck_assert(tokenbucket_allow_at(early, SEC, 10));
	ck_assert_double_eq(tokenbucket_tokens_at(late, SEC), 10);
	ck_assert(tokenbucket_table_allow_at(t, SEC + 4 * MS, "late", 4, 1));
	ck_assert(tokenbucket_allow_at(late, SEC + 4 * MS, 1));
	/* Asked for at SEC + 1 ms, the change happens at SEC + 4 ms, the late key's clock. */
	ck_assert_int_eq(tokenbucket_table_set_limit_at(t, SEC + MS, &b), 0);
	ck_assert_int_eq(tokenbucket_set_limit_at(early, SEC + 4 * MS, &b), 0);
	ck_assert_int_eq(tokenbucket_set_limit_at(late, SEC + 4 * MS, &b), 0);
	for (int64_t at = SEC + 2 * MS; at < SEC + 20 * MS; at += MS / 2) {
		ck_assert(tokenbucket_table_tokens_at(t, at, "early", 5) ==
			  tokenbucket_tokens_at(early, at));
		ck_assert(tokenbucket_table_tokens_at(t, at, "late", 4) ==
			  tokenbucket_tokens_at(late, at));
	}
	tokenbucket_free(early);
	tokenbucket_free(late);
	tokenbucket_table_free(t);
}
END_TEST

/* Raising the burst brings back nothing a lower one dropped; new keys are full at the new one. */
START_TEST(raise_restores_nothing)
{
	const struct tokenbucket_limit five = {1, 1 * MS, 5}, two = {1, 1 * MS, 2},
				       ten = {1, 1 * MS, 10}, ten0 = {0, 1, 10};
	struct tokenbucket_table *t = table_of(&five, 64);
	/* full (never took since long), in debt, at 3 */
	ck_assert(tokenbucket_table_allow_at(t, SEC, "full", 4, 1));
	struct tokenbucket_reservation r;
	ck_assert_int_eq(tokenbucket_table_reserve_at(t, SEC + 9 * MS, "debt", 4, 5, 0, &r), 0);
	ck_assert_int_eq(tokenbucket_table_reserve_at(t, SEC + 9 * MS, "debt", 4, 3,
						      TOKENBUCKET_NEVER, &r),
			 0);
	ck_assert(tokenbucket_table_allow_at(t, SEC + 9 * MS, "three", 5, 2));
	int64_t at = SEC + 10 * MS;
	ck_assert_double_eq(tokenbucket_table_tokens_at(t, at, "full", 4), 5);
	ck_assert_double_eq(tokenbucket_table_tokens_at(t, at, "debt", 4), -2);
	ck_assert_double_eq(tokenbucket_table_tokens_at(t, at, "three", 5), 4);
	ck_assert_int_eq(tokenbucket_table_set_limit_at(t, at, &ten), 0);
	ck_assert_double_eq(tokenbucket_table_tokens_at(t, at, "full", 4), 5);
	ck_assert_double_eq(tokenbucket_table_tokens_at(t, at, "debt", 4), -2);
	ck_assert_double_eq(tokenbucket_table_tokens_at(t, at, "three", 5), 4);
	ck_assert_double_eq(tokenbucket_table_tokens_at(t, at, "new", 3), 10);
	/* Then refill to the new burst at the rate. */
	ck_assert_double_eq(tokenbucket_table_tokens_at(t, at + 3 * MS, "full", 4), 8);
	ck_assert_double_eq(tokenbucket_table_tokens_at(t, at + 9 * MS, "full", 4), 10);
	/* Down to 2 drops; up again at rate 0 brings none of it back. */
	at += 20 * MS;
	ck_assert_int_eq(tokenbucket_table_set_limit_at(t, at, &two), 0);
	ck_assert_double_eq(tokenbucket_table_tokens_at(t, at, "full", 4), 2);
	ck_assert_double_eq(tokenbucket_table_tokens_at(t, at, "three", 5), 2);
	ck_assert_int_eq(tokenbucket_table_set_limit_at(t, at + MS, &ten0), 0);
	ck_assert_double_eq(tokenbucket_table_tokens_at(t, at + SEC, "full", 4), 2);
	ck_assert_double_eq(tokenbucket_table_tokens_at(t, at + SEC, "three", 5), 2);
	ck_assert(tokenbucket_table_allow_at(t, at + SEC, "full", 4, 2));
	ck_assert(!tokenbucket_table_allow_at(t, at + SEC, "full", 4, 1));
	tokenbucket_table_free(t);
}
END_TEST

START_TEST(bad_changes)
{
	const struct tokenbucket_limit ok = {1, 1 * MS, 5};
	struct tokenbucket_table *t = table_of(&ok, 64);
	struct tokenbucket_limit lim;
	ck_assert_int_eq(tokenbucket_table_set_limit_at(NULL, SEC, &ok), -EINVAL);
	ck_assert_int_eq(tokenbucket_table_set_limit_at(t, SEC, NULL), -EINVAL);
	lim = (struct tokenbucket_limit){1, -1, 5};
	ck_assert_int_eq(tokenbucket_table_set_limit_at(t, SEC, &lim), -EINVAL);
	lim = (struct tokenbucket_limit){1, 0, 5};
	ck_assert_int_eq(tokenbucket_table_set_limit(t, &lim), -ERANGE);
	lim = (struct tokenbucket_limit){17, 1, 5};
	ck_assert_int_eq(tokenbucket_table_set_limit_at(t, SEC, &lim), -ERANGE);
	lim = (struct tokenbucket_limit){1, 1, TOKENBUCKET_TABLE_BURST_MAX + 1};
	ck_assert_int_eq(tokenbucket_table_set_limit_at(t, SEC, &lim), -ERANGE);
	ck_assert_int_eq(tokenbucket_table_get_limit(NULL, &lim), -EINVAL);
	ck_assert_int_eq(tokenbucket_table_get_limit(t, NULL), -EINVAL);
	/* Refusals change nothing. */
	ck_assert_int_eq(tokenbucket_table_get_limit(t, &lim), 0);
	ck_assert_uint_eq(lim.tokens, 1);
	ck_assert_int_eq(lim.period_ns, MS);
	ck_assert_uint_eq(lim.burst, 5);
	/* Lowest terms; rate 0 as {0, 1}. */
	lim = (struct tokenbucket_limit){4, 6 * MS, 3};
	ck_assert_int_eq(tokenbucket_table_set_limit(t, &lim), 0);
	ck_assert_int_eq(tokenbucket_table_get_limit(t, &lim), 0);
	ck_assert_uint_eq(lim.tokens, 1);
	ck_assert_int_eq(lim.period_ns, 3 * MS / 2);
	lim = (struct tokenbucket_limit){0, 77, 0};
	ck_assert_int_eq(tokenbucket_table_set_limit(t, &lim), 0);
	ck_assert_int_eq(tokenbucket_table_get_limit(t, &lim), 0);
	ck_assert_uint_eq(lim.tokens, 0);
	ck_assert_int_eq(lim.period_ns, 1);
	ck_assert_uint_eq(lim.burst, 0);
	ck_assert(!tokenbucket_table_allow(t, "a", 1, 1));
	ck_assert(tokenbucket_table_allow(t, "a", 1, 0));
	tokenbucket_table_free(t);
}
END_TEST

/* ---- A change cut short ------------------------------------------------------- */

static const char *const keys3[3] = {"full", "half", "debt"};

/* A shared table of *lim and a reference bucket for each of keys3, all from SEC. */
static struct tbt_mem *three_keys(const struct tokenbucket_limit *lim, size_t size,
				  struct tokenbucket_table **t, struct tokenbucket *ref[3])
{
	struct tbt_mem *m = shared_anon(size);
	ck_assert_int_eq(tokenbucket_table_init_shared_limit(t, m, size, lim, 64, 0), 0);
	for (int k = 0; k < 3; k++) {
		ck_assert_int_eq(tokenbucket_create_limit(&ref[k], lim, 0), 0);
		ck_assert_double_eq(tokenbucket_tokens_at(ref[k], SEC), (double)lim->burst);
	}
	ck_assert_double_eq(tokenbucket_table_tokens_at(*t, SEC, "", 0), (double)lim->burst);
	return m;
}

/*
 * A process takes the writer mutex, takes a change to *lim at "at" as far
 * as tokenbucket_table_set_limit_at does before its pass over the slots
 * (the next regime's rate and burst, the freeze), and dies holding it.
 */
static void die_frozen(struct tbt_mem *m, int64_t at, const struct tokenbucket_limit *lim,
		       bool exact)
{
	pid_t pid = fork();
	TBT_FORKED(pid);
	if (pid == 0) {
		if (pthread_mutex_lock(&m->lock.writer))
			_exit(1);
		uint64_t gen = atomic_load(&m->regimes.gen);
		struct tbt_regime *nr = &m->regimes.slot[((gen >> 1) + 1) & 1];
		atomic_store(&nr->origin, at);
		atomic_store(&nr->fine0, 0);
		atomic_store(&nr->p, lim->tokens);
		atomic_store(&nr->q, (uint64_t)lim->period_ns);
		atomic_store(&nr->burst, lim->burst);
		atomic_store(&m->header.h.exact_carry, exact);
		atomic_store(&m->regimes.frozen_at, at);
		atomic_store(&m->regimes.gen, gen + 1);
		_exit(0); /* holding the mutex */
	}
	int st;
	ck_assert_int_eq(waitpid(pid, &st, 0), pid);
	ck_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0);
	ck_assert_uint_eq(atomic_load(&m->regimes.gen) & 1, 1);
}

/* The three keys of the table against their buckets from "from", every step ns, n taken each time. */
static void three_compare(struct tokenbucket_table *t, struct tokenbucket *ref[3], int64_t from,
			  int64_t to, int64_t step, uint64_t n)
{
	for (int64_t now = from; now < to; now += step) {
		for (int k = 0; k < 3; k++) {
			size_t len = strlen(keys3[k]);
			if (n)
				ck_assert(tokenbucket_table_allow_at(t, now, keys3[k], len, n) ==
					  tokenbucket_allow_at(ref[k], now, n));
			double x = tokenbucket_table_tokens_at(t, now, keys3[k], len);
			double y = tokenbucket_tokens_at(ref[k], now);
			ck_assert_msg(x == y, "%s at +%lld: table %.17g, bucket %.17g", keys3[k],
				      (long long)(now - from), x, y);
		}
	}
}

/*
 * A process that froze the regime, wrote the next one's rate and burst and
 * died holding the mutex: the next call finishes the change (at the frozen
 * time or the latest key clock), exactly as a whole change would have.
 */
START_TEST(dead_writer_finished)
{
	const struct tokenbucket_limit a = {3, 7 * US, 6}, b = {1, 1 * MS, 9};
	size_t size = tokenbucket_table_size(64);
	struct tokenbucket_table *t;
	struct tokenbucket *ref[3];
	struct tbt_mem *m = three_keys(&a, size, &t, ref);
	uint64_t take[3] = {1, 3, 6};
	for (int k = 0; k < 3; k++) {
		ck_assert(tokenbucket_table_allow_at(t, SEC + 5 * US, keys3[k], strlen(keys3[k]),
						     take[k]));
		ck_assert(tokenbucket_allow_at(ref[k], SEC + 5 * US, take[k]));
	}
	struct tokenbucket_reservation r1, r2;
	ck_assert_int_eq(tokenbucket_table_reserve_at(t, SEC + 5 * US, "debt", 4, 4,
						      TOKENBUCKET_NEVER, &r1), 0);
	ck_assert_int_eq(tokenbucket_reserve_at(ref[2], SEC + 5 * US, 4, TOKENBUCKET_NEVER, &r2), 0);
	int64_t at = SEC + 11 * US;
	die_frozen(m, at, &b, false);
	for (int k = 0; k < 3; k++)
		ck_assert_int_eq(tokenbucket_set_limit_at(ref[k], at, &b), 0);
	/* The next call finds the freeze, takes the dead owner's mutex and finishes. */
	three_compare(t, ref, at, at + 30 * MS, 700 * US, 0);
	ck_assert_uint_eq(atomic_load(&m->regimes.gen), 2);
	/* And the mutex is usable again. */
	ck_assert_int_eq(tokenbucket_table_set_limit_at(t, at + 30 * MS, &a), 0);
	ck_assert_uint_eq(atomic_load(&m->regimes.gen), 4);
	for (int k = 0; k < 3; k++)
		tokenbucket_free(ref[k]);
	tokenbucket_table_free(t);
	munmap(m, size);
}
END_TEST

/* ---- No horizon: re-anchors ------------------------------------------------- */

/* Fast rates, deep bursts: a regime reaches TBT_ANCHOR tokens within days. */
static const struct tokenbucket_limit fast_limits[] = {
	{31, 2, UINT64_C(1) << 40},      {16, 1, (UINT64_C(1) << 40) - 5},
	{15, 1, UINT64_C(1) << 39},      {7, 3, UINT64_C(1) << 40},
	{45, 7, 1000},
};
#define NFAST (int)(sizeof(fast_limits) / sizeof(fast_limits[0]))

/*
 * Days of calls at up to 15.5 tokens per ns against one bucket per key:
 * mostly seconds apart (keys below burst, in debt), sometimes days (every
 * key full again), and now and then a change; the table re-anchors every
 * 2^53 tokens (at most 6.7 days) and stays exact through each.
 */
START_TEST(exact_across_reanchors)
{
	rng_state = 0x2545f4914f6cdd1du + (uint64_t)_i * 104729;
	int cur = _i % NFAST;
	size_t size = tokenbucket_table_size(1024);
	struct tbt_mem *m = shared_anon(size);
	struct tokenbucket_table *t;
	ck_assert_int_eq(tokenbucket_table_init_shared_limit(&t, m, size, &fast_limits[cur], 1024, 0), 0);
	const int64_t origin = 5 * SEC;
	struct tokenbucket *ref[KEYS];
	struct tokenbucket_reservation rt[KEYS], rr[KEYS];
	memset(rt, 0, sizeof(rt));
	memset(rr, 0, sizeof(rr));
	ck_assert_double_eq(tokenbucket_table_tokens_at(t, origin, "", 0), (double)fast_limits[cur].burst);
	for (int k = 0; k < KEYS; k++) {
		ck_assert_int_eq(tokenbucket_create_limit(&ref[k], &fast_limits[cur], 0), 0);
		char key[16];
		key_name(key, sizeof(key), k);
		struct tokenbucket_reservation a, b;
		ck_assert_int_eq(tokenbucket_table_reserve_at(t, origin, key, strlen(key), 1, 0, &a), 0);
		ck_assert_int_eq(tokenbucket_reserve_at(ref[k], origin, 1, 0, &b), 0);
		tokenbucket_table_cancel_at(t, key, strlen(key), &a, origin);
		tokenbucket_cancel_at(ref[k], &b, origin);
	}
	int64_t now = origin;
	int steps = 20000 / slowdown(), changes = 0;
	for (int i = 0; i < steps; i++) {
		uint64_t r = rnd();
		now += r % 50 == 0 ? (int64_t)(rnd() % (3 * 86400 * SEC)) : (int64_t)(rnd() % (20 * SEC));
		if (r % 997 == 0) {
			changes++;
			cur = (int)(rnd() % NFAST);
			ck_assert_int_eq(tokenbucket_table_set_limit_at(t, now, &fast_limits[cur]), 0);
			for (int k = 0; k < KEYS; k++)
				ck_assert_int_eq(tokenbucket_set_limit_at(ref[k], now, &fast_limits[cur]), 0);
		}
		int k = (int)(rnd() % KEYS);
		/* Amounts up to a quarter of the burst: debt stays within TOKENBUCKET_TABLE_DEBT_MAX. */
		step(t, ref[k], k, now, fast_limits[cur].burst / 4, &rt[k], &rr[k]);
	}
	uint64_t anchors = atomic_load(&m->regimes.gen) / 2 - (uint64_t)changes;
	fprintf(stderr, "table re-anchors: %.0f days, %d changes, %llu re-anchors\n",
		(double)(now - origin) / 86400e9, changes, (unsigned long long)anchors);
	ck_assert_uint_ge(anchors, (uint64_t)(10 / slowdown()));
	struct tokenbucket_table_stats s;
	ck_assert_int_eq(tokenbucket_table_stats(t, &s), 0);
	ck_assert_uint_eq(s.lossless + s.lossy + s.refused, 0);
	for (int k = 0; k < KEYS; k++)
		tokenbucket_free(ref[k]);
	tokenbucket_table_free(t);
	munmap(m, size);
}
END_TEST

/*
 * A re-anchor cut short: a process froze the regime for a change to the
 * same limit past the regime's TBT_ANCHOR tokens and died holding the
 * mutex.  The next call finishes it; every key stays exact, full ones
 * included (their tails moved up), fractions carried.
 */
START_TEST(dead_reanchor_finished)
{
	const struct tokenbucket_limit a = {31, 2, 1000};
	size_t size = tokenbucket_table_size(64);
	struct tokenbucket_table *t;
	struct tokenbucket *ref[3];
	struct tbt_mem *m = three_keys(&a, size, &t, ref);
	int64_t span = atomic_load(&m->regimes.slot[0].hspan);
	ck_assert_int_gt(span, 0);
	/* Just before the anchor: one key full since long, one half, one in debt. */
	int64_t before = SEC + span - 20;
	uint64_t take[3] = {0, 500, 1000};
	for (int k = 1; k < 3; k++) {
		ck_assert(tokenbucket_table_allow_at(t, before, keys3[k], strlen(keys3[k]), take[k]));
		ck_assert(tokenbucket_allow_at(ref[k], before, take[k]));
	}
	struct tokenbucket_reservation r1, r2;
	ck_assert_int_eq(tokenbucket_table_reserve_at(t, before, "debt", 4, 300, TOKENBUCKET_NEVER,
						      &r1), 0);
	ck_assert_int_eq(tokenbucket_reserve_at(ref[2], before, 300, TOKENBUCKET_NEVER, &r2), 0);
	ck_assert(tokenbucket_table_allow_at(t, SEC, "full", 4, 1));
	ck_assert(tokenbucket_allow_at(ref[0], SEC, 1));
	int64_t at = SEC + span + 3;
	die_frozen(m, at, &a, true);
	/* The buckets see no change: the rate is the same, the fraction kept whole. */
	three_compare(t, ref, at, at + 200, 7, 3);
	ck_assert_uint_eq(atomic_load(&m->regimes.gen), 2);
	for (int k = 0; k < 3; k++)
		tokenbucket_free(ref[k]);
	tokenbucket_table_free(t);
	munmap(m, size);
}
END_TEST

/* ---- Threads ---------------------------------------------------------------- */

enum { TKEYS = 32, TTHREADS = 3 };

struct takers {
	struct tokenbucket_table *t;
	_Atomic bool stop;
	_Atomic uint64_t granted[2 * TKEYS];
};

static void *taker(void *arg)
{
	struct takers *w = arg;
	uint64_t x = (uint64_t)pthread_self() | 1;
	/*
	 * Under memcheck (one thread at a time) spinning takers starve the
	 * changer for minutes: there each take yields, so changes keep coming.
	 */
	bool yield = TBT_ON_VALGRIND;
	while (!atomic_load(&w->stop)) {
		if (yield)
			sched_yield();
		x ^= x << 13;
		x ^= x >> 7;
		x ^= x << 17;
		uint64_t k = x % (2 * TKEYS);
		if (tokenbucket_table_allow(w->t, &k, sizeof(k), 1))
			atomic_fetch_add(&w->granted[k], 1);
	}
	return NULL;
}

/*
 * Rate 0 and the burst moved between 3 and 6 while threads take: keys
 * that held 2 tokens before the first change never get more than 2 (a
 * raise brings back nothing), keys first seen later at most 6.
 */
START_TEST(threads_burst_changes)
{
	const struct tokenbucket_limit three = {0, 1, 3}, six = {0, 1, 6};
	struct takers w = {0};
	w.t = table_of(&three, 1024);
	for (uint64_t k = 0; k < TKEYS; k++)
		ck_assert(tokenbucket_table_allow(w.t, &k, sizeof(k), 1));
	pthread_t th[TTHREADS];
	for (int i = 0; i < TTHREADS; i++)
		ck_assert_int_eq(pthread_create(&th[i], NULL, taker, &w), 0);
	int changes = 400 / slowdown();
	for (int i = 0; i < changes; i++) {
		ck_assert_int_eq(tokenbucket_table_set_limit(w.t, i % 2 ? &three : &six), 0);
		sched_yield();
	}
	atomic_store(&w.stop, true);
	for (int i = 0; i < TTHREADS; i++)
		pthread_join(th[i], NULL);
	for (int k = 0; k < 2 * TKEYS; k++)
		ck_assert_uint_le(atomic_load(&w.granted[k]), k < TKEYS ? 2 : 6);
	tokenbucket_table_free(w.t);
}
END_TEST

/*
 * A producing rate moved between two values (and 0) while threads take at
 * CLOCK_MONOTONIC: no key gets more than the largest burst plus what the
 * fastest rate makes over the run, and each change's bound is kept: the
 * grants up to a change, seen from the changer, never pass the burst
 * plus production up to the latest time the change could happen.
 */
START_TEST(threads_rate_changes)
{
	const struct tokenbucket_limit lims[3] = {{1, 2 * MS, 4}, {0, 1, 8}, {1, 1 * MS, 8}};
	struct takers w = {0};
	w.t = table_of(&lims[0], 1024);
	int64_t start = tokenbucket_now();
	pthread_t th[TTHREADS];
	for (int i = 0; i < TTHREADS; i++)
		ck_assert_int_eq(pthread_create(&th[i], NULL, taker, &w), 0);
	int changes = 60;
	/* Production bound: each regime's rate over [its change asked, the next change returned]. */
	double bound = 8;
	int64_t asked = start;
	const struct tokenbucket_limit *in_force = &lims[0];
	for (int i = 0; i < changes; i++) {
		usleep(2000);
		const struct tokenbucket_limit *next = &lims[(i + 1) % 3];
		int64_t now = tokenbucket_now();
		ck_assert_int_eq(tokenbucket_table_set_limit_at(w.t, now, next), 0);
		int64_t done = tokenbucket_now();
		if (in_force->tokens)
			bound += (double)(done - asked) * (double)in_force->tokens /
				 (double)in_force->period_ns + 1;
		asked = now;
		in_force = next;
	}
	atomic_store(&w.stop, true);
	for (int i = 0; i < TTHREADS; i++)
		pthread_join(th[i], NULL);
	int64_t end = tokenbucket_now();
	if (in_force->tokens)
		bound += (double)(end - asked) * (double)in_force->tokens / (double)in_force->period_ns +
			 1;
	uint64_t most = 0;
	for (int k = 0; k < 2 * TKEYS; k++) {
		uint64_t g = atomic_load(&w.granted[k]);
		ck_assert_msg((double)g <= bound, "key %d: %llu granted, bound %.1f", k,
			      (unsigned long long)g, bound);
		most = g > most ? g : most;
	}
	fprintf(stderr, "table rate changes: %d changes, most granted %llu, bound %.1f\n", changes,
		(unsigned long long)most, bound);
	tokenbucket_table_free(w.t);
}
END_TEST

/* ---- Processes --------------------------------------------------------------- */

enum { SKEYS = 48, SPROCS = 4 };

struct storm {
	_Atomic long calls;
	_Atomic long changes;
	_Atomic uint64_t granted[2 * SKEYS];
};

/*
 * A taker (even seed) or a changer (odd seed) of a shared table at rate 0
 * in force whenever a key takes (changers move between rate 0 bursts 3 and
 * 6 and, at one time, fractional rates: no production at a single time).
 */
static _Noreturn void storm_child(void *mem, size_t size, struct storm *s, unsigned seed)
{
	struct tokenbucket_table *t;
	if (tokenbucket_table_attach_shared(&t, mem, size))
		_exit(3);
	const struct tokenbucket_limit lims[4] = {
		{0, 1, 3}, {0, 1, 6}, {3, 7 * US, 6}, {5, 11 * MS, 3}};
	uint64_t x = seed * 2654435761u + 1;
	for (;;) {
		x ^= x << 13;
		x ^= x >> 7;
		x ^= x << 17;
		if (seed % 2) {
			int err = tokenbucket_table_set_limit_at(t, SEC, &lims[x % 4]);
			if (err)
				_exit(4);
			atomic_fetch_add(&s->changes, 1);
		} else {
			uint64_t k = x % (2 * SKEYS);
			if (tokenbucket_table_allow_at(t, SEC, &k, sizeof(k), 1))
				atomic_fetch_add(&s->granted[k], 1);
		}
		atomic_fetch_add(&s->calls, 1);
	}
}

struct storm_arg {
	void *mem;
	size_t size;
	struct storm *s;
};

static void storm_spawn(void *arg, unsigned seed)
{
	struct storm_arg *a = arg;
	storm_child(a->mem, a->size, a->s, seed);
}

/*
 * Processes change the limit of a shared table while others take, and
 * are SIGKILLed at random instants (inside changes too).  All at one time,
 * so nothing is produced: keys that held 2 tokens before the storm never
 * get more than 2 (no raise brings back what was dropped, no change cut
 * short counts anything twice), the others at most 6.  Afterwards the
 * table is not frozen and takes its limit.
 */
START_TEST(storm_of_changes)
{
	size_t size = tokenbucket_table_size(256);
	void *mem = shared_anon(size);
	struct tokenbucket_table *t;
	const struct tokenbucket_limit three = {0, 1, 3};
	ck_assert_int_eq(tokenbucket_table_init_shared_limit(&t, mem, size, &three, 256, 0), 0);
	for (uint64_t k = 0; k < SKEYS; k++)
		ck_assert(tokenbucket_table_allow_at(t, SEC, &k, sizeof(k), 1));
	struct storm *s = shared_anon(sizeof(*s));
	pid_t pids[SPROCS];
	for (int i = 0; i < SPROCS; i++) {
		pids[i] = fork();
		TBT_FORKED(pids[i]);
		if (pids[i] == 0)
			storm_child(mem, size, s, (unsigned)i);
	}
	int want = 200 / slowdown();
	struct storm_arg arg = {mem, size, s};
	int kills = storm_run(pids, SPROCS, &s->calls, want, 30, 777, 0, storm_spawn, &arg);
	fprintf(stderr, "table change storm: %d kills, %ld calls, %ld changes\n", kills,
		atomic_load(&s->calls), atomic_load(&s->changes));
	ck_assert_int_ge(kills, want / 2);
	ck_assert_int_gt(atomic_load(&s->changes), kills);
	for (int k = 0; k < 2 * SKEYS; k++)
		ck_assert_uint_le(atomic_load(&s->granted[k]), k < SKEYS ? 2 : 6);
	/* A change (finishing any cut short) and the keys within their bound at it. */
	const struct tokenbucket_limit six = {0, 1, 6};
	ck_assert_int_eq(tokenbucket_table_set_limit_at(t, SEC, &six), 0);
	struct tbt_mem *m = mem;
	ck_assert_uint_eq(atomic_load(&m->regimes.gen) & 1, 0);
	struct tokenbucket_limit lim;
	ck_assert_int_eq(tokenbucket_table_get_limit(t, &lim), 0);
	ck_assert_uint_eq(lim.burst, 6);
	for (uint64_t k = 0; k < 2 * SKEYS; k++) {
		double level = tokenbucket_table_tokens_at(t, SEC, &k, sizeof(k));
		ck_assert(level + (double)atomic_load(&s->granted[k]) <= (k < SKEYS ? 2 : 6));
	}
	tokenbucket_table_free(t);
	munmap(s, sizeof(*s));
	munmap(mem, size);
}
END_TEST

/*
 * Re-anchors under SIGKILL: 16 tokens per ns, burst 3, and a time that
 * jumps by one regime's span (2^49 ns, 2^53 tokens) at every epoch, so that
 * the first take of each epoch re-anchors the table (a pass over 4096
 * slots) and every key refills to 3.  Processes take at the epoch's time
 * and are killed just after the epoch moves, when they re-anchor.  A take
 * happens at its epoch's time or, the table having moved on, a later one:
 * so from any epoch on, a key gets at most 3 per epoch.
 */
enum { AKEYS = 16, AEPOCHS = 300 };

struct anchors {
	_Atomic long calls;
	_Atomic int64_t epoch;
	_Atomic uint64_t granted[AEPOCHS][AKEYS];
};

static _Noreturn void anchor_child(void *mem, size_t size, struct anchors *a, unsigned seed)
{
	struct tokenbucket_table *t;
	if (tokenbucket_table_attach_shared(&t, mem, size))
		_exit(3);
	uint64_t x = seed * 2654435761u + 1;
	for (;;) {
		x ^= x << 13;
		x ^= x >> 7;
		x ^= x << 17;
		int64_t e = atomic_load(&a->epoch);
		uint64_t k = x % AKEYS;
		if (tokenbucket_table_allow_at(t, SEC + e * (INT64_C(1) << 49), &k, sizeof(k), 1))
			atomic_fetch_add(&a->granted[e][k], 1);
		atomic_fetch_add(&a->calls, 1);
	}
}

struct anchor_arg {
	void *mem;
	size_t size;
	struct anchors *a;
};

static void anchor_spawn(void *arg, unsigned seed)
{
	struct anchor_arg *p = arg;
	anchor_child(p->mem, p->size, p->a, seed);
}

START_TEST(storm_of_reanchors)
{
	size_t size = tokenbucket_table_size(4096);
	void *mem = shared_anon(size);
	struct tokenbucket_table *t;
	const struct tokenbucket_limit lim = {16, 1, 3};
	ck_assert_int_eq(tokenbucket_table_init_shared_limit(&t, mem, size, &lim, 4096, 0), 0);
	struct tbt_mem *m = mem;
	ck_assert_int_eq(atomic_load(&m->regimes.slot[0].hspan), INT64_C(1) << 49);
	struct anchors *a = shared_anon(sizeof(*a));
	pid_t pids[SPROCS];
	for (int i = 0; i < SPROCS; i++) {
		pids[i] = fork();
		TBT_FORKED(pids[i]);
		if (pids[i] == 0)
			anchor_child(mem, size, a, (unsigned)i);
	}
	struct anchor_arg arg = {mem, size, a};
	int epochs = AEPOCHS / slowdown(), kills = 0;
	srand(99);
	for (int e = 1; e < epochs; e++) {
		atomic_store(&a->epoch, e);
		/* One kill, at once or a little later: inside the re-anchor or a take. */
		kills += storm_run(pids, SPROCS, &a->calls, 1, 5, (unsigned)rand(),
				   (unsigned)(SPROCS * 1000 * e), anchor_spawn, &arg);
		for (int i = 0; i < SPROCS; i++) {
			pids[i] = fork();
			TBT_FORKED(pids[i]);
			if (pids[i] == 0)
				anchor_child(mem, size, a, (unsigned)(SPROCS * 1000 * e + 500 + i));
		}
		long calls = atomic_load(&a->calls);
		while (atomic_load(&a->calls) < calls + 200)
			usleep(100);
	}
	for (int i = 0; i < SPROCS; i++) {
		kill(pids[i], SIGKILL);
		waitpid(pids[i], NULL, 0);
	}
	uint64_t regimes = atomic_load(&m->regimes.gen) / 2;
	fprintf(stderr, "table re-anchor storm: %d epochs, %d kills, %ld calls, %llu regimes\n",
		epochs, kills, atomic_load(&a->calls), (unsigned long long)regimes);
	ck_assert_uint_ge(regimes, (uint64_t)epochs / 2);
	for (int k = 0; k < AKEYS; k++) {
		uint64_t suffix = 0;
		for (int e = epochs - 1; e >= 0; e--) {
			suffix += atomic_load(&a->granted[e][k]);
			ck_assert_msg(suffix <= 3 * (uint64_t)(epochs - e),
				      "key %d: %llu granted from epoch %d of %d", k,
				      (unsigned long long)suffix, e, epochs);
		}
	}
	/* The table goes on: not frozen after a change, every key at most full. */
	ck_assert_int_eq(tokenbucket_table_set_limit_at(t, SEC + epochs * (INT64_C(1) << 49), &lim), 0);
	ck_assert_uint_eq(atomic_load(&m->regimes.gen) & 1, 0);
	for (uint64_t k = 0; k < AKEYS; k++)
		ck_assert(tokenbucket_table_tokens_at(t, SEC + epochs * (INT64_C(1) << 49), &k,
						      sizeof(k)) <= 3);
	tokenbucket_table_free(t);
	munmap(a, sizeof(*a));
	munmap(mem, size);
}
END_TEST

/* ---- The wait --------------------------------------------------------------- */

/* A change to rate 0 while a wait sleeps: it does not return at the old time_to_act. */
struct waiter {
	struct tokenbucket_table *t;
	int64_t deadline;
	int err;
};

static void *wait_thread(void *arg)
{
	struct waiter *w = arg;
	w->err = tokenbucket_table_wait(w->t, "w", 1, 1, w->deadline, -1);
	return NULL;
}

START_TEST(wait_sees_a_change)
{
	const struct tokenbucket_limit slow = {1, 1 * SEC, 1}, none = {0, 1, 1};
	struct waiter w = {.t = table_of(&slow, 64)};
	ck_assert(tokenbucket_table_allow(w.t, "w", 1, 1));
	/* The token was due in 1 s; the change to rate 0 comes long before. */
	w.deadline = tokenbucket_now() + 1500 * MS;
	pthread_t th;
	ck_assert_int_eq(pthread_create(&th, NULL, wait_thread, &w), 0);
	usleep(50000);
	ck_assert_int_eq(tokenbucket_table_set_limit(w.t, &none), 0);
	pthread_join(th, NULL);
	ck_assert_int_eq(w.err, -ETIMEDOUT);
	ck_assert_int_ge(tokenbucket_now(), w.deadline);
	/* Given back whole: the key is where it was, at 0 and a fraction. */
	double level = tokenbucket_table_tokens(w.t, "w", 1);
	ck_assert(level >= 0 && level < 1);
	/* And a change that speeds tokens up lets a wait end sooner than its deadline. */
	const struct tokenbucket_limit fast = {1, 10 * MS, 1};
	ck_assert_int_eq(tokenbucket_table_set_limit(w.t, &fast), 0);
	ck_assert_int_eq(tokenbucket_table_wait(w.t, "w", 1, 1, tokenbucket_now() + 5 * SEC, -1), 0);
	tokenbucket_table_free(w.t);
}
END_TEST

Suite *table_regime_suite(void)
{
	Suite *s = suite_create("table-regime");
	TCase *tc = tcase_create("exactness");
	tcase_set_timeout(tc, 120);
	tcase_add_loop_test(tc, exact_across_changes, 0, 12);
	tcase_add_test(tc, change_at_latest_clock);
	tcase_add_test(tc, raise_restores_nothing);
	tcase_add_test(tc, bad_changes);
	tcase_add_test(tc, dead_writer_finished);
	tcase_add_loop_test(tc, exact_across_reanchors, 0, 6);
	tcase_add_test(tc, dead_reanchor_finished);
	suite_add_tcase(s, tc);
	tc = tcase_create("threads");
	tcase_set_timeout(tc, 120);
	tcase_add_test(tc, threads_burst_changes);
	tcase_add_test(tc, threads_rate_changes);
	tcase_add_test(tc, wait_sees_a_change);
	suite_add_tcase(s, tc);
	tc = tcase_create("processes");
	tcase_set_timeout(tc, 120);
	tcase_add_test(tc, storm_of_changes);
	tcase_add_test(tc, storm_of_reanchors);
	suite_add_tcase(s, tc);
	return s;
}
