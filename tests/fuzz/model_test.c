/* SPDX-License-Identifier: MIT */
/*
 * Unit tests of the reference model alone, on hand-computed cases (most of
 * them the worked examples of the manual pages), so that a divergence found
 * by the fuzzer can be blamed on the library with some confidence.
 */
#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdio.h>

#include "model.h"

#define MS INT64_C(1000000)
#define S INT64_C(1000000000)

static int failures;

#define CHECK(cond)                                                              \
	do {                                                                     \
		if (!(cond)) {                                                   \
			fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, #cond); \
			failures++;                                              \
		}                                                                \
	} while (0)

#define CHECK_EQ(a, b)                                                           \
	do {                                                                     \
		long double a_ = (a), b_ = (b);                                  \
		if (a_ != b_) {                                                  \
			fprintf(stderr, "%s:%d: %s == %s: %.20Lg != %.20Lg\n",  \
				__FILE__, __LINE__, #a, #b, a_, b_);            \
			failures++;                                              \
		}                                                                \
	} while (0)

static struct model *every(uint64_t tokens, int64_t period, uint64_t burst, unsigned flags)
{
	struct model *m = NULL;
	int err = model_create_every(&m, tokens, period, burst, flags);
	CHECK(err == 0);
	return m;
}

static void test_ratios(void)
{
	uint64_t p, q;
	CHECK(model_ratio_from_rate(3.0, &p, &q) == MODEL_FINITE);
	CHECK_EQ(p, 3);
	CHECK_EQ(q, 1000000000);
	model_ratio_from_rate(0.1, &p, &q); /* one token every 10 s */
	CHECK_EQ(p, 1);
	CHECK_EQ(q, 10000000000);
	model_ratio_from_rate(300.0, &p, &q); /* 3 every 10^7 ns */
	CHECK_EQ(p, 3);
	CHECK_EQ(q, 10000000);
	model_ratio_from_rate(1e9 / 3, &p, &q); /* one every 3 ns */
	CHECK_EQ(p, 1);
	CHECK_EQ(q, 3);
	model_ratio_from_rate(1000.0, &p, &q);
	CHECK_EQ(p, 1);
	CHECK_EQ(q, 1000000);
	CHECK(model_ratio_from_rate(0.0, &p, &q) == MODEL_ZERO);
	CHECK(model_ratio_from_rate(-0.0, &p, &q) == MODEL_ZERO);
	CHECK(model_ratio_from_rate(INFINITY, &p, &q) == MODEL_INF);
	CHECK(model_ratio_from_rate(DBL_MAX, &p, &q) == MODEL_INF);
	CHECK(model_ratio_from_rate(1e-12, &p, &q) == MODEL_FINITE);
	CHECK_EQ(p, 1);
	CHECK_EQ(q, INT64_MAX);
	CHECK(model_ratio_from_rate(1e30, &p, &q) == MODEL_FINITE);
	CHECK_EQ(p, UINT64_MAX);
	CHECK_EQ(q, 1);
	/* Every convergent chosen reads back as the rate for ordinary rates. */
	for (int i = 1; i < 2000; i++) {
		double r = i * 7.25;
		model_ratio_from_rate(r, &p, &q);
		CHECK((double)((long double)p * 1e9L / (long double)q) == r);
	}

	struct model *m = NULL;
	CHECK(model_create(&m, 300.0, 5, 0) == 0);
	CHECK_EQ(model_rate(m), 300.0);
	CHECK_EQ(model_duration_for(m, 1), 3333334); /* ceil(1e7 / 3) */
	CHECK_EQ(model_duration_for(m, 0), 0);
	model_free(m);
}

static void test_create_errors(void)
{
	struct model *m = NULL;
	CHECK(model_create(NULL, 1.0, 1, 0) == -EINVAL);
	CHECK(model_create(&m, NAN, 1, 0) == -EINVAL);
	CHECK(model_create(&m, -1.0, 1, 0) == -EINVAL);
	CHECK(model_create(&m, -INFINITY, 1, 0) == -EINVAL);
	CHECK(model_create(&m, 1.0, 1, 2) == -EINVAL);
	CHECK(model_create(&m, 1.0, TOKENBUCKET_BURST_MAX + 1, 0) == -ERANGE);
	CHECK(model_create_every(&m, 1, 0, 1, 0) == -EINVAL);
	CHECK(model_create_every(&m, 1, -5, 1, 0) == -EINVAL);
	CHECK(m == NULL);
	CHECK(model_create_every(&m, 0, -5, 1, 0) == 0); /* tokens 0: rate 0 */
	CHECK_EQ(model_rate(m), 0);
	CHECK_EQ(model_duration_for(m, 1), TOKENBUCKET_NEVER);
	CHECK(model_release(m, 1) == -ENOTSUP);
	CHECK(model_set_threshold(m, 0) == -EINVAL);
	CHECK(model_set_threshold(m, 2) == -EINVAL);
	CHECK(model_set_threshold(m, 1) == 0);
	CHECK(model_reset_at(m, 0, 2) == -EINVAL);
	CHECK(model_set_burst_at(m, 0, TOKENBUCKET_BURST_MAX + 1) == -ERANGE);
	CHECK(model_set_rate_at(m, 0, NAN) == -EINVAL);
	CHECK(model_set_rate_every_at(m, 0, 1, 0) == -EINVAL);
	model_free(m);
}

/* tokenbucket_allow(3): 3 per second, burst 2, a request every 100 ms. */
static void test_allow_example(void)
{
	struct model *m = NULL;
	CHECK(model_create(&m, 3.0, 2, 0) == 0);
	const bool want[10] = { 1, 1, 0, 0, 1, 0, 0, 1, 0, 0 };
	int64_t start = 123456789;
	for (int i = 0; i < 10; i++)
		CHECK(model_allow_at(m, start + i * 100 * MS, 1) == want[i]);
	model_free(m);
}

static void test_allow_rules(void)
{
	struct model *m = every(1, MS, 5, 0);
	for (int i = 0; i < 5; i++)
		CHECK(model_allow_at(m, 0, 1));
	CHECK(!model_allow_at(m, 0, 1));
	CHECK(!model_allow_at(m, MS - 1, 1));
	CHECK(model_allow_at(m, MS, 1));
	CHECK(!model_allow_at(m, 0, 1)); /* earlier: read as 1 ms */
	CHECK(model_allow_at(m, 4 * MS, 3));
	CHECK(!model_allow_at(m, 4 * MS, 6)); /* more than burst */
	CHECK(model_allow_at(m, 4 * MS, 0));
	model_grab(m, 1);
	CHECK(!model_allow_at(m, 4 * MS, 0)); /* n = 0 is false in debt, as in Go */
	model_free(m);
}

/* tokenbucket_cancel(3)'s example, and conservation. */
static void test_debt_and_cancel(void)
{
	struct model *m = every(1, MS, 10, 0);
	struct tokenbucket_reservation a, b;
	CHECK(model_reset_at(m, 0, 4) == 0);
	CHECK_EQ(model_tokens_at(m, 0), 4.0);
	CHECK(model_reserve_at(m, 0, 6, TOKENBUCKET_NEVER, &a) == 0);
	CHECK(model_reserve_at(m, 0, 3, TOKENBUCKET_NEVER, &b) == 0);
	CHECK_EQ(model_tokens_at(m, 0), -5.0);
	CHECK_EQ(a.time_to_act, 2 * MS);
	CHECK_EQ(b.time_to_act, 5 * MS);
	CHECK_EQ(a.tokens, 6);
	CHECK_EQ(b.ticket - a.ticket, 3);
	model_cancel_at(m, &a, MS);
	CHECK_EQ(a.tokens, 0);
	CHECK_EQ(model_tokens_at(m, MS), 2.0);
	CHECK_EQ(model_deficiency(m, b.ticket), 0);
	model_cancel_at(m, &b, MS);
	CHECK_EQ(model_tokens_at(m, MS), 5.0);
	model_cancel_at(m, &b, MS);
	CHECK_EQ(model_tokens_at(m, MS), 5.0);
	CHECK(model_reserve_at(m, MS, 7, TOKENBUCKET_NEVER, &a) == 0);
	CHECK_EQ(model_tokens_at(m, MS), -2.0);
	CHECK_EQ(a.time_to_act, 3 * MS);
	model_cancel_at(m, &a, 3 * MS + 1); /* too late: the tokens were used */
	CHECK_EQ(model_tokens_at(m, 3 * MS + 1), (double)(1.0L / 1000000));
	model_free(m);

	/* Interleaved reserve/cancel leaves the bucket as it was. */
	m = every(2, 7 * MS, 8, 0);
	CHECK(model_reset_at(m, 0, 0) == 0);
	struct tokenbucket_reservation r[4];
	for (int i = 0; i < 4; i++)
		CHECK(model_reserve_at(m, i * MS, 3, TOKENBUCKET_NEVER, &r[i]) == 0);
	model_cancel_at(m, &r[2], 4 * MS);
	model_cancel_at(m, &r[0], 4 * MS);
	model_cancel_at(m, &r[3], 4 * MS);
	model_cancel_at(m, &r[1], 4 * MS);
	/* All 12 back; 8/7 produced by 4 ms: one credited, 1/7 pending. */
	CHECK_EQ(model_tokens_at(m, 4 * MS), (double)(1.0L + 1.0L / 7));
	model_free(m);

	/* Limits: E2BIG, ETIMEDOUT, EOVERFLOW, and the grab bound. */
	m = every(1, S, TOKENBUCKET_BURST_MAX, 0);
	CHECK(model_reset_at(m, 0, 0) == 0);
	struct tokenbucket_reservation keep = { 1, 2, 3, 4 };
	CHECK(model_reserve_at(m, 0, TOKENBUCKET_BURST_MAX + 1, TOKENBUCKET_NEVER, &keep) == -E2BIG);
	CHECK(model_reserve_at(m, 0, 1, S - 1, &keep) == -ETIMEDOUT);
	CHECK(model_reserve_at(m, 0, 0, -1, &keep) == -ETIMEDOUT);
	CHECK(model_reserve_at(m, 0, TOKENBUCKET_BURST_MAX, TOKENBUCKET_NEVER, &keep) == -EOVERFLOW);
	CHECK(keep.time_to_act == 1 && keep.tokens == 2 && keep.ticket == 3 && keep.reserved == 4);
	CHECK(model_reserve_at(m, 0, 1, S, &a) == 0);
	CHECK_EQ(a.time_to_act, S);
	uint64_t t0 = model_grab(m, 0), t = model_grab(m, UINT64_MAX);
	CHECK_EQ(t - t0, TOKENBUCKET_DEBT_MAX - 1);
	CHECK_EQ(model_grab(m, 1), t);
	CHECK_EQ(model_deficiency(m, t), TOKENBUCKET_DEBT_MAX);
	CHECK(model_reserve_at(m, 0, 0, TOKENBUCKET_NEVER, &a) == 0);
	/* Debt 2^62 - 1 at one token per second is beyond INT64_MAX ns. */
	CHECK_EQ(a.time_to_act, TOKENBUCKET_NEVER);
	model_free(m);

	/* Rate 0: a reservation not covered is never there. */
	m = every(0, 1, 3, 0);
	CHECK(model_reserve_at(m, 5, 2, 0, &a) == 0);
	CHECK(model_reserve_at(m, 5, 2, S, &b) == -ETIMEDOUT);
	CHECK(model_reserve_at(m, 5, 2, TOKENBUCKET_NEVER, &b) == 0);
	CHECK_EQ(b.time_to_act, TOKENBUCKET_NEVER);
	model_free(m);
}

/* tokenbucket_deficiency(3)'s example: one token every 2 ms, replenish every 3 ms. */
static void test_deficiency_example(void)
{
	struct model *m = every(1, 2 * MS, 10, 0);
	CHECK(model_reset_at(m, 0, 0) == 0);
	uint64_t a = model_grab(m, 3), b = model_grab(m, 1), c = model_grab(m, 2);
	const uint64_t want[5][3] = { { 3, 4, 6 }, { 2, 3, 5 }, { 0, 1, 3 }, { 0, 0, 2 }, { 0, 0, 0 } };
	const int64_t needs[5] = { 12, 10, 6, 4, 0 };
	for (int i = 0; i < 5; i++) {
		model_replenish(m, i * 3 * MS);
		CHECK_EQ(model_deficiency(m, a), want[i][0]);
		CHECK_EQ(model_deficiency(m, b), want[i][1]);
		CHECK_EQ(model_deficiency(m, c), want[i][2]);
		CHECK_EQ(model_duration_for(m, model_deficiency(m, c)), needs[i] * MS);
	}
	model_free(m);
}

/* A day at 7 tokens every 3 us, claimed in uneven steps, then all at once. */
static void test_long_spans(void)
{
	const int64_t day = 86400 * S;
	struct model *m = every(7, 3000, TOKENBUCKET_BURST_MAX, 0);
	CHECK(model_reset_at(m, -day, 0) == 0);
	uint64_t ticket = model_grab(m, TOKENBUCKET_DEBT_MAX);
	int64_t t = -day;
	for (int i = 1; t < 0; i++) {
		t += (int64_t)i * 7919 * 1000003 % (37 * S);
		if (t > 0)
			t = 0;
		model_replenish(m, t);
	}
	uint64_t want = (uint64_t)(day * 7 / 3000);
	CHECK_EQ(TOKENBUCKET_DEBT_MAX - model_deficiency(m, ticket), want);
	model_free(m);

	m = every(7, 3000, TOKENBUCKET_BURST_MAX, 0);
	CHECK(model_reset_at(m, -day, 0) == 0);
	ticket = model_grab(m, TOKENBUCKET_DEBT_MAX);
	model_replenish(m, 0);
	CHECK_EQ(TOKENBUCKET_DEBT_MAX - model_deficiency(m, ticket), want);
	model_free(m);

	/* The whole time range: 2^64 - 2 ns at one token per 2^62 ns is 3 tokens. */
	m = every(1, INT64_C(1) << 62, 10, 0);
	CHECK(model_reset_at(m, INT64_MIN, 0) == 0); /* read as INT64_MIN + 1 */
	CHECK(model_allow_at(m, INT64_MAX, 3));
	CHECK(!model_allow_at(m, INT64_MAX, 1));
	model_free(m);

	/* UINT64_MAX tokens per ns over the range, within DEBT_MAX + burst. */
	m = every(UINT64_MAX, 1, TOKENBUCKET_BURST_MAX, 0);
	CHECK(model_reset_at(m, INT64_MIN + 1, 0) == 0);
	ticket = model_grab(m, TOKENBUCKET_DEBT_MAX);
	model_replenish(m, INT64_MAX);
	CHECK_EQ(model_deficiency(m, ticket), 0);
	CHECK_EQ(model_tokens_at(m, INT64_MAX), (double)TOKENBUCKET_BURST_MAX);
	model_free(m);
}

/* tokenbucket_set_rate(3): one token every 3 ms, at 4 ms 1000 per second. */
static void test_rate_change_carries(void)
{
	struct model *m = every(1, 3 * MS, 10, 0);
	CHECK(model_reset_at(m, 0, 0) == 0);
	CHECK(model_set_rate_at(m, 4 * MS, 1000.0) == 0);
	CHECK_EQ(model_rate(m), 1000.0);
	CHECK_EQ(model_tokens_at(m, 4 * MS), (double)(1.0L + 333333.0L / 1000000));
	CHECK(!model_allow_at(m, 4 * MS + 666666, 2));
	CHECK(model_allow_at(m, 4 * MS + 666667, 2));
	model_free(m);

	/* Earlier now: the change happens at the latest time seen. */
	m = every(1, MS, 10, 0);
	CHECK(model_reset_at(m, 0, 0) == 0);
	CHECK_EQ(model_tokens_at(m, 5 * MS + MS / 2), 5.5);
	/* At 5.5 ms: half a token carries as the 1 ms the new rate needs for it. */
	CHECK(model_set_rate_every_at(m, 0, 1, 2 * MS) == 0);
	CHECK_EQ(model_tokens_at(m, 0), 5.5);
	CHECK_EQ(model_tokens_at(m, 7 * MS), 6.25);
	/* No carry to rate 0, none back from it. */
	CHECK(model_set_rate_every_at(m, 8 * MS, 0, 1) == 0);
	CHECK_EQ(model_tokens_at(m, 9 * MS), 6.0);
	CHECK(model_set_rate_every_at(m, 9 * MS, 1, MS) == 0);
	CHECK_EQ(model_tokens_at(m, 9 * MS + MS / 2), 6.5);
	/* To unlimited: full; back: stays full. */
	CHECK(model_set_rate_at(m, 10 * MS, INFINITY) == 0);
	CHECK_EQ(model_tokens_at(m, 10 * MS), 10.0);
	struct tokenbucket_reservation r;
	CHECK(model_reserve_at(m, 0, 99, -1, &r) == 0);
	CHECK(r.tokens == 0 && r.time_to_act == 10 * MS);
	CHECK(model_allow_at(m, 10 * MS, 1000));
	CHECK(model_set_rate_every_at(m, 11 * MS, 1, MS) == 0);
	CHECK_EQ(model_tokens_at(m, 11 * MS), 10.0);
	model_free(m);
}

static void test_threshold(void)
{
	struct model *m = every(1, MS, 10, 0);
	CHECK(model_reset_at(m, 0, 0) == 0);
	CHECK(model_set_threshold(m, 11) == -EINVAL);
	CHECK(model_set_threshold(m, 3) == 0);
	uint64_t t = model_grab(m, 5);
	model_replenish(m, 2 * MS); /* 2 < 3: nothing, not even the clock */
	CHECK_EQ(model_deficiency(m, t), 5);
	CHECK_EQ(model_tokens_at(m, MS), -4.0); /* the Go face credits every token */
	model_replenish(m, 3 * MS); /* 2 more since 1 ms: still below */
	CHECK_EQ(model_deficiency(m, t), 4);
	model_replenish(m, 4 * MS);
	CHECK_EQ(model_deficiency(m, t), 1);
	model_replenish(m, 6 * MS);
	CHECK_EQ(model_deficiency(m, t), 1);
	model_replenish(m, 3 * MS); /* earlier: nothing */
	model_replenish(m, 7 * MS);
	CHECK_EQ(model_deficiency(m, t), 0);
	CHECK_EQ(model_tokens_at(m, 7 * MS), 2.0);
	/* A bucket that has seen no time: the first replenish fixes the clock only. */
	model_free(m);
	m = every(1, MS, 10, 0);
	t = model_grab(m, 12);
	model_replenish(m, 50 * MS);
	CHECK_EQ(model_deficiency(m, t), 2);
	model_replenish(m, 51 * MS);
	CHECK_EQ(model_deficiency(m, t), 1);
	model_free(m);
}

static void test_burst_lowering(void)
{
	struct model *m = every(1, MS, 10, 0);
	CHECK(model_set_threshold(m, 8) == 0);
	CHECK(model_set_burst_at(m, 0, 4) == 0);
	CHECK_EQ(model_burst(m), 4);
	CHECK_EQ(model_tokens_at(m, 0), 4.0);
	CHECK(model_set_threshold(m, 5) == -EINVAL);
	CHECK_EQ(model_grab(m, 0), 6); /* the 6 dropped tokens moved the tail */
	CHECK(model_set_burst_at(m, 0, 20) == 0); /* raising adds nothing */
	CHECK_EQ(model_tokens_at(m, 0), 4.0);
	CHECK_EQ(model_tokens_at(m, 3 * MS), 7.0);
	CHECK(model_set_burst_at(m, 3 * MS, 0) == 0);
	CHECK_EQ(model_tokens_at(m, 3 * MS), 0.0);
	CHECK(model_set_threshold(m, 1) == -EINVAL);
	CHECK(model_allow_at(m, 5 * MS, 0));
	CHECK(!model_allow_at(m, 5 * MS, 1));
	uint64_t t = model_grab(m, 1);
	model_replenish(m, 6 * MS);
	CHECK_EQ(model_deficiency(m, t), 0); /* a debt counts as room */
	model_free(m);

	/* Capped: the ceiling keeps what is in flight. */
	m = every(1, MS, 10, TOKENBUCKET_CAPPED_RELEASE);
	CHECK(model_reset_at(m, 0, 10) == 0);
	model_grab(m, 6); /* 6 in flight, 4 held */
	/* 1 dropped; 6 still in flight against a burst of 3: ceil below head. */
	CHECK(model_set_burst_at(m, 0, 3) == 0);
	CHECK_EQ(model_tokens_at(m, 0), 3.0);
	CHECK(model_release(m, 3) == 0);
	CHECK_EQ(model_tokens_at(m, 5 * MS), 3.0);
	model_free(m);
}

static void test_capped_release(void)
{
	struct model *m = every(1, MS, 5, TOKENBUCKET_CAPPED_RELEASE);
	CHECK(model_allow_at(m, 0, 5));
	CHECK(!model_allow_at(m, 3 * MS, 1)); /* all in flight: production is lost */
	CHECK_EQ(model_tokens_at(m, 3 * MS + MS / 2), 0.0);
	CHECK(model_release(m, 2) == 0);
	CHECK_EQ(model_tokens_at(m, 3 * MS + MS / 2), 0.5);
	CHECK_EQ(model_tokens_at(m, 4 * MS), 1.0);
	CHECK_EQ(model_tokens_at(m, 10 * MS), 2.0); /* ceil */
	CHECK(model_release(m, 6) == -EINVAL);
	CHECK(model_release(m, 5) == 0); /* only 3 fit: ceil <= tail + burst */
	CHECK_EQ(model_tokens_at(m, 20 * MS), 5.0);
	CHECK(model_allow_at(m, 20 * MS, 5));
	model_refund(m, 2); /* back, and no longer in flight */
	CHECK_EQ(model_tokens_at(m, 20 * MS), 2.0);
	CHECK_EQ(model_tokens_at(m, 30 * MS), 2.0);
	CHECK(model_release(m, 3) == 0);
	CHECK_EQ(model_tokens_at(m, 30 * MS), 2.0);
	CHECK_EQ(model_tokens_at(m, 31 * MS), 3.0);
	CHECK(model_reset_at(m, 31 * MS, 1) == 0); /* room burst - tokens */
	CHECK_EQ(model_tokens_at(m, 40 * MS), 5.0);
	model_free(m);

	/* A new capped bucket credits nothing until a release. */
	m = every(1, MS, 4, TOKENBUCKET_CAPPED_RELEASE);
	uint64_t t = model_grab(m, 6);
	model_replenish(m, 0);
	model_replenish(m, 10 * MS);
	CHECK_EQ(model_deficiency(m, t), 2);
	CHECK(model_release(m, 1) == 0);
	model_replenish(m, 11 * MS);
	CHECK_EQ(model_deficiency(m, t), 1);
	model_free(m);
}

static void test_unlimited(void)
{
	struct model *m = NULL;
	CHECK(model_create(&m, INFINITY, 3, 0) == 0);
	CHECK_EQ(model_grab(m, 100), 0);
	CHECK(model_allow_at(m, 5, 100));
	CHECK_EQ(model_tokens_at(m, 1), 3.0);
	CHECK_EQ(model_duration_for(m, 7), 0);
	CHECK(model_reset_at(m, 0, 1) == 0);
	CHECK_EQ(model_tokens_at(m, 0), 3.0);
	/* Unlimited is always full, the reset's 1 included: a finite rate starts full. */
	CHECK(model_set_rate_every_at(m, 0, 1, S) == 0);
	CHECK_EQ(model_tokens_at(m, 0), 3.0);
	model_free(m);
}

int main(void)
{
	test_ratios();
	test_create_errors();
	test_allow_example();
	test_allow_rules();
	test_debt_and_cancel();
	test_deficiency_example();
	test_long_spans();
	test_rate_change_carries();
	test_threshold();
	test_burst_lowering();
	test_capped_release();
	test_unlimited();
	if (failures)
		fprintf(stderr, "%d check(s) failed\n", failures);
	return failures != 0;
}
