/* SPDX-License-Identifier: MIT */
/*
 * tbrate's own part of its quantities (tools/tbrate/units.c): the messages
 * it gives for the rates and bursts the library refuses (the grammar
 * itself is the core's parse suite), the deadline's durations and the rate
 * shown.
 */
#include <check.h>
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "units.h"

#define NS INT64_C(1000000000)
#define N_OF(a) ((int)(sizeof(a) / sizeof((a)[0])))

static const struct bad {
	const char *text;
	int err;
	const char *names; /* the message must contain this */
} bad_rates[] = {
	{ "", -EINVAL, "a number must come first" },
	{ "unlimitedx", -EINVAL, "a number must come first" },
	{ "5.", -EINVAL, "\"5.\": a digit must follow \".\"" },
	{ "5./s", -EINVAL, "a digit must follow \".\"" },
	{ "5/", -EINVAL, "incomplete" },
	{ "5/sec", -EINVAL, "unexpected \"sec\"" },
	{ "5MiB/s junk", -EINVAL, "unexpected \"s junk\"" },
	{ "5K/s", -EINVAL, "unexpected \"K/s\"" },
	{ "0/s", -EDOM, "must be positive (or \"unlimited\")" },
	{ "18446744073709551617/s", -ERANGE, "too large or too fine" },
};

static void check_bad(const struct bad *b, int e, const char *err)
{
	ck_assert_msg(e == b->err, "%s: %d, want %d (%s)", b->text, e, b->err, err);
	ck_assert_msg(strstr(err, b->names) != NULL, "%s: message \"%s\" lacks \"%s\"", b->text,
		      err, b->names);
}

START_TEST(rate_bad)
{
	struct tokenbucket_limit r = { .tokens = 42 };
	bool bytes = true;
	char err[TBRATE_ERR_SIZE] = "";
	int e = tbrate_parse_rate(bad_rates[_i].text, &r, &bytes, err);
	check_bad(&bad_rates[_i], e, err);
	ck_assert_int_eq(r.tokens, 42); /* untouched on failure */
	ck_assert(bytes);
}
END_TEST

START_TEST(rate_good)
{
	struct tokenbucket_limit r;
	bool bytes = true;
	char err[TBRATE_ERR_SIZE] = "";
	ck_assert_int_eq(tbrate_parse_rate("1000/h", &r, &bytes, err), 0);
	ck_assert(r.tokens == 1 && r.period_ns == 36 * NS / 10 && r.burst == 1000 && !bytes);
	ck_assert_int_eq(tbrate_parse_rate("1GB/h", &r, &bytes, err), 0);
	ck_assert(r.tokens == 1 && r.period_ns == 3600 && r.burst == 1000000000 && bytes);
	ck_assert_int_eq(tbrate_parse_rate("unlimited", &r, &bytes, err), 0);
	ck_assert(r.period_ns == 0 && !bytes);
	ck_assert(tbrate_rate_per_second(&r) > 1e300);
}
END_TEST

static const struct bad bad_sizes[] = {
	{ "0", -EDOM, "not a whole number of tokens, at least 1" },
	{ "1.5", -EDOM, "not a whole number" },
	{ "5x", -EINVAL, "unexpected \"x\"" },
	{ "5/s", -EINVAL, "unexpected \"/s\"" },
	{ "1024", -ERANGE, "larger than 1023" },
	{ "100Ei", -ERANGE, "larger than 1023" },
	{ "", -EINVAL, "a number must come first" },
};

START_TEST(size_bad)
{
	uint64_t v = 7;
	char err[TBRATE_ERR_SIZE] = "";
	int e = tbrate_parse_size(bad_sizes[_i].text, 1023, &v, err);
	check_bad(&bad_sizes[_i], e, err);
	ck_assert_uint_eq(v, 7);
}
END_TEST

START_TEST(size_good)
{
	uint64_t v = 0;
	char err[TBRATE_ERR_SIZE] = "";
	ck_assert_int_eq(tbrate_parse_size("1023", 1023, &v, err), 0);
	ck_assert_uint_eq(v, 1023);
	ck_assert_int_eq(tbrate_parse_size("1kbit", 1023, &v, err), 0);
	ck_assert_uint_eq(v, 125);
}
END_TEST

static const struct {
	const char *text;
	int64_t ns;
} good_durations[] = {
	{ "1", NS },         { "1.5s", 3 * NS / 2 }, { "500ms", NS / 2 },
	{ "10us", 10000 },   { "1ns", 1 },           { "2min", 120 * NS },
	{ "1h", 3600 * NS }, { "1d", 86400 * NS },   { "106751d", INT64_C(106751) * 86400 * NS },
	{ "0.000000001", 1 }, { "9223372036854775807ns", INT64_MAX },
	{ "0.5us", 500 }, { "1.0000000000000000000000000s", NS }, { "007.50min", 450 * NS },
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
	{ "0", -EDOM, "must be positive" },
	{ "0.000ms", -EDOM, "must be positive" },
	{ "0.5ns", -EDOM, "a whole number of nanoseconds" },
	{ "0.0000000001", -EDOM, "a whole number of nanoseconds" },
	{ "0.0000000000000000000000000000001", -EDOM, "a whole number of nanoseconds" },
	{ "5sec", -EINVAL, "unknown unit \"sec\"" },
	{ "5 s", -EINVAL, "unknown unit \" s\"" },
	{ "5.", -EINVAL, "a digit must follow" },
	{ "5.s", -EINVAL, "a digit must follow" },
	{ "1.2.3", -EINVAL, "unknown unit \".3\"" },
	{ "5/s", -EINVAL, "unknown unit \"/s\"" },
	{ "5ks", -EINVAL, "unknown unit \"ks\"" },
	{ "unlimited", -EINVAL, "a number must come first" },
	{ ".5s", -EINVAL, "a number must come first" },
	{ "106752d", -ERANGE, "too long" },
	{ "9223372036854775808ns", -ERANGE, "too long" },
	{ "99999999999999999999999999999999999999999999", -ERANGE, "too long" },
	{ "s", -EINVAL, "a number must come first" },
	{ "-1s", -EINVAL, "a number must come first" },
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
	struct tokenbucket_limit r;
	bool bytes;
	char err[TBRATE_ERR_SIZE];
	ck_assert_int_eq(tbrate_parse_rate("2.5M/s", &r, &bytes, err), 0);
	ck_assert_str_eq(tbrate_rate_format(&r, buf, sizeof(buf)), "2500000/s");
	ck_assert_int_eq(tbrate_parse_rate("5/min", &r, &bytes, err), 0);
	ck_assert_str_eq(tbrate_rate_format(&r, buf, sizeof(buf)), "1 per 12000000000 ns");
	ck_assert_double_eq_tol(tbrate_rate_per_second(&r), 1.0 / 12, 1e-15);
	ck_assert_int_eq(tbrate_parse_rate("unlimited", &r, &bytes, err), 0);
	ck_assert_str_eq(tbrate_rate_format(&r, buf, sizeof(buf)), "unlimited");
}
END_TEST

static Suite *units_suite(void)
{
	Suite *s = suite_create("tbrate-units");
	TCase *tc = tcase_create("parse");
	tcase_add_loop_test(tc, rate_bad, 0, N_OF(bad_rates));
	tcase_add_test(tc, rate_good);
	tcase_add_loop_test(tc, size_bad, 0, N_OF(bad_sizes));
	tcase_add_test(tc, size_good);
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
