/* SPDX-License-Identifier: MIT */
/*
 * Expiry: a key lives until its bucket would be full again plus a second;
 * then it is gone, and a missing key is a full bucket, so callers see no
 * difference.  A bucket that never fills again stays, and so does one
 * written at the caller's time.
 */
#include <hiredis/hiredis.h>
#include <stdlib.h>
#include <string.h>
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

START_TEST(test_explicit_time_keys_stay)
{
	/*
	 * At the caller's time the key has no expiry: its nanoseconds need not
	 * run with the server's, and a key that vanished would forget its clock
	 * and grant again.  Rate 1 per 100 ns, burst 5, as a caller whose
	 * clock starts at 1 ms: after 1.3 s of real time the bucket still
	 * answers as the local library does.
	 */
	const struct tokenbucket_redis_limit lim = { .tokens = 1, .period_ns = 100, .burst = 5 };
	struct tokenbucket *tb;
	ck_assert_int_eq(tokenbucket_create_every(&tb, 1, 100, 5, 0), 0);
	struct tokenbucket_result res;
	ck_assert_int_eq(tokenbucket_redis_allow_at(cli, KEY("at"), &lim, 1000000, 5, &res), 0);
	ck_assert(res.allowed);
	ck_assert(tokenbucket_allow_at(tb, 1000000, 5));
	ck_assert_int_eq(pttl("at"), -1);
	/* A reserve at the caller's time keeps it so. */
	struct tokenbucket_reservation r, want;
	const struct tokenbucket_redis_limit slow = { .tokens = 1, .period_ns = SEC, .burst = 100 };
	ck_assert_int_eq(tokenbucket_redis_reserve_at(cli, KEY("at30"), &slow, 0, 30, 0, &r, NULL), 0);
	ck_assert_int_eq(pttl("at30"), -1);
	usleep(1300000);
	ck_assert_int_eq(tokenbucket_redis_allow_at(cli, KEY("at"), &lim, 1000001, 5, &res), 0);
	ck_assert(!res.allowed);
	ck_assert(!tokenbucket_allow_at(tb, 1000001, 5));
	/* An earlier time counts as the latest one seen. */
	ck_assert_int_eq(tokenbucket_redis_reserve_at(cli, KEY("at"), &lim, 900000, 5, TOKENBUCKET_NEVER, &r, NULL), 0);
	ck_assert_int_eq(tokenbucket_reserve_at(tb, 900000, 5, TOKENBUCKET_NEVER, &want), 0);
	ck_assert_int_eq(r.time_to_act, want.time_to_act);
	ck_assert_int_eq(pttl("at"), -1);
	/* A call on the server's clock gives the key its expiry back. */
	ck_assert_int_eq(tokenbucket_redis_allow(cli, KEY("at"), &lim, 0, &res), 0);
	ck_assert_int_gt(pttl("at"), 0);
	tokenbucket_free(tb);
}
END_TEST

static char *value_of(const char *key)
{
	redisContext *c = server_admin(&srv);
	ck_assert_ptr_nonnull(c);
	redisReply *r = redisCommand(c, "GET %s", key);
	ck_assert_ptr_nonnull(r);
	ck_assert_int_eq(r->type, REDIS_REPLY_STRING);
	char *v = strdup(r->str);
	freeReplyObject(r);
	redisFree(c);
	return v;
}

START_TEST(test_refusal_writes_nothing)
{
	/* 1 token per hour, burst 2: the third call is refused. */
	const struct tokenbucket_redis_limit lim = { .tokens = 1, .period_ns = 3600 * SEC, .burst = 2 };
	struct tokenbucket_result res;
	ck_assert_int_eq(tokenbucket_redis_allow(cli, KEY("r"), &lim, 2, &res), 0);
	ck_assert(res.allowed);
	char *before = value_of("r");
	usleep(20000);
	for (int i = 0; i < 3; i++) {
		ck_assert_int_eq(tokenbucket_redis_allow(cli, KEY("r"), &lim, 1, &res), 0);
		ck_assert(!res.allowed);
		struct tokenbucket_reservation rv;
		ck_assert_int_eq(tokenbucket_redis_reserve(cli, KEY("r"), &lim, 1, SEC, &rv, &res), -ETIMEDOUT);
	}
	char *after = value_of("r");
	ck_assert_str_eq(after, before);
	free(after);
	/* A grant writes. */
	ck_assert_int_eq(tokenbucket_redis_reset(cli, KEY("r"), &lim, 2), 0);
	ck_assert_int_eq(tokenbucket_redis_allow(cli, KEY("r"), &lim, 1, &res), 0);
	ck_assert(res.allowed);
	after = value_of("r");
	ck_assert_str_ne(after, before);
	free(after);
	free(before);
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
		    (const TTest *const[]){ test_idle_key_expires_when_full, test_explicit_time_keys_stay, test_refusal_writes_nothing, test_never_full_never_expires, NULL });
	return s;
}
