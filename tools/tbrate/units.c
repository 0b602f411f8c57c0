/* SPDX-License-Identifier: MIT */
/*
 * tbrate's quantities (units.h): the library reads rates and bursts, this
 * file says what was wrong in tbrate's words, reads the deadline and
 * shows a rate.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "units.h"

typedef unsigned __int128 u128;

#define NS_PER_S UINT64_C(1000000000)

static int fail(char *err, int code, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));

static int fail(char *err, int code, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(err, TBRATE_ERR_SIZE, fmt, ap);
	va_end(ap);
	return code;
}

/* -EINVAL from tokenbucket_limit_parse: where the text left the grammar. */
static int syntax(char *err, const char *s, const char *end)
{
	if (end == s)
		return fail(err, -EINVAL, "\"%.100s\": a number must come first", s);
	if (*end == '\0')
		return fail(err, -EINVAL, "\"%.100s\": incomplete", s);
	return fail(err, -EINVAL, "\"%.100s\": unexpected \"%.40s\"", s, end);
}

int tbrate_parse_rate(const char *s, struct tokenbucket_limit *out, bool *bytes,
		      char err[TBRATE_ERR_SIZE])
{
	unsigned flags = 0;
	const char *end = s;
	int e = tokenbucket_limit_parse(out, s, &flags, &end);
	if (e == -EINVAL)
		return syntax(err, s, end);
	if (e == -EDOM)
		return fail(err, e, "\"%.100s\": the rate must be positive (or \"unlimited\")", s);
	if (e)
		return fail(err, e, "\"%.100s\": too large or too fine to hold exactly", s);
	*bytes = flags & TOKENBUCKET_PARSE_BYTES;
	return 0;
}

int tbrate_parse_size(const char *s, uint64_t max, uint64_t *out, char err[TBRATE_ERR_SIZE])
{
	unsigned flags = TOKENBUCKET_PARSE_BURST;
	const char *end = s;
	struct tokenbucket_limit lim;
	int e = tokenbucket_limit_parse(&lim, s, &flags, &end);
	if (e == -EINVAL)
		return syntax(err, s, end);
	if (e == -EDOM)
		return fail(err, e, "\"%.100s\": not a whole number of tokens, at least 1", s);
	if (e == -ERANGE || lim.burst > max)
		return fail(err, -ERANGE, "\"%.100s\": larger than %" PRIu64, s, max);
	*out = lim.burst;
	return 0;
}

int tbrate_parse_duration(const char *s, int64_t *out_ns, char err[TBRATE_ERR_SIZE])
{
	static const struct {
		const char *name;
		uint64_t ns;
	} units[] = {
		{ "", NS_PER_S },        { "ns", 1 },
		{ "us", 1000 },          { "ms", 1000000 },
		{ "s", NS_PER_S },       { "min", 60 * NS_PER_S },
		{ "h", 3600 * NS_PER_S }, { "d", 86400 * NS_PER_S },
	};
	/* ns = digits * unit / 10^decimals, kept exact; past 2^63 it is too long. */
	u128 digits = 0, scale = 1;
	bool point = false, wide = false;
	const char *p = s;
	if (*p < '0' || *p > '9')
		return fail(err, -EINVAL, "\"%.100s\": a number must come first", s);
	for (; (*p >= '0' && *p <= '9') || (*p == '.' && !point); p++) {
		if (*p == '.') {
			if (p[1] < '0' || p[1] > '9')
				return fail(err, -EINVAL, "\"%.100s\": a digit must follow \".\"", s);
			point = true;
			continue;
		}
		if (digits > INT64_MAX || scale > INT64_MAX) {
			wide = true; /* further digits change nothing but the verdict */
			continue;
		}
		digits = digits * 10 + (unsigned)(*p - '0');
		if (point)
			scale *= 10;
	}
	size_t u = 0;
	while (u < sizeof(units) / sizeof(units[0]) && strcmp(units[u].name, p) != 0)
		u++;
	if (u == sizeof(units) / sizeof(units[0]))
		return fail(err, -EINVAL,
			    "\"%.100s\": unknown unit \"%.20s\" (ns, us, ms, s, min, h or d)", s, p);
	u128 ns = digits * units[u].ns;
	if (wide || ns / scale > INT64_MAX)
		return fail(err, -ERANGE, "\"%.100s\": too long or too fine", s);
	if (ns % scale != 0)
		return fail(err, -EINVAL, "\"%.100s\": finer than a nanosecond", s);
	if (ns == 0)
		return fail(err, -EINVAL, "\"%.100s\": must be positive", s);
	*out_ns = (int64_t)(ns / scale);
	return 0;
}

double tbrate_rate_per_second(const struct tokenbucket_limit *r)
{
	if (r->period_ns == 0)
		return __builtin_inf();
	return (double)((long double)r->tokens * 1e9L / (long double)r->period_ns);
}

const char *tbrate_rate_format(const struct tokenbucket_limit *r, char *buf, size_t size)
{
	if (r->period_ns == 0) {
		snprintf(buf, size, "unlimited");
		return buf;
	}
	/* tokens per period_ns, shown per second when whole. */
	u128 num = (u128)r->tokens * NS_PER_S;
	if (num % (uint64_t)r->period_ns == 0 && num / (uint64_t)r->period_ns <= UINT64_MAX)
		snprintf(buf, size, "%" PRIu64 "/s", (uint64_t)(num / (uint64_t)r->period_ns));
	else
		snprintf(buf, size, "%" PRIu64 " per %" PRId64 " ns", r->tokens, r->period_ns);
	return buf;
}
