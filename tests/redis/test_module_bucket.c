/* SPDX-License-Identifier: MIT */
/*
 * The module's arithmetic (src/redis/module/bucket.c) without a server
 * (bucket_diff.c): the differential's random sequences decided by it and by
 * the local library, and hostile stored values, each refused with the
 * documented TBCORRUPT text writing nothing, or decided as documented.
 *
 * TOKENBUCKET_MODULE_SEQUENCES sets how many sequences of each kind run
 * (default 1500, a twentieth of it under valgrind).
 */
#include <check.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../on_valgrind.h"
#include "bucket.h"
#include "bucket_diff.h"

static long sequences(void)
{
	const char *e = getenv("TOKENBUCKET_MODULE_SEQUENCES");
	long n = e != NULL ? strtol(e, NULL, 10) : 1500;
	if (e == NULL && TBT_ON_VALGRIND)
		n /= 20;
	return n > 0 ? n : 1;
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
		char why[512];
		uint64_t r = 0x5eed0000u + (uint64_t)i;
		const struct tokenbucket_redis_limit *first =
			i % 3 == 0 ? &edges[(size_t)(i / 3) % (sizeof(edges) / sizeof(edges[0]))] : NULL;
		if (!bd_sequence(seq_rand(&r), 60, first, why, sizeof(why)))
			ck_abort_msg("sequence %ld, %s", i, why);
	}
}
END_TEST

START_TEST(test_sets_decide_as_the_library)
{
	long count = sequences();
	for (long i = 0; i < count; i++) {
		char why[512];
		uint64_t r = 0x5e7000u + (uint64_t)i;
		if (!bd_set_sequence(seq_rand(&r), 40, i % 4 == 0 ? TBM_SET_MAX : 4, why, sizeof(why)))
			ck_abort_msg("set %ld, %s", i, why);
	}
}
END_TEST

/* allow_all on value v must refuse it as corrupt and write nothing. */
static void refused_set(const char *v, size_t n)
{
	struct tbm_str s = { v, n };
	const struct tbm_str arg[6] = { { "allow_all", 9 }, { "5000", 4 }, { "1", 1 },
					{ "1", 1 },	    { "1000", 4 }, { "10", 2 } };
	struct tbm_out o;
	tbm_call_all(arg, 6, &s, 0, &o);
	ck_assert_msg(o.error != NULL && strcmp(o.error, "TBCORRUPT the value at this key is not a "
							 "set of token buckets") == 0 && !o.write,
		      "allow_all on \"%.*s\": %s", (int)n, v, o.error ? o.error : "decided");
}

/* Every op on value v must refuse it as corrupt and write nothing. */
static void refused(const char *v, size_t n)
{
	static const char *const ops[] = { "allow", "reserve", "cancel", "tokens",
					   "reset", "refund", "lease", "giveback" };
	struct tbm_str s = { v, n };
	for (size_t op = 0; op < sizeof(ops) / sizeof(ops[0]); op++) {
		const struct tbm_str arg[7] = { { ops[op], strlen(ops[op]) }, { "5000", 4 }, { "1", 1 },
						{ "1000", 4 }, { "10", 2 }, { "1", 1 }, { "1000", 4 } };
		struct tbm_out o;
		tbm_call(arg, &s, 0, &o);
		ck_assert_msg(o.error != NULL && strcmp(o.error, "TBCORRUPT the value at this key is "
								 "not a token bucket") == 0 && !o.write,
			      "%s on \"%.*s\": %s", ops[op], (int)n, v, o.error ? o.error : "decided");
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
		"tb1 1 2 99999999999999999999 1 1000 10", "tb1 1 2 000000000000000000001 1 1000 10",
		"tb1 1 000000000000000000002 0 1 1000 10",
		/* lease groups: none, on a "tb1", count 0, expiries not ascending,
		 * five, signs, no times, counts past 2^62, a space too many */
		"tbl1 1 2 0 1 1000 10", "tbl1 1 2 0 1 1000 10 ", "tb1 1 2 0 1 1000 10 9000 1",
		"tbl1 1 2 0 1 1000 10 9000 0", "tbl1 1 2 0 1 1000 10 9000 1 9000 1",
		"tbl1 1 2 0 1 1000 10 9000 1 8000 1", "tbl1 1 2 0 1 1000 10 9000",
		"tbl1 1 2 0 1 1000 10 1 1 2 1 3 1 4 1 5 1", "tbl1 1 2 0 1 1000 10 9000 -1",
		"tbl1 1 2 0 1 1000 10 9000 +1", "tbl1 1 2 0 1 1000 10 +9000 1",
		"tbl1 1 2 0 1 1000 10 9223372036854775807 1", "tbl1 1 2 0 1 1000 10 -9223372036854775808 1",
		"tbl1 1 2 0 1 1000 10 9000 4611686018427387905", "tbl1 1 2 0 1 1000 10 9000  1",
		"tbl1 1 2 0 1 1000 10  9000 1", "tbl1 1 2 0 1 1000 10 9000 1 ", "tbl1 1 2 0 1 1000 10 - 1",
		"tbl1 1 11 0 1 1000 10 9000 1", "tbl 1 2 0 1 1000 10 9000 1",
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
	static const char *const bad_sets[] = {
		"", "tbs1", "tbs1 ", "tbs1 1", "tbs1 1 5 0 1 1000", "tbs1 1 5 0 1 1000 10 3",
		"tbs1 1 5 0 1 1000 10 ", "tbs1 1 -5 0 1 1000 10", "tbs1 1 11 0 1 1000 10",
		"tbs1 1 5 1000 1 1000 10", "tbs1 1 5 0 0 2 10", "tbs1 1 5 0 1 0 10",
		"tbs1 9223372036854775807 5 0 1 1000 10", "tbs1 -9223372036854775808 5 0 1 1000 10",
		"tbs1 1 5 000000000000000000001 1 1000 10", "tb1 1 2 0 1 1000 10",
		"tbs1 1 5 0 1 1000 10 5 0 1 1000 10 5 0 1 1000 10 5 0 1 1000 10 5 0 1 1000 10 "
		"5 0 1 1000 10 5 0 1 1000 10 5 0 1 1000 10 5 0 1 1000 10 5 0 1 1000 10 5 0 1 1000 10 "
		"5 0 1 1000 10 5 0 1 1000 10 5 0 1 1000 10 5 0 1 1000 10 5 0 1 1000 10 5 0 1 1000 10",
	};
	for (size_t i = 0; i < sizeof(bad_sets) / sizeof(bad_sets[0]); i++)
		refused_set(bad_sets[i], strlen(bad_sets[i]));
	/* Every proper prefix that does not end in a digit. */
	static const char whole[] = "tb1 -9 -4611686018427387903 999 1000 1001 4611686018427387904";
	for (size_t n = 0; n + 1 < sizeof(whole); n++)
		if (n < 5 || whole[n - 1] < '0' || whole[n - 1] > '9')
			refused(whole, n);
}
END_TEST

/* Random bytes near the format's: a documented answer every time (bd_any_value). */
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
		char why[512];
		int op = (int)(i % 7);
		if (!bd_any_value(v, n, op, 1700000000000000000 + i, i % 2 == 0, &l, 1 + (uint64_t)i % 12,
				  5, why, sizeof(why)))
			ck_abort_msg("\"%.*s\": %s", (int)n, v, why);
	}
}
END_TEST

/*
 * Lease groups against a reference model written here, in plain integers
 * (small rates and times): production up to burst less the live groups'
 * counts, piecewise at each expiry; a lease's grant into the latest group
 * living half a window more, a new one, or the latest; a give-back
 * lowering its group.  Every written value must be the model's, and
 * level + what live groups hold never above burst once a lease came.
 */
struct lm {
	int64_t clock, level;
	uint64_t rem;
	int ng;
	int64_t e[4];
	int64_t c[4];
};

static int64_t lm_held(const struct lm *m)
{
	int64_t o = 0;
	for (int i = 0; i < m->ng; i++)
		o += m->c[i];
	return o;
}

static void lm_credit(struct lm *m, int64_t k, int64_t burst)
{
	if (m->level < 0) {
		int64_t pay = k < -m->level ? k : -m->level;
		m->level += pay, k -= pay;
	}
	int64_t cap = burst - lm_held(m);
	if (cap < 0)
		cap = 0;
	if (m->level < cap)
		m->level = m->level + k < cap ? m->level + k : cap;
}

static void lm_produce(struct lm *m, int64_t t, uint64_t p, uint64_t q, int64_t burst)
{
	if (t <= m->clock)
		return;
	uint64_t x = (uint64_t)(t - m->clock) * p + m->rem;
	m->rem = x % q;
	lm_credit(m, (int64_t)(x / q), burst);
	m->clock = t;
}

static void lm_advance(struct lm *m, int64_t t, uint64_t p, uint64_t q, int64_t burst)
{
	while (m->ng > 0 && m->e[0] <= t) {
		lm_produce(m, m->e[0], p, q, burst);
		for (int i = 1; i < m->ng; i++)
			m->e[i - 1] = m->e[i], m->c[i - 1] = m->c[i];
		m->ng--;
	}
	lm_produce(m, t, p, q, burst);
}

static size_t lm_text(const struct lm *m, uint64_t p, uint64_t q, int64_t burst, char *d, size_t size)
{
	int k = snprintf(d, size, "%s %" PRId64 " %" PRId64 " %" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRId64,
			 m->ng > 0 ? "tbl1" : "tb1", m->clock, m->level, m->rem, p, q, burst);
	for (int i = 0; i < m->ng; i++)
		k += snprintf(d + k, size - (size_t)k, " %" PRId64 " %" PRId64, m->e[i], m->c[i]);
	return (size_t)k;
}

START_TEST(test_lease_groups_as_the_model)
{
	static const char *const ops[] = { "lease", "giveback", "allow", "refund", "tokens", "reserve" };
	long count = sequences();
	uint64_t r = 0x1ea5e;
	for (long i = 0; i < count; i++) {
		uint64_t p = 1 + seq_rand(&r) % 5, q = 1 + seq_rand(&r) % 400;
		int64_t burst = 1 + (int64_t)(seq_rand(&r) % 20), window = 1 + (int64_t)(seq_rand(&r) % 3000);
		struct lm m = { .clock = 1000, .level = burst };
		char value[TBM_VALUE_MAX], want[TBM_VALUE_MAX];
		size_t vlen = 0;
		int64_t now = 1000, told[8] = { 0 };
		for (int step = 0; step < 60; step++) {
			uint64_t x = seq_rand(&r);
			now += (int64_t)(x % 900) - (x % 10 == 0 ? 1200 : 0);
			int op = (int)((x >> 16) % 6);
			if (step == 0)
				m.clock = now, op = 4; /* a new bucket, written: full at its first time */
			int64_t n = (int64_t)((x >> 24) % (uint64_t)(burst + 2));
			int64_t arg = op == 0 ? window : op == 1 ? told[(x >> 40) % 8] : op == 5 ? INT64_MAX : 0;
			char a[7][24];
			snprintf(a[0], 24, "%s", ops[op]);
			snprintf(a[1], 24, "%" PRId64, now);
			snprintf(a[2], 24, "%" PRIu64, p);
			snprintf(a[3], 24, "%" PRIu64, q);
			snprintf(a[4], 24, "%" PRId64, burst);
			snprintf(a[5], 24, "%" PRId64, n);
			snprintf(a[6], 24, "%" PRId64, arg);
			struct tbm_str args[7];
			for (int k = 0; k < 7; k++)
				args[k] = (struct tbm_str){ a[k], strlen(a[k]) };
			struct tbm_str st = { value, vlen };
			struct tbm_out o;
			tbm_call(args, step == 0 ? NULL : &st, 0, &o);
			ck_assert_msg(o.error == NULL, "%s: %s", a[0], o.error);
			/* The model. */
			long long code = 1;
			int64_t gexp = 0;
			if (n > burst && op != 4) {
				code = 2;
			} else {
				lm_advance(&m, now, p, q, burst);
				if (op == 0 || op == 2) {
					if (m.level >= n) {
						m.level -= n;
						gexp = m.clock;
						if (op == 0 && n > 0) {
							int64_t half = m.clock + window / 2;
							if (m.ng == 0 || (m.e[m.ng - 1] < half && m.ng < 4))
								m.e[m.ng] = m.clock + window, m.c[m.ng++] = 0;
							m.c[m.ng - 1] += n;
							gexp = m.e[m.ng - 1];
							told[x % 8] = gexp;
						}
					} else {
						code = 0;
					}
				} else if (op == 1 || op == 3) {
					for (int k = 0; op == 1 && k < m.ng; k++) {
						if (m.e[k] == arg) {
							m.c[k] -= n < m.c[k] ? n : m.c[k];
							if (m.c[k] == 0) {
								for (int j = k + 1; j < m.ng; j++)
									m.e[j - 1] = m.e[j], m.c[j - 1] = m.c[j];
								m.ng--;
							}
							break;
						}
					}
					lm_credit(&m, n, burst);
				} else if (op == 5) {
					m.level -= n;
				}
			}
			ck_assert_msg(o.code == code, "sequence %ld step %d %s: code %lld, model %lld", i,
				      step, a[0], o.code, code);
			if (op == 0 && code == 1) {
				ck_assert(o.lease);
				char g[24];
				snprintf(g, sizeof(g), "%" PRId64, gexp);
				ck_assert(o.field_len[6] == strlen(g) && memcmp(o.field[6], g, strlen(g)) == 0);
			}
			if (o.write) {
				memcpy(value, o.value, o.value_len);
				vlen = o.value_len;
			}
			size_t wl = lm_text(&m, p, q, burst, want, sizeof(want));
			ck_assert_msg(wl == vlen && memcmp(want, value, vlen) == 0,
				      "sequence %ld step %d %s %s n %s arg %s: \"%.*s\", model \"%s\"", i,
				      step, a[0], a[1], a[5], a[6], (int)vlen, value, want);
			ck_assert(m.level + lm_held(&m) <= burst);
		}
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
	tcase_add_test(tc, test_lease_groups_as_the_model);
	suite_add_tcase(s, tc);
	SRunner *sr = srunner_create(s);
	srunner_run_all(sr, CK_NORMAL);
	int failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
