/* SPDX-License-Identifier: MIT */
/* The Seastar face: tickets, explicit replenishment, threshold, capped release. */
#include "check_tb.h"
/* The clock word, to stop a replenisher between its two steps. */
#include "core.h"

START_TEST(grab_returns_the_tail)
{
	struct tokenbucket *tb = bucket_every(1, MS, 10, 0);
	uint64_t a = tokenbucket_grab(tb, 3);
	uint64_t b = tokenbucket_grab(tb, 4);
	ck_assert_uint_eq(b - a, 4);
	ck_assert_uint_eq(tokenbucket_deficiency(tb, a), 0);
	ck_assert_uint_eq(tokenbucket_deficiency(tb, b), 0);
	uint64_t c = tokenbucket_grab(tb, 5); /* 3 left: the tail passes the head */
	ck_assert_uint_eq(tokenbucket_deficiency(tb, c), 2);
	ck_assert_uint_eq(tokenbucket_grab(tb, 0), c);
	tokenbucket_free(tb);
}
END_TEST

START_TEST(tickets_are_covered_in_order)
{
	struct tokenbucket *tb = bucket_empty_at(1, MS, 10, 0, 0);
	uint64_t a = tokenbucket_grab(tb, 3), b = tokenbucket_grab(tb, 2), c = tokenbucket_grab(tb, 1);
	ck_assert_uint_eq(tokenbucket_deficiency(tb, a), 3);
	ck_assert_uint_eq(tokenbucket_deficiency(tb, b), 5);
	ck_assert_uint_eq(tokenbucket_deficiency(tb, c), 6);
	for (int64_t t = 1; t <= 6; t++) {
		tokenbucket_replenish(tb, t * MS);
		/* Once a ticket is covered, every earlier one is too. */
		if (tokenbucket_deficiency(tb, c) == 0)
			ck_assert_uint_eq(tokenbucket_deficiency(tb, b), 0);
		if (tokenbucket_deficiency(tb, b) == 0)
			ck_assert_uint_eq(tokenbucket_deficiency(tb, a), 0);
		ck_assert_uint_eq(tokenbucket_deficiency(tb, c), (uint64_t)(6 - t));
	}
	tokenbucket_free(tb);
}
END_TEST

START_TEST(replenish_only_when_asked)
{
	struct tokenbucket *tb = bucket_empty_at(1, MS, 10, 0, 0);
	uint64_t t = tokenbucket_grab(tb, 2);
	ck_assert_uint_eq(tokenbucket_deficiency(tb, t), 2);
	/* Time passing alone credits nothing to the Seastar face... */
	ck_assert_uint_eq(tokenbucket_deficiency(tb, t), 2);
	tokenbucket_replenish(tb, MS);
	ck_assert_uint_eq(tokenbucket_deficiency(tb, t), 1);
	/* ...while any Go-face call credits up to its now. */
	ck_assert(!tokenbucket_allow_at(tb, 2 * MS, 1));
	ck_assert_uint_eq(tokenbucket_deficiency(tb, t), 0);
	tokenbucket_free(tb);
}
END_TEST

START_TEST(replenish_is_capped_at_burst)
{
	struct tokenbucket *tb = bucket_empty_at(1, MS, 4, 0, 0);
	tokenbucket_replenish(tb, 100 * MS);
	uint64_t t = tokenbucket_grab(tb, 5);
	ck_assert_uint_eq(tokenbucket_deficiency(tb, t), 1);
	/* Replenishing again at the same time adds nothing: those tokens were lost. */
	tokenbucket_replenish(tb, 100 * MS);
	ck_assert_uint_eq(tokenbucket_deficiency(tb, t), 1);
	tokenbucket_replenish(tb, 101 * MS);
	ck_assert_uint_eq(tokenbucket_deficiency(tb, t), 0);
	tokenbucket_free(tb);
}
END_TEST

START_TEST(replenish_waits_for_the_threshold)
{
	struct tokenbucket *tb = bucket_empty_at(1, MS, 10, 0, 0);
	ck_assert_int_eq(tokenbucket_set_threshold(tb, 4), 0);
	uint64_t t = tokenbucket_grab(tb, 1);
	tokenbucket_replenish(tb, 3 * MS);
	ck_assert_uint_eq(tokenbucket_deficiency(tb, t), 1);
	tokenbucket_replenish(tb, 4 * MS);
	ck_assert_uint_eq(tokenbucket_deficiency(tb, t), 0);
	ck_assert_tokens(tokenbucket_tokens_at(tb, 4 * MS), 3);
	/* Nothing was lost while below the threshold. */
	tokenbucket_replenish(tb, 7 * MS);
	ck_assert_tokens(tokenbucket_tokens_at(tb, 7 * MS), 6);
	tokenbucket_free(tb);
}
END_TEST

START_TEST(refund_gives_back_within_burst)
{
	struct tokenbucket *tb = bucket_every(1, MS, 5, 0);
	uint64_t t = tokenbucket_grab(tb, 4);
	tokenbucket_refund(tb, 3);
	ck_assert_tokens(tokenbucket_tokens_at(tb, 0), 4);
	tokenbucket_refund(tb, 100);
	ck_assert_tokens(tokenbucket_tokens_at(tb, 0), 5);
	ck_assert_uint_eq(tokenbucket_deficiency(tb, t), 0);
	/* A refund moves head: the queue behind it is covered sooner. */
	uint64_t a = tokenbucket_grab(tb, 5), b = tokenbucket_grab(tb, 2);
	ck_assert_uint_eq(tokenbucket_deficiency(tb, b), 2);
	tokenbucket_refund(tb, 2);
	ck_assert_uint_eq(tokenbucket_deficiency(tb, a), 0);
	ck_assert_uint_eq(tokenbucket_deficiency(tb, b), 0);
	tokenbucket_free(tb);
}
END_TEST

START_TEST(capped_release_feeds_the_bucket)
{
	struct tokenbucket *tb = bucket_every(1, MS, 4, TOKENBUCKET_CAPPED_RELEASE);
	tokenbucket_replenish(tb, 0);
	uint64_t t = tokenbucket_grab(tb, 4);
	ck_assert_uint_eq(tokenbucket_deficiency(tb, t), 0);
	uint64_t u = tokenbucket_grab(tb, 2);
	/* Time alone does not refill a capped bucket: nothing was released. */
	tokenbucket_replenish(tb, 100 * MS);
	ck_assert_uint_eq(tokenbucket_deficiency(tb, u), 2);
	ck_assert_int_eq(tokenbucket_release(tb, 1), 0);
	tokenbucket_replenish(tb, 101 * MS);
	ck_assert_uint_eq(tokenbucket_deficiency(tb, u), 1);
	ck_assert_int_eq(tokenbucket_release(tb, 3), 0);
	tokenbucket_replenish(tb, 102 * MS); /* 1 ms produced one token, and the cap allows it */
	ck_assert_uint_eq(tokenbucket_deficiency(tb, u), 0);
	tokenbucket_replenish(tb, 200 * MS);
	ck_assert_tokens(tokenbucket_tokens_at(tb, 200 * MS), 2);
	/* Releasing more than was ever grabbed cannot lift ceil beyond tail + burst. */
	ck_assert_int_eq(tokenbucket_release(tb, 4), 0);
	ck_assert_int_eq(tokenbucket_release(tb, 4), 0);
	ck_assert_tokens(tokenbucket_tokens_at(tb, 300 * MS), 4);
	ck_assert(tokenbucket_allow_at(tb, 300 * MS, 4));
	ck_assert_int_eq(tokenbucket_release(tb, 4), 0);
	ck_assert_tokens(tokenbucket_tokens_at(tb, 310 * MS), 4);
	tokenbucket_free(tb);
}
END_TEST

/*
 * A replenisher first moves the clock, then loses the production that ceil
 * holds back.  A grab or a deficiency between the two must not count that
 * production: as tokens above burst it would be dropped with ceil left
 * behind, and the bucket would lose its room for good.
 */
START_TEST(capped_between_clock_and_cap)
{
	struct tokenbucket *tb = bucket_every(1, MS, 4, TOKENBUCKET_CAPPED_RELEASE);
	tokenbucket_replenish(tb, 0);
	uint64_t a = tokenbucket_grab(tb, 4);
	uint64_t b = tokenbucket_grab(tb, 2); /* in debt: nothing released */
	atomic_store(&tb->clock, 100 * MS);   /* the first step only */
	ck_assert_uint_eq(tokenbucket_deficiency(tb, b), 2);
	ck_assert_int_eq(tokenbucket_release(tb, 4), 0);
	uint64_t c = tokenbucket_grab(tb, 1);
	ck_assert_uint_eq(c - b, 1); /* nothing dropped */
	ck_assert_uint_eq(tokenbucket_deficiency(tb, a), 0);
	ck_assert_uint_eq(tokenbucket_deficiency(tb, c), 0);
	ck_assert_int_eq(tokenbucket_release(tb, 3), 0);
	/* Everything is back: the bucket fills to burst again. */
	tokenbucket_replenish(tb, 200 * MS);
	ck_assert_tokens(tokenbucket_tokens_at(tb, 200 * MS), 4);
	/* A refund in the same window finds the room that ceil leaves. */
	uint64_t d = tokenbucket_grab(tb, 4);
	atomic_store(&tb->clock, 300 * MS);
	tokenbucket_refund(tb, 4);
	ck_assert_uint_eq(tokenbucket_grab(tb, 4) - d, 4);
	ck_assert_uint_eq(tokenbucket_deficiency(tb, d + 4), 0);
	tokenbucket_free(tb);
}
END_TEST

START_TEST(capped_refund_is_no_longer_in_flight)
{
	struct tokenbucket *tb = bucket_every(1, MS, 4, TOKENBUCKET_CAPPED_RELEASE);
	tokenbucket_replenish(tb, 0);
	tokenbucket_grab(tb, 3);
	tokenbucket_refund(tb, 3);
	uint64_t t = tokenbucket_grab(tb, 4);
	ck_assert_uint_eq(tokenbucket_deficiency(tb, t), 0);
	ck_assert_int_eq(tokenbucket_release(tb, 4), 0);
	tokenbucket_replenish(tb, 10 * MS);
	ck_assert_tokens(tokenbucket_tokens_at(tb, 10 * MS), 4);
	tokenbucket_free(tb);
}
END_TEST

START_TEST(reset_sets_capped_room)
{
	struct tokenbucket *tb = bucket_every(1, MS, 4, TOKENBUCKET_CAPPED_RELEASE);
	ck_assert_int_eq(tokenbucket_reset_at(tb, 0, 1), 0);
	/* Room for replenishment is burst - tokens = 3. */
	tokenbucket_replenish(tb, 100 * MS);
	ck_assert_tokens(tokenbucket_tokens_at(tb, 100 * MS), 4);
	tokenbucket_free(tb);
}
END_TEST

START_TEST(duration_for_rounds_up)
{
	struct tokenbucket *tb = bucket_every(1, 3 * MS, 4, 0);
	ck_assert_int_eq(tokenbucket_duration_for(tb, 0), 0);
	ck_assert_int_eq(tokenbucket_duration_for(tb, 2), 6 * MS);
	tokenbucket_free(tb);
	tb = bucket_every(3, 7, 4, 0);
	ck_assert_int_eq(tokenbucket_duration_for(tb, 1), 3);
	ck_assert_int_eq(tokenbucket_duration_for(tb, 3), 7);
	ck_assert_int_eq(tokenbucket_duration_for(tb, 4), 10);
	tokenbucket_free(tb);
	tb = bucket_every(1, INT64_MAX, 4, 0);
	ck_assert_int_eq(tokenbucket_duration_for(tb, 1), INT64_MAX); /* not representable: never */
	tokenbucket_free(tb);
}
END_TEST

START_TEST(grab_debt_is_bounded)
{
	struct tokenbucket *tb = bucket_every(1, MS, 0, 0);
	uint64_t t0 = tokenbucket_grab(tb, 0);
	uint64_t t1 = tokenbucket_grab(tb, UINT64_MAX);
	ck_assert_uint_eq(t1 - t0, TOKENBUCKET_DEBT_MAX);
	ck_assert_uint_eq(tokenbucket_deficiency(tb, t1), TOKENBUCKET_DEBT_MAX);
	ck_assert_uint_eq(tokenbucket_grab(tb, 5), t1);
	tokenbucket_free(tb);
}
END_TEST

START_TEST(mixed_faces_share_one_state)
{
	struct tokenbucket *tb = bucket_empty_at(1, MS, 10, 0, 0);
	struct tokenbucket_reservation r;
	ck_assert_int_eq(tokenbucket_reserve_at(tb, 0, 2, TOKENBUCKET_NEVER, &r), 0);
	uint64_t g = tokenbucket_grab(tb, 1);
	ck_assert_uint_eq(g - r.ticket, 1);
	ck_assert_uint_eq(tokenbucket_deficiency(tb, r.ticket), 2);
	ck_assert_uint_eq(tokenbucket_deficiency(tb, g), 3);
	tokenbucket_replenish(tb, 2 * MS);
	ck_assert_uint_eq(tokenbucket_deficiency(tb, r.ticket), 0);
	ck_assert_tokens(tokenbucket_tokens_at(tb, 2 * MS), -1);
	tokenbucket_free(tb);
}
END_TEST

Suite *seastar_suite(void)
{
	Suite *s = suite_create("seastar");
	TCase *tc = tcase_create("tickets");
	tcase_add_test(tc, grab_returns_the_tail);
	tcase_add_test(tc, tickets_are_covered_in_order);
	tcase_add_test(tc, grab_debt_is_bounded);
	tcase_add_test(tc, mixed_faces_share_one_state);
	suite_add_tcase(s, tc);
	tc = tcase_create("replenish");
	tcase_add_test(tc, replenish_only_when_asked);
	tcase_add_test(tc, replenish_is_capped_at_burst);
	tcase_add_test(tc, replenish_waits_for_the_threshold);
	tcase_add_test(tc, refund_gives_back_within_burst);
	tcase_add_test(tc, duration_for_rounds_up);
	suite_add_tcase(s, tc);
	tc = tcase_create("capped-release");
	tcase_add_test(tc, capped_release_feeds_the_bucket);
	tcase_add_test(tc, capped_refund_is_no_longer_in_flight);
	tcase_add_test(tc, capped_between_clock_and_cap);
	tcase_add_test(tc, reset_sets_capped_room);
	suite_add_tcase(s, tc);
	return s;
}
