/* SPDX-License-Identifier: MIT */
/*
 * tbrate's quantity parser (tools/tbrate/units.c): tables of good inputs
 * with their exact values in lowest terms, and of bad ones with the errno
 * and the part of the text that the message must name.
 */
#include <check.h>
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "units.h"

#define NS INT64_C(1000000000)
#define N_OF(a) ((int)(sizeof(a) / sizeof((a)[0])))

static const struct {
	const char *text;
	uint64_t tokens;
	int64_t period_ns;
	bool bytes_unit;
} good_rates[] = {
	{ "1", 1, NS, false },
	{ "1/s", 1, NS, false },
	{ "5/min", 1, 12 * NS, false },
	{ "3600/h", 1, NS, false },
	{ "1/d", 1, 86400 * NS, false },
	{ "2.5M/s", 1, 400, false },          /* 2500000 per 1e9 ns */
	{ "2.5MB/s", 1, 400, true },
	{ "1.5Ki/min", 1, 39062500, false }, /* 1536 per 60e9 ns */
	{ "10Mbit/s", 1, 800, true },         /* 1250000 bytes per s */
	{ "10Mb/s", 1, 800, true },
	{ "1b/s", 1, 8 * NS, true },          /* a byte every 8 s */
	{ "1k", 1, 1000000, false },
	{ "1Ki", 2, 1953125, false },       /* 1024 per 1e9 ns */
	{ "1KiB/s", 2, 1953125, true },
	{ "1Mi/s", 2048, 1953125, false },
	{ "1G/s", 1, 1, false },
	{ "1Gi/s", 2097152, 1953125, false },
	{ "1T/s", 1000, 1, false },
	{ "1P/s", 1000000, 1, false },
	{ "1E/s", 1000000000, 1, false },
	{ "16Ei/s", UINT64_C(1) << 55, 1953125, false }, /* 2^64 per 1e9 ns */
	{ "0.1", 1, 10 * NS, false },
	{ "0.001/s", 1, 1000 * NS, false },
	{ "007.50/min", 1, 8 * NS, false },
	{ "18446744073709551615/s", UINT64_MAX / 5, NS / 5, false },
	{ "10r/s", 1, NS / 10, false },     /* nginx's spelling */
	{ "2.5r/min", 1, 24 * NS, false },
	{ "7r/3s", 7, 3 * NS, false },
	{ "7/3s", 7, 3 * NS, false },
	{ "1MB/10s", 1, 10000, true },
	{ "30r/2min", 1, 4 * NS, false },
};

START_TEST(rate_good)
{
	struct tbrate_rate r;
	char err[TBRATE_ERR_SIZE] = "";
	const char *t = good_rates[_i].text;
	int e = tbrate_parse_rate(t, &r, err);
	ck_assert_msg(e == 0, "%s: %d %s", t, e, err);
	ck_assert_msg(r.tokens == good_rates[_i].tokens && r.period_ns == good_rates[_i].period_ns,
		      "%s: %llu per %lld ns, want %llu per %lld", t, (unsigned long long)r.tokens,
		      (long long)r.period_ns, (unsigned long long)good_rates[_i].tokens,
		      (long long)good_rates[_i].period_ns);
	ck_assert_msg(r.bytes_unit == good_rates[_i].bytes_unit, "%s: unit", t);
	ck_assert(!r.unlimited);
}
END_TEST

/* The period as written, which a quota's default burst is counted over. */
START_TEST(rate_span)
{
	static const struct {
		const char *text;
		int64_t span_ns;
	} spans[] = {
		{ "1", NS },          { "5/min", 60 * NS },    { "1GB/h", 3600 * NS },
		{ "7r/3s", 3 * NS },  { "30r/2min", 120 * NS }, { "1/d", 86400 * NS },
		{ "3600/h", 3600 * NS },
	};
	for (int i = 0; i < N_OF(spans); i++) {
		struct tbrate_rate r;
		char err[TBRATE_ERR_SIZE] = "";
		ck_assert_msg(tbrate_parse_rate(spans[i].text, &r, err) == 0, "%s: %s",
			      spans[i].text, err);
		ck_assert_msg(r.span_ns == spans[i].span_ns, "%s: span %lld, want %lld",
			      spans[i].text, (long long)r.span_ns, (long long)spans[i].span_ns);
	}
	struct tbrate_rate r;
	char err[TBRATE_ERR_SIZE] = "";
	ck_assert(tbrate_parse_rate("unlimited", &r, err) == 0 && r.span_ns == 0);
}
END_TEST

START_TEST(rate_unlimited)
{
	struct tbrate_rate r;
	char err[TBRATE_ERR_SIZE];
	ck_assert_int_eq(tbrate_parse_rate("unlimited", &r, err), 0);
	ck_assert(r.unlimited);
	ck_assert(tbrate_rate_per_second(&r) > 1e300);
}
END_TEST

static const struct bad {
	const char *text;
	int err;
	const char *names; /* the message must contain this */
} bad_rates[] = {
	{ "", -EINVAL, "a number must come first" },
	{ "abc", -EINVAL, "a number must come first" },
	{ "-5/s", -EINVAL, "a number must come first" },
	{ ".5", -EINVAL, "a number must come first" },
	{ "5.", -EINVAL, "a digit must follow" },
	{ "5./s", -EINVAL, "a digit must follow" },
	{ "5/", -EINVAL, "unknown period \"\"" },
	{ "5/sec", -EINVAL, "unknown period \"sec\"" },
	{ "5/m", -EINVAL, "unknown period \"m\"" },
	{ "5/s ", -EINVAL, "unknown period \"s \"" },
	{ "5MiB/s junk", -EINVAL, "unknown period \"s junk\"" },
	{ "5 /s", -EINVAL, "unexpected \" /s\"" },
	{ "5K/s", -EINVAL, "unknown prefix \"K\"" },
	{ "5ki/s", -EINVAL, "unexpected \"i/s\"" },
	{ "5Q/s", -EINVAL, "unexpected \"Q/s\"" },
	{ "1e3/s", -EINVAL, "unexpected \"e3/s\"" },
	{ "1.2.3", -EINVAL, "unexpected \".3\"" },
	{ "5min", -EINVAL, "unexpected \"min\"" },
	{ "5Bb/s", -EINVAL, "unexpected \"b/s\"" },
	{ "0/s", -EINVAL, "must be positive" },
	{ "0.000", -EINVAL, "must be positive" },
	{ "unlimitedx", -EINVAL, "a number must come first" },
	{ "18446744073709551617/s", -ERANGE, "too large or too fine" },
	{ "1.000000000000000000001/s", -ERANGE, "too large or too fine" },
	{ "0.0000000000000000001/d", -ERANGE, "too large or too fine" },
	{ "1000000000000000000000000000000000000000", -ERANGE, "too many digits" },
	{ "20Ei/ns", -EINVAL, "unknown period \"ns\"" },
	{ "100000000000Ei/s", -ERANGE, "too large or too fine" },
	{ "5/0s", -EINVAL, "unknown period \"0s\"" },
	{ "5rB/s", -EINVAL, "unexpected \"B/s\"" },
	{ "5/3", -EINVAL, "unknown period \"3\"" },
	{ "5/99999999999999999999s", -ERANGE, "period too long" },
	{ "5/9223372036854775807d", -ERANGE, "too large or too fine" },
};

static void check_bad(const struct bad *b, int e, const char *err)
{
	ck_assert_msg(e == b->err, "%s: %d, want %d (%s)", b->text, e, b->err, err);
	ck_assert_msg(strstr(err, b->names) != NULL, "%s: message \"%s\" lacks \"%s\"", b->text,
		      err, b->names);
}

START_TEST(rate_bad)
{
	struct tbrate_rate r = { .tokens = 42 };
	char err[TBRATE_ERR_SIZE] = "";
	int e = tbrate_parse_rate(bad_rates[_i].text, &r, err);
	check_bad(&bad_rates[_i], e, err);
	ck_assert_int_eq(r.tokens, 42); /* untouched on failure */
}
END_TEST

static const struct {
	const char *text;
	uint64_t value;
} good_sizes[] = {
	{ "1", 1 },          { "64Ki", 65536 },   { "64KiB", 65536 },
	{ "1k", 1000 },      { "1.5k", 1500 },    { "8b", 1 },
	{ "1kbit", 125 },    { "0.5Ki", 512 },    { "4611686018427387904", UINT64_C(1) << 62 },
};

START_TEST(size_good)
{
	uint64_t v = 0;
	char err[TBRATE_ERR_SIZE] = "";
	int e = tbrate_parse_size(good_sizes[_i].text, UINT64_C(1) << 62, &v, err);
	ck_assert_msg(e == 0, "%s: %s", good_sizes[_i].text, err);
	ck_assert_uint_eq(v, good_sizes[_i].value);
}
END_TEST

static const struct bad bad_sizes[] = {
	{ "0", -EINVAL, "at least 1" },
	{ "1.5", -EINVAL, "not a whole number" },
	{ "12b", -EINVAL, "not a whole number" },
	{ "5x", -EINVAL, "unexpected \"x\"" },
	{ "5/s", -EINVAL, "unexpected \"/s\"" },
	{ "4611686018427387905", -ERANGE, "larger than 4611686018427387904" },
	{ "100Ei", -ERANGE, "larger than" },
	{ "1000000000000000000000Ei", -ERANGE, "too large" },
	{ "", -EINVAL, "a number must come first" },
};

START_TEST(size_bad)
{
	uint64_t v = 7;
	char err[TBRATE_ERR_SIZE] = "";
	int e = tbrate_parse_size(bad_sizes[_i].text, UINT64_C(1) << 62, &v, err);
	check_bad(&bad_sizes[_i], e, err);
	ck_assert_uint_eq(v, 7);
}
END_TEST

static const struct {
	const char *text;
	int64_t ns;
} good_durations[] = {
	{ "1", NS },         { "1.5s", 3 * NS / 2 }, { "500ms", NS / 2 },
	{ "10us", 10000 },   { "1ns", 1 },           { "2min", 120 * NS },
	{ "1h", 3600 * NS }, { "1d", 86400 * NS },   { "106751d", INT64_C(106751) * 86400 * NS },
	{ "0.000000001", 1 },
};

START_TEST(duration_good)
{
	int64_t v = 0;
	char err[TBRATE_ERR_SIZE] = "";
	int e = tbrate_parse_duration(good_durations[_i].text, &v, err);
	ck_assert_msg(e == 0, "%s: %s", good_durations[_i].text, err);
	ck_assert_int_eq(v, good_durations[_i].ns);
}
END_TEST

static const struct bad bad_durations[] = {
	{ "0", -EINVAL, "must be positive" },
	{ "0.5ns", -EINVAL, "finer than a nanosecond" },
	{ "0.0000000001", -EINVAL, "finer than a nanosecond" },
	{ "5sec", -EINVAL, "unknown unit \"sec\"" },
	{ "5 s", -EINVAL, "unknown unit \" s\"" },
	{ "106752d", -ERANGE, "too long" },
	{ "9223372036854775808ns", -ERANGE, "too long" },
	{ "s", -EINVAL, "a number must come first" },
};

START_TEST(duration_bad)
{
	int64_t v = 7;
	char err[TBRATE_ERR_SIZE] = "";
	int e = tbrate_parse_duration(bad_durations[_i].text, &v, err);
	check_bad(&bad_durations[_i], e, err);
	ck_assert_int_eq(v, 7);
}
END_TEST

START_TEST(rate_format)
{
	char buf[64];
	struct tbrate_rate r;
	char err[TBRATE_ERR_SIZE];
	ck_assert_int_eq(tbrate_parse_rate("2.5M/s", &r, err), 0);
	ck_assert_str_eq(tbrate_rate_format(&r, buf, sizeof(buf)), "2500000/s");
	ck_assert_int_eq(tbrate_parse_rate("5/min", &r, err), 0);
	ck_assert_str_eq(tbrate_rate_format(&r, buf, sizeof(buf)), "1 per 12000000000 ns");
	ck_assert_double_eq_tol(tbrate_rate_per_second(&r), 1.0 / 12, 1e-15);
}
END_TEST

static Suite *units_suite(void)
{
	Suite *s = suite_create("tbrate-units");
	TCase *tc = tcase_create("parse");
	tcase_add_loop_test(tc, rate_good, 0, N_OF(good_rates));
	tcase_add_test(tc, rate_span);
	tcase_add_test(tc, rate_unlimited);
	tcase_add_loop_test(tc, rate_bad, 0, N_OF(bad_rates));
	tcase_add_loop_test(tc, size_good, 0, N_OF(good_sizes));
	tcase_add_loop_test(tc, size_bad, 0, N_OF(bad_sizes));
	tcase_add_loop_test(tc, duration_good, 0, N_OF(good_durations));
	tcase_add_loop_test(tc, duration_bad, 0, N_OF(bad_durations));
	tcase_add_test(tc, rate_format);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	SRunner *sr = srunner_create(units_suite());
	srunner_run_all(sr, CK_NORMAL);
	int failed = srunner_ntests_failed(sr);
	int run = srunner_ntests_run(sr);
	srunner_free(sr);
	return failed == 0 && run > 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
