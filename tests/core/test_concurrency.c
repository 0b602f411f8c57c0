/* SPDX-License-Identifier: MIT */
/*
 * Threads hammering one bucket.  The invariants are hard bounds, not timings:
 * no more is granted than burst + what the rate produced; with rate 0 tokens
 * are conserved exactly; tickets are distinct and dense (FIFO).
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "check_tb.h"

enum { THREADS = 4 };

struct hammer {
	struct tokenbucket *tb;
	int64_t until;
	atomic_uint_fast64_t granted;
	int iterations;
	uint64_t *tickets; /* THREADS * iterations, for the FIFO test */
	atomic_int next_slot;
	atomic_bool stop;
};

static void *allow_loop(void *arg)
{
	struct hammer *h = arg;
	uint64_t mine = 0;
	while (tokenbucket_now() < h->until)
		for (int i = 0; i < 64; i++) {
			uint64_t n = 1 + (uint64_t)(i & 1);
			mine += tokenbucket_allow(h->tb, n) ? n : 0;
		}
	atomic_fetch_add(&h->granted, mine);
	return NULL;
}

static void *reserve_loop(void *arg)
{
	struct hammer *h = arg;
	uint64_t mine = 0;
	struct tokenbucket_reservation r;
	while (tokenbucket_now() < h->until) {
		if (tokenbucket_reserve(h->tb, 1, 0, &r) == 0)
			mine++;
		/*
		 * A grab is granted once its ticket is covered; wait for that as a
		 * dispatch loop would.  (Refunding an uncovered grab instead would
		 * move head and cover earlier tickets with tokens not yet produced,
		 * a debt the bound below would have to allow for.)
		 */
		uint64_t t = tokenbucket_grab(h->tb, 1);
		while (tokenbucket_deficiency(h->tb, t) != 0)
			tokenbucket_replenish(h->tb, tokenbucket_now());
		mine++;
	}
	atomic_fetch_add(&h->granted, mine);
	return NULL;
}

static void run_threads(void *(*fn)(void *), void *arg, int n)
{
	pthread_t t[8];
	for (int i = 0; i < n; i++)
		ck_assert_int_eq(pthread_create(&t[i], NULL, fn, arg), 0);
	for (int i = 0; i < n; i++)
		pthread_join(t[i], NULL);
}

/* No more than burst + floor(elapsed * rate): 100 000 tokens per second, burst 50. */
static void check_rate_bound(void *(*fn)(void *))
{
	struct hammer h = { 0 };
	h.tb = bucket_every(1, 10 * US, 50, 0);
	int64_t start = tokenbucket_now();
	ck_assert_tokens(tokenbucket_tokens_at(h.tb, start), 50); /* fixes the clock at start */
	h.until = start + 150 * MS;
	run_threads(fn, &h, THREADS);
	int64_t end = tokenbucket_now();
	uint64_t limit = 50 + (uint64_t)((end - start) / (10 * US));
	uint64_t granted = atomic_load(&h.granted);
	ck_assert_msg(granted <= limit, "granted %llu > limit %llu", (unsigned long long)granted,
		      (unsigned long long)limit);
	/* And the bucket never held more than burst. */
	ck_assert_double_le(tokenbucket_tokens_at(h.tb, end), 50);
	tokenbucket_free(h.tb);
}

START_TEST(allow_never_exceeds_the_rate)
{
	check_rate_bound(allow_loop);
}
END_TEST

START_TEST(reserve_and_grab_never_exceed_the_rate)
{
	check_rate_bound(reserve_loop);
}
END_TEST

/*
 * Rate 0: every taker gives back what it took; the bucket ends exactly as it
 * began.  All at one time, so that no cancel comes after its time_to_act.
 */
static void *conserve_loop(void *arg)
{
	struct hammer *h = arg;
	struct tokenbucket_reservation r;
	for (int i = 0; i < h->iterations; i++) {
		uint64_t n = 1 + (uint64_t)(i % 7);
		switch (i % 4) {
		case 0:
			if (tokenbucket_allow_at(h->tb, 0, n))
				tokenbucket_refund(h->tb, n);
			break;
		case 1:
			ck_assert_int_eq(tokenbucket_reserve_at(h->tb, 0, n, TOKENBUCKET_NEVER, &r), 0);
			tokenbucket_cancel_at(h->tb, &r, 0);
			break;
		case 2:
			tokenbucket_grab(h->tb, n);
			tokenbucket_refund(h->tb, n);
			break;
		default:
			tokenbucket_replenish(h->tb, 0);
			ck_assert_double_le(tokenbucket_tokens_at(h->tb, 0), 1000);
			break;
		}
	}
	return NULL;
}

START_TEST(rate_zero_conserves_tokens)
{
	struct hammer h = { .iterations = 100000 };
	h.tb = bucket_rate(0, 1000, 0);
	ck_assert(tokenbucket_allow_at(h.tb, 0, 10)); /* start below burst: 990 */
	run_threads(conserve_loop, &h, THREADS);
	ck_assert_tokens(tokenbucket_tokens_at(h.tb, 0), 990);
	tokenbucket_free(h.tb);
}
END_TEST

static void *ticket_loop(void *arg)
{
	struct hammer *h = arg;
	for (int i = 0; i < h->iterations; i++) {
		uint64_t t = tokenbucket_grab(h->tb, 1);
		h->tickets[atomic_fetch_add(&h->next_slot, 1)] = t;
	}
	return NULL;
}

static int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return (x > y) - (x < y);
}

START_TEST(tickets_are_distinct_and_covered_in_order)
{
	struct hammer h = { .iterations = 50000 };
	const uint64_t total = (uint64_t)THREADS * h.iterations;
	h.tb = bucket_rate(0, 100, 0);
	h.tickets = calloc(total, sizeof(uint64_t));
	ck_assert_ptr_nonnull(h.tickets);
	uint64_t first = tokenbucket_grab(h.tb, 0);
	run_threads(ticket_loop, &h, THREADS);
	qsort(h.tickets, total, sizeof(uint64_t), cmp_u64);
	for (uint64_t i = 0; i < total; i++)
		ck_assert_uint_eq(h.tickets[i], first + i + 1);
	/* Covered in order: exactly the first 100 tickets are. */
	for (uint64_t i = 0; i < total; i += 997)
		ck_assert_uint_eq(tokenbucket_deficiency(h.tb, h.tickets[i]), i < 100 ? 0 : i + 1 - 100);
	free(h.tickets);
	tokenbucket_free(h.tb);
}
END_TEST

/* Writers change rate and burst while takers run; the bound uses the largest of each. */
static void *writer_loop(void *arg)
{
	struct hammer *h = arg;
	for (int i = 0; !atomic_load(&h->stop); i++) {
		ck_assert_int_eq(tokenbucket_set_rate(h->tb, (i & 1) ? 50000 : 100000), 0);
		ck_assert_int_eq(tokenbucket_set_burst(h->tb, (i & 2) ? 20 : 50), 0);
	}
	return NULL;
}

static void *mixed_loop(void *arg)
{
	return (tokenbucket_now() & 1) ? allow_loop(arg) : reserve_loop(arg);
}

START_TEST(writers_beside_takers)
{
	struct hammer h = { 0 };
	h.tb = bucket_rate(100000, 50, 0);
	int64_t start = tokenbucket_now();
	tokenbucket_replenish(h.tb, start);
	h.until = start + 150 * MS;
	pthread_t w;
	ck_assert_int_eq(pthread_create(&w, NULL, writer_loop, &h), 0);
	run_threads(mixed_loop, &h, THREADS - 1);
	atomic_store(&h.stop, true);
	pthread_join(w, NULL);
	int64_t end = tokenbucket_now();
	uint64_t limit = 50 + (uint64_t)((end - start) / (10 * US));
	ck_assert_uint_le(atomic_load(&h.granted), limit);
	ck_assert_double_le(tokenbucket_tokens(h.tb), 50);
	tokenbucket_free(h.tb);
}
END_TEST

Suite *concurrency_suite(void)
{
	Suite *s = suite_create("concurrency");
	TCase *tc = tcase_create("hammer");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, allow_never_exceeds_the_rate);
	tcase_add_test(tc, reserve_and_grab_never_exceed_the_rate);
	tcase_add_test(tc, rate_zero_conserves_tokens);
	tcase_add_test(tc, tickets_are_distinct_and_covered_in_order);
	tcase_add_test(tc, writers_beside_takers);
	suite_add_tcase(s, tc);
	return s;
}
