/* SPDX-License-Identifier: MIT */
/*
 * Differential: random call sequences at explicit times through the real
 * server, every answer equal to the local library's (tests/redis/sequence.c
 * makes the steps and asks the library).
 */
#if defined(__has_include)
#if __has_include(<valgrind/valgrind.h>)
#include <valgrind/valgrind.h>
#define TBT_ON_VALGRIND RUNNING_ON_VALGRIND
#endif
#endif
#ifndef TBT_ON_VALGRIND
#define TBT_ON_VALGRIND 0
#endif
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "check_redis.h"
#include "sequence.h"

int redis_sequence(struct tokenbucket_redis *c, uint64_t seed, int steps, long index)
{
	struct seq s;
	struct seq_step st;
	struct seq_expect ex;
	char key[48];
	snprintf(key, sizeof(key), "diff:%" PRIx64 ":%ld", seed, index);
	ck_assert_int_eq(seq_start(&s, seed, steps), 0);
	int done = 0;
	while (seq_next(&s, &st, &ex)) {
		ck_assert_msg(ex.err != -EFAULT, "the local library refused a step");
		struct tokenbucket_result res;
		int err = 0;
		switch (st.op) {
		case TOKENBUCKET_REDIS_ALLOW:
			err = tokenbucket_redis_allow_at(c, KEY(key), &st.lim, st.now, st.n, &res);
			ck_assert_int_eq(err, 0);
			ck_assert_msg(res.allowed == ex.allowed, "%s step %d: allow %d, local %d", key,
				      done, res.allowed, ex.allowed);
			break;
		case TOKENBUCKET_REDIS_RESERVE: {
			struct tokenbucket_reservation r;
			err = tokenbucket_redis_reserve_at(c, KEY(key), &st.lim, st.now, st.n, st.arg,
							   &r, &res);
			ck_assert_msg(err == ex.err, "%s step %d: reserve %d, local %d", key, done, err,
				      ex.err);
			if (err == 0) {
				ck_assert_msg(r.time_to_act == ex.act,
					      "%s step %d: time_to_act %" PRId64 ", local %" PRId64, key,
					      done, r.time_to_act, ex.act);
				ck_assert_uint_eq(r.tokens, st.n);
			}
			break;
		}
		case TOKENBUCKET_REDIS_CANCEL: {
			struct tokenbucket_reservation r = { .time_to_act = st.arg, .tokens = st.n };
			err = tokenbucket_redis_cancel_at(c, KEY(key), &st.lim, &r, st.now);
			ck_assert_int_eq(err, 0);
			ck_assert_uint_eq(r.tokens, 0);
			break;
		}
		case TOKENBUCKET_REDIS_REFUND: {
			err = tokenbucket_redis_refund_at(c, KEY(key), &st.lim, st.now, st.n);
			ck_assert_msg(err == ex.err, "%s step %d: refund %d, local %d", key, done, err,
				      ex.err);
			break;
		}
		case TOKENBUCKET_REDIS_TOKENS: {
			double v = 0;
			err = tokenbucket_redis_tokens_at(c, KEY(key), &st.lim, st.now, &v, &res);
			ck_assert_int_eq(err, 0);
			/* Bit for bit: the client computes level + rem/q as the local library
			 * does.  Memcheck emulates long double with a 64-bit mantissa, so
			 * under it the two may differ by one ulp. */
			ck_assert_msg(memcmp(&v, &ex.tokens, sizeof(v)) == 0 ||
					      (TBT_ON_VALGRIND && nextafter(v, ex.tokens) == ex.tokens),
				      "%s step %d: tokens %a, local %a", key, done, v, ex.tokens);
			break;
		}
		case TOKENBUCKET_REDIS_RESET:
			err = tokenbucket_redis_reset_at(c, KEY(key), &st.lim, st.now, st.n);
			ck_assert_msg(err == ex.err, "%s step %d: reset %d, local %d", key, done, err,
				      ex.err);
			break;
		}
		done++;
	}
	seq_end(&s);
	return done;
}

START_TEST(test_differential)
{
	/* 10^4 sequences of 16 steps by default: a few seconds on a unix socket. */
	long count = redis_sequences(10000);
	long steps = 0;
	for (long i = 0; i < count; i++)
		steps += redis_sequence(cli, 0x7b0c5e11u + (uint64_t)i * 0x9e3779b97f4a7c15u, 16, i);
	printf("redis differential: %ld steps in %ld sequences, no difference\n", steps, count);
}
END_TEST

Suite *redis_diff_suite(void)
{
	Suite *s = suite_create("redis-diff");
	redis_tcase(s, "differential", redis_setup, 240,
		    (const TTest *const[]){ test_differential, NULL });
	return s;
}
