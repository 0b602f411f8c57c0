/* SPDX-License-Identifier: MIT */
/*
 * The module's arithmetic (src/redis/module/bucket.c) without a server:
 * the differential's random sequences (sequence.c, which asks the local
 * library) run through tbm_call and tbm_call_all on the value they store,
 * and every decision must be the library's: the code, a reservation's
 * time_to_act, and after every step the level as tokens_at reads it
 * (bit for bit), the whole tokens and the time until full.  Then hostile
 * stored values: each is refused with the documented TBCORRUPT text and
 * writes nothing, or decides.
 *
 * TOKENBUCKET_MODULE_SEQUENCES sets how many sequences of each kind run
 * (default 1500, a tenth of it under valgrind).
 */
#include <check.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../on_valgrind.h"
#include "bucket.h"
#include "sequence.h"

static const char corrupt[] = "TBCORRUPT the value at this key is not a token bucket";
static const char corrupt_set[] = "TBCORRUPT the value at this key is not a set of token buckets";
static const char *const op_names[] = { "allow", "reserve", "cancel", "tokens", "reset", "refund" };

/* ck_assert marks every assertion passed through a pipe, which costs more
 * than a step here: the loops check with this, silent until one fails. */
#define expect(cond, ...)                         \
	do {                                      \
		if (!(cond))                      \
			ck_abort_msg(__VA_ARGS__); \
	} while (0)

static long sequences(void)
{
	const char *e = getenv("TOKENBUCKET_MODULE_SEQUENCES");
	long n = e != NULL ? strtol(e, NULL, 10) : 1500;
	if (e == NULL && TBT_ON_VALGRIND)
		n /= 10;
	return n > 0 ? n : 1;
}

/* The arguments of one call, as the client sends them. */
struct call {
	char text[7][24];
	struct tbm_str arg[7];
};

static void put_call(struct call *c, enum tokenbucket_redis_op op, int64_t now,
		     const struct tokenbucket_redis_limit *l, uint64_t n, int64_t arg)
{
	snprintf(c->text[0], sizeof(c->text[0]), "%s", op_names[op]);
	snprintf(c->text[1], sizeof(c->text[1]), "%" PRId64, now);
	snprintf(c->text[2], sizeof(c->text[2]), "%" PRIu64, l->tokens);
	snprintf(c->text[3], sizeof(c->text[3]), "%" PRId64, l->tokens ? l->period_ns : 1);
	snprintf(c->text[4], sizeof(c->text[4]), "%" PRIu64, l->burst);
	snprintf(c->text[5], sizeof(c->text[5]), "%" PRIu64, n);
	snprintf(c->text[6], sizeof(c->text[6]), "%" PRId64, arg);
	for (int i = 0; i < 7; i++)
		c->arg[i] = (struct tbm_str){ c->text[i], strlen(c->text[i]) };
}

static int64_t field_i64(const struct tbm_out *o, int i)
{
	char t[32];
	expect(o->field_len[i] < sizeof(t), "field %d of %zu characters", i, o->field_len[i]);
	memcpy(t, o->field[i], o->field_len[i]);
	t[o->field_len[i]] = '\0';
	return strtoll(t, NULL, 10);
}

/* The client's reading of a tokens reply (codec.c): level + rem/q in long double, rounded once, within burst. */
static double reply_tokens(const struct tbm_out *o, uint64_t burst)
{
	double v = (double)((long double)field_i64(o, 1) +
			    (long double)field_i64(o, 2) / (long double)field_i64(o, 3));
	return v > (double)burst ? (double)burst : v;
}

/* Bit for bit; memcheck emulates long double with a 64-bit mantissa, so under it one ulp. */
static bool same_double(double a, double b)
{
	return memcmp(&a, &b, sizeof(a)) == 0 || (TBT_ON_VALGRIND && nextafter(a, b) == b);
}

/* The key: what the module last wrote. */
struct key {
	bool held;
	char value[TBM_VALUE_MAX];
	size_t len;
};

static const struct tbm_str *stored_of(const struct key *k, struct tbm_str *s)
{
	*s = (struct tbm_str){ k->value, k->len };
	return k->held ? s : NULL;
}

static void keep(struct key *k, const struct tbm_out *o)
{
	if (!o->write)
		return;
	memcpy(k->value, o->value, o->value_len);
	k->len = o->value_len;
	k->held = true;
}

/*
 * After a step: the key and the local bucket read at now, with the
 * configuration the local bucket has, must hold the same.  The read is
 * kept on both sides (both have then seen now).
 */
static void compare_state(struct seq *s, struct key *k, int64_t now, long seq, int step)
{
	struct call c;
	struct tbm_out o;
	struct tbm_str v;
	put_call(&c, TOKENBUCKET_REDIS_TOKENS, now, &s->made, 0, 0);
	tbm_call(c.arg, stored_of(k, &v), 0, &o);
	expect(o.error == NULL, "sequence %ld step %d: %s", seq, step, o.error);
	keep(k, &o);
	double local = tokenbucket_tokens_at(s->tb, now);
	struct tokenbucket_result res;
	expect(tokenbucket_allow_result_at(s->tb, now, 0, &res) == 0, "allow_result_at refused");
	double mine = reply_tokens(&o, s->made.burst);
	int64_t level = field_i64(&o, 1), clock = field_i64(&o, 0);
	expect(same_double(mine, local), "sequence %ld step %d: tokens %a, local %a (%.*s)",
		      seq, step, mine, local, (int)k->len, k->value);
	expect(res.remaining == (uint64_t)(level > 0 ? level : 0),
		      "sequence %ld step %d: level %" PRId64 ", local %" PRIu64, seq, step, level,
		      res.remaining);
	int64_t full = seq_until(field_i64(&o, 5), clock);
	expect(full == res.reset_after_ns,
		      "sequence %ld step %d: full in %" PRId64 ", local %" PRId64 " (%.*s)", seq, step,
		      full, res.reset_after_ns, (int)k->len, k->value);
}

/* Limits at the edges the API accepts, to start some sequences with. */
static const struct tokenbucket_redis_limit edges[] = {
	{ 1, 1000000000, 1 },                                   /* burst 1 */
	{ 7, 3000000000, 10 },                                  /* 7 per 3 s */
	{ 7, 3000000000, TOKENBUCKET_BURST_MAX },
	{ 1000000000, 1000000000, 1000000000 },                 /* 10^9 a second */
	{ 1000000000, 1000000000, TOKENBUCKET_BURST_MAX },
	{ UINT64_MAX, INT64_MAX, TOKENBUCKET_BURST_MAX },
	{ UINT64_MAX, 1, TOKENBUCKET_BURST_MAX },
	{ 1, INT64_MAX, 1 },
	{ 0, 1, 5 },
};

START_TEST(test_sequences_decide_as_the_library)
{
	long count = sequences();
	for (long i = 0; i < count; i++) {
		struct seq s;
		struct seq_step st;
		struct seq_expect ex;
		uint64_t r = 0x5eed0000u + (uint64_t)i;
		seq_start(&s, seq_rand(&r), 60);
		if (i % 3 == 0)
			s.lim = edges[(size_t)(i / 3) % (sizeof(edges) / sizeof(edges[0]))];
		struct key k = { 0 };
		int step = 0;
		while (seq_next(&s, &st, &ex)) {
			expect(ex.err != -EFAULT, "sequence %ld step %d: the library refused", i,
				      step);
			struct call c;
			struct tbm_out o;
			struct tbm_str v;
			put_call(&c, st.op, st.now, &st.lim, st.n, st.arg);
			tbm_call(c.arg, stored_of(&k, &v), 0, &o);
			if (ex.code < 0) {
				expect(o.error != NULL &&
					       strcmp(o.error, "ERR tokenbucket: bad reset level") == 0 &&
					       !o.write,
				       "sequence %ld step %d: reset above burst: %s", i, step,
				       o.error ? o.error : "decided");
			} else {
				expect(o.error == NULL, "sequence %ld step %d: %s", i, step, o.error);
				expect(o.code == ex.code,
					      "sequence %ld step %d: %s code %lld, local %d", i, step,
					      op_names[st.op], o.code, ex.code);
				if (st.op == TOKENBUCKET_REDIS_RESERVE && ex.code == 1)
					expect(field_i64(&o, 4) == ex.act,
					       "sequence %ld step %d: time_to_act %" PRId64 ", local %" PRId64,
					       i, step, field_i64(&o, 4), ex.act);
				if (st.op == TOKENBUCKET_REDIS_TOKENS)
					expect(same_double(reply_tokens(&o, st.lim.burst), ex.tokens),
					       "sequence %ld step %d: tokens %a, local %a", i, step,
					       reply_tokens(&o, st.lim.burst), ex.tokens);
			}
			keep(&k, &o);
			expect(k.held == s.seen, "sequence %ld step %d: key %d, local %d", i,
				      step, k.held, s.seen);
			if (s.seen)
				compare_state(&s, &k, st.now, i, step);
			step++;
		}
		seq_end(&s);
	}
}
END_TEST

START_TEST(test_sets_decide_as_the_library)
{
	long count = sequences();
	for (long i = 0; i < count; i++) {
		struct seq_set s;
		struct seq_set_step st;
		struct seq_set_expect ex;
		uint64_t r = 0x5e7000u + (uint64_t)i;
		seq_set_start(&s, seq_rand(&r), 40, i % 4 == 0 ? TOKENBUCKET_SET_MAX : 4);
		struct key k = { 0 };
		int step = 0;
		while (seq_set_next(&s, &st, &ex)) {
			expect(ex.err != -EFAULT, "set %ld step %d: the library refused", i, step);
			char text[3 + 3 * TBM_SET_MAX][24];
			struct tbm_str arg[3 + 3 * TBM_SET_MAX];
			size_t nargs = 3 + 3 * st.count;
			snprintf(text[0], sizeof(text[0]), "allow_all");
			snprintf(text[1], sizeof(text[1]), "%" PRId64, st.now);
			snprintf(text[2], sizeof(text[2]), "%" PRIu64, st.n);
			for (size_t j = 0; j < st.count; j++) {
				const struct tokenbucket_redis_limit *l = &st.lim[j];
				snprintf(text[3 + 3 * j], sizeof(text[0]), "%" PRIu64, l->tokens);
				snprintf(text[4 + 3 * j], sizeof(text[0]), "%" PRId64,
					 l->tokens ? l->period_ns : 1);
				snprintf(text[5 + 3 * j], sizeof(text[0]), "%" PRIu64, l->burst);
			}
			for (size_t j = 0; j < nargs; j++)
				arg[j] = (struct tbm_str){ text[j], strlen(text[j]) };
			struct tbm_out o;
			struct tbm_str v;
			tbm_call_all(arg, nargs, stored_of(&k, &v), 0, &o);
			expect(o.error == NULL, "set %ld step %d: %s", i, step, o.error);
			if (ex.err == -E2BIG) {
				expect(o.code == 2 && !o.write, "set %ld step %d: n above a burst: code %lld",
				       i, step, o.code);
			} else {
				int64_t clock = field_i64(&o, 0);
				const struct tokenbucket_set_result *e = &ex.res;
				expect(o.code == e->allowed && (size_t)o.index == e->index &&
						      field_i64(&o, 1) == (int64_t)e->remaining,
					      "set %ld step %d: code %lld index %lld level %" PRId64
					      ", local %d %zu %" PRIu64, i, step, o.code, o.index,
					      field_i64(&o, 1), e->allowed, e->index, e->remaining);
				int64_t retry = e->allowed ? 0 : seq_until(field_i64(&o, 4), clock);
				int64_t reset = seq_until(field_i64(&o, 5), clock);
				expect(retry == e->retry_after_ns && reset == e->reset_after_ns,
				       "set %ld step %d: retry %" PRId64 " reset %" PRId64
				       ", local %" PRId64 " %" PRId64,
				       i, step, retry, reset, e->retry_after_ns, e->reset_after_ns);
			}
			keep(&k, &o);
			step++;
		}
		seq_set_end(&s);
	}
}
END_TEST

/* Every op on value v (as the client sends it, configured as v is) must refuse it as corrupt and write nothing. */
static void refused(const char *v, size_t n)
{
	static const struct tokenbucket_redis_limit l = { 1, 1000, 10 };
	struct tbm_str s = { v, n };
	for (int op = 0; op < 6; op++) {
		struct call c;
		struct tbm_out o;
		put_call(&c, (enum tokenbucket_redis_op)op, 5000, &l, 1, 0);
		tbm_call(c.arg, &s, 0, &o);
		expect(o.error != NULL && strcmp(o.error, corrupt) == 0 && !o.write,
			      "%s on \"%.*s\": %s", op_names[op], (int)n, v,
			      o.error ? o.error : "decided");
	}
}

START_TEST(test_hostile_values_refused)
{
	static const char *const bad[] = {
		"", "tb1", "tb1 ", "tb1 1 2 0 1 1000", "tb1 1 2 0 1 1000 10 ", " tb1 1 2 0 1 1000 10",
		"tb1  1 2 0 1 1000 10", "TB1 1 2 0 1 1000 10", "tb2 1 2 0 1 1000 10",
		"tbs1 1 2 0 1 1000 10", "tb1 1 2 0 1 1000 10 7", "tb1 +1 2 0 1 1000 10",
		"tb1 1 +2 0 1 1000 10", "tb1 1 2 -0 1 1000 10", "tb1 1 2 0 -1 1000 10",
		"tb1 1 2 0 1 -1000 10", "tb1 1 2 0 1 1000 -10", "tb1 1 2 0 1 1000 10\n",
		"tb1 1 2 0 1 1000 1x", "tb1 1 2 0 1 1000 1.0", "tb1 1 2 0 1 1e3 10", "tb1 - 2 0 1 1000 10",
		"tb1 1 -- 0 1 1000 10", "tb1 1 2\t0 1 1000 10",
		/* level above burst, rem not below q, q 0, rate 0 not 0/1 */
		"tb1 1 11 0 1 1000 10", "tb1 1 2 1000 1 1000 10", "tb1 1 2 0 1 0 10", "tb1 1 2 0 0 0 10",
		"tb1 1 2 0 0 2 10",
		/* clocks that are no times, and one past int64 */
		"tb1 -9223372036854775808 2 0 1 1000 10", "tb1 9223372036854775807 2 0 1 1000 10",
		"tb1 9223372036854775808 2 0 1 1000 10", "tb1 -9223372036854775809 2 0 1 1000 10",
		/* overlong numbers: 21 digits, 20 past 2^64, q past 2^63, burst past 2^62, debt at 2^62 */
		"tb1 1 2 0 000000000000000000001 1000 10", "tb1 1 2 0 18446744073709551616 1000 10",
		"tb1 1 2 0 1 9223372036854775808 10", "tb1 1 2 0 1 1000 4611686018427387905",
		"tb1 1 -4611686018427387904 0 1 1000 10", "tb1 00000000000000000001 2 0 1 1000 10",
		"tb1 1 2 99999999999999999999 1 1000 10",
	};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
		refused(bad[i], strlen(bad[i]));
	/* A NUL where a digit or a space belongs. */
	static const char nul[] = "tb1 1 2 0 1 1000 10";
	char b[sizeof(nul)];
	for (size_t i = 0; i + 1 < sizeof(nul); i++) {
		memcpy(b, nul, sizeof(nul));
		b[i] = '\0';
		refused(b, sizeof(nul) - 1);
	}
	/* Every proper prefix that does not end in a digit. */
	static const char whole[] = "tb1 -9 -4611686018427387903 999 1000 1001 4611686018427387904";
	for (size_t n = 0; n + 1 < sizeof(whole); n++)
		if (n < 5 || whole[n - 1] < '0' || whole[n - 1] > '9')
			refused(whole, n);
}
END_TEST

/* Random bytes near the format's: a documented answer every time; a value accepted decides and writes a value accepted again. */
START_TEST(test_random_values_answer_as_documented)
{
	static const char alphabet[] = "0123456789 -tbs1\n+\0x";
	static const char *const seeds[] = {
		"tb1 1700000000000000000 5 123 7 3000000000 10",
		"tb1 -5 -4611686018427387903 0 1 1 4611686018427387904",
		"tbs1 1700000000000000000 5 0 1 1000 10 3 2 7 3000000000 10",
	};
	static const struct tokenbucket_redis_limit l = { 7, 3000000000, 10 };
	uint64_t r = 42;
	long count = sequences() * 50;
	for (long i = 0; i < count; i++) {
		char v[96];
		size_t n = strlen(seeds[i % 3]);
		memcpy(v, seeds[i % 3], n);
		for (uint64_t m = 1 + seq_rand(&r) % 4; m > 0; m--) {
			uint64_t x = seq_rand(&r);
			size_t at = (size_t)(x % (n + 1));
			char c = (x >> 32) % 4 == 0 ? (char)(x >> 40)
						    : alphabet[(x >> 40) % (sizeof(alphabet) - 1)];
			switch ((x >> 48) % 3) {
			case 0: /* overwrite */
				if (at < n)
					v[at] = c;
				break;
			case 1: /* insert */
				if (n < sizeof(v)) {
					memmove(v + at + 1, v + at, n - at);
					v[at] = c, n++;
				}
				break;
			default: /* cut */
				n = at;
			}
		}
		struct tbm_str s = { v, n };
		struct call c;
		struct tbm_out o;
		put_call(&c, (enum tokenbucket_redis_op)(i % 6), 1700000000000000000 + i, &l, 3, 5);
		tbm_call(c.arg, &s, 0, &o);
		expect(o.error == NULL || (strcmp(o.error, corrupt) == 0 && !o.write),
			      "\"%.*s\": %s", (int)n, v, o.error);
		if (o.error == NULL && o.write) {
			struct tbm_str w = { o.value, o.value_len };
			struct tbm_out again;
			put_call(&c, TOKENBUCKET_REDIS_TOKENS, 1700000000000000000 + i, &l, 0, 0);
			tbm_call(c.arg, &w, 0, &again);
			expect(again.error == NULL, "\"%.*s\" wrote \"%.*s\"", (int)n, v,
				      (int)o.value_len, o.value);
		}
		const struct tbm_str all[6] = { { "allow_all", 9 }, { "", 0 }, { "1", 1 },
						{ "7", 1 },	    { "3000000000", 10 }, { "10", 2 } };
		tbm_call_all(all, 6, &s, 1700000000000000000 + i, &o);
		expect(o.error == NULL || (strcmp(o.error, corrupt_set) == 0 && !o.write),
			      "allow_all on \"%.*s\": %s", (int)n, v, o.error);
	}
}
END_TEST

int main(void)
{
	Suite *s = suite_create("redis-module-bucket");
	TCase *tc = tcase_create("model");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_sequences_decide_as_the_library);
	tcase_add_test(tc, test_sets_decide_as_the_library);
	tcase_add_test(tc, test_hostile_values_refused);
	tcase_add_test(tc, test_random_values_answer_as_documented);
	suite_add_tcase(s, tc);
	SRunner *sr = srunner_create(s);
	srunner_run_all(sr, CK_NORMAL);
	int failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
