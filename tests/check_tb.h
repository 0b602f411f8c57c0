/* SPDX-License-Identifier: MIT */
/* Shared helpers for the Check suites; one suite per area, one ctest entry per suite. */
#ifndef CHECK_TB_H
#define CHECK_TB_H

#include <check.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
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

/*
 * The sets' thread tests (core/test_set.c, table/test_table_set.c): the
 * tokens a limit may grant over elapsed ns, burst + floor(elapsed * tokens
 * / period), exactly; the ns after which it is full again from empty.
 */
static inline uint64_t limit_bound(const struct tokenbucket_limit *l, int64_t elapsed)
{
	unsigned __int128 made = (unsigned __int128)(uint64_t)elapsed * l->tokens /
				 (uint64_t)l->period_ns;
	return l->burst + (uint64_t)made;
}

static inline int64_t limit_refill(const struct tokenbucket_limit *l)
{
	return (int64_t)(l->burst * (uint64_t)l->period_ns / l->tokens) + 1;
}

/*
 * The sets' reset tests: folds member i's own reset_after_ns into *latest
 * (from 0), counting in *distinct the members whose wait differs from
 * member 0's (*first).
 */
static inline void fold_reset(size_t i, int64_t reset, int64_t *latest, int64_t *first,
			      uint64_t *distinct)
{
	if (reset > *latest)
		*latest = reset;
	if (i == 0)
		*first = reset;
	else if (reset != *first)
		(*distinct)++;
}

/* Runs fn on each of count args of size bytes at args, in threads of their own, and joins them. */
static inline void run_each_thread(int count, void *(*fn)(void *), void *args, size_t size)
{
	pthread_t t[64];
	ck_assert_int_le(count, 64);
	for (int i = 0; i < count; i++)
		ck_assert_int_eq(pthread_create(&t[i], NULL, fn, (char *)args + (size_t)i * size), 0);
	for (int i = 0; i < count; i++)
		pthread_join(t[i], NULL);
}

/* The stress tests' length: TOKENBUCKET_STRESS_SECONDS, else dflt. */
static inline double stress_seconds(double dflt)
{
	const char *env = getenv("TOKENBUCKET_STRESS_SECONDS");
	return env && atof(env) > 0 ? atof(env) : dflt;
}

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
Suite *parse_suite(void);
/* 1.2: a table's rate and burst change (table/test_table_regime.c). */
Suite *table_regime_suite(void);
/* 1.2: several limits in one decision (core/test_set.c). */
Suite *set_suite(void);
/* 1.2: several limits per key (table/test_table_set.c). */
Suite *table_set_suite(void);

#endif
