/* SPDX-License-Identifier: MIT */
/*
 * tokenbucket_limit_parse: a rate, a burst or a duration read from text
 * exactly.  Every quantity is a ratio of unsigned 128-bit integers until
 * the end, where it is reduced and must fit a limit's 64-bit terms;
 * nothing is rounded.  The whole text is read for its syntax first, so
 * that -EINVAL comes before -EDOM and -ERANGE whatever the text.  The
 * grammar is in tokenbucket_limit_parse(3).
 */
#include <errno.h>
#include <string.h>

#include "core.h"

typedef tb__u128 u128;

#define NS_PER_S UINT64_C(1000000000)

/* The number read: num / den, den a power of ten; wide: it did not fit. */
struct decimal {
	u128 num;
	u128 den;
	bool wide;
	bool nonzero;
};

static bool is_digit(char c)
{
	return c >= '0' && c <= '9';
}

/* digits [ "." digits ] at s; returns the first character after it, or NULL. */
static const char *read_number(const char *s, struct decimal *d, const char **bad)
{
	*d = (struct decimal){ 0, 1, false, false };
	if (!is_digit(*s)) {
		*bad = s;
		return NULL;
	}
	bool frac = false;
	for (;; s++) {
		if (*s == '.' && !frac) {
			if (!is_digit(s[1])) {
				*bad = s + 1;
				return NULL;
			}
			frac = true;
			continue;
		}
		if (!is_digit(*s))
			return s;
		d->nonzero |= *s != '0';
		if (__builtin_mul_overflow(d->num, 10, &d->num) ||
		    __builtin_add_overflow(d->num, (unsigned)(*s - '0'), &d->num) ||
		    (frac && __builtin_mul_overflow(d->den, 10, &d->den)))
			d->wide = true;
	}
}

/*
 * An SI prefix (k M G T P E, powers of 1000) or IEC one (Ki Mi ... Ei,
 * powers of 1024) at *p, if any; *factor 1 if none.  A bare "K" is
 * neither (false): k is 1000 and Ki 1024.
 */
static bool read_prefix(const char **p, u128 *factor)
{
	static const char letters[] = "kMGTPE";
	const char *c = *p;
	*factor = 1;
	if (*c == '\0')
		return true;
	if (*c == 'K' && c[1] != 'i')
		return false;
	const char *at = *c == 'K' ? letters : strchr(letters, *c);
	if (at == NULL)
		return true;
	unsigned power = (unsigned)(at - letters) + 1;
	u128 base = 1000;
	if (c[1] == 'i' && *c != 'k') { /* "ki" is not a prefix: k, then 'i' */
		base = 1024;
		*p = c + 2;
	} else {
		*p = c + 1;
	}
	while (power--)
		*factor *= base;
	return true;
}

/*
 * A unit at *p, if any: bits per token, 8 for "b" and "bit" (a token is a
 * byte), 1 for "B", "r" (requests, as nginx writes rates) and none.
 */
static unsigned read_unit(const char **p, unsigned *flags)
{
	const char *c = *p;
	if (*c == 'r') {
		*p = c + 1;
		return 1;
	}
	if (*c == 'B') {
		*flags |= TOKENBUCKET_PARSE_BYTES;
		*p = c + 1;
		return 1;
	}
	if (*c == 'b') {
		*flags |= TOKENBUCKET_PARSE_BYTES;
		*p = c + (strncmp(c, "bit", 3) == 0 ? 3 : 1);
		return 8;
	}
	return 1;
}

/*
 * The units of time, shortest first: a duration takes any, a rate's period
 * one of a second or more (from RATE_PERIODS on: "5/ms" is refused).
 */
static const struct {
	const char *name;
	uint64_t ns;
} times[] = {
	{ "ns", 1 },
	{ "us", 1000 },
	{ "ms", 1000000 },
	{ "s", NS_PER_S },
	{ "min", 60 * NS_PER_S },
	{ "h", 3600 * NS_PER_S },
	{ "d", 86400 * NS_PER_S },
};
#define RATE_PERIODS 3

/* The unit of time, from times[first] on, that is all of p: its ns, or 0. */
static uint64_t read_time(const char *p, size_t first)
{
	for (size_t i = first; i < sizeof(times) / sizeof(times[0]); i++)
		if (strcmp(p, times[i].name) == 0)
			return times[i].ns;
	return 0;
}

/* "/" [count] period, all of the rest of the text; 0 or the period in ns. */
static u128 read_period(const char *p, const char **bad, bool *wide)
{
	u128 count = 1; /* "7/3s": a whole multiple of the unit */
	if (*p >= '1' && *p <= '9') {
		count = 0;
		for (; is_digit(*p); p++)
			if (__builtin_mul_overflow(count, 10, &count) ||
			    __builtin_add_overflow(count, (unsigned)(*p - '0'), &count) ||
			    count > INT64_MAX)
				*wide = true;
	}
	uint64_t unit = read_time(p, RATE_PERIODS);
	if (unit == 0) {
		*bad = p;
		return 0;
	}
	return *wide ? unit : count * unit; /* wide: refused later */
}

static int refuse(int e, const char *at, const char **end)
{
	if (end != NULL)
		*end = at;
	return e;
}

/* A rate: amount (num / den tokens) every span_ns. */
static int parse_rate(struct tokenbucket_limit *lim, const char *text, const struct decimal *d,
		      u128 num, u128 den, u128 span_ns, const char **end)
{
	if (!d->nonzero)
		return refuse(-EDOM, text, end);
	u128 n, q, g;
	if (d->wide || __builtin_mul_overflow(den, span_ns, &q))
		return refuse(-ERANGE, text, end);
	n = num;
	g = tb__gcd(n, q);
	n /= g;
	q /= g;
	if (n > UINT64_MAX || q > INT64_MAX)
		return refuse(-ERANGE, text, end);
	/* The amount as written is the burst a quota ("1000r/h") holds. */
	u128 amount = num / den;
	*lim = (struct tokenbucket_limit){
		(uint64_t)n, (int64_t)q,
		amount < 1 ? 1 : amount > TOKENBUCKET_BURST_MAX ? TOKENBUCKET_BURST_MAX
								  : (uint64_t)amount
	};
	return 0;
}

/*
 * A whole count: num / den, the number d read times its units.  -EDOM for
 * 0 or a fraction, -ERANGE when d did not fit or the count passes max.
 */
static int whole(const struct decimal *d, u128 num, u128 den, u128 max, uint64_t *count)
{
	if (!d->nonzero)
		return -EDOM;
	if (d->wide)
		return -ERANGE;
	if (num % den != 0)
		return -EDOM;
	if (num / den > max)
		return -ERANGE;
	*count = (uint64_t)(num / den);
	return 0;
}

int tokenbucket_limit_parse(struct tokenbucket_limit *lim, const char *text, unsigned *flags,
			    const char **end)
{
	const unsigned kinds = TOKENBUCKET_PARSE_BURST | TOKENBUCKET_PARSE_PERIOD;
	unsigned in = flags != NULL ? *flags : 0;
	if (lim == NULL || text == NULL)
		return -EINVAL;
	if ((in & ~(kinds | TOKENBUCKET_PARSE_BYTES)) || (in & kinds) == kinds)
		return refuse(-EINVAL, text, end);
	/* BYTES is said back only: a caller may pass the flags it got before. */
	unsigned seen = in & kinds;
	bool burst = in & TOKENBUCKET_PARSE_BURST;
	bool period = in & TOKENBUCKET_PARSE_PERIOD;
	uint64_t count;
	int e;
	if (!burst && !period && strcmp(text, "unlimited") == 0) {
		*lim = (struct tokenbucket_limit){ 1, 0, TOKENBUCKET_BURST_MAX };
		goto done;
	}
	struct decimal d;
	const char *bad = NULL;
	const char *p = read_number(text, &d, &bad);
	u128 factor, span_ns = 0;
	bool wide = false;
	if (p == NULL)
		return refuse(-EINVAL, bad, end);
	if (period) {
		/* A duration: a number of seconds or of the unit of time after it. */
		uint64_t unit = *p == '\0' ? NS_PER_S : read_time(p, 0);
		u128 ns;
		if (unit == 0)
			return refuse(-EINVAL, p, end);
		if (__builtin_mul_overflow(d.num, (u128)unit, &ns))
			d.wide = true;
		e = whole(&d, ns, d.den, INT64_MAX, &count);
		if (e)
			return refuse(e, text, end);
		lim->period_ns = (int64_t)count;
		goto done;
	}
	if (!read_prefix(&p, &factor))
		return refuse(-EINVAL, p, end);
	unsigned per_token = read_unit(&p, &seen);
	if (!burst && *p == '/') {
		span_ns = read_period(p + 1, &bad, &wide);
		if (span_ns == 0)
			return refuse(-EINVAL, bad, end);
	} else if (*p != '\0') {
		return refuse(-EINVAL, p, end);
	} else {
		span_ns = NS_PER_S;
	}
	/* The amount as written: d.num * factor / (d.den * per_token) tokens. */
	u128 num = 0, den = 1;
	if (wide || __builtin_mul_overflow(d.num, factor, &num) ||
	    __builtin_mul_overflow(d.den, (u128)per_token, &den))
		d.wide = true;
	if (burst) {
		e = whole(&d, num, den, TOKENBUCKET_BURST_MAX, &count);
		if (e)
			return refuse(e, text, end);
		lim->burst = count;
		goto done;
	}
	e = parse_rate(lim, text, &d, num, den, span_ns, end);
	if (e)
		return e;
done:
	if (flags != NULL)
		*flags = seen;
	if (end != NULL)
		*end = text + strlen(text);
	return 0;
}
