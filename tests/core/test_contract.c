/* SPDX-License-Identifier: MIT */
/*
 * Where the contract deliberately differs from Go and Seastar: time never
 * runs backwards, production is exact over any horizon, cancel conserves.
 * "exactness" replays a simulated day at awkward rates against 128-bit
 * arithmetic done here independently.
 */
#include "check_tb.h"

/* golang/go#56287, #71360: an earlier time must not credit an interval twice. */
START_TEST(earlier_time_credits_nothing_twice)
{
	struct tokenbucket *tb = bucket_empty_at(1, MS, 10, 0, 0);
	ck_assert(tokenbucket_allow_at(tb, 5 * MS, 5));
	ck_assert(!tokenbucket_allow_at(tb, 3 * MS, 1)); /* read as 5 ms: empty */
	ck_assert(!tokenbucket_allow_at(tb, 5 * MS, 1)); /* Go would find 2 tokens here */
	ck_assert(tokenbucket_allow_at(tb, 6 * MS, 1));
	tokenbucket_free(tb);
}
END_TEST

START_TEST(earlier_time_takes_nothing_away)
{
	struct tokenbucket *tb = bucket_empty_at(1, 3 * MS, 10, 0, 0);
	double later = tokenbucket_tokens_at(tb, 5 * MS);
	ck_assert_tokens(later, 5.0 / 3);
	ck_assert_tokens(tokenbucket_tokens_at(tb, 4 * MS), later);
	ck_assert_tokens(tokenbucket_tokens_at(tb, INT64_MIN), later);
	ck_assert(tokenbucket_allow_at(tb, MS, 1)); /* a token is there at 5 ms */
	/* A reservation made with an old now acts no earlier than the latest time. */
	struct tokenbucket_reservation r;
	ck_assert_int_eq(tokenbucket_reserve_at(tb, 0, 0, 0, &r), 0);
	ck_assert_int_eq(r.time_to_act, 5 * MS);
	/* And a cancel with an old now is judged at the latest time. */
	ck_assert_int_eq(tokenbucket_reserve_at(tb, 5 * MS, 1, TOKENBUCKET_NEVER, &r), 0);
	ck_assert_int_eq(r.time_to_act, 6 * MS);
	ck_assert(!tokenbucket_allow_at(tb, 7 * MS, 1));
	tokenbucket_cancel_at(tb, &r, 5 * MS); /* 7 ms is past time_to_act: too late */
	ck_assert_tokens(tokenbucket_tokens_at(tb, 7 * MS), 1.0 / 3);
	tokenbucket_free(tb);
}
END_TEST

START_TEST(replenish_with_earlier_time_is_harmless)
{
	struct tokenbucket *tb = bucket_empty_at(1, MS, 10, 0, 0);
	tokenbucket_replenish(tb, 4 * MS);
	tokenbucket_replenish(tb, 2 * MS);
	tokenbucket_replenish(tb, 4 * MS);
	ck_assert_tokens(tokenbucket_tokens_at(tb, 4 * MS), 4);
	tokenbucket_free(tb);
}
END_TEST

/* golang/go#69419: interleaved cancels must give back every token. */
START_TEST(interleaved_cancels_conserve_tokens)
{
	const int orders[2][2] = { { 0, 1 }, { 1, 0 } };
	for (int o = 0; o < 2; o++) {
		struct tokenbucket *tb = bucket_rate(0, 10, 0);
		struct tokenbucket_reservation r[2];
		ck_assert_int_eq(tokenbucket_reserve_at(tb, 0, 3, TOKENBUCKET_NEVER, &r[0]), 0);
		ck_assert_int_eq(tokenbucket_reserve_at(tb, 0, 4, TOKENBUCKET_NEVER, &r[1]), 0);
		tokenbucket_cancel_at(tb, &r[orders[o][0]], 0);
		tokenbucket_cancel_at(tb, &r[orders[o][1]], 0);
		ck_assert_tokens(tokenbucket_tokens_at(tb, 0), 10);
		tokenbucket_free(tb);
	}
}
END_TEST

START_TEST(cancel_in_debt_conserves_tokens)
{
	struct tokenbucket *tb = bucket_rate(0, 5, 0);
	struct tokenbucket_reservation a, b;
	ck_assert_int_eq(tokenbucket_reserve_at(tb, 0, 5, TOKENBUCKET_NEVER, &a), 0);
	ck_assert_int_eq(tokenbucket_reserve_at(tb, 0, 5, TOKENBUCKET_NEVER, &b), 0);
	ck_assert_int_eq(b.time_to_act, TOKENBUCKET_NEVER);
	ck_assert_tokens(tokenbucket_tokens_at(tb, 0), -5);
	tokenbucket_cancel_at(tb, &a, 0);
	ck_assert_uint_eq(tokenbucket_deficiency(tb, b.ticket), 0); /* b is covered now */
	ck_assert_tokens(tokenbucket_tokens_at(tb, 0), 0);
	tokenbucket_cancel_at(tb, &b, 0);
	ck_assert_tokens(tokenbucket_tokens_at(tb, 0), 5);
	tokenbucket_free(tb);
}
END_TEST

START_TEST(success_means_enough_exactly)
{
	/* 3 tokens per 7 ns: the first token is there at ceil(7/3) = 3 ns, not before. */
	struct tokenbucket *tb = bucket_empty_at(3, 7, 10, 0, 100);
	ck_assert(!tokenbucket_allow_at(tb, 102, 1));
	ck_assert(tokenbucket_allow_at(tb, 103, 1));
	ck_assert(!tokenbucket_allow_at(tb, 104, 1));
	ck_assert(tokenbucket_allow_at(tb, 105, 1));
	ck_assert(tokenbucket_allow_at(tb, 107, 1));
	ck_assert(!tokenbucket_allow_at(tb, 109, 1));
	tokenbucket_free(tb);
}
END_TEST

/* ---- A simulated day --------------------------------------------------- */

typedef unsigned __int128 u128;

struct day_case {
	const char *name;
	uint64_t tokens; /* per period; 0: use rate */
	int64_t period;
	double rate;
	uint64_t p, q; /* the exact ratio expected, tokens per ns */
};

/*
 * Drains the bucket at awkward steps over a day; burst is large enough that
 * nothing is lost to it (steps stay under 600 s), so at every step exactly
 * floor(T * p / q) - granted tokens must be there: that many are allowed and
 * not one more.
 */
static void run_day(const struct day_case *c)
{
	const uint64_t burst = UINT64_C(1) << 40;
	const int64_t day = 86400 * SEC, start = 123456789;
	struct tokenbucket *tb = c->tokens ? bucket_every(c->tokens, c->period, burst, 0)
					   : bucket_rate(c->rate, burst, 0);
	ck_assert_int_eq(tokenbucket_reset_at(tb, start, 0), 0);
	uint64_t granted = 0;
	int64_t step = 9999991; /* a prime number of ns, growing to 600 s */
	for (int64_t t = start; t <= start + day; t += step) {
		uint64_t expect = (uint64_t)((u128)(uint64_t)(t - start) * c->p / c->q) - granted;
		if (expect)
			ck_assert_msg(tokenbucket_allow_at(tb, t, expect), "%s at +%lld ns: %llu not there",
				      c->name, (long long)(t - start), (unsigned long long)expect);
		ck_assert_msg(!tokenbucket_allow_at(tb, t, 1), "%s at +%lld ns: more than %llu",
			      c->name, (long long)(t - start), (unsigned long long)expect);
		granted += expect;
		step = step * 3 / 2 + 7;
		if (step > 600 * SEC)
			step = 600 * SEC - 1;
	}
	int64_t end = start + day;
	uint64_t left = (uint64_t)((u128)(uint64_t)day * c->p / c->q) - granted;
	ck_assert(tokenbucket_allow_at(tb, end, left));
	ck_assert(!tokenbucket_allow_at(tb, end, 1));
	tokenbucket_free(tb);
}

START_TEST(a_day_at_awkward_rates)
{
	const struct day_case cases[] = {
		{ "1 per 3 ns", 1, 3, 0, 1, 3 },
		{ "7 per (1e9+7) ns", 7, 1000000007, 0, 7, 1000000007 },
		{ "999999937 per s", 999999937, SEC, 0, 999999937, 1000000000 },
		{ "rate 0.1/s", 0, 0, 0.1, 1, 10000000000 },
		{ "rate 1e9/3", 0, 0, 1e9 / 3, 1, 3 },
		{ "every 7 ms", 0, 0, 1e9 / (7 * MS), 1, 7000000 },
		{ "rate 333.333/s", 0, 0, 333.333, 333333, 1000000000000 },
		{ "6 per 4 ns", 6, 4, 0, 3, 2 },
	};
	for (unsigned i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
		run_day(&cases[i]);
}
END_TEST

START_TEST(no_drift_from_many_small_steps)
{
	/* 10 tokens per second, asked for one at a time every 1 000 001 ns for 10 s. */
	struct tokenbucket *tb = bucket_empty_at(10, SEC, 1000, 0, 0);
	uint64_t granted = 0;
	for (int64_t t = 0; t <= 10 * SEC; t += 1000001)
		while (tokenbucket_allow_at(tb, t, 1))
			granted++;
	/* Everything produced by the last step, floor(last * 10 / 1e9), and not one more. */
	int64_t last = (10 * SEC / 1000001) * 1000001;
	ck_assert_uint_eq(granted, (uint64_t)(last * 10 / SEC));
	tokenbucket_free(tb);
}
END_TEST

START_TEST(huge_times_and_rates_stay_exact)
{
	/* A simulated clock spanning the whole int64 range. */
	struct tokenbucket *tb = bucket_empty_at(1, SEC, 5, 0, INT64_MIN + 1);
	ck_assert_tokens(tokenbucket_tokens_at(tb, INT64_MIN + 1 + 2 * SEC + SEC / 2), 2.5);
	ck_assert_tokens(tokenbucket_tokens_at(tb, INT64_MAX), 5);
	ck_assert(tokenbucket_allow_at(tb, INT64_MAX, 5));
	ck_assert(!tokenbucket_allow_at(tb, INT64_MAX, 1));
	tokenbucket_free(tb);
	/* More than a token per ns (bytes at 12.5 GB/s) over the full range. */
	tb = bucket_empty_at(25, 2, TOKENBUCKET_BURST_MAX, 0, -SEC);
	ck_assert(tokenbucket_allow_at(tb, 0, 12500000000ULL));
	ck_assert(!tokenbucket_allow_at(tb, 0, 1));
	ck_assert(tokenbucket_allow_at(tb, INT64_MAX, TOKENBUCKET_BURST_MAX));
	tokenbucket_free(tb);
}
END_TEST

Suite *contract_suite(void)
{
	Suite *s = suite_create("contract");
	TCase *tc = tcase_create("monotonic-time");
	tcase_add_test(tc, earlier_time_credits_nothing_twice);
	tcase_add_test(tc, earlier_time_takes_nothing_away);
	tcase_add_test(tc, replenish_with_earlier_time_is_harmless);
	suite_add_tcase(s, tc);
	tc = tcase_create("conservation");
	tcase_add_test(tc, interleaved_cancels_conserve_tokens);
	tcase_add_test(tc, cancel_in_debt_conserves_tokens);
	tcase_add_test(tc, success_means_enough_exactly);
	suite_add_tcase(s, tc);
	return s;
}

Suite *exactness_suite(void)
{
	Suite *s = suite_create("exactness");
	TCase *tc = tcase_create("horizons");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, a_day_at_awkward_rates);
	tcase_add_test(tc, no_drift_from_many_small_steps);
	tcase_add_test(tc, huge_times_and_rates_stay_exact);
	suite_add_tcase(s, tc);
	return s;
}
