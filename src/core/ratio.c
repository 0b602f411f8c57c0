/* SPDX-License-Identifier: MIT */
/*
 * Exact arithmetic of a rate regime.  A finite rate is p tokens every q ns
 * (lowest terms, p, q >= 1).  Production since the origin is
 * P(t) = floor((t - origin) * p / q); every product below fits unsigned
 * 128-bit integers (a 64-bit time difference times a 64-bit factor), so no
 * rounding enters anywhere and the fraction of a token is never lost.
 */
#include <float.h>
#include <math.h>

#include "core.h"
#include "span.h"

typedef tb__u128 u128;

u128 tb__gcd(u128 a, u128 b)
{
	/* Terms only shrink: once both fit 64 bits, 64-bit divisions finish it. */
	while ((a | b) >> 64) {
		if (b == 0)
			return a;
		u128 t = a % b;
		a = b;
		b = t;
	}
	uint64_t x = (uint64_t)a, y = (uint64_t)b;
	while (y) {
		uint64_t t = x % y;
		x = y;
		y = t;
	}
	return x;
}

#define fine_units tb__fine_units
#define producing tb__producing

enum tb__kind tb__ratio_from_every(uint64_t tokens, int64_t period_ns, uint64_t *p, uint64_t *q)
{
	if (tokens == 0) {
		*p = 0;
		*q = 1;
		return TB__ZERO;
	}
	uint64_t g = (uint64_t)tb__gcd(tokens, (uint64_t)period_ns);
	*p = tokens / g;
	*q = (uint64_t)period_ns / g;
	return TB__FINITE;
}

/*
 * Whether p tokens per q ns, in tokens per second, rounds to rate.  When
 * p * 1e9 and q are below 2^53 both are exact doubles and one IEEE division
 * rounds once, correctly.  Beyond that, long double (64-bit significand on
 * x86-64) holds p * 1e9 < 2^94 rounded once more; the double rounding can
 * only matter for a quotient within 2^-64 of a halfway point.
 */
static bool reads_back(uint64_t p, uint64_t q, double rate)
{
	const uint64_t exact = UINT64_C(1) << 53;
	if (p < exact / 1000000000 && q < exact)
		return (double)(p * 1000000000) / (double)q == rate;
	return (double)((long double)p * 1e9L / (long double)q) == rate;
}

/*
 * rate / 1e9 exactly, as num / den: a double is mant * 2^e exactly.  For
 * the rates that reach the continued fraction (1/INT64_MAX to UINT64_MAX
 * tokens per ns), num < 2^95 and den < 2^117.
 */
static void per_ns_exactly(double rate, u128 *num, u128 *den)
{
	int e;
	uint64_t mant = (uint64_t)ldexp(frexp(rate, &e), 53);
	e -= 53;
	if (e >= 0) {
		*num = (u128)mant << e;
		*den = 1000000000;
	} else {
		*num = mant;
		*den = (u128)1000000000 << -e;
	}
}

/*
 * A double rate in tokens per second becomes the simplest ratio p/q tokens
 * per ns that reads back as the same double: the first convergent of the
 * continued fraction of rate / 1e9 that rounds to it.  The fraction is
 * expanded exactly (Euclid on 128-bit integers): expanded in floating
 * point, its later terms drift, and another convergent would be chosen.
 * Rates slower than a token per INT64_MAX ns count as that; rates above
 * UINT64_MAX tokens per ns count as that.
 */
enum tb__kind tb__ratio_from_rate(double rate, uint64_t *p, uint64_t *q)
{
	if (rate == 0) {
		*p = 0;
		*q = 1;
		return TB__ZERO;
	}
	if (rate >= DBL_MAX) {
		*p = 1;
		*q = 0;
		return TB__INF;
	}
	long double x = (long double)rate / 1e9L;
	if (x <= 1.0L / (long double)INT64_MAX) {
		*p = 1;
		*q = INT64_MAX;
		return TB__FINITE;
	}
	if (x >= (long double)UINT64_MAX) {
		*p = UINT64_MAX;
		*q = 1;
		return TB__FINITE;
	}

	u128 num, den;
	per_ns_exactly(rate, &num, &den);
	/* Convergents h/k with h(-2) = 0, h(-1) = 1, k(-2) = 1, k(-1) = 0. */
	u128 h0 = 0, h1 = 1, k0 = 1, k1 = 0;
	uint64_t best_p = 0, best_q = 1;
	while (den != 0) {
		u128 a = num / den, r = num % den;
		/* a, h1, k1 < 2^64: the products stay below 2^128. */
		if (a > UINT64_MAX)
			break;
		u128 h2 = a * h1 + h0, k2 = a * k1 + k0;
		if (h2 > UINT64_MAX || k2 > INT64_MAX)
			break;
		h0 = h1, h1 = h2, k0 = k1, k1 = k2;
		if (h1 != 0) {
			best_p = (uint64_t)h1;
			best_q = (uint64_t)k1;
			if (reads_back(best_p, best_q, rate))
				break;
		}
		num = den;
		den = r;
	}
	if (best_p == 0) { /* cannot happen for x > 1/INT64_MAX; stay defined */
		best_p = 1;
		best_q = INT64_MAX;
	}
	*p = best_p;
	*q = best_q;
	return TB__FINITE;
}

/* Whether tb__time_of can find a time: a finite rate producing from its origin. */
static inline bool timed(const struct tb__view *v)
{
	return v->kind == TB__FINITE && v->p != 0 && v->q != 0 && v->origin != TB__NO_TIME;
}

/* The fine units still to produce from "at" until j more tokens than P(at) are there. */
static inline u128 need_of(const struct tb__view *v, int64_t at, uint64_t j)
{
	u128 rem = at >= v->origin ? tb__mod(fine_units(v, at), v->q) : 0;
	return (u128)j * v->q - rem;
}

int64_t tb__time_of(const struct tb__view *v, int64_t at, uint64_t j)
{
	if (!timed(v))
		return TOKENBUCKET_NEVER;
	u128 need = need_of(v, at, j);
	u128 wait = tb__div(need + v->p - 1, v->p);
	if (wait >= (u128)tb__span(TOKENBUCKET_NEVER, at))
		return TOKENBUCKET_NEVER;
	return (int64_t)((uint64_t)at + (uint64_t)wait); /* in range; wait may pass INT64_MAX */
}

int64_t tb__wait_of(const struct tb__view *v, int64_t at, uint64_t j, int64_t *act)
{
	*act = tb__time_of(v, at, j);
	/* act - at can pass INT64_MAX (at far below 0): saturated to NEVER. */
	uint64_t span = (uint64_t)*act - (uint64_t)at;
	return *act == TOKENBUCKET_NEVER || span >= (uint64_t)TOKENBUCKET_NEVER ? TOKENBUCKET_NEVER
										: (int64_t)span;
}

int64_t tb__seconds_up(int64_t ns)
{
	/* Unsigned: NEVER - 1 + 999999999 passes INT64_MAX. */
	return ns == TOKENBUCKET_NEVER ? TOKENBUCKET_NEVER
				       : (int64_t)(((uint64_t)ns + 999999999u) / 1000000000u);
}

/* tb__seconds_of the long way, out of line: its fast path then saves no register. */
static __attribute__((noinline)) int64_t seconds_via_wait(const struct tb__view *v, int64_t at,
							   uint64_t j)
{
	int64_t act;
	return tb__seconds_up(tb__wait_of(v, at, j, &act));
}

int64_t tb__seconds_of(const struct tb__view *v, int64_t at, uint64_t j)
{
	uint64_t per_s, far = tb__span(TOKENBUCKET_NEVER, at);
	if (far > (uint64_t)TOKENBUCKET_NEVER)
		far = (uint64_t)TOKENBUCKET_NEVER;
	/*
	 * ceil(ceil(need / p) / 10^9) = ceil(need / (p * 10^9)): one 64-bit
	 * division when both fit.  need below far: the wait (at most need) is
	 * not NEVER to tb__wait_of.
	 */
	if (timed(v) && !__builtin_mul_overflow(v->p, (uint64_t)1000000000u, &per_s)) {
		u128 need = need_of(v, at, j);
		if (need < far) {
			uint64_t whole = (uint64_t)need / per_s;
			return (int64_t)(whole + ((uint64_t)need % per_s != 0));
		}
	}
	return seconds_via_wait(v, at, j);
}

double tb__fraction(const struct tb__view *v, int64_t t)
{
	if (t > v->until)
		t = v->until;
	if (!producing(v, t))
		return 0;
	uint64_t rem = tb__mod(fine_units(v, t), v->q);
	return (double)((long double)rem / (long double)v->q);
}

int64_t tb__duration(const struct tb__view *v, uint64_t n)
{
	if (n == 0 || v->kind == TB__INF)
		return 0;
	if (v->kind != TB__FINITE || v->p == 0)
		return TOKENBUCKET_NEVER;
	u128 d = tb__div((u128)n * v->q + v->p - 1, v->p);
	return d >= (u128)TOKENBUCKET_NEVER ? TOKENBUCKET_NEVER : (int64_t)d;
}

int64_t tb__limit(int64_t origin, uint64_t p, uint64_t q, uint64_t fine0)
{
	if (p == 0 || q == 0)
		return INT64_MAX;
	/* The smallest span with span * p + fine0 >= TB__ANCHOR * q (fine0 < q). */
	u128 d = ((u128)TB__ANCHOR * q - fine0 + p - 1) / p;
	if (d >= (u128)tb__span(INT64_MAX, origin))
		return INT64_MAX; /* no time the bucket sees is that far */
	return (int64_t)((uint64_t)origin + (uint64_t)d);
}

uint64_t tb__remainder(const struct tb__view *v, int64_t t)
{
	return producing(v, t) ? tb__mod(fine_units(v, t), v->q) : 0;
}

double tb__tokens_value(const struct tb__view *v, int64_t level, int64_t t)
{
	uint64_t rem = tb__remainder(v, t);
	if (rem == 0)
		return (double)level;
	return (double)((long double)level + (long double)rem / (long double)v->q);
}

double tb__rate_value(const struct tb__view *r)
{
	switch (r->kind) {
	case TB__INF:
		return TOKENBUCKET_INF;
	case TB__ZERO:
		return 0;
	default:
		return (double)((long double)r->p * 1e9L / (long double)r->q);
	}
}

/*
 * At a rate change at time "at", the fraction of a token the old rate had
 * produced is kept: the time the new rate needs for it, rounded down to a
 * nanosecond, no further back than INT64_MIN + 1, as fine units of the new
 * rate (never invented, and below q).
 */
uint64_t tb__carry(const struct tb__view *old, uint64_t p, uint64_t q, int64_t at)
{
	if (!producing(old, at) || p == 0 || q == 0)
		return 0;
	u128 rem = fine_units(old, at) % old->q;
	u128 carry = rem * q / ((u128)old->q * p);
	u128 room = tb__span(at, TB__NO_TIME + 1);
	if (carry > room)
		carry = room; /* the time base starts there: carry what fits */
	return (uint64_t)(carry * p);
}
