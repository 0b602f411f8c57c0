/* SPDX-License-Identifier: MIT */
/*
 * The quantity parser of tbrate (grammar in units.h).  Every value is an
 * exact ratio of unsigned 128-bit integers until the end, where it is
 * reduced and must fit the bucket's 64-bit terms.
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

static u128 gcd128(u128 a, u128 b)
{
	while (b) {
		u128 t = a % b;
		a = b;
		b = t;
	}
	return a;
}

/* num / den of the number read, den a power of ten; *end after it. */
struct decimal {
	u128 num;
	u128 den;
};

static int parse_number(const char *s, const char **end, struct decimal *d, char *err)
{
	const char *p = s;
	d->num = 0;
	d->den = 1;
	if (*p < '0' || *p > '9')
		return fail(err, -EINVAL, "\"%s\": a number must come first", s);
	bool frac = false;
	for (;; p++) {
		if (*p == '.' && !frac) {
			if (p[1] < '0' || p[1] > '9')
				return fail(err, -EINVAL, "\"%s\": a digit must follow \".\"", s);
			frac = true;
			continue;
		}
		if (*p < '0' || *p > '9')
			break;
		if (__builtin_mul_overflow(d->num, 10, &d->num) ||
		    __builtin_add_overflow(d->num, (unsigned)(*p - '0'), &d->num) ||
		    (frac && __builtin_mul_overflow(d->den, 10, &d->den)))
			return fail(err, -ERANGE, "\"%s\": too many digits", s);
	}
	*end = p;
	return 0;
}

/* An SI or IEC prefix at *p, if any: its factor (1 if none), *p moved past it. */
static int parse_prefix(const char *s, const char **p, u128 *factor, char *err)
{
	static const char letters[] = "kMGTPE";
	const char *c = *p;
	*factor = 1;
	if (*c == '\0')
		return 0;
	if (*c == 'K' && c[1] != 'i')
		return fail(err, -EINVAL, "\"%s\": unknown prefix \"K\" (k is 1000, Ki is 1024)",
			    s);
	const char *at = *c == 'K' ? letters : strchr(letters, *c);
	if (at == NULL)
		return 0;
	unsigned power = (unsigned)(at - letters) + 1;
	u128 base = 1000;
	if (c[1] == 'i' && *c != 'k') { /* IEC: Ki, Mi, ...; "ki" is not one */
		base = 1024;
		*p = c + 2;
	} else {
		*p = c + 1;
	}
	while (power--)
		*factor *= base;
	return 0;
}

/*
 * A byte or bit unit at *p, if any: 1 for bytes and none, 8 for bits.  "r"
 * (requests, as nginx writes rates) is a token like no unit at all.
 */
static u128 parse_unit(const char **p, bool *named)
{
	const char *c = *p;
	*named = false;
	if (*c == 'r') {
		*p = c + 1;
		return 1;
	}
	*named = true;
	if (strncmp(c, "bit", 3) == 0) {
		*p = c + 3;
		return 8;
	}
	if (*c == 'b') {
		*p = c + 1;
		return 8;
	}
	if (*c == 'B') {
		*p = c + 1;
		return 1;
	}
	*named = false;
	return 1;
}

struct named_span {
	const char *name;
	uint64_t ns;
};

static const struct named_span periods[] = {
	{ "s", NS_PER_S },
	{ "min", 60 * NS_PER_S },
	{ "h", 3600 * NS_PER_S },
	{ "d", 86400 * NS_PER_S },
	{ NULL, 0 },
};

static const struct named_span durations[] = {
	{ "ns", 1 },
	{ "us", 1000 },
	{ "ms", 1000000 },
	{ "s", NS_PER_S },
	{ "min", 60 * NS_PER_S },
	{ "h", 3600 * NS_PER_S },
	{ "d", 86400 * NS_PER_S },
	{ NULL, 0 },
};

static const struct named_span *find_span(const struct named_span *t, const char *p)
{
	for (; t->name; t++)
		if (strcmp(t->name, p) == 0)
			return t;
	return NULL;
}

/* num/den in lowest terms, which must fit 64 bits (den: 63). */
static int reduce(const char *s, u128 num, u128 den, uint64_t *p, uint64_t *q, char *err)
{
	u128 g = gcd128(num, den);
	num /= g;
	den /= g;
	if (num > UINT64_MAX || den > INT64_MAX)
		return fail(err, -ERANGE, "\"%s\": too large or too fine to hold exactly", s);
	*p = (uint64_t)num;
	*q = (uint64_t)den;
	return 0;
}

int tbrate_parse_rate(const char *s, struct tbrate_rate *out, char err[TBRATE_ERR_SIZE])
{
	if (strcmp(s, "unlimited") == 0) {
		*out = (struct tbrate_rate){ .unlimited = true };
		return 0;
	}
	const char *p;
	struct decimal d;
	u128 factor, per_byte;
	bool named;
	int e = parse_number(s, &p, &d, err);
	if (e)
		return e;
	if ((e = parse_prefix(s, &p, &factor, err)))
		return e;
	per_byte = parse_unit(&p, &named);
	const struct named_span *period = &periods[0];
	u128 count = 1; /* "7/3s": the period may be a whole multiple of a unit */
	if (*p == '/') {
		const char *u = p + 1;
		if (*u >= '1' && *u <= '9') {
			count = 0;
			for (; *u >= '0' && *u <= '9'; u++)
				if (__builtin_mul_overflow(count, 10, &count) ||
				    __builtin_add_overflow(count, (unsigned)(*u - '0'), &count) ||
				    count > INT64_MAX)
					return fail(err, -ERANGE, "\"%s\": period too long", s);
		}
		period = find_span(periods, u);
		if (period == NULL)
			return fail(err, -EINVAL,
				    "\"%s\": unknown period \"%s\" (s, min, h or d)", s, p + 1);
	} else if (*p != '\0') {
		return fail(err, -EINVAL, "\"%s\": unexpected \"%s\"", s, p);
	}
	if (d.num == 0)
		return fail(err, -EINVAL, "\"%s\": the rate must be positive (or \"unlimited\")",
			    s);
	u128 num, den;
	if (__builtin_mul_overflow(d.num, factor, &num) ||
	    __builtin_mul_overflow(d.den, (u128)period->ns * per_byte, &den) ||
	    __builtin_mul_overflow(den, count, &den))
		return fail(err, -ERANGE, "\"%s\": too large or too fine to hold exactly", s);
	struct tbrate_rate r = { .bytes_unit = named };
	uint64_t q = 0;
	if ((e = reduce(s, num, den, &r.tokens, &q, err)))
		return e;
	r.period_ns = (int64_t)q;
	u128 span = (u128)period->ns * count;
	r.span_ns = span > INT64_MAX ? INT64_MAX : (int64_t)span;
	*out = r;
	return 0;
}

int tbrate_parse_size(const char *s, uint64_t max, uint64_t *out, char err[TBRATE_ERR_SIZE])
{
	const char *p;
	struct decimal d;
	u128 factor, num, den;
	bool named;
	int e = parse_number(s, &p, &d, err);
	if (e)
		return e;
	if ((e = parse_prefix(s, &p, &factor, err)))
		return e;
	u128 per_byte = parse_unit(&p, &named);
	if (*p != '\0')
		return fail(err, -EINVAL, "\"%s\": unexpected \"%s\"", s, p);
	if (__builtin_mul_overflow(d.num, factor, &num) ||
	    __builtin_mul_overflow(d.den, per_byte, &den))
		return fail(err, -ERANGE, "\"%s\": too large", s);
	if (num % den != 0)
		return fail(err, -EINVAL, "\"%s\": not a whole number of tokens", s);
	num /= den;
	if (num == 0)
		return fail(err, -EINVAL, "\"%s\": must be at least 1", s);
	if (num > max)
		return fail(err, -ERANGE, "\"%s\": larger than %" PRIu64, s, max);
	*out = (uint64_t)num;
	return 0;
}

int tbrate_parse_duration(const char *s, int64_t *out_ns, char err[TBRATE_ERR_SIZE])
{
	const char *p;
	struct decimal d;
	int e = parse_number(s, &p, &d, err);
	if (e)
		return e;
	const struct named_span *unit = *p ? find_span(durations, p) : &durations[3];
	if (unit == NULL)
		return fail(err, -EINVAL,
			    "\"%s\": unknown unit \"%s\" (ns, us, ms, s, min, h or d)", s, p);
	u128 ns;
	if (__builtin_mul_overflow(d.num, (u128)unit->ns, &ns))
		return fail(err, -ERANGE, "\"%s\": too long", s);
	if (ns % d.den != 0)
		return fail(err, -EINVAL, "\"%s\": finer than a nanosecond", s);
	ns /= d.den;
	if (ns == 0)
		return fail(err, -EINVAL, "\"%s\": must be positive", s);
	if (ns > INT64_MAX)
		return fail(err, -ERANGE, "\"%s\": too long", s);
	*out_ns = (int64_t)ns;
	return 0;
}

double tbrate_rate_per_second(const struct tbrate_rate *r)
{
	if (r->unlimited)
		return __builtin_inf();
	return (double)((long double)r->tokens * 1e9L / (long double)r->period_ns);
}

const char *tbrate_rate_format(const struct tbrate_rate *r, char *buf, size_t size)
{
	if (r->unlimited) {
		snprintf(buf, size, "unlimited");
		return buf;
	}
	/* tokens per period_ns, shown per second as a fraction when not whole. */
	u128 num = (u128)r->tokens * NS_PER_S, den = (u128)r->period_ns;
	u128 g = gcd128(num, den);
	num /= g;
	den /= g;
	if (num <= UINT64_MAX && den == 1)
		snprintf(buf, size, "%" PRIu64 "/s", (uint64_t)num);
	else
		snprintf(buf, size, "%" PRIu64 " per %" PRId64 " ns", r->tokens, r->period_ns);
	return buf;
}
