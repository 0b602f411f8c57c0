/* SPDX-License-Identifier: MIT */
/*
 * Every error the contract names, and the calls that accept NULL.  After a
 * refusal, output parameters and the bucket are unchanged.
 */
#include <fcntl.h>
#include <float.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "check_tb.h"

#define SENTINEL ((struct tokenbucket *)0x5)

START_TEST(create_errors)
{
	struct tokenbucket *tb = SENTINEL;
	ck_assert_int_eq(tokenbucket_create(NULL, 1, 1, 0), -EINVAL);
	ck_assert_int_eq(tokenbucket_create(&tb, NAN, 1, 0), -EINVAL);
	ck_assert_int_eq(tokenbucket_create(&tb, -1, 1, 0), -EINVAL);
	ck_assert_int_eq(tokenbucket_create(&tb, -TOKENBUCKET_INF, 1, 0), -EINVAL);
	ck_assert_int_eq(tokenbucket_create(&tb, 1, 1, 1u << 1), -EINVAL);
	ck_assert_int_eq(tokenbucket_create(&tb, 1, TOKENBUCKET_BURST_MAX + 1, 0), -ERANGE);
	ck_assert_int_eq(tokenbucket_create(&tb, 1, UINT64_MAX, 0), -ERANGE);
	ck_assert_int_eq(tokenbucket_create_every(NULL, 1, 1, 1, 0), -EINVAL);
	ck_assert_int_eq(tokenbucket_create_every(&tb, 1, 0, 1, 0), -EINVAL);
	ck_assert_int_eq(tokenbucket_create_every(&tb, 1, -5, 1, 0), -EINVAL);
	ck_assert_int_eq(tokenbucket_create_every(&tb, 1, 1, 1, ~0u), -EINVAL);
	ck_assert_int_eq(tokenbucket_create_every(&tb, 1, 1, TOKENBUCKET_BURST_MAX + 1, 0), -ERANGE);
	ck_assert_ptr_eq(tb, SENTINEL);
	/* The generous limits: 2^40 tokens of burst at 1e9 tokens per second, and beyond. */
	ck_assert_int_eq(tokenbucket_create(&tb, 1e9, UINT64_C(1) << 40, 0), 0);
	tokenbucket_free(tb);
	ck_assert_int_eq(tokenbucket_create(&tb, 1e-300, TOKENBUCKET_BURST_MAX, 0), 0);
	ck_assert_int_eq(tokenbucket_duration_for(tb, 1), TOKENBUCKET_NEVER);
	tokenbucket_free(tb);
	ck_assert_int_eq(tokenbucket_create(&tb, 1e300, 0, TOKENBUCKET_CAPPED_RELEASE), 0);
	tokenbucket_free(tb);
	ck_assert_int_eq(tokenbucket_create(&tb, -0.0, 1, 0), 0);
	ck_assert_double_eq(tokenbucket_rate(tb), 0);
	tokenbucket_free(tb);
	ck_assert_int_eq(tokenbucket_create(&tb, DBL_TRUE_MIN, 1, 0), 0);
	ck_assert_double_gt(tokenbucket_rate(tb), 0);
	tokenbucket_free(tb);
}
END_TEST

START_TEST(reset_errors)
{
	struct tokenbucket *tb = bucket_every(1, MS, 5, 0);
	ck_assert(tokenbucket_allow_at(tb, 0, 2));
	ck_assert_int_eq(tokenbucket_reset_at(NULL, 0, 0), -EINVAL);
	ck_assert_int_eq(tokenbucket_reset_at(tb, 0, 6), -EINVAL);
	ck_assert_tokens(tokenbucket_tokens_at(tb, 0), 3);
	ck_assert_int_eq(tokenbucket_reset_at(tb, 0, 5), 0);
	ck_assert_tokens(tokenbucket_tokens_at(tb, 0), 5);
	tokenbucket_free(tb);
}
END_TEST

START_TEST(seastar_errors)
{
	struct tokenbucket *tb = bucket_every(1, MS, 5, 0);
	ck_assert_int_eq(tokenbucket_release(tb, 1), -ENOTSUP);
	ck_assert_int_eq(tokenbucket_release(NULL, 1), -EINVAL);
	ck_assert_int_eq(tokenbucket_set_threshold(tb, 0), -EINVAL);
	ck_assert_int_eq(tokenbucket_set_threshold(tb, 6), -EINVAL);
	ck_assert_int_eq(tokenbucket_set_threshold(NULL, 1), -EINVAL);
	ck_assert_int_eq(tokenbucket_set_threshold(tb, 5), 0);
	tokenbucket_free(tb);
	tb = bucket_every(1, MS, 5, TOKENBUCKET_CAPPED_RELEASE);
	ck_assert_int_eq(tokenbucket_release(tb, 6), -EINVAL);
	ck_assert_int_eq(tokenbucket_release(tb, 5), 0);
	tokenbucket_free(tb);
	tb = bucket_every(1, MS, 0, 0);
	ck_assert_int_eq(tokenbucket_set_threshold(tb, 1), -EINVAL); /* no valid threshold */
	tokenbucket_free(tb);
}
END_TEST

START_TEST(reserve_errors)
{
	struct tokenbucket *tb = bucket_every(1, MS, 5, 0);
	struct tokenbucket_reservation r = { 1, 2, 3, 4 }, saved = r;
	ck_assert_int_eq(tokenbucket_reserve_at(NULL, 0, 1, 0, &r), -EINVAL);
	ck_assert_int_eq(tokenbucket_reserve_at(tb, 0, 1, 0, NULL), -EINVAL);
	ck_assert_int_eq(tokenbucket_reserve_at(tb, 0, 6, TOKENBUCKET_NEVER, &r), -E2BIG);
	ck_assert_int_eq(tokenbucket_reserve_at(tb, 0, 5, -1, &r), -ETIMEDOUT);
	ck_assert_int_eq(tokenbucket_reserve_at(tb, 0, 5, 0, &r), 0);
	saved = r = (struct tokenbucket_reservation){ 1, 2, 3, 4 };
	ck_assert_int_eq(tokenbucket_reserve_at(tb, 0, 1, MS - 1, &r), -ETIMEDOUT);
	ck_assert_int_eq(tokenbucket_reserve(tb, 6, TOKENBUCKET_NEVER, &r), -E2BIG);
	ck_assert(memcmp(&r, &saved, sizeof(r)) == 0);
	ck_assert_tokens(tokenbucket_tokens_at(tb, 0), 0);
	tokenbucket_free(tb);
	/* The debt a bucket can carry is bounded. */
	tb = bucket_rate(0, TOKENBUCKET_BURST_MAX, 0);
	ck_assert_int_eq(tokenbucket_reserve_at(tb, 0, TOKENBUCKET_BURST_MAX, 0, &r), 0);
	ck_assert_int_eq(tokenbucket_reserve_at(tb, 0, TOKENBUCKET_DEBT_MAX, TOKENBUCKET_NEVER, &r), 0);
	saved = r;
	ck_assert_int_eq(tokenbucket_reserve_at(tb, 0, 1, TOKENBUCKET_NEVER, &r), -EOVERFLOW);
	ck_assert(memcmp(&r, &saved, sizeof(r)) == 0);
	tokenbucket_free(tb);
}
END_TEST

START_TEST(wait_errors)
{
	struct tokenbucket *tb = bucket_every(1, SEC, 5, 0);
	ck_assert_int_eq(tokenbucket_wait(NULL, 1, TOKENBUCKET_NEVER, -1), -EINVAL);
	ck_assert_int_eq(tokenbucket_wait(tb, 6, TOKENBUCKET_NEVER, -1), -E2BIG);
	ck_assert_int_eq(tokenbucket_wait(tb, 1, TOKENBUCKET_NEVER, -2), -EBADF);
	int fds[2];
	ck_assert_int_eq(pipe(fds), 0);
	close(fds[0]);
	close(fds[1]);
	ck_assert_int_eq(tokenbucket_wait(tb, 1, TOKENBUCKET_NEVER, fds[0]), -EBADF);
	int efd = eventfd(1, EFD_CLOEXEC);
	ck_assert_int_ge(efd, 0);
	ck_assert_int_eq(tokenbucket_wait(tb, 1, TOKENBUCKET_NEVER, efd), -ECANCELED);
	close(efd);
	/* A deadline already past: at once, nothing taken, though tokens are there. */
	ck_assert_int_eq(tokenbucket_wait(tb, 1, tokenbucket_now() - 1, -1), -ETIMEDOUT);
	ck_assert_int_eq(tokenbucket_wait(tb, 5, TOKENBUCKET_NEVER, -1), 0);
	ck_assert_int_eq(tokenbucket_wait(tb, 5, tokenbucket_now() + MS, -1), -ETIMEDOUT);
	tokenbucket_free(tb);
	tb = bucket_rate(0, 1, 0);
	ck_assert(tokenbucket_allow(tb, 1));
	ck_assert_int_eq(tokenbucket_wait(tb, 1, TOKENBUCKET_NEVER, -1), -ETIMEDOUT);
	ck_assert_tokens(tokenbucket_tokens(tb), 0);
	tokenbucket_free(tb);
}
END_TEST

START_TEST(setting_errors)
{
	struct tokenbucket *tb = bucket_every(1, MS, 5, 0);
	ck_assert_int_eq(tokenbucket_set_rate(NULL, 1), -EINVAL);
	ck_assert_int_eq(tokenbucket_set_rate_at(tb, 0, NAN), -EINVAL);
	ck_assert_int_eq(tokenbucket_set_rate_at(tb, 0, -3), -EINVAL);
	ck_assert_int_eq(tokenbucket_set_rate_every_at(NULL, 0, 1, 1), -EINVAL);
	ck_assert_int_eq(tokenbucket_set_rate_every_at(tb, 0, 1, 0), -EINVAL);
	ck_assert_int_eq(tokenbucket_set_rate_every_at(tb, 0, 1, -1), -EINVAL);
	ck_assert_int_eq(tokenbucket_set_burst(NULL, 1), -EINVAL);
	ck_assert_int_eq(tokenbucket_set_burst_at(tb, 0, TOKENBUCKET_BURST_MAX + 1), -ERANGE);
	ck_assert_double_eq(tokenbucket_rate(tb), 1000);
	ck_assert_uint_eq(tokenbucket_burst(tb), 5);
	ck_assert_tokens(tokenbucket_tokens_at(tb, 0), 5);
	tokenbucket_free(tb);
}
END_TEST

START_TEST(null_is_harmless)
{
	tokenbucket_free(NULL);
	ck_assert_uint_eq(tokenbucket_grab(NULL, 1), 0);
	ck_assert_uint_eq(tokenbucket_deficiency(NULL, 1), 0);
	tokenbucket_replenish(NULL, 0);
	tokenbucket_refund(NULL, 1);
	ck_assert(!tokenbucket_allow(NULL, 1));
	ck_assert(!tokenbucket_allow_at(NULL, 0, 1));
	ck_assert(isnan(tokenbucket_tokens(NULL)));
	ck_assert(isnan(tokenbucket_tokens_at(NULL, 0)));
	ck_assert(isnan(tokenbucket_rate(NULL)));
	ck_assert_uint_eq(tokenbucket_burst(NULL), 0);
	ck_assert_int_eq(tokenbucket_duration_for(NULL, 1), TOKENBUCKET_NEVER);
	ck_assert_int_eq(tokenbucket_reservation_delay(NULL, 0), TOKENBUCKET_NEVER);
	struct tokenbucket_reservation r = { 0, 3, 0, 0 };
	tokenbucket_cancel(NULL, &r);
	tokenbucket_cancel_at(NULL, &r, 0);
	struct tokenbucket *tb = bucket_every(1, MS, 5, 0);
	tokenbucket_cancel(tb, NULL);
	tokenbucket_cancel_at(tb, NULL, 0);
	tokenbucket_free(tb);
}
END_TEST

START_TEST(version_matches_header)
{
	ck_assert_uint_eq(tokenbucket_version_number(), TOKENBUCKET_VERSION_NUMBER);
	ck_assert_uint_eq(TOKENBUCKET_VERSION_NUMBER, 10200);
	ck_assert_str_eq(tokenbucket_version_string(), TOKENBUCKET_VERSION_STRING);
	ck_assert_str_eq(tokenbucket_version_string(), "1.2.0");
}
END_TEST

Suite *errors_suite(void)
{
	Suite *s = suite_create("errors");
	TCase *tc = tcase_create("errno");
	tcase_add_test(tc, create_errors);
	tcase_add_test(tc, reset_errors);
	tcase_add_test(tc, seastar_errors);
	tcase_add_test(tc, reserve_errors);
	tcase_add_test(tc, wait_errors);
	tcase_add_test(tc, setting_errors);
	tcase_add_test(tc, null_is_harmless);
	tcase_add_test(tc, version_matches_header);
	suite_add_tcase(s, tc);
	return s;
}
