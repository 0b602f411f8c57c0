/* SPDX-License-Identifier: MIT */
/* Shared helpers for the Check suites; one suite per area, one ctest entry per suite. */
#ifndef CHECK_TB_H
#define CHECK_TB_H

#include <check.h>
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <tokenbucket.h>

#include "forked.h"

#define US INT64_C(1000)
#define MS INT64_C(1000000)
#define SEC INT64_C(1000000000)

/* A bucket producing tokens per period_ns; the test fails if it cannot be made. */
static inline struct tokenbucket *bucket_every(uint64_t tokens, int64_t period_ns, uint64_t burst,
					       unsigned flags)
{
	struct tokenbucket *tb = NULL;
	int err = tokenbucket_create_every(&tb, tokens, period_ns, burst, flags);
	ck_assert_int_eq(err, 0);
	ck_assert_ptr_nonnull(tb);
	return tb;
}

/* As bucket_every, but empty, with its clock fixed at t0. */
static inline struct tokenbucket *bucket_empty_at(uint64_t tokens, int64_t period_ns, uint64_t burst,
						  unsigned flags, int64_t t0)
{
	struct tokenbucket *tb = bucket_every(tokens, period_ns, burst, flags);
	ck_assert_int_eq(tokenbucket_reset_at(tb, t0, 0), 0);
	return tb;
}

static inline struct tokenbucket *bucket_rate(double rate, uint64_t burst, unsigned flags)
{
	struct tokenbucket *tb = NULL;
	int err = tokenbucket_create(&tb, rate, burst, flags);
	ck_assert_int_eq(err, 0);
	ck_assert_ptr_nonnull(tb);
	return tb;
}

/* Fractional token counts are exact rationals; doubles hold them to ~1e-15 relative. */
#define ck_assert_tokens(got, want) ck_assert_double_eq_tol((got), (want), 1e-9)

Suite *seeds_suite(void);
Suite *go_suite(void);
Suite *seastar_suite(void);
Suite *contract_suite(void);
Suite *exactness_suite(void);
Suite *errors_suite(void);
Suite *concurrency_suite(void);
Suite *wait_suite(void);
Suite *badinput_suite(void);
Suite *stress_suite(void);
Suite *shared_suite(void);
Suite *table_suite(void);
Suite *table_shared_suite(void);
/* 1.2: exact limits, the twins without _at, a table's wait (core/test_limit.c). */
Suite *limit_suite(void);
/* 1.2: a table's rate and burst change (table/test_table_regime.c). */
Suite *table_regime_suite(void);
/* 1.2: several limits in one decision (core/test_set.c). */
Suite *set_suite(void);
/* 1.2: several limits per key (table/test_table_set.c). */
Suite *table_set_suite(void);

#endif
