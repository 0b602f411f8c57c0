/* SPDX-License-Identifier: MIT */
/*
 * Differential: random call sequences at explicit times through the real
 * server, every answer equal to the local library's (tests/redis/sequence.c
 * makes the steps and asks the library).  The client asks for the compact
 * reply to an allow; the same steps sent by hand in the 7-argument form of
 * tokenbucket-redis(7) to a twin key must say the same and store the same.
 */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <hiredis/hiredis.h>

#include "check_redis.h"
#include "../on_valgrind.h"
#include "sequence.h"

static const char *const op_names[] = { "allow", "reserve", "cancel", "tokens", "reset", "refund" };

static int64_t reply_int(const redisReply *e)
{
	ck_assert(e->type == REDIS_REPLY_STRING);
	return strtoll(e->str, NULL, 10);
}

static redisReply *get(redisContext *x, const char *key)
{
	redisReply *r = redisCommand(x, "GET %s", key);
	ck_assert_ptr_nonnull(r);
	return r;
}

/*
 * Step st sent by hand in the 7-argument form to key twin on x; for an
 * allow, the result the client made (res) must be what the 7 elements say,
 * and after any step both keys hold the same value.
 */
static void twin_step(redisContext *x, const char *key, const char *twin,
		      const struct seq_step *st, const struct tokenbucket_result *res, int step)
{
	char now[24], tok[24], per[24], bur[24], n[24], arg[24];
	snprintf(now, sizeof(now), "%" PRId64, st->now);
	snprintf(tok, sizeof(tok), "%" PRIu64, st->lim.tokens);
	snprintf(per, sizeof(per), "%" PRId64, st->lim.tokens ? st->lim.period_ns : 1);
	snprintf(bur, sizeof(bur), "%" PRIu64, st->lim.burst);
	snprintf(n, sizeof(n), "%" PRIu64, st->n);
	bool has_arg = st->op == TOKENBUCKET_REDIS_RESERVE || st->op == TOKENBUCKET_REDIS_CANCEL;
	snprintf(arg, sizeof(arg), "%" PRId64, has_arg ? st->arg : 0);
	const char *argv[] = { "EVAL", tokenbucket_redis_script(NULL), "1", twin, op_names[st->op],
			       now, tok, per, bur, n, arg };
	redisReply *r = redisCommandArgv(x, 11, argv, NULL);
	ck_assert_ptr_nonnull(r);
	if (st->op == TOKENBUCKET_REDIS_ALLOW) {
		ck_assert_msg(r->type == REDIS_REPLY_ARRAY && r->elements == 7, "%s step %d", twin, step);
		int64_t t = reply_int(r->element[1]), level = reply_int(r->element[2]);
		ck_assert_msg(res->allowed == (r->element[0]->integer == 1) &&
				      res->remaining == (uint64_t)(level > 0 ? level : 0) &&
				      res->retry_after_ns == seq_until(reply_int(r->element[5]), t) &&
				      res->reset_after_ns == seq_until(reply_int(r->element[6]), t) &&
				      res->limit == st->lim.burst,
			      "%s step %d: allowed %d remaining %" PRIu64 " retry %" PRId64 " reset %" PRId64
			      ", the 7-element reply says otherwise",
			      key, step, res->allowed, res->remaining, res->retry_after_ns,
			      res->reset_after_ns);
	}
	freeReplyObject(r);
	redisReply *a = get(x, key), *b = get(x, twin);
	ck_assert_msg(a->type == b->type && a->len == b->len &&
			      (a->len == 0 || memcmp(a->str, b->str, a->len) == 0),
		      "%s step %d: %s holds %s, %s holds %s", key, step, key,
		      a->type == REDIS_REPLY_STRING ? a->str : "-", twin,
		      b->type == REDIS_REPLY_STRING ? b->str : "-");
	freeReplyObject(a);
	freeReplyObject(b);
}

/* redis_sequence, and with x every step also sent by hand to a twin key (twin_step). */
static int sequence(struct tokenbucket_redis *c, redisContext *x, uint64_t seed, int steps,
		    long index)
{
	struct seq s;
	struct seq_step st;
	struct seq_expect ex;
	char key[48], twin[56];
	snprintf(key, sizeof(key), "diff:%" PRIx64 ":%ld", seed, index);
	snprintf(twin, sizeof(twin), "twin:%" PRIx64 ":%ld", seed, index);
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
			err = tokenbucket_redis_refund_at(c, KEY(key), &(const struct tokenbucket_limit){ st.lim.tokens, st.lim.period_ns, st.lim.burst }, st.now, st.n);
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
		case TOKENBUCKET_REDIS_ALLOW_ALL: /* run_set's, never a single key's step */
			ck_abort_msg("allow_all in a single key's sequence");
		}
		if (x != NULL)
			twin_step(x, key, twin, &st, &res, done);
		done++;
	}
	seq_end(&s);
	return done;
}

int redis_sequence(struct tokenbucket_redis *c, uint64_t seed, int steps, long index)
{
	return sequence(c, NULL, seed, steps, index);
}

START_TEST(test_differential)
{
	/* 10^4 sequences of 16 steps by default: a few seconds on a unix socket. */
	long count = redis_sequences(10000);
	long steps = 0;
	redisContext *x = server_admin(&srv);
	ck_assert_ptr_nonnull(x);
	for (long i = 0; i < count; i++)
		steps += sequence(cli, x, 0x7b0c5e11u + (uint64_t)i * 0x9e3779b97f4a7c15u, 16, i);
	redisFree(x);
	printf("redis differential: %ld steps in %ld sequences, no difference, each the same "
	       "in the 7-argument form\n", steps, count);
}
END_TEST

/* A sequence of allow_all through client c, each result equal to the local set's. */
int redis_set_sequence(struct tokenbucket_redis *c, uint64_t seed, int steps, long index)
{
	struct seq_set s;
	struct seq_set_step st;
	struct seq_set_expect ex;
	char key[48];
	snprintf(key, sizeof(key), "set:%" PRIx64 ":%ld", seed, index);
	ck_assert_int_eq(seq_set_start(&s, seed, steps, 4), 0);
	int done = 0;
	while (seq_set_next(&s, &st, &ex)) {
		ck_assert_msg(ex.err != -EFAULT, "the local library refused a step");
		struct tokenbucket_set_result res;
		memset(&res, 0xa5, sizeof(res));
		struct tokenbucket_limit lims[TOKENBUCKET_SET_MAX];
		for (size_t i = 0; i < st.count; i++)
			lims[i] = (struct tokenbucket_limit){ st.lim[i].tokens, st.lim[i].period_ns,
							      st.lim[i].burst };
		int err = tokenbucket_redis_allow_all_at(c, KEY(key), lims, st.count, st.now, st.n,
							 &res);
		ck_assert_msg(err == ex.err, "%s step %d: allow_all %d, local %d", key, done, err,
			      ex.err);
		if (err == 0) {
			const struct tokenbucket_set_result *w = &ex.res;
			ck_assert_msg(res.allowed == w->allowed && res.index == w->index &&
					      res.limit == w->limit && res.remaining == w->remaining &&
					      res.retry_after_ns == w->retry_after_ns &&
					      res.reset_after_ns == w->reset_after_ns && res.flags == 0,
				      "%s step %d: allowed %d index %zu limit %" PRIu64 " remaining %" PRIu64
				      " retry %" PRId64 " reset %" PRId64 ", local %d %zu %" PRIu64
				      " %" PRIu64 " %" PRId64 " %" PRId64,
				      key, done, res.allowed, res.index, res.limit, res.remaining,
				      res.retry_after_ns, res.reset_after_ns, w->allowed, w->index,
				      w->limit, w->remaining, w->retry_after_ns, w->reset_after_ns);
		}
		done++;
	}
	seq_set_end(&s);
	return done;
}

START_TEST(test_set_differential)
{
	/* A tenth of the single-limit sequences: each step carries up to 4 limits. */
	long count = redis_sequences(10000) / 10;
	long steps = 0;
	for (long i = 0; i < count; i++)
		steps += redis_set_sequence(cli, 0x5e75e7u + (uint64_t)i * 0x9e3779b97f4a7c15u, 16, i);
	printf("redis differential of allow_all: %ld steps in %ld sequences, every result the "
	       "local set's\n", steps, count);
}
END_TEST

/*
 * The compact reply on the server's clock, where two keys cannot be asked
 * at one time: the results are the bucket's, a refusal writes nothing, and
 * the 7-element reply a moment later says the same within the moment.
 */
START_TEST(test_compact_server_clock)
{
	const struct tokenbucket_redis_limit lim = { .tokens = 1, .period_ns = 3600 * SEC, .burst = 3 };
	redisContext *x = server_admin(&srv);
	ck_assert_ptr_nonnull(x);
	struct tokenbucket_result res;
	for (uint64_t i = 0; i < 3; i++) {
		ck_assert_int_eq(tokenbucket_redis_allow(cli, KEY("sc"), &lim, 1, &res), 0);
		ck_assert(res.allowed);
		ck_assert_uint_eq(res.remaining, 2 - i);
		ck_assert_int_eq(res.retry_after_ns, 0);
		/* Full again (i + 1) hours on, less the moments since the first call. */
		ck_assert_int_le(res.reset_after_ns, (int64_t)(i + 1) * 3600 * SEC);
		ck_assert_int_gt(res.reset_after_ns, (int64_t)(i + 1) * 3600 * SEC - 60 * SEC);
	}
	redisReply *before = get(x, "sc");
	ck_assert_int_eq(tokenbucket_redis_allow(cli, KEY("sc"), &lim, 1, &res), 0);
	ck_assert(!res.allowed);
	ck_assert_uint_eq(res.remaining, 0);
	ck_assert_int_le(res.retry_after_ns, 3600 * SEC);
	ck_assert_int_gt(res.retry_after_ns, 3600 * SEC - 60 * SEC);
	ck_assert_int_le(res.reset_after_ns, 3 * 3600 * SEC);
	ck_assert_int_gt(res.reset_after_ns, 3 * 3600 * SEC - 60 * SEC);
	redisReply *after = get(x, "sc");
	ck_assert(before->type == REDIS_REPLY_STRING && after->type == REDIS_REPLY_STRING);
	ck_assert_str_eq(before->str, after->str);
	/* The 7-argument form on the same key. */
	const char *argv[] = { "EVAL", tokenbucket_redis_script(NULL), "1", "sc", "allow", "",
			       "1", "3600000000000", "3", "1", "0" };
	redisReply *r = redisCommandArgv(x, 11, argv, NULL);
	ck_assert(r != NULL && r->type == REDIS_REPLY_ARRAY && r->elements == 7);
	ck_assert_int_eq(r->element[0]->integer, 0);
	ck_assert_int_eq(reply_int(r->element[2]), 0);
	int64_t t = reply_int(r->element[1]);
	int64_t retry = seq_until(reply_int(r->element[5]), t);
	int64_t reset = seq_until(reply_int(r->element[6]), t);
	ck_assert_int_le(retry, res.retry_after_ns);
	ck_assert_int_gt(retry, res.retry_after_ns - 60 * SEC);
	ck_assert_int_eq(res.reset_after_ns - reset, res.retry_after_ns - retry);
	freeReplyObject(r);
	r = get(x, "sc");
	ck_assert_str_eq(before->str, r->str);
	freeReplyObject(r);
	freeReplyObject(before);
	freeReplyObject(after);
	/* The 8th argument takes "1" or "0", nothing else; "0" is the 7-element reply. */
	const char *eight[] = { "EVAL", tokenbucket_redis_script(NULL), "1", "sc8", "allow", "",
				"1", "3600000000000", "3", "1", "0", "0" };
	r = redisCommandArgv(x, 12, eight, NULL);
	ck_assert(r != NULL && r->type == REDIS_REPLY_ARRAY && r->elements == 7);
	freeReplyObject(r);
	eight[11] = "1";
	r = redisCommandArgv(x, 12, eight, NULL);
	ck_assert(r != NULL && r->type == REDIS_REPLY_ARRAY && r->elements == 4);
	ck_assert_int_eq(r->element[0]->integer, 1);
	ck_assert_int_eq(r->element[1]->integer, 1);
	freeReplyObject(r);
	eight[4] = "reserve"; /* only an allow replies in integers */
	r = redisCommandArgv(x, 12, eight, NULL);
	ck_assert(r != NULL && r->type == REDIS_REPLY_ARRAY && r->elements == 7);
	freeReplyObject(r);
	before = get(x, "sc8");
	eight[11] = "2";
	r = redisCommandArgv(x, 12, eight, NULL);
	ck_assert(r != NULL && r->type == REDIS_REPLY_ERROR);
	ck_assert_str_eq(r->str, "ERR tokenbucket: bad reply form");
	freeReplyObject(r);
	r = get(x, "sc8");
	ck_assert(before->type == REDIS_REPLY_STRING && r->type == REDIS_REPLY_STRING);
	ck_assert_str_eq(before->str, r->str);
	freeReplyObject(r);
	freeReplyObject(before);
	redisFree(x);
}
END_TEST

Suite *redis_diff_suite(void)
{
	Suite *s = suite_create("redis-diff");
	redis_tcase(s, "differential", redis_setup, 240,
		    (const TTest *const[]){ test_differential, test_compact_server_clock,
					    test_set_differential, NULL });
	return s;
}
