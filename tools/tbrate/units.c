/* SPDX-License-Identifier: MIT */
/*
 * tbrate's quantities (units.h): the library reads rates, bursts and the
 * deadline, this file says what was wrong in tbrate's words and shows a
 * rate.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>

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
	if (end[-1] == '.')
		return fail(err, -EINVAL, "\"%.100s\": a digit must follow \".\"", s);
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
	unsigned flags = TOKENBUCKET_PARSE_PERIOD;
	const char *end = s;
	struct tokenbucket_limit lim;
	int e = tokenbucket_limit_parse(&lim, s, &flags, &end);
	if (e == -EINVAL && end > s && end[-1] != '.')
		return fail(err, e, "\"%.100s\": unknown unit \"%.20s\" (ns, us, ms, s, min, h or d)",
			    s, end);
	if (e == -EINVAL)
		return syntax(err, s, end);
	if (e == -EDOM)
		return fail(err, e, "\"%.100s\": must be positive and a whole number of nanoseconds",
			    s);
	if (e)
		return fail(err, e, "\"%.100s\": too long or too fine", s);
	*out_ns = lim.period_ns;
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
