/* SPDX-License-Identifier: MIT */
/* The Go face: golang.org/x/time/rate semantics, on a manual clock. */
#include <float.h>

#include "check_tb.h"

START_TEST(allow_takes_what_is_there)
{
	struct tokenbucket *tb = bucket_every(1, MS, 5, 0);
	for (int i = 0; i < 5; i++)
		ck_assert(tokenbucket_allow_at(tb, 0, 1));
	ck_assert(!tokenbucket_allow_at(tb, 0, 1));
	ck_assert(!tokenbucket_allow_at(tb, MS - 1, 1));
	ck_assert(tokenbucket_allow_at(tb, MS, 1));
	ck_assert(tokenbucket_allow_at(tb, 4 * MS, 3));
	ck_assert(!tokenbucket_allow_at(tb, 4 * MS, 1));
	tokenbucket_free(tb);
}
END_TEST

START_TEST(allow_refusal_changes_nothing)
{
	struct tokenbucket *tb = bucket_every(1, MS, 5, 0);
	ck_assert(tokenbucket_allow_at(tb, 0, 3));
	ck_assert(!tokenbucket_allow_at(tb, 0, 3)); /* 2 left: all or nothing */
	ck_assert_tokens(tokenbucket_tokens_at(tb, 0), 2);
	ck_assert(!tokenbucket_allow_at(tb, 0, 6)); /* more than burst: never */
	ck_assert_tokens(tokenbucket_tokens_at(tb, 0), 2);
	ck_assert(tokenbucket_allow_at(tb, 0, 2));
	tokenbucket_free(tb);
}
END_TEST

START_TEST(allow_zero_tokens)
{
	struct tokenbucket *tb = bucket_every(1, MS, 2, 0);
	ck_assert(tokenbucket_allow_at(tb, 0, 0));
	struct tokenbucket_reservation r;
	ck_assert_int_eq(tokenbucket_reserve_at(tb, 0, 2, TOKENBUCKET_NEVER, &r), 0);
	ck_assert_int_eq(tokenbucket_reserve_at(tb, 0, 1, TOKENBUCKET_NEVER, &r), 0);
	/* As in Go: AllowN(now, 0) is false while the bucket is in debt. */
	ck_assert(!tokenbucket_allow_at(tb, 0, 0));
	ck_assert(tokenbucket_allow_at(tb, MS, 0));
	tokenbucket_free(tb);
}
END_TEST

START_TEST(reserve_into_debt)
{
	struct tokenbucket *tb = bucket_empty_at(1, MS, 10, 0, 0);
	struct tokenbucket_reservation a, b;
	ck_assert_int_eq(tokenbucket_reserve_at(tb, 0, 1, TOKENBUCKET_NEVER, &a), 0);
	ck_assert_int_eq(a.time_to_act, MS);
	ck_assert_uint_eq(a.tokens, 1);
	ck_assert_uint_eq(a.reserved, 0);
	ck_assert_int_eq(tokenbucket_reserve_at(tb, 0, 2, TOKENBUCKET_NEVER, &b), 0);
	ck_assert_int_eq(b.time_to_act, 3 * MS);
	ck_assert_uint_eq(b.ticket - a.ticket, 2);
	ck_assert_int_eq(tokenbucket_reservation_delay(&b, 0), 3 * MS);
	ck_assert_int_eq(tokenbucket_reservation_delay(&b, MS), 2 * MS);
	ck_assert_int_eq(tokenbucket_reservation_delay(&b, 5 * MS), 0);
	ck_assert_tokens(tokenbucket_tokens_at(tb, 0), -3);
	ck_assert_tokens(tokenbucket_tokens_at(tb, 3 * MS), 0);
	/* A covered reservation acts now. */
	ck_assert_int_eq(tokenbucket_reserve_at(tb, 5 * MS, 2, 0, &a), 0);
	ck_assert_int_eq(a.time_to_act, 5 * MS);
	tokenbucket_free(tb);
}
END_TEST

START_TEST(reserve_respects_max_wait)
{
	struct tokenbucket *tb = bucket_every(1, MS, 10, 0);
	ck_assert_int_eq(tokenbucket_reset_at(tb, 0, 1), 0);
	struct tokenbucket_reservation r = { 7, 7, 7, 7 };
	ck_assert_int_eq(tokenbucket_reserve_at(tb, 0, 3, 2 * MS - 1, &r), -ETIMEDOUT);
	ck_assert_int_eq(r.time_to_act, 7); /* untouched on failure */
	ck_assert_tokens(tokenbucket_tokens_at(tb, 0), 1);
	ck_assert_int_eq(tokenbucket_reserve_at(tb, 0, 3, 2 * MS, &r), 0);
	ck_assert_int_eq(r.time_to_act, 2 * MS);
	/* max_wait 0 is AllowN: only what is there now. */
	ck_assert_int_eq(tokenbucket_reserve_at(tb, 2 * MS, 1, 0, &r), -ETIMEDOUT);
	tokenbucket_free(tb);
}
END_TEST

START_TEST(cancel_gives_back_once)
{
	struct tokenbucket *tb = bucket_every(1, MS, 10, 0);
	ck_assert_int_eq(tokenbucket_reset_at(tb, 0, 5), 0);
	struct tokenbucket_reservation r;
	ck_assert_int_eq(tokenbucket_reserve_at(tb, 0, 4, TOKENBUCKET_NEVER, &r), 0);
	ck_assert_tokens(tokenbucket_tokens_at(tb, 0), 1);
	tokenbucket_cancel_at(tb, &r, 0);
	ck_assert_uint_eq(r.tokens, 0);
	ck_assert_tokens(tokenbucket_tokens_at(tb, 0), 5);
	tokenbucket_cancel_at(tb, &r, 0);
	ck_assert_tokens(tokenbucket_tokens_at(tb, 0), 5);
	tokenbucket_free(tb);
}
END_TEST

START_TEST(cancel_too_late_gives_nothing)
{
	struct tokenbucket *tb = bucket_empty_at(1, MS, 10, 0, 0);
	struct tokenbucket_reservation r;
	ck_assert_int_eq(tokenbucket_reserve_at(tb, 0, 2, TOKENBUCKET_NEVER, &r), 0);
	ck_assert_int_eq(r.time_to_act, 2 * MS);
	tokenbucket_cancel_at(tb, &r, 2 * MS + 1);
	ck_assert_tokens(tokenbucket_tokens_at(tb, 2 * MS + 1), 1.0 / MS);
	/* At time_to_act itself it is not too late. */
	ck_assert_int_eq(tokenbucket_reserve_at(tb, 3 * MS, 2, TOKENBUCKET_NEVER, &r), 0);
	ck_assert_int_eq(r.time_to_act, 4 * MS);
	tokenbucket_cancel_at(tb, &r, 4 * MS);
	ck_assert_tokens(tokenbucket_tokens_at(tb, 4 * MS), 2);
	tokenbucket_free(tb);
}
END_TEST

START_TEST(cancel_covers_later_tickets_sooner)
{
	struct tokenbucket *tb = bucket_empty_at(1, MS, 10, 0, 0);
	struct tokenbucket_reservation a, b;
	ck_assert_int_eq(tokenbucket_reserve_at(tb, 0, 3, TOKENBUCKET_NEVER, &a), 0);
	ck_assert_int_eq(tokenbucket_reserve_at(tb, 0, 2, TOKENBUCKET_NEVER, &b), 0);
	ck_assert_uint_eq(tokenbucket_deficiency(tb, b.ticket), 5);
	tokenbucket_cancel_at(tb, &a, MS);
	/* One token produced by 1 ms, three given back: b misses one. */
	ck_assert_uint_eq(tokenbucket_deficiency(tb, b.ticket), 1);
	ck_assert(!tokenbucket_allow_at(tb, MS, 1));
	ck_assert_tokens(tokenbucket_tokens_at(tb, 2 * MS), 0);
	tokenbucket_free(tb);
}
END_TEST

START_TEST(set_rate_credits_the_old_rate_first)
{
	struct tokenbucket *tb = bucket_empty_at(1, MS, 100, 0, 0);
	ck_assert_int_eq(tokenbucket_set_rate_every_at(tb, 10 * MS, 2, MS), 0);
	ck_assert_tokens(tokenbucket_tokens_at(tb, 10 * MS), 10);
	ck_assert_tokens(tokenbucket_tokens_at(tb, 15 * MS), 20);
	ck_assert_double_eq(tokenbucket_rate(tb), 2000);
	ck_assert_int_eq(tokenbucket_set_rate_at(tb, 15 * MS, 0), 0);
	ck_assert_tokens(tokenbucket_tokens_at(tb, 1000 * MS), 20);
	ck_assert_int_eq(tokenbucket_duration_for(tb, 1), TOKENBUCKET_NEVER);
	tokenbucket_free(tb);
}
END_TEST

START_TEST(set_rate_carries_the_fraction)
{
	/* One token per 3 ms: by 4 ms, 1 1/3 tokens; then one per ms. */
	struct tokenbucket *tb = bucket_empty_at(1, 3 * MS, 100, 0, 0);
	ck_assert_int_eq(tokenbucket_set_rate_at(tb, 4 * MS, 1000), 0);
	/* The third of a token carries as 333 333 ns of the new rate, rounded down. */
	ck_assert_tokens(tokenbucket_tokens_at(tb, 4 * MS), 1 + 333333.0 / MS);
	ck_assert(!tokenbucket_allow_at(tb, 4 * MS + 666666, 2));
	ck_assert(tokenbucket_allow_at(tb, 4 * MS + 666667, 2));
	tokenbucket_free(tb);
}
END_TEST

START_TEST(set_burst_drops_or_keeps)
{
	struct tokenbucket *tb = bucket_every(1, MS, 10, 0);
	ck_assert_int_eq(tokenbucket_set_burst_at(tb, 0, 4), 0);
	ck_assert_uint_eq(tokenbucket_burst(tb), 4);
	ck_assert_tokens(tokenbucket_tokens_at(tb, 0), 4);
	ck_assert(!tokenbucket_allow_at(tb, 0, 5));
	ck_assert_int_eq(tokenbucket_set_burst_at(tb, 0, 8), 0);
	ck_assert_tokens(tokenbucket_tokens_at(tb, 0), 4); /* raising adds nothing */
	ck_assert_tokens(tokenbucket_tokens_at(tb, 10 * MS), 8);
	/* Tokens produced before the change count under the old burst. */
	ck_assert(tokenbucket_allow_at(tb, 10 * MS, 8));
	ck_assert_int_eq(tokenbucket_set_burst_at(tb, 13 * MS, 2), 0);
	ck_assert_tokens(tokenbucket_tokens_at(tb, 13 * MS), 2);
	ck_assert(tokenbucket_allow_at(tb, 13 * MS, 2));
	ck_assert(!tokenbucket_allow_at(tb, 13 * MS, 1));
	tokenbucket_free(tb);
}
END_TEST

START_TEST(tokens_are_fractional)
{
	struct tokenbucket *tb = bucket_empty_at(1, 3 * MS, 4, 0, 0);
	ck_assert_tokens(tokenbucket_tokens_at(tb, MS), 1.0 / 3);
	ck_assert_tokens(tokenbucket_tokens_at(tb, 2 * MS), 2.0 / 3);
	ck_assert_tokens(tokenbucket_tokens_at(tb, 1000 * MS), 4); /* never above burst */
	tokenbucket_free(tb);
}
END_TEST

START_TEST(infinite_rate_allows_everything)
{
	struct tokenbucket *tb = bucket_rate(TOKENBUCKET_INF, 3, 0);
	ck_assert(tokenbucket_rate(tb) == TOKENBUCKET_INF);
	for (int i = 0; i < 100; i++)
		ck_assert(tokenbucket_allow_at(tb, 0, 1000));
	ck_assert_tokens(tokenbucket_tokens_at(tb, 0), 3);
	struct tokenbucket_reservation r;
	ck_assert_int_eq(tokenbucket_reserve_at(tb, 42, 1000, 0, &r), 0);
	ck_assert_int_eq(r.time_to_act, 42);
	ck_assert_uint_eq(r.tokens, 0); /* nothing taken, nothing to give back */
	tokenbucket_cancel_at(tb, &r, 42);
	ck_assert_tokens(tokenbucket_tokens_at(tb, 42), 3);
	/* Time never runs backwards, not even without a limit. */
	ck_assert_int_eq(tokenbucket_reserve_at(tb, 7, 1, 0, &r), 0);
	ck_assert_int_eq(r.time_to_act, 42);
	ck_assert_int_eq(tokenbucket_duration_for(tb, 1000), 0);
	ck_assert_uint_eq(tokenbucket_deficiency(tb, tokenbucket_grab(tb, 1000)), 0);
	tokenbucket_free(tb);
	/* Anything at or above DBL_MAX is infinite. */
	tb = bucket_rate(DBL_MAX, 1, 0);
	ck_assert(tokenbucket_rate(tb) == TOKENBUCKET_INF);
	ck_assert(tokenbucket_allow_at(tb, 0, 5));
	tokenbucket_free(tb);
}
END_TEST

START_TEST(infinite_rate_switches)
{
	struct tokenbucket *tb = bucket_every(1, SEC, 5, 0);
	ck_assert(tokenbucket_allow_at(tb, 0, 5));
	ck_assert_int_eq(tokenbucket_set_rate_at(tb, 0, TOKENBUCKET_INF), 0);
	ck_assert(tokenbucket_allow_at(tb, 0, 50));
	/* Back to a finite rate: unlimited production left the bucket full. */
	ck_assert_int_eq(tokenbucket_set_rate_at(tb, MS, 1), 0);
	ck_assert_tokens(tokenbucket_tokens_at(tb, MS), 5);
	ck_assert(tokenbucket_allow_at(tb, MS, 5));
	ck_assert(!tokenbucket_allow_at(tb, MS, 1));
	/* A reset while unlimited leaves it full, so the switch back starts full too. */
	ck_assert_int_eq(tokenbucket_set_rate_at(tb, 2 * MS, TOKENBUCKET_INF), 0);
	ck_assert_int_eq(tokenbucket_reset_at(tb, 3 * MS, 0), 0);
	ck_assert_tokens(tokenbucket_tokens_at(tb, 3 * MS), 5);
	ck_assert_int_eq(tokenbucket_set_rate_at(tb, 3 * MS, 1), 0);
	ck_assert_tokens(tokenbucket_tokens_at(tb, 3 * MS), 5);
	ck_assert(tokenbucket_allow_at(tb, 3 * MS, 5));
	tokenbucket_free(tb);
}
END_TEST

START_TEST(zero_rate_never_refills)
{
	struct tokenbucket *tb = bucket_rate(0, 3, 0);
	ck_assert_double_eq(tokenbucket_rate(tb), 0);
	ck_assert(tokenbucket_allow_at(tb, 0, 3));
	ck_assert(!tokenbucket_allow_at(tb, TOKENBUCKET_NEVER - 1, 1));
	struct tokenbucket_reservation r;
	ck_assert_int_eq(tokenbucket_reserve_at(tb, 0, 1, SEC, &r), -ETIMEDOUT);
	ck_assert_int_eq(tokenbucket_reserve_at(tb, 0, 1, TOKENBUCKET_NEVER, &r), 0);
	ck_assert_int_eq(r.time_to_act, TOKENBUCKET_NEVER);
	ck_assert_int_eq(tokenbucket_reservation_delay(&r, 0), TOKENBUCKET_NEVER);
	tokenbucket_free(tb);
	tb = bucket_every(0, 0, 3, 0); /* zero tokens per any period is rate 0 */
	ck_assert_double_eq(tokenbucket_rate(tb), 0);
	tokenbucket_free(tb);
}
END_TEST

START_TEST(every_and_rates_read_back)
{
	ck_assert(tokenbucket_every(0) == TOKENBUCKET_INF);
	ck_assert(tokenbucket_every(-5) == TOKENBUCKET_INF);
	ck_assert_double_eq(tokenbucket_every(100 * MS), 10);
	const double rates[] = { 10, 0.1, 1e9 / 3, 1.0 / 3, 333.333, 1e-3, 7e8, 2.5e12, 1e-9 };
	for (unsigned i = 0; i < sizeof(rates) / sizeof(rates[0]); i++) {
		struct tokenbucket *tb = bucket_rate(rates[i], 1, 0);
		ck_assert_msg(tokenbucket_rate(tb) == rates[i], "rate %.17g read back as %.17g", rates[i],
			      tokenbucket_rate(tb));
		tokenbucket_free(tb);
	}
	struct tokenbucket *tb = bucket_rate(tokenbucket_every(7 * MS), 1, 0);
	ck_assert_int_eq(tokenbucket_duration_for(tb, 3), 21 * MS);
	tokenbucket_free(tb);
}
END_TEST

/*
 * every(n) is 1e9 / n rounded once; the ratio read back from it must be
 * exactly one token per n ns.  A read-back that rounded twice took 1/28936
 * for every(28935), among ten such n below 200000.
 */
START_TEST(every_reads_back_as_its_period)
{
	for (int64_t n = 1; n <= 200000; n++) {
		struct tokenbucket *tb = bucket_rate(tokenbucket_every(n), 1, 0);
		ck_assert_msg(tokenbucket_duration_for(tb, 1) == n, "every(%lld) became %lld ns",
			      (long long)n, (long long)tokenbucket_duration_for(tb, 1));
		tokenbucket_free(tb);
	}
}
END_TEST

/*
 * The continued fraction is expanded exactly.  56.807000000000002 tokens/s
 * reads back from 71451 tokens every 1257785132114 ns, its first such
 * convergent; expanded in long double, the terms drifted and the bucket got
 * 78773 every 1386677698171 ns, which reads back too but is not the first.
 * duration_for(78773) tells them apart (...172 against ...171).
 */
START_TEST(rate_takes_the_first_exact_convergent)
{
	struct tokenbucket *tb = bucket_rate(56.807000000000002, 1, 0);
	ck_assert_int_eq(tokenbucket_duration_for(tb, 71451), INT64_C(1257785132114));
	ck_assert_int_eq(tokenbucket_duration_for(tb, 78773), INT64_C(1386677698172));
	tokenbucket_free(tb);
}
END_TEST

START_TEST(new_bucket_is_full_until_time_passes)
{
	struct tokenbucket *tb = bucket_every(1, MS, 3, 0);
	/* The first time passed fixes the clock; nothing is credited before it. */
	ck_assert_tokens(tokenbucket_tokens_at(tb, 500 * MS), 3);
	ck_assert(tokenbucket_allow_at(tb, 500 * MS, 3));
	ck_assert_tokens(tokenbucket_tokens_at(tb, 501 * MS), 1);
	tokenbucket_free(tb);
}
END_TEST

START_TEST(real_clock_functions)
{
	int64_t a = tokenbucket_now(), b = tokenbucket_now();
	ck_assert_int_le(a, b);
	struct tokenbucket *tb = bucket_every(1, SEC, 2, 0);
	ck_assert(tokenbucket_allow(tb, 2));
	ck_assert(!tokenbucket_allow(tb, 1));
	struct tokenbucket_reservation r;
	ck_assert_int_eq(tokenbucket_reserve(tb, 1, TOKENBUCKET_NEVER, &r), 0);
	ck_assert_int_gt(r.time_to_act, b);
	tokenbucket_cancel(tb, &r);
	double t = tokenbucket_tokens(tb);
	ck_assert(t >= 0 && t < 1);
	ck_assert_int_eq(tokenbucket_set_rate(tb, 5), 0);
	ck_assert_double_eq(tokenbucket_rate(tb), 5);
	ck_assert_int_eq(tokenbucket_set_burst(tb, 9), 0);
	ck_assert_uint_eq(tokenbucket_burst(tb), 9);
	tokenbucket_free(tb);
}
END_TEST

Suite *go_suite(void)
{
	Suite *s = suite_create("go");
	TCase *tc = tcase_create("allow");
	tcase_add_test(tc, allow_takes_what_is_there);
	tcase_add_test(tc, allow_refusal_changes_nothing);
	tcase_add_test(tc, allow_zero_tokens);
	tcase_add_test(tc, new_bucket_is_full_until_time_passes);
	suite_add_tcase(s, tc);
	tc = tcase_create("reserve-cancel");
	tcase_add_test(tc, reserve_into_debt);
	tcase_add_test(tc, reserve_respects_max_wait);
	tcase_add_test(tc, cancel_gives_back_once);
	tcase_add_test(tc, cancel_too_late_gives_nothing);
	tcase_add_test(tc, cancel_covers_later_tickets_sooner);
	suite_add_tcase(s, tc);
	tc = tcase_create("settings");
	/* every_reads_back_as_its_period converts 200000 rates: seconds on a busy 2-core machine. */
	tcase_set_timeout(tc, 30);
	tcase_add_test(tc, set_rate_credits_the_old_rate_first);
	tcase_add_test(tc, set_rate_carries_the_fraction);
	tcase_add_test(tc, set_burst_drops_or_keeps);
	tcase_add_test(tc, tokens_are_fractional);
	tcase_add_test(tc, every_and_rates_read_back);
	tcase_add_test(tc, every_reads_back_as_its_period);
	tcase_add_test(tc, rate_takes_the_first_exact_convergent);
	suite_add_tcase(s, tc);
	tc = tcase_create("inf-and-zero");
	tcase_add_test(tc, infinite_rate_allows_everything);
	tcase_add_test(tc, infinite_rate_switches);
	tcase_add_test(tc, zero_rate_never_refills);
	tcase_add_test(tc, real_clock_functions);
	suite_add_tcase(s, tc);
	return s;
}
