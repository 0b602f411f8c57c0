/* SPDX-License-Identifier: MIT */
/*
 * Bad input, the caller's and the server's: keys of every shape, absurd
 * configurations, malformed URLs, raw script calls with bad arguments and
 * stored values that are not buckets.  Each is an error or works; none
 * crashes the library or the script.
 */
#include <hiredis/hiredis.h>
#include <stdlib.h>

#include "check_redis.h"

static const struct tokenbucket_redis_limit lim = { .tokens = 1, .period_ns = SEC, .burst = 3 };

START_TEST(test_keys)
{
	struct tokenbucket_result res;
	/* The empty key is a key. */
	ck_assert_int_eq(tokenbucket_redis_allow(cli, "", 0, &lim, 3, &res), 0);
	ck_assert(res.allowed);
	ck_assert_int_eq(tokenbucket_redis_allow(cli, NULL, 0, &lim, 1, &res), 0);
	ck_assert(!res.allowed);
	/* Binary keys: bytes after a NUL count. */
	ck_assert_int_eq(tokenbucket_redis_allow(cli, "a\0b", 3, &lim, 3, &res), 0);
	ck_assert(res.allowed);
	ck_assert_int_eq(tokenbucket_redis_allow(cli, "a\0c", 3, &lim, 3, &res), 0);
	ck_assert(res.allowed);
	ck_assert_int_eq(tokenbucket_redis_allow(cli, "a\0b", 3, &lim, 1, &res), 0);
	ck_assert(!res.allowed);
	/* 512 KiB of bytes, every value. */
	size_t len = 512 * 1024;
	char *big = malloc(len);
	ck_assert_ptr_nonnull(big);
	for (size_t i = 0; i < len; i++)
		big[i] = (char)(i * 31 + 7);
	ck_assert_int_eq(tokenbucket_redis_allow(cli, big, len, &lim, 2, &res), 0);
	ck_assert(res.allowed);
	ck_assert_uint_eq(res.remaining, 1);
	ck_assert_int_eq(tokenbucket_redis_allow(cli, big, len, &lim, 2, &res), 0);
	ck_assert(!res.allowed);
	free(big);
	/* NULL with a length is an error, not a read. */
	ck_assert_int_eq(tokenbucket_redis_allow(cli, NULL, 5, &lim, 1, &res), -EINVAL);
}
END_TEST

START_TEST(test_configurations)
{
	struct tokenbucket_result res;
	struct tokenbucket_reservation r;
	const struct tokenbucket_redis_limit no_period = { .tokens = 1, .period_ns = 0, .burst = 3 };
	const struct tokenbucket_redis_limit negative = { .tokens = 1, .period_ns = -5, .burst = 3 };
	const struct tokenbucket_redis_limit huge_burst = { .tokens = 1, .period_ns = 1,
							    .burst = TOKENBUCKET_BURST_MAX + 1 };
	ck_assert_int_eq(tokenbucket_redis_allow(cli, KEY("c"), &no_period, 1, &res), -EINVAL);
	ck_assert_int_eq(tokenbucket_redis_allow(cli, KEY("c"), &negative, 1, &res), -EINVAL);
	ck_assert_int_eq(tokenbucket_redis_allow(cli, KEY("c"), &huge_burst, 1, &res), -ERANGE);
	ck_assert_int_eq(tokenbucket_redis_allow(cli, KEY("c"), NULL, 1, &res), -EINVAL);
	ck_assert_int_eq(tokenbucket_redis_reset(cli, KEY("c"), &lim, 4), -EINVAL);
	ck_assert_int_eq(tokenbucket_redis_reserve(cli, KEY("c"), &lim, 1, 0, NULL, &res), -EINVAL);
	ck_assert_int_eq(tokenbucket_redis_allow(NULL, KEY("c"), &lim, 1, &res), -EINVAL);
	ck_assert_int_eq(tokenbucket_redis_reserve(cli, KEY("c"), &lim, 4, 0, &r, &res), -E2BIG);
	/* The extremes the local library accepts work, exactly. */
	const struct tokenbucket_redis_limit fastest = { .tokens = UINT64_MAX, .period_ns = 1,
							 .burst = TOKENBUCKET_BURST_MAX };
	ck_assert_int_eq(tokenbucket_redis_reset_at(cli, KEY("f"), &fastest, INT64_MIN, 0), 0);
	ck_assert_int_eq(tokenbucket_redis_reserve_at(cli, KEY("f"), &fastest, INT64_MIN, TOKENBUCKET_DEBT_MAX,
						      TOKENBUCKET_NEVER, &r, &res), 0);
	ck_assert_int_eq(r.time_to_act, INT64_MIN + 2); /* 2^62 - 1 tokens at 2^64 - 1 per ns: 1 ns */
	const struct tokenbucket_redis_limit slowest = { .tokens = 1, .period_ns = INT64_MAX,
							 .burst = TOKENBUCKET_BURST_MAX };
	ck_assert_int_eq(tokenbucket_redis_reset_at(cli, KEY("s"), &slowest, 0, 0), 0);
	ck_assert_int_eq(tokenbucket_redis_reserve_at(cli, KEY("s"), &slowest, 0, 1, TOKENBUCKET_NEVER, &r,
						      &res), 0);
	ck_assert_int_eq(r.time_to_act, TOKENBUCKET_NEVER);
	ck_assert_int_eq(res.retry_after_ns, TOKENBUCKET_NEVER);
}
END_TEST

START_TEST(test_urls)
{
	static const char *const bad[] = { "", "http://x", "redis://", "redis://h:0", "redis://h:99999",
					   "redis://h:12x", "unix:", "unix:relative", "redis://h/x",
					   "redis://h/1/2", "/tmp/s?db=-1" };
	struct tokenbucket_redis *r = NULL;
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
		ck_assert_msg(tokenbucket_redis_open(&r, bad[i], 0, 0) == -EINVAL, "%s", bad[i]);
	ck_assert_int_eq(tokenbucket_redis_open(NULL, srv.url, 0, 0), -EINVAL);
	ck_assert_int_eq(tokenbucket_redis_open(&r, NULL, 0, 0), -EINVAL);
	ck_assert_int_eq(tokenbucket_redis_set_fallback(cli, -0.5), -EINVAL);
	ck_assert_int_eq(tokenbucket_redis_set_fallback(cli, 1.5), -EINVAL);
	ck_assert_int_eq(tokenbucket_redis_set_prefix(cli, NULL, 3), -EINVAL);
	tokenbucket_redis_close(NULL);
}
END_TEST

/* A raw EVAL of the script with the given arguments after the key. */
static redisReply *raw(redisContext *c, const char *key, const char *const args[7])
{
	const char *argv[11] = { "EVAL", tokenbucket_redis_script(NULL), "1", key };
	for (int i = 0; i < 7; i++)
		argv[4 + i] = args[i];
	return redisCommandArgv(c, 11, argv, NULL);
}

START_TEST(test_raw_arguments)
{
	redisContext *c = server_admin(&srv);
	ck_assert_ptr_nonnull(c);
	for (size_t i = 0; i < redis_bad_args_count; i++) {
		redisReply *r = raw(c, "k", redis_bad_args[i]);
		ck_assert_ptr_nonnull(r);
		ck_assert_msg(r->type == REDIS_REPLY_ERROR && strncmp(r->str, "ERR tokenbucket: bad", 20) == 0,
			      "case %zu: type %d %s", i, r->type, r->type == REDIS_REPLY_ERROR ? r->str : "");
		freeReplyObject(r);
	}
	/* Wrong argument counts. */
	redisReply *r = redisCommand(c, "EVAL %s 1 k allow", tokenbucket_redis_script(NULL));
	ck_assert(r != NULL && r->type == REDIS_REPLY_ERROR);
	freeReplyObject(r);
	r = redisCommand(c, "EVAL %s 0", tokenbucket_redis_script(NULL));
	ck_assert(r != NULL && r->type == REDIS_REPLY_ERROR);
	freeReplyObject(r);
	/* Nothing was stored by any of them. */
	r = redisCommand(c, "EXISTS k");
	ck_assert_int_eq(r->integer, 0);
	freeReplyObject(r);
	redisFree(c);
}
END_TEST

START_TEST(test_hostile_values)
{
	static const char *const values[] = {
		"", "tb1", "tb1 1 2 0 1 1", "tb1 1 2 0 1 1 3 4", "tb2 1 2 0 1 1 3",
		"tb1 1 4 0 1 1 3",                           /* level above burst */
		"tb1 1 2 3 1 3 3",                           /* rem = q */
		"tb1 1 2 0 1 0 3",                           /* q = 0 */
		"tb1 1 2 0 0 2 3",                           /* rate 0 must be 0/1 */
		"tb1 -9223372036854775808 2 0 1 1 3",        /* clock INT64_MIN */
		"tb1 9223372036854775807 2 0 1 1 3",         /* clock INT64_MAX */
		"tb1 1 2 0 1 1 4611686018427387905",         /* burst above 2^62 */
		"tb1 1 -4611686018427387904 0 1 1 3",        /* debt above the limit */
		"tb1 1 2 0 1 9223372036854775808 3",         /* q = 2^63 */
		"tb1 1 2 0 18446744073709551616 1 3",        /* p above 2^64 - 1 */
		"tb1 99999999999999999999 2 0 1 1 3",
		"tb1 1 2 0 1 1 3\n", "tb1  1 2 0 1 1 3", "tb1 1 2 0 1 1 +3", "tb1 1 2 0 1 1 0x3",
	};
	struct tokenbucket_result res;
	struct tokenbucket_reservation rv = { .time_to_act = TOKENBUCKET_NEVER, .tokens = 1 };
	for (size_t i = 0; i < sizeof(values) / sizeof(values[0]); i++) {
		redisContext *c = server_admin(&srv);
		redisReply *r = redisCommand(c, "SET k %b", values[i], strlen(values[i]));
		freeReplyObject(r);
		ck_assert_msg(tokenbucket_redis_allow(cli, KEY("k"), &lim, 1, &res) == -EBADMSG, "%zu", i);
		ck_assert_msg(tokenbucket_redis_reserve(cli, KEY("k"), &lim, 1, 0, &rv, &res) == -EBADMSG, "%zu", i);
		ck_assert_msg(tokenbucket_redis_cancel(cli, KEY("k"), &lim, &rv) == -EBADMSG, "%zu", i);
		ck_assert_uint_eq(rv.tokens, 1);
		/* The value is left as it was. */
		r = redisCommand(c, "GET k");
		ck_assert(r != NULL && r->type == REDIS_REPLY_STRING && r->len == strlen(values[i]) &&
			  memcmp(r->str, values[i], r->len) == 0);
		freeReplyObject(r);
		redisFree(c);
	}
}
END_TEST

Suite *redis_badinput_suite(void)
{
	Suite *s = suite_create("redis-badinput");
	redis_tcase(s, "badinput", redis_setup, 30,
		    (const TTest *const[]){ test_keys, test_configurations, test_urls, test_raw_arguments, test_hostile_values, NULL });
	return s;
}
