/* SPDX-License-Identifier: MIT */
/*
 * The Redis module (src/redis/module) against the script and the local
 * library, in a redis-server that loads it: the same sequences through
 * both, every reply equal byte for byte and every stored value equal; keys
 * handed back and forth between them; hostile values and bad arguments
 * refused alike and left as they were; the server's clock; a replica (which
 * does not load the module) holding what the primary holds; a call that
 * writes nothing leaving its key untouched (WATCH, encoding, events, the
 * replication stream), as the script's does.
 */
#include <dirent.h>
#include <fcntl.h>
#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include <hiredis/hiredis.h>

#include "check_redis.h"
#include "sequence.h"

static const char *const ops[] = { "allow", "reserve", "cancel", "tokens", "reset", "refund" };
static const char *sha;

/* Starts srv loading the module, with more options (NULL-terminated). */
static int start_with_module(const char *const *more)
{
	return redis_start_module(TOKENBUCKET_MODULE_PATH, more);
}

static void module_setup(void)
{
	/* MODULE UNLOAD, for test_module_detected. */
	ck_assert_int_eq(start_with_module((const char *const[]){ "--enable-module-command", "yes", NULL }), 0);
	ck_assert_int_eq(tokenbucket_redis_open(&cli, srv.url, SEC, 500 * MS), 0);
	tokenbucket_redis_script(&sha);
}

/* EVALSHA of the script (loaded first) or TOKENBUCKET.CALL, on key, args. */
static redisReply *call(redisContext *c, bool module, const char *key, size_t klen,
			const char *const args[7])
{
	const char *argv[11];
	size_t lens[11];
	int n = 0;
	if (module) {
		argv[n++] = "TOKENBUCKET.CALL";
	} else {
		argv[n++] = "EVAL";
		argv[n++] = tokenbucket_redis_script(NULL);
		argv[n++] = "1";
	}
	for (int i = 0; i < n; i++)
		lens[i] = strlen(argv[i]);
	argv[n] = key, lens[n++] = klen;
	for (int i = 0; i < 7; i++)
		argv[n] = args[i], lens[n++] = strlen(args[i]);
	redisReply *r = redisCommandArgv(c, n, argv, lens);
	ck_assert_ptr_nonnull(r);
	return r;
}

static bool same_reply(const redisReply *a, const redisReply *b)
{
	if (a->type != b->type)
		return false;
	switch (a->type) {
	case REDIS_REPLY_INTEGER:
		return a->integer == b->integer;
	case REDIS_REPLY_ARRAY:
		if (a->elements != b->elements)
			return false;
		for (size_t i = 0; i < a->elements; i++)
			if (!same_reply(a->element[i], b->element[i]))
				return false;
		return true;
	case REDIS_REPLY_NIL:
		return true;
	default:
		return a->len == b->len && memcmp(a->str, b->str, a->len) == 0;
	}
}

/* GET key: a copy of the value (or NULL for none) and its length. */
static char *get(redisContext *c, const char *key, size_t *len)
{
	redisReply *r = redisCommand(c, "GET %s", key);
	ck_assert_ptr_nonnull(r);
	char *v = NULL;
	*len = 0;
	if (r->type == REDIS_REPLY_STRING) {
		v = malloc(r->len + 1);
		ck_assert_ptr_nonnull(v);
		memcpy(v, r->str, r->len);
		*len = r->len;
	}
	freeReplyObject(r);
	return v;
}

static long long integer(redisContext *c, const char *fmt, const char *key)
{
	redisReply *r = redisCommand(c, fmt, key);
	ck_assert(r != NULL && r->type == REDIS_REPLY_INTEGER);
	long long v = r->integer;
	freeReplyObject(r);
	return v;
}

static void assert_same_value(redisContext *c, const char *a, const char *b)
{
	size_t la, lb;
	char *va = get(c, a, &la), *vb = get(c, b, &lb);
	ck_assert_msg((va == NULL) == (vb == NULL) && la == lb && (la == 0 || memcmp(va, vb, la) == 0),
		      "%s holds %.*s, %s holds %.*s", a, (int)la, va ? va : "", b, (int)lb,
		      vb ? vb : "");
	free(va);
	free(vb);
}

/* One sequence: the script on s:, the module on m:, and both by turns on
 * x:, every reply equal to the script's and agreeing with the local
 * library, every value equal, no expiry (all calls are _at). */
static int module_sequence(redisContext *c, uint64_t seed, int steps, long index)
{
	char ks[48], km[48], kx[48];
	snprintf(ks, sizeof(ks), "s:%ld", index);
	snprintf(km, sizeof(km), "m:%ld", index);
	snprintf(kx, sizeof(kx), "x:%ld", index);
	struct seq s;
	struct seq_step st;
	struct seq_expect ex;
	ck_assert_int_eq(seq_start(&s, seed, steps), 0);
	uint64_t turn = seed;
	int done = 0;
	while (seq_next(&s, &st, &ex)) {
		ck_assert(ex.err != -EFAULT);
		char now[24], tok[24], per[24], bur[24], n[24], arg[24];
		snprintf(now, sizeof(now), "%" PRId64, st.now);
		snprintf(tok, sizeof(tok), "%" PRIu64, st.lim.tokens);
		snprintf(per, sizeof(per), "%" PRId64, st.lim.tokens ? st.lim.period_ns : 1);
		snprintf(bur, sizeof(bur), "%" PRIu64, st.lim.burst);
		snprintf(n, sizeof(n), "%" PRIu64, st.n);
		snprintf(arg, sizeof(arg), "%" PRId64,
			 (st.op == TOKENBUCKET_REDIS_RESERVE || st.op == TOKENBUCKET_REDIS_CANCEL) ? st.arg
												  : 0);
		const char *const args[7] = { ops[st.op], now, tok, per, bur, n, arg };
		redisReply *rs = call(c, false, ks, strlen(ks), args);
		redisReply *rm = call(c, true, km, strlen(km), args);
		redisReply *rx = call(c, seq_rand(&turn) & 1, kx, strlen(kx), args);
		ck_assert_msg(same_reply(rs, rm), "%s step %d (%s): the module's reply differs", km,
			      done, ops[st.op]);
		ck_assert_msg(same_reply(rs, rx), "%s step %d (%s): by turns, the reply differs", kx,
			      done, ops[st.op]);
		if (ex.code < 0) {
			ck_assert_int_eq(rm->type, REDIS_REPLY_ERROR);
		} else {
			ck_assert(rm->type == REDIS_REPLY_ARRAY && rm->elements == 7);
			ck_assert_msg(rm->element[0]->integer == ex.code, "%s step %d: code %lld, local %d",
				      km, done, rm->element[0]->integer, ex.code);
			if (st.op == TOKENBUCKET_REDIS_RESERVE && ex.code == 1)
				ck_assert_int_eq(strtoll(rm->element[5]->str, NULL, 10), ex.act);
			if (st.op == TOKENBUCKET_REDIS_TOKENS) {
				/* As the client reads it: the fraction rounded once,
				 * at most burst. */
				double v = (double)strtoll(rm->element[2]->str, NULL, 10) +
					   (double)(strtold(rm->element[3]->str, NULL) /
						    strtold(rm->element[4]->str, NULL));
				if (v > (double)st.lim.burst)
					v = (double)st.lim.burst;
				ck_assert_msg(fabs(v - ex.tokens) <=
						      4 * DBL_EPSILON * fmax(1, fabs(ex.tokens)),
					      "%s step %d: tokens %.17g, local %.17g", km, done, v,
					      ex.tokens);
			}
		}
		freeReplyObject(rs);
		freeReplyObject(rm);
		freeReplyObject(rx);
		assert_same_value(c, ks, km);
		assert_same_value(c, ks, kx);
		/* A call at the caller's time sets no expiry (-2: no key). */
		ck_assert_int_le(integer(c, "PTTL %s", km), -1);
		done++;
	}
	seq_end(&s);
	return done;
}

START_TEST(test_module_differential)
{
	redisContext *c = server_admin(&srv);
	ck_assert_ptr_nonnull(c);
	long count = redis_sequences(10000) / 4;
	long steps = 0;
	for (long i = 0; i < count; i++)
		steps += module_sequence(c, 0x5eed0d01u + (uint64_t)i * 0x9e3779b97f4a7c15u, 16, i);
	printf("redis module differential: %ld steps in %ld sequences, module = script = local\n",
	       steps, count);
	redisFree(c);
}
END_TEST

/*
 * Lease groups ("tbl1" values): random lease, giveback, allow, reserve,
 * refund, tokens and reset on keys s: (script), m: (module) and x: (both
 * by turns), at small and at the widest rates, each reply and value the
 * script's.  Give-backs name groups the leases were told, or none.
 */
static int lease_sequence(redisContext *c, uint64_t seed, long index)
{
	static const char *const lops[] = { "lease", "lease", "giveback", "allow", "reserve",
					    "refund", "tokens", "reset" };
	static const struct tokenbucket_redis_limit lims[] = {
		{ 50, 1000000000, 10 }, { 3, 700, 20 }, { UINT64_MAX, INT64_MAX, TOKENBUCKET_BURST_MAX },
		{ 1000000000, 1, TOKENBUCKET_BURST_MAX }, { 0, 1, 5 },
	};
	char ks[48], km[48], kx[48];
	snprintf(ks, sizeof(ks), "ls:%ld", index);
	snprintf(km, sizeof(km), "lm:%ld", index);
	snprintf(kx, sizeof(kx), "lx:%ld", index);
	uint64_t r = seed;
	const struct tokenbucket_redis_limit *l = &lims[seq_rand(&r) % 5];
	int64_t now = 1700000000000000000 + (int64_t)(seq_rand(&r) % 1000000000);
	char told[4][24] = { "0", "0", "0", "0" };
	int steps = 24;
	for (int step = 0; step < steps; step++) {
		uint64_t x = seq_rand(&r);
		now += (int64_t)(x % 400000000) - (x % 16 == 0 ? 500000000 : 0);
		const char *op = lops[(x >> 8) % 8];
		uint64_t n = l->burst < 1000 ? (x >> 16) % (l->burst + 2) : (x >> 16) % 1000000 * (l->burst / 1000000);
		char a[7][24];
		snprintf(a[1], 24, "%" PRId64, now);
		snprintf(a[2], 24, "%" PRIu64, l->tokens);
		snprintf(a[3], 24, "%" PRId64, l->tokens ? l->period_ns : 1);
		snprintf(a[4], 24, "%" PRIu64, l->burst);
		snprintf(a[5], 24, "%" PRIu64, strcmp(op, "reset") == 0 && n > l->burst ? l->burst : n);
		if (strcmp(op, "lease") == 0)
			snprintf(a[6], 24, "%" PRIu64, 1 + (x >> 40) % 2000000000);
		else if (strcmp(op, "giveback") == 0)
			snprintf(a[6], 24, "%s", told[(x >> 40) % 4]);
		else if (strcmp(op, "reserve") == 0)
			snprintf(a[6], 24, "%" PRId64, (x >> 40) % 2 ? INT64_MAX : (int64_t)((x >> 42) % 1000000000));
		else
			snprintf(a[6], 24, "0");
		const char *const args[7] = { op, a[1], a[2], a[3], a[4], a[5], a[6] };
		redisReply *rs = call(c, false, ks, strlen(ks), args);
		redisReply *rm = call(c, true, km, strlen(km), args);
		redisReply *rx = call(c, seq_rand(&r) & 1, kx, strlen(kx), args);
		ck_assert_msg(same_reply(rs, rm), "%s step %d (%s %s n %s arg %s): the module's reply differs",
			      km, step, op, a[1], a[5], a[6]);
		ck_assert_msg(same_reply(rs, rx), "%s step %d (%s): by turns, the reply differs", kx, step, op);
		ck_assert_msg(rs->type == REDIS_REPLY_ARRAY, "%s step %d (%s): %s", ks, step, op,
			      rs->type == REDIS_REPLY_ERROR ? rs->str : "no array");
		if (strcmp(op, "lease") == 0) {
			ck_assert_int_eq(rs->elements, 8);
			if (rs->element[0]->integer == 1)
				snprintf(told[x % 4], 24, "%s", rs->element[7]->str);
		}
		freeReplyObject(rs);
		freeReplyObject(rm);
		freeReplyObject(rx);
		assert_same_value(c, ks, km);
		assert_same_value(c, ks, kx);
	}
	return steps;
}

START_TEST(test_module_lease_differential)
{
	redisContext *c = server_admin(&srv);
	ck_assert_ptr_nonnull(c);
	long count = redis_sequences(10000) / 40;
	long steps = 0, leased = 0;
	for (long i = 0; i < count; i++) {
		steps += lease_sequence(c, 0x1ea5e0u + (uint64_t)i * 0x9e3779b97f4a7c15u, i);
		char k[48];
		size_t len;
		snprintf(k, sizeof(k), "ls:%ld", i);
		char *v = get(c, k, &len);
		leased += v != NULL && len > 5 && memcmp(v, "tbl1 ", 5) == 0;
		free(v);
	}
	printf("redis module lease differential: %ld steps in %ld sequences, module = script, "
	       "%ld ending leased\n", steps, count, leased);
	ck_assert_int_gt(leased, 0);
	redisFree(c);
}
END_TEST

/* allow_all on key through the script or the module: "allow_all" now n, then count limits' triples. */
static redisReply *call_all(redisContext *c, bool module, const char *key, const char *now,
			    const char *n, size_t count, const char (*lim)[3][24])
{
	const char *argv[8 + 3 * TOKENBUCKET_SET_MAX];
	int k = 0;
	if (module) {
		argv[k++] = "TOKENBUCKET.CALL";
	} else {
		argv[k++] = "EVAL";
		argv[k++] = tokenbucket_redis_script(NULL);
		argv[k++] = "1";
	}
	argv[k++] = key;
	argv[k++] = "allow_all";
	argv[k++] = now;
	argv[k++] = n;
	for (size_t i = 0; i < count; i++)
		for (int j = 0; j < 3; j++)
			argv[k++] = lim[i][j];
	redisReply *r = redisCommandArgv(c, k, argv, NULL);
	ck_assert_ptr_nonnull(r);
	return r;
}

/* A set sequence: the script on S:, the module on M:, both by turns on X:;
 * replies equal, values equal, and what they decide the local sets'. */
static int module_set_sequence(redisContext *c, uint64_t seed, int steps, long index)
{
	char ks[48], km[48], kx[48];
	snprintf(ks, sizeof(ks), "S:%ld", index);
	snprintf(km, sizeof(km), "M:%ld", index);
	snprintf(kx, sizeof(kx), "X:%ld", index);
	struct seq_set s;
	struct seq_set_step st;
	struct seq_set_expect ex;
	ck_assert_int_eq(seq_set_start(&s, seed, steps, 4), 0);
	uint64_t turn = seed;
	int done = 0;
	while (seq_set_next(&s, &st, &ex)) {
		ck_assert(ex.err != -EFAULT);
		char now[24], n[24], lim[TOKENBUCKET_SET_MAX][3][24];
		snprintf(now, sizeof(now), "%" PRId64, st.now);
		snprintf(n, sizeof(n), "%" PRIu64, st.n);
		for (size_t i = 0; i < st.count; i++) {
			snprintf(lim[i][0], 24, "%" PRIu64, st.lim[i].tokens);
			snprintf(lim[i][1], 24, "%" PRId64, st.lim[i].tokens ? st.lim[i].period_ns : 1);
			snprintf(lim[i][2], 24, "%" PRIu64, st.lim[i].burst);
		}
		redisReply *rs = call_all(c, false, ks, now, n, st.count, lim);
		redisReply *rm = call_all(c, true, km, now, n, st.count, lim);
		redisReply *rx = call_all(c, seq_rand(&turn) & 1, kx, now, n, st.count, lim);
		ck_assert_msg(same_reply(rs, rm), "%s step %d: the module's reply differs", km, done);
		ck_assert_msg(same_reply(rs, rx), "%s step %d: by turns, the reply differs", kx, done);
		ck_assert(rm->type == REDIS_REPLY_ARRAY && rm->elements == 6);
		long long code = rm->element[0]->integer;
		if (ex.err == -E2BIG) {
			ck_assert_int_eq(code, 2);
		} else {
			ck_assert_msg(code == ex.res.allowed &&
					      rm->element[1]->integer == (long long)ex.res.index &&
					      strtoull(rm->element[3]->str, NULL, 10) == ex.res.remaining,
				      "%s step %d: code %lld index %lld level %s, local %d %zu %" PRIu64,
				      km, done, code, rm->element[1]->integer, rm->element[3]->str,
				      ex.res.allowed, ex.res.index, ex.res.remaining);
		}
		freeReplyObject(rs);
		freeReplyObject(rm);
		freeReplyObject(rx);
		assert_same_value(c, ks, km);
		assert_same_value(c, ks, kx);
		ck_assert_int_le(integer(c, "PTTL %s", km), -1);
		done++;
	}
	seq_set_end(&s);
	return done;
}

START_TEST(test_module_set_differential)
{
	redisContext *c = server_admin(&srv);
	ck_assert_ptr_nonnull(c);
	long count = redis_sequences(10000) / 10;
	long steps = 0;
	for (long i = 0; i < count; i++)
		steps += module_set_sequence(c, 0x5e7d0d01u + (uint64_t)i * 0x9e3779b97f4a7c15u, 16, i);
	printf("redis module differential of allow_all: %ld steps in %ld sequences, module = "
	       "script = local sets\n", steps, count);
	redisFree(c);
}
END_TEST

/* Hostile values at a key of several limits: refused alike, unchanged. */
START_TEST(test_module_set_hostile)
{
	static const char *const fixed[] = {
		"tbs1", "tbs1 ", "tbs1 5", "tbs1 5 1 0 1 1", "tbs1 5 1 0 1 1 3 4",
		"tbs1 5 4 0 1 1 3", "tbs1 5 1 1 1 1 3", "tbs1 5 1 0 1 0 3", "tbs1 5 1 0 0 2 3",
		"tbs1 5 -1 0 1 1 3", "tbs1 -9223372036854775808 1 0 1 1 3",
		"tbs1 9223372036854775807 1 0 1 1 3", "tbs1 5 1 0 1 1 3 ", "tbs1  5 1 0 1 1 3",
		"tbs1 5 1 0 1 1 4611686018427387905", "tb1 5 1 0 1 1 3", "tbs2 5 1 0 1 1 3",
		"tbs1 5 1 0 1 1 3\n",
	};
	static const char alphabet[] = "tbs1 -0123456789 9 x";
	const char lim[2][3][24] = { { "1", "1", "3" }, { "1", "1000", "3" } };
	redisContext *c = server_admin(&srv);
	uint64_t rng = 0x5e7u;
	long refused = 0, taken = 0;
	for (int i = 0; i < 3000; i++) {
		char v[160];
		size_t len;
		if (i < (int)(sizeof(fixed) / sizeof(fixed[0]))) {
			len = strlen(fixed[i]);
			memcpy(v, fixed[i], len);
		} else if (i % 2 == 0) {
			/* 1 + 5k small fields, k 1 to 3. */
			static const char *const f[] = { "0", "1", "2", "3", "-0", "-1", "007", "4", "1000" };
			size_t nf = sizeof(f) / sizeof(f[0]);
			len = (size_t)snprintf(v, sizeof(v), "tbs1 %s", f[seq_rand(&rng) % nf]);
			for (uint64_t k = 5 * (1 + seq_rand(&rng) % 3); k > 0; k--)
				len += (size_t)snprintf(v + len, sizeof(v) - len, " %s",
							f[seq_rand(&rng) % nf]);
		} else {
			memcpy(v, "tbs1 ", 5);
			len = 5 + seq_rand(&rng) % 60;
			for (size_t j = 5; j < len; j++) {
				uint64_t x = seq_rand(&rng);
				v[j] = x % 50 == 0 ? (char)(x >> 8) : alphabet[x % (sizeof(alphabet) - 1)];
			}
		}
		for (int m = 0; m < 2; m++)
			freeReplyObject(redisCommand(c, "SET %s %b", m ? "hm" : "hs", v, len));
		size_t count = 1 + (size_t)(i % 2);
		redisReply *rs = call_all(c, false, "hs", "1000", "1", count, lim);
		redisReply *rm = call_all(c, true, "hm", "1000", "1", count, lim);
		ck_assert_msg(same_reply(rs, rm), "value %d (%.*s): the module's reply differs", i,
			      (int)len, v);
		if (rm->type == REDIS_REPLY_ERROR) {
			ck_assert_str_eq(rm->str,
					 "TBCORRUPT the value at this key is not a set of token buckets");
			size_t l;
			char *after = get(c, "hm", &l);
			ck_assert(after != NULL && l == len && memcmp(after, v, len) == 0);
			free(after);
			refused++;
		} else {
			taken++;
		}
		freeReplyObject(rs);
		freeReplyObject(rm);
		assert_same_value(c, "hs", "hm");
	}
	ck_assert_int_gt(refused, 1000);
	ck_assert_int_gt(taken, 10);
	printf("redis module hostile values of sets: %ld refused unchanged, %ld read as sets, alike\n",
	       refused, taken);
	/* Argument counts and bad numbers: the script's errors, word for word. */
	static const char *const bad[][9] = {
		{ "allow_all", "", "1", NULL },
		{ "allow_all", "", "1", "1", "1", NULL },
		{ "allow_all", "", "1", "1", "1", "3", "1", "1", NULL },
		{ "allow_all", "x", "1", "1", "1", "3", NULL },
		{ "allow_all", "", "-1", "1", "1", "3", NULL },
		{ "allow_all", "", "1", "1", "0", "3", NULL },
		{ "allow_all", "", "1", "1", "1", "4611686018427387905", NULL },
		{ "allow_all", "", "1", "1", "1", "3", "1", "1", "x" },
	};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		const char *argv[2][16];
		int k[2] = { 0, 0 };
		argv[0][k[0]++] = "EVAL", argv[0][k[0]++] = tokenbucket_redis_script(NULL);
		argv[0][k[0]++] = "1", argv[0][k[0]++] = "b";
		argv[1][k[1]++] = "TOKENBUCKET.CALL", argv[1][k[1]++] = "b";
		for (int j = 0; j < 9 && bad[i][j]; j++)
			for (int m = 0; m < 2; m++)
				argv[m][k[m]++] = bad[i][j];
		redisReply *a = redisCommandArgv(c, k[0], argv[0], NULL);
		redisReply *b = redisCommandArgv(c, k[1], argv[1], NULL);
		ck_assert(a != NULL && b != NULL && a->type == REDIS_REPLY_ERROR);
		ck_assert_msg(same_reply(a, b), "bad arguments %zu: script %s, module %s", i, a->str,
			      b->str);
		freeReplyObject(a);
		freeReplyObject(b);
	}
	ck_assert_int_eq(integer(c, "EXISTS %s", "b"), 0);
	redisFree(c);
}
END_TEST

START_TEST(test_module_version)
{
	redisContext *c = server_admin(&srv);
	redisReply *r = redisCommand(c, "TOKENBUCKET.VERSION");
	ck_assert(r != NULL && r->type == REDIS_REPLY_STRING);
	ck_assert_str_eq(r->str, TOKENBUCKET_VERSION_STRING);
	freeReplyObject(r);
	r = redisCommand(c, "TOKENBUCKET.VERSION x");
	ck_assert(r != NULL && r->type == REDIS_REPLY_ERROR);
	freeReplyObject(r);
	redisFree(c);
}
END_TEST

/* Each random value at a key, through the script on one key and the module
 * on another: the same reply, and the same value after (a refused one as
 * it was).  Values are made mostly of the stored format's bytes, so that
 * they reach every field's checks. */
START_TEST(test_module_hostile)
{
	static const char *const fixed[] = {
		"", "tb1", "tb1 1 2 0 1 1", "tb1 1 2 0 1 1 3 4", "tb2 1 2 0 1 1 3", "tb1 1 4 0 1 1 3",
		"tb1 1 2 3 1 3 3", "tb1 1 2 0 1 0 3", "tb1 1 2 0 0 2 3",
		"tb1 -9223372036854775808 2 0 1 1 3", "tb1 9223372036854775807 2 0 1 1 3",
		"tb1 1 2 0 1 1 4611686018427387905", "tb1 1 -4611686018427387904 0 1 1 3",
		"tb1 1 2 0 1 9223372036854775808 3", "tb1 1 2 0 18446744073709551616 1 3",
		"tb1 99999999999999999999 2 0 1 1 3", "tb1 1 2 0 1 1 3\n", "tb1  1 2 0 1 1 3",
		"tb1 1 2 0 1 1 +3", "tb1 1 2 0 1 1 0x3", "tb1 1 -0 0 1 1 3", "tb1 -5 007 0 1 1 9",
		"tb1 1 2\0 0 1 1 3",
	};
	static const char alphabet[] = "tb1 -0123456789 9 x\n";
	const char *const args[][7] = {
		{ "allow", "1000", "1", "1", "3", "1", "0" },
		{ "reserve", "1000", "1", "1000", "3", "2", "5000" },
		{ "cancel", "1000", "1", "1", "3", "1", "2000" },
		{ "tokens", "5", "7", "3", "9", "0", "0" },
		{ "reset", "1000", "1", "1", "3", "2", "0" },
		{ "refund", "1000", "1", "1", "3", "2", "0" },
		{ "lease", "1000", "1", "1", "3", "1", "500" },
		{ "giveback", "1000", "1", "1", "3", "1", "1500" },
	};
	redisContext *c = server_admin(&srv);
	uint64_t rng = 0x4057113u;
	long refused = 0, taken = 0;
	for (int i = 0; i < 4000; i++) {
		char v[64];
		size_t len;
		if (i < (int)(sizeof(fixed) / sizeof(fixed[0]))) {
			/* The last one holds a NUL. */
			len = i == (int)(sizeof(fixed) / sizeof(fixed[0])) - 1
				      ? sizeof("tb1 1 2\0 0 1 1 3") - 1
				      : strlen(fixed[i]);
			memcpy(v, fixed[i], len);
		} else if (i % 2 == 0) {
			/* Six small fields, signs and leading zeros included: many
			 * are buckets, many break one invariant. */
			static const char *const f[] = { "0", "1", "2", "3", "-0", "-1", "-2", "007",
							 "4", "00", "1000", "-1000" };
			size_t nf = sizeof(f) / sizeof(f[0]);
			bool leased = i % 4 == 0;
			int w = snprintf(v, sizeof(v), "%s %s %s %s %s %s %s", leased ? "tbl1" : "tb1",
					 f[seq_rand(&rng) % nf], f[seq_rand(&rng) % nf],
					 f[seq_rand(&rng) % 4], f[seq_rand(&rng) % 4],
					 f[seq_rand(&rng) % 5], f[seq_rand(&rng) % nf]);
			/* lease groups: 0 to 5 of them, expiries around the clock */
			for (uint64_t g = leased ? seq_rand(&rng) % 6 : 0; g > 0 && w < 40; g--)
				w += snprintf(v + w, sizeof(v) - (size_t)w, " %s %s",
					      f[seq_rand(&rng) % nf], f[seq_rand(&rng) % 5]);
			len = (size_t)w;
		} else {
			/* "tb1 " then random fields, sometimes a random byte. */
			memcpy(v, "tb1 ", 4);
			len = 4 + seq_rand(&rng) % 40;
			for (size_t j = 4; j < len; j++) {
				uint64_t x = seq_rand(&rng);
				v[j] = x % 50 == 0 ? (char)(x >> 8) : alphabet[x % (sizeof(alphabet) - 1)];
			}
		}
		const char *const *a = args[i % 8];
		for (int m = 0; m < 2; m++) {
			redisReply *r = redisCommand(c, "SET %s %b", m ? "hm" : "hs", v, len);
			freeReplyObject(r);
		}
		redisReply *rs = call(c, false, "hs", 2, a);
		redisReply *rm = call(c, true, "hm", 2, a);
		ck_assert_msg(same_reply(rs, rm), "value %d (%.*s): the module's reply differs", i,
			      (int)len, v);
		if (rm->type == REDIS_REPLY_ERROR) {
			ck_assert_str_eq(rm->str, "TBCORRUPT the value at this key is not a token bucket");
			size_t l;
			char *after = get(c, "hm", &l);
			ck_assert(after != NULL && l == len && memcmp(after, v, len) == 0);
			free(after);
			refused++;
		} else {
			taken++;
		}
		freeReplyObject(rs);
		freeReplyObject(rm);
		assert_same_value(c, "hs", "hm");
	}
	printf("redis module hostile values: %ld refused unchanged, %ld read as buckets, alike\n",
	       refused, taken);
	/* Another type: WRONGTYPE, nothing changed. */
	freeReplyObject(redisCommand(c, "RPUSH l a"));
	redisReply *r = call(c, true, "l", 1, (const char *const[7]){ "allow", "", "1", "1", "3", "1", "0" });
	ck_assert(r->type == REDIS_REPLY_ERROR && strncmp(r->str, "WRONGTYPE", 9) == 0);
	freeReplyObject(r);
	ck_assert_int_eq(integer(c, "LLEN %s", "l"), 1);
	redisFree(c);
}
END_TEST

START_TEST(test_module_arguments)
{
	/* The script's refusals, then edges it accepts. */
	static const char *const edges[][7] = {
		{ "allow", "", "0", "0", "1", "1", "zz" }, /* rate 0 with period 0; arg ignored */
		{ "allow", "", "00000000000000000001", "1", "1", "1", "0" },
		{ "allow", "-9223372036854775808", "1", "1", "1", "1", "0" },
		{ "allow", "9223372036854775807", "1", "1", "1", "1", "0" },
	};
	size_t nedges = sizeof(edges) / sizeof(edges[0]);
	redisContext *c = server_admin(&srv);
	for (size_t i = 0; i < redis_bad_args_count + nedges; i++) {
		const char *const *a = i < redis_bad_args_count ? redis_bad_args[i]
								: edges[i - redis_bad_args_count];
		char k[32];
		snprintf(k, sizeof(k), "a%zu", i);
		redisReply *rs = call(c, false, "as", 2, a);
		redisReply *rm = call(c, true, k, strlen(k), a);
		/* Replies on the server's clock carry different times; compare
		 * errors and codes. */
		ck_assert_int_eq(rs->type, rm->type);
		ck_assert_int_eq(rm->type, i < redis_bad_args_count ? REDIS_REPLY_ERROR
								     : REDIS_REPLY_ARRAY);
		if (rm->type == REDIS_REPLY_ERROR)
			ck_assert_str_eq(rs->str, rm->str);
		else
			ck_assert_int_eq(rs->element[0]->integer, rm->element[0]->integer);
		if (rm->type == REDIS_REPLY_ERROR)
			ck_assert_int_eq(integer(c, "EXISTS %s", k), 0);
		freeReplyObject(rs);
		freeReplyObject(rm);
		freeReplyObject(redisCommand(c, "DEL as"));
	}
	const char *counts[] = { "TOKENBUCKET.CALL", "TOKENBUCKET.CALL k allow",
				 "TOKENBUCKET.CALL k allow 1 1 1 1 1 0 extra" };
	for (size_t i = 0; i < 3; i++) {
		redisReply *r = redisCommand(c, counts[i]);
		ck_assert(r != NULL && r->type == REDIS_REPLY_ERROR);
		freeReplyObject(r);
	}
	redisReply *r = redisCommandArgv(c, 2, (const char *[]){ "TOKENBUCKET.CALL", "k" }, NULL);
	ck_assert(r != NULL && r->type == REDIS_REPLY_ERROR);
	ck_assert_str_eq(r->str, "ERR tokenbucket: bad argument count");
	freeReplyObject(r);
	ck_assert_int_eq(integer(c, "EXISTS %s", "k"), 0);
	redisFree(c);
}
END_TEST

/* The server's clock: an expiry a second past full, a refusal that writes
 * nothing, keys handed between the script and the module. */
START_TEST(test_module_server_clock)
{
	redisContext *c = server_admin(&srv);
	/* 1 token per 100 s, burst 2: full again 100 s after one is taken. */
	const char *const take[7] = { "allow", "", "1", "100000000000", "2", "1", "0" };
	for (int i = 0; i < 4; i++) {
		/* Script and module by turns on one key: granted, granted, refused, refused. */
		redisReply *r = call(c, i & 1, "sc", 2, take);
		ck_assert(r->type == REDIS_REPLY_ARRAY);
		ck_assert_int_eq(r->element[0]->integer, i < 2);
		freeReplyObject(r);
		long long pttl = integer(c, "PTTL %s", "sc");
		if (i < 2)
			ck_assert(pttl > 100000 * (i + 1) - 30000 && pttl <= 100000 * (i + 1) + 1000);
		size_t l1, l2;
		char *before = get(c, "sc", &l1);
		long long at = integer(c, "PEXPIRETIME %s", "sc");
		if (i >= 2) {
			/* The refusal left value and expiry alone; a third call checks. */
			redisReply *q = call(c, true, "sc", 2, take);
			ck_assert_int_eq(q->element[0]->integer, 0);
			freeReplyObject(q);
			char *after = get(c, "sc", &l2);
			ck_assert(l1 == l2 && memcmp(before, after, l1) == 0);
			ck_assert_int_eq(integer(c, "PEXPIRETIME %s", "sc"), at);
			free(after);
		}
		free(before);
	}
	/* A call at the caller's time writes the key without an expiry. */
	const char *const at[7] = { "tokens", "1", "1", "100000000000", "2", "0", "0" };
	freeReplyObject(call(c, true, "nx", 2, at));
	ck_assert_int_eq(integer(c, "PTTL %s", "nx"), -1);
	freeReplyObject(call(c, true, "sc", 2, (const char *const[7]){ "reset", "1", "1", "100000000000", "2", "0", "0" }));
	ck_assert_int_eq(integer(c, "PTTL %s", "sc"), -1);
	redisFree(c);
}
END_TEST

static int wait_replica(redisContext *c)
{
	redisReply *r = redisCommand(c, "WAIT 1 5000");
	int n = r != NULL && r->type == REDIS_REPLY_INTEGER ? (int)r->integer : -1;
	freeReplyObject(r);
	return n;
}

/* A replica that does not load the module: it gets SETs, and holds the
 * primary's values and absolute expiries. */
START_TEST(test_module_replica)
{
	struct server rep;
	char port[16];
	snprintf(port, sizeof(port), "%d", srv.port);
	const char *const extra[] = { "--replicaof", "127.0.0.1", port, NULL };
	ck_assert_int_eq(server_start(&rep, extra), 0);
	redisContext *c = server_admin(&srv), *rc = server_admin(&rep);
	ck_assert(c != NULL && rc != NULL);
	/* The link is up once a write is acknowledged. */
	for (int i = 0; i < 100 && wait_replica(c) != 1; i++) {
		freeReplyObject(redisCommand(c, "SET ping 1"));
		nanosleep(&(struct timespec){ 0, 50000000 }, NULL);
	}
	const char *const calls[][7] = {
		{ "allow", "", "1", "100000000000", "3", "1", "0" },
		{ "reserve", "", "1", "100000000000", "3", "3", "9223372036854775807" },
		{ "allow", "", "1", "100000000000", "3", "1", "0" }, /* refused: no write */
		{ "cancel", "", "1", "100000000000", "3", "2", "9223372036854775806" },
		{ "reset", "5", "7", "3", "9", "4", "0" },
		{ "tokens", "", "0", "1", "9", "0", "0" },
	};
	const char *keys[] = { "r1", "r2" };
	for (size_t k = 0; k < 2; k++)
		for (size_t i = 0; i < sizeof(calls) / sizeof(calls[0]); i++)
			freeReplyObject(call(c, true, keys[k], 2, calls[(i + k) % 6]));
	ck_assert_int_eq(wait_replica(c), 1);
	for (size_t k = 0; k < 2; k++) {
		size_t l1, l2;
		char *v1 = get(c, keys[k], &l1), *v2 = get(rc, keys[k], &l2);
		ck_assert(v1 != NULL && v2 != NULL && l1 == l2 && memcmp(v1, v2, l1) == 0);
		ck_assert_int_eq(integer(c, "PEXPIRETIME %s", keys[k]),
				 integer(rc, "PEXPIRETIME %s", keys[k]));
		free(v1);
		free(v2);
	}
	/* The module's command itself never reaches the replica. */
	redisReply *r = redisCommand(rc, "INFO commandstats");
	ck_assert(r != NULL && r->type == REDIS_REPLY_STRING);
	ck_assert_ptr_null(strstr(r->str, "tokenbucket"));
	ck_assert_ptr_nonnull(strstr(r->str, "cmdstat_set:"));
	freeReplyObject(r);
	redisFree(c);
	redisFree(rc);
	server_stop(&rep, false);
}
END_TEST

/* The AOF holds the writes, not the command: reloading it (DEBUG LOADAOF
 * empties the data set and replays the file) gives back every value and
 * expiry as they were, which replaying a command on the server's clock
 * would not. */
START_TEST(test_module_aof)
{
	server_stop(&srv, false);
	const char *const more[] = { "--appendonly", "yes", "--enable-debug-command", "yes", NULL };
	ck_assert_int_eq(start_with_module(more), 0);
	redisContext *c = server_admin(&srv);
	ck_assert_ptr_nonnull(c);
	const char *const calls[][7] = {
		{ "allow", "", "1", "100000000000", "3", "1", "0" },
		{ "reserve", "", "1", "100000000000", "3", "3", "9223372036854775807" },
		{ "reset", "5", "7", "3", "9", "4", "0" },
	};
	const char *keys[] = { "f1", "f2", "f3" };
	for (size_t k = 0; k < 3; k++)
		for (size_t i = 0; i <= k; i++)
			freeReplyObject(call(c, true, keys[k], 2, calls[i]));
	char *before[3];
	size_t len[3];
	long long at[3];
	for (size_t k = 0; k < 3; k++) {
		before[k] = get(c, keys[k], &len[k]);
		at[k] = integer(c, "PEXPIRETIME %s", keys[k]);
	}
	/* Later on the server's clock, so that a replayed command would differ. */
	nanosleep(&(struct timespec){ 0, 20000000 }, NULL);
	redisReply *r = redisCommand(c, "DEBUG LOADAOF");
	ck_assert(r != NULL && r->type == REDIS_REPLY_STATUS);
	freeReplyObject(r);
	for (size_t k = 0; k < 3; k++) {
		size_t l;
		char *after = get(c, keys[k], &l);
		ck_assert(after != NULL && l == len[k] && memcmp(after, before[k], l) == 0);
		ck_assert_int_eq(integer(c, "PEXPIRETIME %s", keys[k]), at[k]);
		free(after);
		free(before[k]);
	}
	redisFree(c);
	/* The AOF's directory, which the fixture's cleanup does not know. */
	server_stop(&srv, true);
	char aof[160];
	snprintf(aof, sizeof(aof), "%s/appendonlydir", srv.dir);
	DIR *d = opendir(aof);
	struct dirent *e;
	while (d != NULL && (e = readdir(d)) != NULL)
		if (e->d_name[0] != '.')
			unlinkat(dirfd(d), e->d_name, 0);
	if (d != NULL)
		closedir(d);
	rmdir(aof);
}
END_TEST

/*
 * A call that writes nothing leaves its key as the script's GET does, in
 * every way a client sees; a call that writes does what the script's SET
 * does.  Each check runs the script and the module alike.  The bucket: 1
 * token per 10 s, burst 1, on the server's clock, so that the value (43
 * bytes) is short enough for the embstr encoding a SET gives it.
 */
static const char *const take1[7] = { "allow", "", "1", "10000000000", "1", "1", "0" };
static const char *const reset1[7] = { "reset", "5", "1", "10000000000", "1", "1", "0" };

/* WATCH key on w, call on c, then MULTI PING EXEC on w: whether EXEC ran. */
static bool exec_after(redisContext *w, redisContext *c, bool module, const char *key,
		       const char *const args[7])
{
	freeReplyObject(redisCommand(w, "WATCH %s", key));
	freeReplyObject(call(c, module, key, strlen(key), args));
	freeReplyObject(redisCommand(w, "MULTI"));
	freeReplyObject(redisCommand(w, "PING"));
	redisReply *r = redisCommand(w, "EXEC");
	ck_assert_ptr_nonnull(r);
	bool ran = r->type == REDIS_REPLY_ARRAY;
	freeReplyObject(r);
	return ran;
}

START_TEST(test_module_untouched_watch)
{
	redisContext *c = server_admin(&srv), *w = server_admin(&srv);
	ck_assert(c != NULL && w != NULL);
	for (int module = 0; module < 2; module++) {
		redisReply *r = call(c, false, "w", 1, take1);
		ck_assert_int_eq(r->element[0]->integer, 1);
		freeReplyObject(r);
		ck_assert_msg(exec_after(w, c, module, "w", take1),
			      "a refusal through the %s broke a WATCH", module ? "module" : "script");
		ck_assert(!exec_after(w, c, module, "w", reset1));
		freeReplyObject(redisCommand(c, "DEL w"));
	}
	redisFree(c);
	redisFree(w);
}
END_TEST

static char *encoding(redisContext *c, const char *key)
{
	redisReply *r = redisCommand(c, "OBJECT ENCODING %s", key);
	ck_assert(r != NULL && r->type == REDIS_REPLY_STRING);
	char *e = strdup(r->str);
	freeReplyObject(r);
	return e;
}

START_TEST(test_module_untouched_encoding)
{
	redisContext *c = server_admin(&srv);
	ck_assert_ptr_nonnull(c);
	for (int module = 0; module < 2; module++) {
		/* A refused call: the script's SET made the value embstr. */
		freeReplyObject(call(c, false, "e", 1, take1));
		char *before = encoding(c, "e");
		ck_assert_str_eq(before, "embstr");
		redisReply *r = call(c, module, "e", 1, take1);
		ck_assert_int_eq(r->element[0]->integer, 0);
		freeReplyObject(r);
		char *after = encoding(c, "e");
		ck_assert_msg(strcmp(before, after) == 0, "%s: %s, then %s after a refusal",
			      module ? "module" : "script", before, after);
		free(before);
		free(after);
		/* A value refused as corrupt, int-encoded. */
		freeReplyObject(redisCommand(c, "SET i 12345"));
		r = call(c, module, "i", 1, take1);
		ck_assert(r->type == REDIS_REPLY_ERROR && strncmp(r->str, "TBCORRUPT", 9) == 0);
		freeReplyObject(r);
		after = encoding(c, "i");
		ck_assert_str_eq(after, "int");
		free(after);
		freeReplyObject(redisCommand(c, "DEL e i"));
	}
	redisFree(c);
}
END_TEST

START_TEST(test_module_untouched_events)
{
	redisContext *c = server_admin(&srv), *sub = server_admin(&srv);
	ck_assert(c != NULL && sub != NULL);
	ck_assert_int_eq(server_cmd(&srv, "CONFIG SET notify-keyspace-events KA"), REDIS_REPLY_STATUS);
	redisReply *r = redisCommand(sub, "PSUBSCRIBE __keyspace@0__:*");
	ck_assert(r != NULL && r->type == REDIS_REPLY_ARRAY);
	freeReplyObject(r);
	/* Granted (SET with an expiry), refused (nothing), reset at the
	 * caller's time (SET without one), on one key each, then a fence. */
	const char *const *steps[] = { take1, take1, reset1 };
	for (int module = 0; module < 2; module++)
		for (size_t i = 0; i < 3; i++)
			freeReplyObject(call(c, module, module ? "nm" : "ns", 2, steps[i]));
	freeReplyObject(redisCommand(c, "SET fence 1"));
	char seen[2][128] = { "", "" };
	for (;;) {
		ck_assert_int_eq(redisGetReply(sub, (void **)&r), REDIS_OK);
		ck_assert(r->type == REDIS_REPLY_ARRAY && r->elements == 4);
		const char *key = strchr(r->element[2]->str, ':') + 1;
		bool fence = strcmp(key, "fence") == 0;
		if (!fence) {
			ck_assert(strcmp(key, "ns") == 0 || strcmp(key, "nm") == 0);
			char *to = seen[key[1] == 'm'];
			strncat(to, " ", 127 - strlen(to));
			strncat(to, r->element[3]->str, 127 - strlen(to));
		}
		freeReplyObject(r);
		if (fence)
			break;
	}
	ck_assert_str_eq(seen[0], " set expire set");
	ck_assert_msg(strcmp(seen[1], seen[0]) == 0, "the module's events:%s, the script's:%s",
		      seen[1], seen[0]);
	redisFree(c);
	redisFree(sub);
}
END_TEST

static long long repl_offset(redisContext *c)
{
	redisReply *r = redisCommand(c, "INFO replication");
	ck_assert(r != NULL && r->type == REDIS_REPLY_STRING);
	const char *at = strstr(r->str, "master_repl_offset:");
	ck_assert_ptr_nonnull(at);
	long long off = strtoll(at + strlen("master_repl_offset:"), NULL, 10);
	freeReplyObject(r);
	return off;
}

/* Whether rc, a replica of c, is linked and has applied all c propagated.
 * Asked of rc itself: WAIT would also count a stray replica of an earlier
 * server on this port. */
static bool caught_up(redisContext *c, redisContext *rc)
{
	for (int i = 0; i < 400; i++) {
		redisReply *r = redisCommand(rc, "INFO replication");
		bool up = r != NULL && r->type == REDIS_REPLY_STRING &&
			  strstr(r->str, "master_link_status:up") != NULL;
		freeReplyObject(r);
		if (up && repl_offset(rc) == repl_offset(c))
			return true;
		nanosleep(&(struct timespec){ 0, 25000000 }, NULL);
	}
	return false;
}

/* The replication stream, read as a replica's offset: a refusal adds
 * nothing, a write exactly its SET ... PXAT, the same bytes for both. */
START_TEST(test_module_untouched_stream)
{
	/* No PINGs in the stream while it is measured. */
	ck_assert_int_eq(server_cmd(&srv, "CONFIG SET repl-ping-replica-period 3600"),
			 REDIS_REPLY_STATUS);
	struct server rep;
	char port[16];
	snprintf(port, sizeof(port), "%d", srv.port);
	ck_assert_int_eq(server_start(&rep, (const char *const[]){ "--replicaof", "127.0.0.1", port, NULL }), 0);
	redisContext *c = server_admin(&srv), *rc = server_admin(&rep);
	ck_assert(c != NULL && rc != NULL);
	ck_assert(caught_up(c, rc));
	/* The first write after the sync carries a SELECT. */
	freeReplyObject(redisCommand(c, "SET ping 1"));
	for (int module = 0; module < 2; module++) {
		const char *key = module ? "pm" : "ps";
		long long off = repl_offset(c);
		redisReply *r = call(c, module, key, 2, take1);
		ck_assert_int_eq(r->element[0]->integer, 1);
		freeReplyObject(r);
		size_t len;
		char *v = get(c, key, &len);
		char at[24];
		snprintf(at, sizeof(at), "%lld", integer(c, "PEXPIRETIME %s", key));
		/* *5 $3 SET $2 key $len value $4 PXAT $n at, once. */
		char head[16];
		long long set = 4 + 9 + 8 + snprintf(head, sizeof(head), "$%zu\r\n", len) + (long long)len +
				2 + 10 + snprintf(head, sizeof(head), "$%zu\r\n", strlen(at)) +
				(long long)strlen(at) + 2;
		ck_assert_int_eq(repl_offset(c) - off, set);
		/* Refused, then refused as corrupt. */
		freeReplyObject(redisCommand(c, "SET h 12345"));
		off = repl_offset(c);
		r = call(c, module, key, 2, take1);
		ck_assert_int_eq(r->element[0]->integer, 0);
		freeReplyObject(r);
		r = call(c, module, "h", 1, take1);
		ck_assert(r->type == REDIS_REPLY_ERROR && strncmp(r->str, "TBCORRUPT", 9) == 0);
		freeReplyObject(r);
		ck_assert_int_eq(repl_offset(c) - off, 0);
		ck_assert(caught_up(c, rc));
		size_t l2;
		char *v2 = get(rc, key, &l2);
		ck_assert(v2 != NULL && l2 == len && memcmp(v, v2, len) == 0);
		free(v);
		free(v2);
	}
	redisFree(c);
	redisFree(rc);
	server_stop(&rep, false);
}
END_TEST

/* n allow calls on key through r, burst 3: the first 3 granted, the rest refused. */
static void allow_burst(struct tokenbucket_redis *r, const char *key, int n)
{
	static const struct tokenbucket_redis_limit lim = { .tokens = 1, .period_ns = 3600 * SEC, .burst = 3 };
	for (int i = 0; i < n; i++) {
		struct tokenbucket_result res;
		ck_assert_int_eq(tokenbucket_redis_allow(r, key, strlen(key), &lim, 1, &res), 0);
		ck_assert_int_eq(res.allowed, i < 3);
	}
}

/*
 * The client asks each connection's server for the module and sends its
 * calls there; _NEVER sends the script; after MODULE UNLOAD the calls go
 * to the script (or the function library), with nothing lost; _ALWAYS on a server without it
 * is the server's error.  One key goes through every path: one bucket.
 */
/* A client of srv with options o (tokenbucket_redis_configure). */
static struct tokenbucket_redis *client_with(const struct tokenbucket_redis_options *o)
{
	struct tokenbucket_redis *r;
	ck_assert_int_eq(tokenbucket_redis_open(&r, srv.url, SEC, 500 * MS), 0);
	ck_assert_int_eq(tokenbucket_redis_configure(r, o), 0);
	return r;
}

START_TEST(test_module_detected)
{
	static const struct tokenbucket_redis_limit lim = { .tokens = 1, .period_ns = 3600 * SEC, .burst = 3 };
	struct tokenbucket_result res;
	for (int piped = 0; piped < 2; piped++) {
		struct tokenbucket_redis *found = client_with(REDIS_OPTIONS(.pipelining = piped));
		struct tokenbucket_redis *never = client_with(
			REDIS_OPTIONS(.pipelining = piped, .module = TOKENBUCKET_REDIS_MODULE_NEVER));
		char key[16];
		snprintf(key, sizeof(key), "d%d", piped);
		/* A new pipelined connection sends the script until the server has answered. */
		allow_burst(found, "warm", 1);
		ck_assert_int_eq(server_cmd(&srv, "CONFIG RESETSTAT"), REDIS_REPLY_STATUS);
		allow_burst(found, key, 2);
		ck_assert_int_eq(redis_calls_of("tokenbucket.call"), 2);
		ck_assert_int_eq(redis_calls_of("evalsha") + redis_calls_of("eval"), 0);
		ck_assert_int_eq(tokenbucket_redis_allow(never, key, strlen(key), &lim, 1, &res), 0);
		ck_assert(res.allowed); /* the third token: the module's writes read by the script */
		ck_assert_int_eq(tokenbucket_redis_allow(never, key, strlen(key), &lim, 1, &res), 0);
		ck_assert(!res.allowed);
		ck_assert_int_eq(redis_calls_of("tokenbucket.call"), 2);
		ck_assert_int_ge(redis_calls_of("evalsha") + redis_calls_of("eval"), 2);
		tokenbucket_redis_close(found);
		tokenbucket_redis_close(never);
	}
	ck_assert_int_eq(tokenbucket_redis_configure(cli, REDIS_OPTIONS(.module = 3)), -EINVAL);
	ck_assert_int_eq(tokenbucket_redis_configure(cli, REDIS_OPTIONS(.module = -1)), -EINVAL);
	ck_assert_int_eq(tokenbucket_redis_configure(NULL, REDIS_OPTIONS(.module = 0)), -EINVAL);

	/* Unloaded under the pooled (cli) and the pipelined connection: the script takes over. */
	struct tokenbucket_redis *piped = client_with(REDIS_OPTIONS(.pipelining = 1));
	allow_burst(piped, "u", 1);
	allow_burst(cli, "warm", 1);
	ck_assert_int_eq(server_cmd(&srv, "MODULE UNLOAD tokenbucket"), REDIS_REPLY_STATUS);
	ck_assert_int_eq(server_cmd(&srv, "CONFIG RESETSTAT"), REDIS_REPLY_STATUS);
	for (int i = 1; i < 4; i++) {
		ck_assert_int_eq(tokenbucket_redis_allow(piped, "u", 1, &lim, 1, &res), 0);
		ck_assert_int_eq(res.allowed, i < 3);
	}
	/* The script, or on Redis 7 the function library, which the connections found too. */
	ck_assert_int_ge(redis_calls_of("evalsha") + redis_calls_of("eval") + redis_calls_of("fcall"), 3);
	/* The pooled blocking connections found the module gone too. */
	ck_assert_int_eq(tokenbucket_redis_allow(cli, "u", 1, &lim, 1, &res), 0);
	ck_assert(!res.allowed);
	ck_assert_int_eq(redis_calls_of("tokenbucket.call"), 0);
	tokenbucket_redis_close(piped);
	/* Forced onto a server without it: the server's error, nothing decided. */
	for (int p = 0; p < 2; p++) {
		struct tokenbucket_redis *always = client_with(
			REDIS_OPTIONS(.pipelining = p, .module = TOKENBUCKET_REDIS_MODULE_ALWAYS));
		ck_assert_int_eq(tokenbucket_redis_allow(always, "u", 1, &lim, 1, &res), -EPROTO);
		tokenbucket_redis_close(always);
	}
}
END_TEST

Suite *redis_module_suite(void)
{
	Suite *s = suite_create("redis-module");
	redis_tcase(s, "module", module_setup, 240,
		    (const TTest *const[]){ test_module_version, test_module_differential, test_module_lease_differential,
					    test_module_hostile, test_module_arguments,
					    test_module_server_clock, test_module_replica,
					    test_module_aof, test_module_detected,
					    test_module_set_differential, test_module_set_hostile,
					    test_module_untouched_watch, test_module_untouched_encoding,
					    test_module_untouched_events, test_module_untouched_stream,
					    NULL });
	return s;
}
