/* SPDX-License-Identifier: MIT */
/*
 * The worked examples the library grew from: TB(1/3 packet per ms, 4) with
 * its three arrival scenarios and token table, and the shared-token-bucket
 * dispatch loop run with real threads and a replenishing timer.
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>

#include "check_tb.h"

/* TB(1/3 packet/ms, 4): one token every 3 ms, four at most, full at first. */
static struct tokenbucket *seed_bucket(void)
{
	return bucket_every(1, 3 * MS, 4, 0);
}

START_TEST(scenario_late_packets_conform)
{
	struct tokenbucket *tb = seed_bucket();
	const int64_t arrivals[] = { 0, 0, 0, 2, 3, 6, 9, 12 };
	for (unsigned i = 0; i < sizeof(arrivals) / sizeof(arrivals[0]); i++)
		ck_assert_msg(tokenbucket_allow_at(tb, arrivals[i] * MS, 1), "packet %u at %lld ms", i,
			      (long long)arrivals[i]);
	/* After the three at T=0 one token is left; at T=2 it is 1 + 2/3. */
	tokenbucket_reset_at(tb, 0, 4);
	for (int i = 0; i < 3; i++)
		ck_assert(tokenbucket_allow_at(tb, 0, 1));
	ck_assert_tokens(tokenbucket_tokens_at(tb, 0), 1);
	ck_assert_tokens(tokenbucket_tokens_at(tb, 2 * MS), 1 + 2.0 / 3);
	ck_assert(tokenbucket_allow_at(tb, 2 * MS, 1));
	ck_assert_tokens(tokenbucket_tokens_at(tb, 2 * MS), 2.0 / 3);
	ck_assert_tokens(tokenbucket_tokens_at(tb, 3 * MS), 1);
	ck_assert(tokenbucket_allow_at(tb, 3 * MS, 1));
	ck_assert_tokens(tokenbucket_tokens_at(tb, 3 * MS), 0);
	tokenbucket_free(tb);
}
END_TEST

START_TEST(scenario_bursts_of_four_conform)
{
	struct tokenbucket *tb = seed_bucket();
	for (int64_t t = 0; t <= 24; t += 12) {
		for (int i = 0; i < 4; i++)
			ck_assert_msg(tokenbucket_allow_at(tb, t * MS, 1), "packet %d at %lld ms", i,
				      (long long)t);
		ck_assert_tokens(tokenbucket_tokens_at(tb, t * MS), 0);
		ck_assert(!tokenbucket_allow_at(tb, t * MS, 1));
	}
	tokenbucket_free(tb);
}
END_TEST

START_TEST(scenario_every_ms_does_not_conform)
{
	struct tokenbucket *tb = seed_bucket();
	/* The seed's table: tokens before and after each arrival, in thirds. */
	const double before[] = { 4, 3 + 1.0 / 3, 2 + 2.0 / 3, 2, 1 + 1.0 / 3, 2.0 / 3 };
	const double after[] = { 3, 2 + 1.0 / 3, 1 + 2.0 / 3, 1, 1.0 / 3, 2.0 / 3 };
	for (int t = 0; t <= 5; t++) {
		ck_assert_tokens(tokenbucket_tokens_at(tb, t * MS), before[t]);
		bool sent = tokenbucket_allow_at(tb, t * MS, 1);
		ck_assert_msg(sent == (t < 5), "packet at %d ms: sent=%d", t, sent);
		ck_assert_tokens(tokenbucket_tokens_at(tb, t * MS), after[t]);
	}
	tokenbucket_free(tb);
}
END_TEST

/* ---- The dispatch loop of the shared token bucket, with threads ---------- */

struct dispatch {
	struct tokenbucket *tb;
	int per_thread;
	uint64_t cost;
	bool capped;
	atomic_int in_flight;
	atomic_int max_in_flight;
	atomic_uint_fast64_t dispatched;
	atomic_bool done;
};

static void *dispatcher(void *arg)
{
	struct dispatch *d = arg;
	for (int i = 0; i < d->per_thread; i++) {
		uint64_t t = tokenbucket_grab(d->tb, d->cost);
		while (tokenbucket_deficiency(d->tb, t))
			sched_yield();
		/* dispatch(): count what is in flight, then complete it. */
		int now = atomic_fetch_add(&d->in_flight, (int)d->cost) + (int)d->cost;
		int seen = atomic_load(&d->max_in_flight);
		while (now > seen && !atomic_compare_exchange_weak(&d->max_in_flight, &seen, now))
			;
		atomic_fetch_add(&d->dispatched, d->cost);
		sched_yield();
		atomic_fetch_sub(&d->in_flight, (int)d->cost);
		if (d->capped)
			ck_assert_int_eq(tokenbucket_release(d->tb, d->cost), 0);
	}
	return NULL;
}

static void *replenisher(void *arg)
{
	struct dispatch *d = arg;
	const struct timespec tick = { 0, 100 * 1000 };
	while (!atomic_load(&d->done)) {
		tokenbucket_replenish(d->tb, tokenbucket_now());
		nanosleep(&tick, NULL);
	}
	return NULL;
}

static void run_dispatch(bool capped)
{
	enum { THREADS = 3, BURST = 8 };
	struct dispatch d = { .per_thread = 400, .cost = 2, .capped = capped };
	/* 200 000 tokens per second: 2400 tokens take at least about 12 ms. */
	d.tb = bucket_every(1, 5 * US, BURST, capped ? TOKENBUCKET_CAPPED_RELEASE : 0);
	int64_t start = tokenbucket_now();
	tokenbucket_replenish(d.tb, start); /* fixes the bucket's clock */
	pthread_t workers[THREADS], timer;
	ck_assert_int_eq(pthread_create(&timer, NULL, replenisher, &d), 0);
	for (int i = 0; i < THREADS; i++)
		ck_assert_int_eq(pthread_create(&workers[i], NULL, dispatcher, &d), 0);
	for (int i = 0; i < THREADS; i++)
		pthread_join(workers[i], NULL);
	int64_t end = tokenbucket_now();
	atomic_store(&d.done, true);
	pthread_join(timer, NULL);

	uint64_t total = (uint64_t)THREADS * d.per_thread * d.cost;
	ck_assert_uint_eq(atomic_load(&d.dispatched), total);
	/* The rate was kept: no more than burst + what time produced. */
	uint64_t produced = (uint64_t)((end - start) / (5 * US));
	ck_assert_msg(total <= BURST + produced, "dispatched %llu > %d + %llu", (unsigned long long)total,
		      BURST, (unsigned long long)produced);
	/* Capped release: never more in flight than the bucket holds. */
	if (capped)
		ck_assert_int_le(atomic_load(&d.max_in_flight), BURST);
	tokenbucket_free(d.tb);
}

START_TEST(dispatch_loop_uncapped)
{
	run_dispatch(false);
}
END_TEST

START_TEST(dispatch_loop_capped_release)
{
	run_dispatch(true);
}
END_TEST

Suite *seeds_suite(void)
{
	Suite *s = suite_create("seeds");
	TCase *tc = tcase_create("token-bucket-examples");
	tcase_add_test(tc, scenario_late_packets_conform);
	tcase_add_test(tc, scenario_bursts_of_four_conform);
	tcase_add_test(tc, scenario_every_ms_does_not_conform);
	suite_add_tcase(s, tc);
	tc = tcase_create("dispatch-loop");
	tcase_set_timeout(tc, 30);
	tcase_add_test(tc, dispatch_loop_uncapped);
	tcase_add_test(tc, dispatch_loop_capped_release);
	suite_add_tcase(s, tc);
	return s;
}
