/* SPDX-License-Identifier: MIT */
/*
 * Expiry: a key lives until its bucket would be full again plus a second;
 * then it is gone, and a missing key is a full bucket, so callers see no
 * difference.  A bucket that never fills again stays.
 */
#include <hiredis/hiredis.h>
#include <unistd.h>

#include "check_redis.h"

static long long pttl(const char *key)
{
	redisContext *c = server_admin(&srv);
	ck_assert_ptr_nonnull(c);
	redisReply *r = redisCommand(c, "PTTL %s", key);
	ck_assert_ptr_nonnull(r);
	ck_assert_int_eq(r->type, REDIS_REPLY_INTEGER);
	long long v = r->integer;
	freeReplyObject(r);
	redisFree(c);
	return v;
}

START_TEST(test_idle_key_expires_when_full)
{
	/* 1000 tokens per second, burst 10: 5 taken are back in 5 ms. */
	const struct tokenbucket_redis_limit lim = { .tokens = 1, .period_ns = MS, .burst = 10 };
	struct tokenbucket_result res;
	for (int i = 0; i < 5; i++)
		ck_assert_int_eq(tokenbucket_redis_allow(cli, KEY("idle"), &lim, 1, &res), 0);
	ck_assert(res.allowed);
	ck_assert_int_le(res.reset_after_ns, 5 * MS);
	long long ttl = pttl("idle");
	/* 1 s after full (5 ms away), less the time since: slow machines vary. */
	ck_assert_msg(ttl > 500 && ttl <= 1006, "PTTL %lld", ttl);
	usleep(1100000);
	ck_assert_int_eq(pttl("idle"), -2); /* gone */
	/* What a bucket left alone for a second holds: full. */
	double tokens = 0;
	ck_assert_int_eq(tokenbucket_redis_tokens(cli, KEY("idle"), &lim, &tokens, &res), 0);
	ck_assert(tokens == 10);
	ck_assert_uint_eq(res.remaining, 10);
	ck_assert_int_eq(res.reset_after_ns, 0);
	for (int i = 0; i < 10; i++) {
		ck_assert_int_eq(tokenbucket_redis_allow(cli, KEY("idle"), &lim, 1, &res), 0);
		ck_assert(res.allowed);
	}
}
END_TEST

START_TEST(test_expiry_follows_explicit_time)
{
	/* 1 token per second, burst 100, at explicit times: 30 missing are 30 s. */
	const struct tokenbucket_redis_limit lim = { .tokens = 1, .period_ns = SEC, .burst = 100 };
	struct tokenbucket_reservation r;
	ck_assert_int_eq(tokenbucket_redis_reserve_at(cli, KEY("x"), &lim, 0, 30, 0, &r, NULL), 0);
	long long ttl = pttl("x");
	ck_assert_msg(ttl > 30000 && ttl <= 31000, "PTTL %lld", ttl);
}
END_TEST

START_TEST(test_never_full_never_expires)
{
	const struct tokenbucket_redis_limit zero = { .tokens = 0, .period_ns = 1, .burst = 10 };
	struct tokenbucket_result res;
	ck_assert_int_eq(tokenbucket_redis_allow(cli, KEY("z"), &zero, 1, &res), 0);
	ck_assert_int_eq(res.reset_after_ns, TOKENBUCKET_NEVER);
	ck_assert_int_eq(pttl("z"), -1);
	/* Full again (a reset), it expires like any full bucket. */
	ck_assert_int_eq(tokenbucket_redis_reset(cli, KEY("z"), &zero, 10), 0);
	long long ttl = pttl("z");
	ck_assert_msg(ttl > 500 && ttl <= 1000, "PTTL %lld", ttl);
}
END_TEST

Suite *redis_expiry_suite(void)
{
	Suite *s = suite_create("redis-expiry");
	redis_tcase(s, "expiry", redis_setup, 30,
		    (const TTest *const[]){ test_idle_key_expires_when_full, test_expiry_follows_explicit_time, test_never_full_never_expires, NULL });
	return s;
}
