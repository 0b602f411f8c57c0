/* SPDX-License-Identifier: MIT */
/*
 * Many threads on one bucket, every kind of call mixed, for a bounded time
 * (about 2 s for the suite; TOKENBUCKET_STRESS_SECONDS runs longer).  Time is
 * a shared fake clock that only grows, passed as now, so that elapsed time is
 * exact.  The checks are invariants, never timings:
 *  - rate 0: what every taker gives back, the bucket gets back, exactly;
 *  - a rate: tokens granted never exceed burst + what the rate produced;
 *  - tickets are covered in order (compared while no rate change runs: one
 *    freezes production, so a read during it may count less than one before);
 *  - no call reports more than burst.
 * Shared counters are atomics, so the test is race-free under TSan.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "check_tb.h"

enum { THREADS = 8, HELD = 16 };

/* The whole suite's budget in ns, shared by its tests by weight. */
static int64_t budget(double share)
{
	const char *env = getenv("TOKENBUCKET_STRESS_SECONDS");
	double seconds = env ? atof(env) : 2.0;
	if (!(seconds > 0))
		seconds = 2.0;
	return (int64_t)(seconds * share * (double)SEC);
}

static uint64_t next_random(uint64_t *s)
{
	*s ^= *s << 13;
	*s ^= *s >> 7;
	*s ^= *s << 17;
	return *s;
}

struct stress {
	struct tokenbucket *tb;
	int64_t until;		 /* on tokenbucket_now() */
	uint64_t burst;		 /* the largest burst the bucket ever has */
	_Atomic int64_t clock;	 /* the fake clock; only grows */
	atomic_int_fast64_t net; /* granted minus given back */
	_Atomic int64_t latest_act; /* the latest time_to_act of a reservation kept */
	atomic_uint_fast64_t calls;
	atomic_int next_id;
	atomic_bool stop;	 /* writers stop once the takers are done */
	/* Rate changes begun and ended: while one runs, the head may read lower. */
	atomic_uint_fast64_t changes_begun, changes_ended;
	atomic_uint_fast64_t compared; /* sweeps of two or more tickets whose order was checked */
	bool writers;		 /* set_rate and set_burst run beside */
};

/* The fake clock moves on by 0 to 2 us at each call. */
static int64_t tick(struct stress *s, uint64_t *rnd)
{
	int64_t step = (int64_t)(next_random(rnd) % (2 * US + 1));
	return atomic_fetch_add(&s->clock, step) + step;
}

static void raise_to(_Atomic int64_t *v, int64_t x)
{
	int64_t seen = atomic_load(v);
	while (seen < x && !atomic_compare_exchange_weak(v, &seen, x))
		;
}

/* No call reports more than burst tokens. */
static void check_reported(struct stress *s, int64_t now)
{
	double tokens = tokenbucket_tokens_at(s->tb, now);
	ck_assert_msg(tokens <= (double)s->burst, "%g tokens, burst %llu", tokens,
		      (unsigned long long)s->burst);
}

/*
 * A thread's grabs not covered yet, oldest first.  Read newest to oldest,
 * deficiencies never grow: head only moves forward, so once a ticket is
 * covered every earlier one is.  Covered grabs leave, counted as granted.
 * They are never refunded uncovered: a give-back lands at the head and covers
 * the earliest tickets first, so giving back tokens still owed would let
 * other tickets be covered before their tokens were produced (the debt
 * stays, and is paid later by the rate).
 */
struct held {
	uint64_t ticket[HELD], n[HELD];
	int count;
};

static void hold(struct held *h, uint64_t ticket, uint64_t n)
{
	h->ticket[h->count] = ticket;
	h->n[h->count++] = n;
}

static void check_fifo(struct stress *s, struct held *h)
{
	uint64_t begun = atomic_load(&s->changes_begun);
	bool quiet = atomic_load(&s->changes_ended) == begun;
	uint64_t d[HELD];
	for (int i = h->count - 1; i >= 0; i--)
		d[i] = tokenbucket_deficiency(s->tb, h->ticket[i]);
	/*
	 * Compared only when no rate change overlapped the reads: a change
	 * freezes the regime, and readers count production up to the frozen
	 * time only, which may be earlier than a time an earlier read used.
	 */
	if (quiet && atomic_load(&s->changes_begun) == begun) {
		if (h->count > 1)
			atomic_fetch_add(&s->compared, 1);
		uint64_t newer = UINT64_MAX;
		for (int i = h->count - 1; i >= 0; i--) {
			ck_assert_msg(d[i] <= newer, "ticket %d short of %llu, a later one of %llu", i,
				      (unsigned long long)d[i], (unsigned long long)newer);
			newer = d[i];
		}
	}
	for (int i = h->count - 1; i > 0; i--)
		ck_assert_msg((int64_t)(h->ticket[i] - h->ticket[i - 1]) > 0, "tickets out of order");
	int covered = 0;
	while (covered < h->count && tokenbucket_deficiency(s->tb, h->ticket[covered]) == 0)
		atomic_fetch_add(&s->net, (int64_t)h->n[covered++]);
	for (int i = covered; i < h->count; i++) {
		h->ticket[i - covered] = h->ticket[i];
		h->n[i - covered] = h->n[i];
	}
	h->count -= covered;
}

/*
 * One call of the mix.  Without h (rate 0) every take is given back at once,
 * at time 0.  With h, what is kept counts in s->net, less what is given back;
 * only tokens that were there are given back.
 */
static void take_some(struct stress *s, uint64_t *rnd, struct held *h)
{
	struct tokenbucket *tb = s->tb;
	bool conserve = h == NULL;
	uint64_t r = next_random(rnd);
	uint64_t n = 1 + r % 5;
	bool give_back = conserve || (r & 0x10000);
	int64_t now = conserve ? 0 : tick(s, rnd);
	struct tokenbucket_reservation res;
	switch ((r >> 8) % 8) {
	case 0:
		if (!tokenbucket_allow_at(tb, now, n))
			break;
		if (give_back)
			tokenbucket_refund(tb, n);
		else
			atomic_fetch_add(&s->net, (int64_t)n);
		break;
	case 1: {
		/* Kept, up to 50 us ahead (only what is there while writers change the rate). */
		int64_t max_wait = conserve ? TOKENBUCKET_NEVER : s->writers ? 0 : 50 * US;
		if (tokenbucket_reserve_at(tb, now, n, max_wait, &res) != 0)
			break;
		ck_assert_uint_le(res.tokens, s->burst);
		if (conserve) {
			tokenbucket_cancel_at(tb, &res, now);
		} else {
			atomic_fetch_add(&s->net, (int64_t)n);
			raise_to(&s->latest_act, res.time_to_act);
		}
		break;
	}
	case 2:
		if (!conserve && h->count == HELD)
			break;
		uint64_t t = tokenbucket_grab(tb, n);
		if (conserve)
			tokenbucket_refund(tb, n);
		else
			hold(h, t, n);
		break;
	case 3:
		tokenbucket_replenish(tb, now);
		break;
	case 4:
		check_reported(s, now);
		break;
	case 5:
		if (!conserve)
			check_fifo(s, h);
		break;
	default:
		/*
		 * Reserve and cancel.  At rate 0, into debt and back.  Otherwise
		 * only tokens that are there (max_wait 0); a cancel that comes too
		 * late gives back nothing, and the count, less n, stays below.
		 */
		if (tokenbucket_reserve_at(tb, now, n, conserve ? TOKENBUCKET_NEVER : 0, &res) != 0)
			break;
		ck_assert_uint_le(res.tokens, s->burst);
		tokenbucket_cancel_at(tb, &res, now);
		ck_assert_uint_eq(res.tokens, 0);
		break;
	}
	atomic_fetch_add_explicit(&s->calls, 1, memory_order_relaxed);
}

static void *taker(void *arg)
{
	struct stress *s = arg;
	int id = atomic_fetch_add(&s->next_id, 1);
	uint64_t rnd = 0x9e3779b97f4a7c15u * (uint64_t)(id + 1);
	struct held h = { .count = 0 };
	while (tokenbucket_now() < s->until)
		for (int i = 0; i < 64; i++)
			take_some(s, &rnd, &h);
	/* Grabs still held are granted once the rate covers them (see settle). */
	check_fifo(s, &h);
	for (int i = 0; i < h.count; i++)
		atomic_fetch_add(&s->net, (int64_t)h.n[i]);
	return NULL;
}

/*
 * Once the threads are done: the fake time by which the rate has covered
 * every ticket (the grabs still held and the reservations kept), at the rate
 * now in force.
 */
static int64_t settle(struct stress *s)
{
	int64_t end = atomic_load(&s->clock);
	for (int i = 0; i < 100; i++) {
		uint64_t missing = tokenbucket_deficiency(s->tb, tokenbucket_grab(s->tb, 0));
		if (missing == 0)
			break;
		int64_t need = tokenbucket_duration_for(s->tb, missing);
		ck_assert_int_lt(need, SEC);
		end += need;
		tokenbucket_replenish(s->tb, end);
	}
	ck_assert_uint_eq(tokenbucket_deficiency(s->tb, tokenbucket_grab(s->tb, 0)), 0);
	int64_t act = atomic_load(&s->latest_act);
	return act > end ? act : end;
}

/* Every taker gives back what it took, all at time 0. */
static void *conserver(void *arg)
{
	struct stress *s = arg;
	int id = atomic_fetch_add(&s->next_id, 1);
	uint64_t rnd = 0x2545f4914f6cdd1du * (uint64_t)(id + 1);
	while (tokenbucket_now() < s->until)
		for (int i = 0; i < 64; i++) {
			take_some(s, &rnd, NULL);
			/* Never above where it started, whatever is out at the moment. */
			ck_assert_double_le(tokenbucket_tokens_at(s->tb, 0), 990);
		}
	return NULL;
}

/* set_rate and set_burst on the fake clock, among finite rates and bursts up to s->burst. */
static void *writer(void *arg)
{
	struct stress *s = arg;
	uint64_t rnd = 0x853c49e6748fea9bu;
	static const double rates[] = { 0, 50000, 100000, 200000 };
	while (!atomic_load(&s->stop)) {
		uint64_t r = next_random(&rnd);
		int64_t now = tick(s, &rnd);
		if (r & 1) {
			atomic_fetch_add(&s->changes_begun, 1);
			ck_assert_int_eq(tokenbucket_set_rate_at(s->tb, now, rates[(r >> 1) % 4]), 0);
			atomic_fetch_add(&s->changes_ended, 1);
		} else
			ck_assert_int_eq(tokenbucket_set_burst_at(s->tb, now, (r >> 1) % (s->burst + 1)),
					 0);
		check_reported(s, now);
	}
	return NULL;
}

static void run(struct stress *s, void *(*fn)(void *), int writers)
{
	pthread_t t[THREADS];
	for (int i = 0; i < THREADS; i++)
		ck_assert_int_eq(pthread_create(&t[i], NULL, i < writers ? writer : fn, s), 0);
	for (int i = writers; i < THREADS; i++)
		pthread_join(t[i], NULL);
	atomic_store(&s->stop, true);
	for (int i = 0; i < writers; i++)
		pthread_join(t[i], NULL);
	ck_assert_uint_gt(atomic_load(&s->calls), 1000);
}

START_TEST(rate_zero_conserves_tokens)
{
	struct stress s = { .burst = 1000 };
	s.tb = bucket_rate(0, 1000, 0);
	ck_assert(tokenbucket_allow_at(s.tb, 0, 10)); /* 990: a give-back beyond would show */
	s.until = tokenbucket_now() + budget(0.25);
	run(&s, conserver, 0);
	ck_assert_tokens(tokenbucket_tokens_at(s.tb, 0), 990);
	/* The rovers agree: head is exactly 990 ahead of tail. */
	uint64_t tail = tokenbucket_grab(s.tb, 0);
	ck_assert_uint_eq(tokenbucket_deficiency(s.tb, tail + 990), 0);
	ck_assert_uint_eq(tokenbucket_deficiency(s.tb, tail + 991), 1);
	tokenbucket_free(s.tb);
}
END_TEST

/*
 * A token every 10 us of fake time, burst 50.  What was granted (allowed,
 * reserved and kept, grabbed and covered, less what was given back) is at
 * most burst + what the rate produced by the time every ticket is covered.
 * Given-back tokens are subtracted even when a cancel came too late to
 * return them, which only makes the count smaller.
 */
START_TEST(granted_never_exceeds_burst_plus_production)
{
	struct stress s = { .burst = 50 };
	s.tb = bucket_every(1, 10 * US, 50, 0);
	ck_assert_int_eq(tokenbucket_reset_at(s.tb, 0, 50), 0);
	s.until = tokenbucket_now() + budget(0.35);
	run(&s, taker, 0);
	int64_t end = settle(&s);
	int64_t limit = 50 + end / (10 * US);
	int64_t net = atomic_load(&s.net);
	ck_assert_msg(net <= limit, "granted %lld > %lld", (long long)net, (long long)limit);
	ck_assert_int_gt(net, 50); /* the mix did grant */
	ck_assert_uint_gt(atomic_load(&s.compared), 10);
	check_reported(&s, end);
	tokenbucket_free(s.tb);
}
END_TEST

/*
 * Rate and burst change while the takers run (finite rates, bursts up to 50).
 * Changes never invent tokens, so the grants stay within the largest burst
 * plus the largest rate, 200 000 per second, over the whole time; the debt
 * left is then paid at that rate.  Reservations only take what is there
 * (max_wait 0), since a rate lowered later would delay the rest.
 */
START_TEST(writers_change_rate_and_burst)
{
	struct stress s = { .burst = 50, .writers = true };
	s.tb = bucket_every(1, 10 * US, 50, 0);
	ck_assert_int_eq(tokenbucket_reset_at(s.tb, 0, 50), 0);
	s.until = tokenbucket_now() + budget(0.4);
	run(&s, taker, 2);
	ck_assert_int_eq(tokenbucket_set_rate_at(s.tb, atomic_load(&s.clock), 200000), 0);
	int64_t end = settle(&s);
	int64_t limit = 50 + end / (5 * US);
	int64_t net = atomic_load(&s.net);
	ck_assert_msg(net <= limit, "granted %lld > %lld", (long long)net, (long long)limit);
	ck_assert_uint_gt(atomic_load(&s.compared), 10); /* the order was checked between changes */
	/* Quiet again: the level is within the burst now in force. */
	ck_assert_double_le(tokenbucket_tokens_at(s.tb, end), (double)tokenbucket_burst(s.tb));
	ck_assert_int_eq(tokenbucket_set_rate_at(s.tb, end, 0), 0);
	ck_assert_int_eq(tokenbucket_set_burst_at(s.tb, end, 7), 0);
	ck_assert_double_le(tokenbucket_tokens_at(s.tb, end), 7);
	tokenbucket_free(s.tb);
}
END_TEST

Suite *stress_suite(void)
{
	Suite *s = suite_create("stress");
	TCase *tc = tcase_create("threads");
	/* Check's timeout bounds a run; scaled with TOKENBUCKET_STRESS_SECONDS. */
	tcase_set_timeout(tc, 60 + budget(1) / SEC * 2);
	tcase_add_test(tc, rate_zero_conserves_tokens);
	tcase_add_test(tc, granted_never_exceeds_burst_plus_production);
	tcase_add_test(tc, writers_change_rate_and_burst);
	suite_add_tcase(s, tc);
	return s;
}
