/* SPDX-License-Identifier: MIT */
/*
 * 1.2: tokenbucket_limit_parse.  Tables of rates, bursts and periods
 * with their exact limits in lowest terms, and of refused texts with the
 * errno and the offset end must point at; the edges of 64, 63 and 128 bits; the
 * order of errors; and agreement with tokenbucket_limit_from_rate where
 * a decimal rate reads back as its double.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "check_tb.h"

#define NS INT64_C(1000000000)
#define BMAX TOKENBUCKET_BURST_MAX
#define BYTES TOKENBUCKET_PARSE_BYTES
#define N_OF(a) ((int)(sizeof(a) / sizeof((a)[0])))

static const struct {
	const char *text;
	uint64_t tokens;
	int64_t period_ns;
	uint64_t burst;
	unsigned flags;
} good_rates[] = {
	{ "1", 1, NS, 1, 0 },
	{ "1/s", 1, NS, 1, 0 },
	{ "10r/s", 1, NS / 10, 10, 0 },
	{ "7r/3s", 7, 3 * NS, 7, 0 },
	{ "7/3s", 7, 3 * NS, 7, 0 },
	{ "30r/2min", 1, 4 * NS, 30, 0 },
	{ "1000r/h", 1, 3600000000, 1000, 0 },
	{ "2.5r/min", 1, 24 * NS, 2, 0 },            /* the amount rounds down */
	{ "5/min", 1, 12 * NS, 5, 0 },
	{ "3600/h", 1, NS, 3600, 0 },
	{ "1/d", 1, 86400 * NS, 1, 0 },
	{ "5MB/s", 1, 200, 5000000, BYTES },
	{ "1GB/h", 1, 3600, 1000000000, BYTES },
	{ "1MB/10s", 1, 10000, 1000000, BYTES },
	{ "2.5M/s", 1, 400, 2500000, 0 },
	{ "1.5Ki/min", 1, 39062500, 1536, 0 },
	{ "10Mbit/s", 1, 800, 1250000, BYTES },      /* 8 bits a byte token */
	{ "10Mb/s", 1, 800, 1250000, BYTES },
	{ "1b/s", 1, 8 * NS, 1, BYTES },             /* an eighth: at least 1 */
	{ "1KiB/s", 2, 1953125, 1024, BYTES },
	{ "1k", 1, 1000000, 1000, 0 },
	{ "1Mi/s", 2048, 1953125, 1048576, 0 },
	{ "1G/s", 1, 1, 1000000000, 0 },
	{ "1T/s", 1000, 1, 1000000000000, 0 },
	{ "1P/d", 625, 54, 1000000000000000, 0 },
	{ "1E/s", 1000000000, 1, 1000000000000000000, 0 },
	{ "16Ei/s", UINT64_C(1) << 55, 1953125, BMAX, 0 }, /* 2^64 a second */
	{ "36893488147419103232/3s", UINT64_C(1) << 56, 5859375, BMAX, 0 }, /* 2^65 over 3 10^9 */
	{ "0.1", 1, 10 * NS, 1, 0 },
	{ "0.001/s", 1, 1000 * NS, 1, 0 },
	{ "007.50/min", 1, 8 * NS, 7, 0 },
	/* 64 bits of tokens, 63 of ns: the edges that still fit */
	{ "18446744073709551615/s", UINT64_MAX / 5, NS / 5, BMAX, 0 },
	{ "18446744073709551615000000000/s", UINT64_MAX, 1, BMAX, 0 },
	{ "18446744073709551616/s", UINT64_C(1) << 55, 1953125, BMAX, 0 }, /* 2^64 reduces */
	{ "1/9223372036s", 1, INT64_C(9223372036000000000), 1, 0 },
	{ "unlimited", 1, 0, BMAX, 0 },
};

START_TEST(rate_good)
{
	const char *t = good_rates[_i].text;
	struct tokenbucket_limit lim = { 42, 42, 42 };
	unsigned flags = 0;
	const char *end = NULL;
	int e = tokenbucket_limit_parse(&lim, t, &flags, &end);
	ck_assert_msg(e == 0, "%s: %d at \"%s\"", t, e, end ? end : "(null)");
	ck_assert_msg(lim.tokens == good_rates[_i].tokens && lim.period_ns == good_rates[_i].period_ns,
		      "%s: %llu per %lld ns, want %llu per %lld", t, (unsigned long long)lim.tokens,
		      (long long)lim.period_ns, (unsigned long long)good_rates[_i].tokens,
		      (long long)good_rates[_i].period_ns);
	ck_assert_msg(lim.burst == good_rates[_i].burst, "%s: burst %llu", t,
		      (unsigned long long)lim.burst);
	ck_assert_msg(flags == good_rates[_i].flags, "%s: flags %u", t, flags);
	ck_assert_ptr_eq(end, t + strlen(t));
	/* flags and end are optional */
	struct tokenbucket_limit again;
	ck_assert_int_eq(tokenbucket_limit_parse(&again, t, NULL, NULL), 0);
	ck_assert_mem_eq(&again, &lim, sizeof(lim));
}
END_TEST

static const struct bad {
	const char *text;
	int err;
	int at; /* where end must point: text + at */
} bad_rates[] = {
	{ "", -EINVAL, 0 },
	{ "abc", -EINVAL, 0 },
	{ "-5/s", -EINVAL, 0 },
	{ "+5/s", -EINVAL, 0 },
	{ " 5/s", -EINVAL, 0 },
	{ ".5", -EINVAL, 0 },
	{ "5.", -EINVAL, 2 },
	{ "5./s", -EINVAL, 2 },
	{ "5/", -EINVAL, 2 },
	{ "5/sec", -EINVAL, 2 },
	{ "5/m", -EINVAL, 2 },
	{ "5/ns", -EINVAL, 2 },
	{ "5/ms", -EINVAL, 2 },                       /* a period is a second or more */
	{ "5/2us", -EINVAL, 3 },
	{ "5ms", -EINVAL, 1 },
	{ "5/s ", -EINVAL, 2 },
	{ "5/s\n", -EINVAL, 2 },
	{ "5/ s", -EINVAL, 2 },
	{ "5MiB/s junk", -EINVAL, 5 },
	{ "5 /s", -EINVAL, 1 },
	{ "5K/s", -EINVAL, 1 },                       /* k is 1000, Ki 1024 */
	{ "5ki/s", -EINVAL, 2 },
	{ "5Q/s", -EINVAL, 1 },
	{ "1e3/s", -EINVAL, 1 },
	{ "1,5/s", -EINVAL, 1 },
	{ "1.2.3", -EINVAL, 3 },
	{ "5min", -EINVAL, 1 },
	{ "5Bb/s", -EINVAL, 2 },
	{ "5rB/s", -EINVAL, 2 },
	{ "5/0s", -EINVAL, 2 },
	{ "5/3", -EINVAL, 3 },
	{ "5/3ss", -EINVAL, 3 },
	{ "unlimitedx", -EINVAL, 0 },
	{ "Unlimited", -EINVAL, 0 },
	{ "inf", -EINVAL, 0 },
	/* syntax before value: a huge number and a bad period */
	{ "999999999999999999999999999999999999999999/x", -EINVAL, 43 },
	{ "0/x", -EINVAL, 2 },
	{ "0/s", -EDOM, 0 },
	{ "0r/h", -EDOM, 0 },
	{ "0.000", -EDOM, 0 },
	{ "0.000000000000000000000000000000000000000000000000/s", -EDOM, 0 },
	{ "18446744073709551617/s", -ERANGE, 0 },      /* 2^64 + 1, prime to 10^9 */
	{ "18446744073709551616000000000/s", -ERANGE, 0 }, /* 2^64 a ns */
	{ "1/9223372037s", -ERANGE, 0 },                /* past 2^63 - 1 ns */
	{ "1.000000000000000000001/s", -ERANGE, 0 },
	{ "0.0000000000000000001/d", -ERANGE, 0 },
	{ "100000000000Ei/s", -ERANGE, 0 },
	{ "340282366920938463463374607431768211455/d", -ERANGE, 0 }, /* 2^128 - 1 */
	{ "340282366920938463463374607431768211456/s", -ERANGE, 0 }, /* 2^128 */
	/* 10^128 is 0 modulo 2^128: too many digits, not zero */
	{ "1000000000000000000000000000000000000000000000000000000000000000"
	  "00000000000000000000000000000000000000000000000000000000000000000/s",
	  -ERANGE, 0 },
	{ "5/99999999999999999999s", -ERANGE, 0 },
	{ "5/9223372036854775807d", -ERANGE, 0 },
};

static void check_bad(const struct bad *b, unsigned in)
{
	struct tokenbucket_limit lim = { 42, 43, 44 };
	unsigned flags = in;
	const char *end = NULL;
	int e = tokenbucket_limit_parse(&lim, b->text, &flags, &end);
	ck_assert_msg(e == b->err, "%s: %d, want %d", b->text, e, b->err);
	ck_assert_msg(end == b->text + b->at, "%s: end at %td, want %d", b->text,
		      end ? end - b->text : -1, b->at);
	/* untouched on failure */
	ck_assert(lim.tokens == 42 && lim.period_ns == 43 && lim.burst == 44);
	ck_assert_uint_eq(flags, in);
}

START_TEST(rate_bad)
{
	check_bad(&bad_rates[_i], 0);
}
END_TEST

static const struct {
	const char *text;
	uint64_t burst;
	unsigned flags;
} good_bursts[] = {
	{ "1", 1, 0 },          { "20", 20, 0 },          { "20r", 20, 0 },
	{ "64Ki", 65536, 0 },   { "64KiB", 65536, BYTES }, { "4MB", 4000000, BYTES },
	{ "1k", 1000, 0 },      { "1.5k", 1500, 0 },       { "8b", 1, BYTES },
	{ "1kbit", 125, BYTES }, { "0.5Ki", 512, 0 },      { "4Ei", BMAX, 0 },
	{ "4611686018427387904", BMAX, 0 },
};

START_TEST(burst_good)
{
	const char *t = good_bursts[_i].text;
	struct tokenbucket_limit lim = { 42, 43, 44 };
	unsigned flags = TOKENBUCKET_PARSE_BURST;
	ck_assert_msg(tokenbucket_limit_parse(&lim, t, &flags, NULL) == 0, "%s", t);
	ck_assert_uint_eq(lim.burst, good_bursts[_i].burst);
	ck_assert(lim.tokens == 42 && lim.period_ns == 43); /* the burst alone */
	ck_assert_uint_eq(flags, TOKENBUCKET_PARSE_BURST | good_bursts[_i].flags);
}
END_TEST

static const struct bad bad_bursts[] = {
	{ "", -EINVAL, 0 },
	{ "unlimited", -EINVAL, 0 },
	{ "5x", -EINVAL, 1 },
	{ "5/s", -EINVAL, 1 },
	{ "5 ", -EINVAL, 1 },
	{ "-1", -EINVAL, 0 },
	{ "0", -EDOM, 0 },
	{ "0.0", -EDOM, 0 },
	{ "1.5", -EDOM, 0 },   /* not a whole number of tokens */
	{ "12b", -EDOM, 0 },
	{ "4611686018427387905", -ERANGE, 0 },
	{ "5Ei", -ERANGE, 0 },
	{ "1000000000000000000000Ei", -ERANGE, 0 },
	{ "340282366920938463463374607431768211456", -ERANGE, 0 },
};

START_TEST(burst_bad)
{
	check_bad(&bad_bursts[_i], TOKENBUCKET_PARSE_BURST);
}
END_TEST

static const struct {
	const char *text;
	int64_t ns;
} good_periods[] = {
	{ "1", NS },          { "1.5", 3 * NS / 2 },  { "1s", NS },          { "500ms", NS / 2 },
	{ "10us", 10000 },    { "0.5us", 500 },       { "1ns", 1 },          { "2min", 120 * NS },
	{ "1.5h", 5400 * NS }, { "1d", 86400 * NS },  { "0.000000001", 1 },  { "007.50min", 450 * NS },
	{ "1.0000000000000000000000000s", NS }, /* 10^34 ns over 10^25 */
	/* 2^63 - 1 ns, the longest */
	{ "9223372036854775807ns", INT64_MAX },
	{ "9223372036.854775807", INT64_MAX },
	{ "106751d", INT64_C(106751) * 86400 * NS },
};

/* The period tables in one test each: a process per row costs seconds under valgrind. */
START_TEST(period_good)
{
	for (int i = 0; i < N_OF(good_periods); i++) {
		const char *t = good_periods[i].text;
		struct tokenbucket_limit lim = { 42, 43, 44 };
		unsigned flags = TOKENBUCKET_PARSE_PERIOD;
		const char *end = NULL;
		int e = tokenbucket_limit_parse(&lim, t, &flags, &end);
		ck_assert_msg(e == 0, "%s: %d at \"%s\"", t, e, end ? end : "(null)");
		ck_assert_msg(lim.period_ns == good_periods[i].ns, "%s: %lld ns, want %lld", t,
			      (long long)lim.period_ns, (long long)good_periods[i].ns);
		ck_assert(lim.tokens == 42 && lim.burst == 44); /* the period alone */
		ck_assert_uint_eq(flags, TOKENBUCKET_PARSE_PERIOD);
		ck_assert_ptr_eq(end, t + strlen(t));
	}
}
END_TEST

static const struct bad bad_periods[] = {
	{ "", -EINVAL, 0 },
	{ "unlimited", -EINVAL, 0 },
	{ "s", -EINVAL, 0 },
	{ ".5s", -EINVAL, 0 },
	{ "-1s", -EINVAL, 0 },
	{ "5.", -EINVAL, 2 },
	{ "5.s", -EINVAL, 2 },
	{ "5sec", -EINVAL, 1 },
	{ "5m", -EINVAL, 1 },
	{ "5 s", -EINVAL, 1 },
	{ "5s ", -EINVAL, 1 },
	{ "5/s", -EINVAL, 1 },  /* a period, not a rate */
	{ "5ks", -EINVAL, 1 },  /* no prefix */
	{ "5Ki", -EINVAL, 1 },
	{ "5r", -EINVAL, 1 },   /* no unit of tokens */
	{ "5B", -EINVAL, 1 },
	{ "1.2.3", -EINVAL, 3 },
	{ "1e3ms", -EINVAL, 1 },
	/* syntax before value */
	{ "0x", -EINVAL, 1 },
	{ "99999999999999999999999999999999999999999999x", -EINVAL, 44 },
	{ "0", -EDOM, 0 },
	{ "0.000ms", -EDOM, 0 },
	{ "0.5ns", -EDOM, 0 },   /* not a whole number of ns */
	{ "0.0000000001", -EDOM, 0 },
	{ "1.0000000001", -EDOM, 0 },
	{ "0.0000000000000000000000000000001", -EDOM, 0 },
	{ "9223372036854775808ns", -ERANGE, 0 }, /* 2^63 ns */
	{ "9223372036.854775808", -ERANGE, 0 },
	{ "106752d", -ERANGE, 0 },
	{ "340282366920938463463374607431768211456ns", -ERANGE, 0 }, /* 2^128 */
	{ "340282366920938463463374607431768211455d", -ERANGE, 0 },  /* times a day: past 128 bits */
	{ "99999999999999999999999999999999999999999999", -ERANGE, 0 },
	{ "1.00000000000000000000000000000000s", -ERANGE, 0 }, /* 10^41 ns over 10^32 */
};

START_TEST(period_bad)
{
	for (int i = 0; i < N_OF(bad_periods); i++)
		check_bad(&bad_periods[i], TOKENBUCKET_PARSE_PERIOD);
}
END_TEST

START_TEST(parse_args)
{
	struct tokenbucket_limit lim = { 42, 43, 44 };
	unsigned flags = 0;
	const char *end = NULL;
	ck_assert_int_eq(tokenbucket_limit_parse(NULL, "1/s", NULL, &end), -EINVAL);
	ck_assert_ptr_null(end);
	ck_assert_int_eq(tokenbucket_limit_parse(&lim, NULL, NULL, &end), -EINVAL);
	ck_assert_ptr_null(end);
	/* an unknown flag, or a burst and a period at once: refused, whatever the text */
	const unsigned refused[] = { 0x8, 0x80000000u,
				     TOKENBUCKET_PARSE_BURST | TOKENBUCKET_PARSE_PERIOD };
	const char *one = "1";
	for (int i = 0; i < N_OF(refused); i++) {
		flags = refused[i];
		end = NULL;
		ck_assert_int_eq(tokenbucket_limit_parse(&lim, one, &flags, &end), -EINVAL);
		ck_assert_uint_eq(flags, refused[i]);
		ck_assert_ptr_eq(end, one);
		ck_assert(lim.tokens == 42 && lim.period_ns == 43 && lim.burst == 44);
	}
	/* BYTES is said back only: passed in again, it is ignored */
	flags = TOKENBUCKET_PARSE_BYTES;
	ck_assert_int_eq(tokenbucket_limit_parse(&lim, "1/s", &flags, NULL), 0);
	ck_assert_uint_eq(flags, 0);
	flags = TOKENBUCKET_PARSE_BYTES | TOKENBUCKET_PARSE_BURST;
	ck_assert_int_eq(tokenbucket_limit_parse(&lim, "3", &flags, NULL), 0);
	ck_assert_uint_eq(flags, TOKENBUCKET_PARSE_BURST);
	ck_assert_uint_eq(lim.burst, 3);
	flags = TOKENBUCKET_PARSE_BYTES | TOKENBUCKET_PARSE_PERIOD;
	ck_assert_int_eq(tokenbucket_limit_parse(&lim, "3ms", &flags, NULL), 0);
	ck_assert_uint_eq(flags, TOKENBUCKET_PARSE_PERIOD);
	ck_assert_int_eq(lim.period_ns, 3000000);
}
END_TEST

/* A parsed limit makes a bucket: a quota lets its amount through at once. */
START_TEST(parse_makes_bucket)
{
	struct tokenbucket_limit lim;
	struct tokenbucket *tb;
	ck_assert_int_eq(tokenbucket_limit_parse(&lim, "1000r/h", NULL, NULL), 0);
	ck_assert_int_eq(tokenbucket_create_limit(&tb, &lim, 0), 0);
	ck_assert(tokenbucket_allow_at(tb, 1000, 1000));
	ck_assert(!tokenbucket_allow_at(tb, 1000, 1));
	ck_assert(tokenbucket_allow_at(tb, 1000 + 3600000000, 1)); /* one every 3.6 s */
	tokenbucket_free(tb);
}
END_TEST

/* k/1000 tokens a second, for every k to 5000, as the double k/1000.0. */
START_TEST(parse_agrees_with_double)
{
	char text[32];
	for (int k = 1; k <= 5000; k++) {
		snprintf(text, sizeof(text), "%d.%03d/s", k / 1000, k % 1000);
		struct tokenbucket_limit a, b;
		ck_assert_int_eq(tokenbucket_limit_parse(&a, text, NULL, NULL), 0);
		ck_assert_int_eq(tokenbucket_limit_from_rate(&b, k / 1000.0, a.burst), 0);
		ck_assert_msg(a.tokens == b.tokens && a.period_ns == b.period_ns,
			      "%s: %llu/%lld, the double %llu/%lld", text,
			      (unsigned long long)a.tokens, (long long)a.period_ns,
			      (unsigned long long)b.tokens, (long long)b.period_ns);
	}
}
END_TEST

Suite *parse_suite(void)
{
	Suite *s = suite_create("parse");
	TCase *tc = tcase_create("parse");
	tcase_add_loop_test(tc, rate_good, 0, N_OF(good_rates));
	tcase_add_loop_test(tc, rate_bad, 0, N_OF(bad_rates));
	tcase_add_loop_test(tc, burst_good, 0, N_OF(good_bursts));
	tcase_add_loop_test(tc, burst_bad, 0, N_OF(bad_bursts));
	tcase_add_test(tc, period_good);
	tcase_add_test(tc, period_bad);
	tcase_add_test(tc, parse_args);
	tcase_add_test(tc, parse_makes_bucket);
	tcase_add_test(tc, parse_agrees_with_double);
	suite_add_tcase(s, tc);
	return s;
}
