/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <string.h>

#include "sequence.h"

typedef unsigned __int128 u128;

uint64_t seq_rand(uint64_t *state)
{
	uint64_t z = (*state += 0x9e3779b97f4a7c15u); /* splitmix64 */
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9u;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebu;
	return z ^ (z >> 31);
}

int64_t seq_until(int64_t t, int64_t now)
{
	if (t == TOKENBUCKET_NEVER || t <= now)
		return t == TOKENBUCKET_NEVER ? TOKENBUCKET_NEVER : 0;
	uint64_t d = (uint64_t)t - (uint64_t)now;
	return d >= (uint64_t)TOKENBUCKET_NEVER ? TOKENBUCKET_NEVER : (int64_t)d;
}

static uint64_t below(struct seq *s, uint64_t n)
{
	return n == 0 ? 0 : seq_rand(&s->rng) % n;
}

/*
 * Limits whose products pass 2^53 at once, which the script's common cases
 * take in two-digit arithmetic: a byte rate (10^9 a second, burst 10^9),
 * the thresholds (2^26 per 2^26 ns, burst 2^27: a full bucket's span is
 * 2^53 ns·tokens), every number at the common cases' largest (10^15 - 1),
 * a rate with no common factor there; then the API's largest rate and
 * burst, and the smallest rate with the largest burst.
 */
static const struct tokenbucket_redis_limit edge_limits[] = {
	{ 1000000000, 1000000000, 1000000000 },
	{ 67108864, 67108864, 134217728 },
	{ 999999999999999, 999999999999999, 999999999999999 },
	{ 999999999999989, 999999999999999, 999999999999999 },
	{ 1, 999999999999999, 999999999999999 },
	{ 999999999999999, 1, 999999999999999 },
	{ UINT64_MAX, INT64_MAX, TOKENBUCKET_BURST_MAX },
	{ 1, INT64_MAX, TOKENBUCKET_BURST_MAX },
};

/*
 * A limit past the script's common cases' 10^15 in every number it can be:
 * a burst from 2^50 to 2^62, a rate's tokens to 2^64 - 1 and its period to
 * 2^63 - 1, each now and then at its very largest, so that a level, a
 * fraction or a product of them carries across every limb of the script.
 */
static struct tokenbucket_redis_limit wide_limit(struct seq *s)
{
	struct tokenbucket_redis_limit l;
	switch (below(s, 3)) {
	case 0:
		l.tokens = UINT64_MAX - below(s, 1000);
		break;
	case 1:
		l.tokens = (UINT64_C(1) << 40) + below(s, UINT64_C(1) << 40);
		break;
	default:
		l.tokens = seq_rand(&s->rng) | 1;
	}
	switch (below(s, 4)) {
	case 0:
		l.period_ns = 1 + (int64_t)below(s, 1000000000);
		break;
	case 1:
		l.period_ns = INT64_MAX - (int64_t)below(s, 1000);
		break;
	default:
		l.period_ns = 1 + (int64_t)below(s, INT64_MAX);
	}
	if (below(s, 2) == 0)
		l.burst = TOKENBUCKET_BURST_MAX - below(s, 1000);
	else
		l.burst = (UINT64_C(1) << 50) + below(s, TOKENBUCKET_BURST_MAX - (UINT64_C(1) << 50) + 1);
	return l;
}

/*
 * Mostly the range (burst to 2^40, rates to 1e9 per second), one
 * limit in ten wide, now and then the library's whole range.
 */
static struct tokenbucket_redis_limit random_limit(struct seq *s)
{
	static const int64_t periods[] = { 1, 3, 1000, 1000000, 7000000, 1000000000, 60000000000 };
	struct tokenbucket_redis_limit l;
	uint64_t k = below(s, 100);
	if (k < 6)
		return edge_limits[below(s, sizeof(edge_limits) / sizeof(edge_limits[0]))];
	if (k < 16)
		return wide_limit(s);
	k = below(s, 100);
	if (k < 5)
		l.tokens = 0;
	else if (k < 60)
		l.tokens = 1 + below(s, 10);
	else if (k < 90)
		l.tokens = 1 + below(s, 1000000000);
	else if (k < 97)
		l.tokens = 1 + below(s, UINT64_C(1) << 40);
	else
		l.tokens = seq_rand(&s->rng) | 1;
	k = below(s, 100);
	if (k < 60)
		l.period_ns = periods[below(s, sizeof(periods) / sizeof(periods[0]))];
	else if (k < 95)
		l.period_ns = 1 + (int64_t)below(s, UINT64_C(1) << 40);
	else
		l.period_ns = 1 + (int64_t)below(s, INT64_MAX);
	/* Keep most rates at or below 1e9 tokens per second. */
	if (k < 90 && l.tokens > (uint64_t)l.period_ns && below(s, 4) != 0)
		l.tokens = (uint64_t)l.period_ns;
	k = below(s, 100);
	if (k < 5)
		l.burst = 0;
	else if (k < 50)
		l.burst = 1 + below(s, 20);
	else if (k < 95)
		l.burst = 1 + below(s, UINT64_C(1) << 40);
	else
		l.burst = below(s, TOKENBUCKET_BURST_MAX + 1);
	return l;
}

static int64_t random_start(struct seq *s)
{
	switch (below(s, 12)) {
	case 0:
		return 0;
	case 1:
		return INT64_MIN + (int64_t)below(s, 1000);
	case 2:
		return INT64_MAX - (int64_t)below(s, 1000000000);
	case 3:
	case 4:
	case 5:
		return 1700000000000000000 + (int64_t)below(s, 1000000000000);
	default:
		return (int64_t)seq_rand(&s->rng);
	}
}

static int64_t add_sat(int64_t t, int64_t d)
{
	if (d > 0 && t > INT64_MAX - d)
		return INT64_MAX;
	if (d < 0 && t < INT64_MIN - d)
		return INT64_MIN;
	return t + d;
}

static int64_t next_time(struct seq *s)
{
	int64_t p = s->lim.period_ns > 0 ? s->lim.period_ns : 1;
	uint64_t k = below(s, 100);
	if (k < 10)
		return s->t; /* the same instant */
	if (k < 20)
		return add_sat(s->t, -(int64_t)below(s, 1000000)); /* backwards */
	if (k < 55)
		return add_sat(s->t, (int64_t)below(s, (uint64_t)p * 3 + 1)); /* a few tokens' time */
	if (k < 65)
		return add_sat(s->t, (int64_t)below(s, UINT64_C(1) << 40));
	if (k < 67)
		return below(s, 4) == 0 ? INT64_MAX : add_sat(s->t, (int64_t)below(s, INT64_MAX));
	return add_sat(s->t, (int64_t)below(s, 1000000));
}

static uint64_t random_n(struct seq *s)
{
	uint64_t b = s->lim.burst;
	switch (below(s, 8)) {
	case 0:
		return 0;
	case 1:
		return b;
	case 2:
		return b + 1;
	case 3:
		return below(s, b + 1);
	case 4:
		return seq_rand(&s->rng);
	default:
		return 1 + below(s, 3);
	}
}

static int64_t random_wait(struct seq *s)
{
	switch (below(s, 5)) {
	case 0:
		return TOKENBUCKET_NEVER;
	case 1:
		return 0;
	case 2:
		return -1 - (int64_t)below(s, 1000);
	default:
		return (int64_t)below(s, (uint64_t)(s->lim.period_ns > 0 ? s->lim.period_ns : 1) * 4 + 1);
	}
}

int seq_start(struct seq *s, uint64_t seed, int steps)
{
	memset(s, 0, sizeof(*s));
	s->rng = seed;
	s->left = steps;
	s->lim = random_limit(s);
	s->t = random_start(s);
	return 0;
}

void seq_end(struct seq *s)
{
	tokenbucket_free(s->tb);
	s->tb = NULL;
}

static bool same_rate(const struct tokenbucket_redis_limit *a, const struct tokenbucket_redis_limit *b)
{
	if (a->tokens == 0 || b->tokens == 0)
		return a->tokens == b->tokens;
	return (u128)a->tokens * (uint64_t)b->period_ns == (u128)b->tokens * (uint64_t)a->period_ns;
}

/* The local bucket as the call's configuration leaves it, as Redis does. */
static int configure(struct seq *s, int64_t now)
{
	const struct tokenbucket_redis_limit *l = &s->lim;
	if (s->tb == NULL || !s->seen) {
		/* No stored key: a new full bucket with the call's configuration. */
		tokenbucket_free(s->tb);
		s->tb = NULL;
		s->made = *l;
		return tokenbucket_create_every(&s->tb, l->tokens, l->tokens ? l->period_ns : 1,
						l->burst, 0);
	}
	if (!same_rate(&s->made, l)) {
		int err = tokenbucket_set_rate_every_at(s->tb, now, l->tokens,
							l->tokens ? l->period_ns : 1);
		if (err != 0)
			return err;
		s->made.tokens = l->tokens;
		s->made.period_ns = l->period_ns;
	}
	if (s->made.burst != l->burst) {
		int err = tokenbucket_set_burst_at(s->tb, now, l->burst);
		if (err != 0)
			return err;
		s->made.burst = l->burst;
	}
	return 0;
}

bool seq_next(struct seq *s, struct seq_step *st, struct seq_expect *ex)
{
	if (s->left-- <= 0)
		return false;
	if (below(s, 100) < 12)
		s->lim = random_limit(s);
	int64_t now = next_time(s);
	if (now > s->t)
		s->t = now;
	memset(st, 0, sizeof(*st));
	memset(ex, 0, sizeof(*ex));
	st->now = now;
	st->lim = s->lim;
	st->resv = -1;
	ex->code = 1;
	uint64_t k = below(s, 100);
	st->op = k < 30 ? TOKENBUCKET_REDIS_ALLOW : k < 60 ? TOKENBUCKET_REDIS_RESERVE
	       : k < 70 ? TOKENBUCKET_REDIS_CANCEL : k < 78 ? TOKENBUCKET_REDIS_REFUND
	       : k < 93 ? TOKENBUCKET_REDIS_TOKENS : TOKENBUCKET_REDIS_RESET;
	st->n = random_n(s);
	if (st->op == TOKENBUCKET_REDIS_RESET && st->n > s->lim.burst) {
		/* Refused before anything is sent or changed. */
		ex->err = -EINVAL;
		ex->code = -1;
		return true;
	}
	/* A config change on a bucket that saw no time is a new bucket (see configure). */
	if (configure(s, now) != 0) {
		ex->err = -EFAULT; /* the local library refused: the test reports it */
		return true;
	}
	struct tokenbucket_reservation r;
	switch (st->op) {
	case TOKENBUCKET_REDIS_ALLOW:
		ex->allowed = tokenbucket_allow_at(s->tb, now, st->n);
		ex->code = ex->allowed ? 1 : st->n > s->lim.burst ? 2 : 0;
		s->seen |= st->n <= s->lim.burst;
		break;
	case TOKENBUCKET_REDIS_RESERVE:
		st->arg = random_wait(s);
		ex->err = tokenbucket_reserve_at(s->tb, now, st->n, st->arg, &r);
		ex->code = ex->err == 0 ? 1 : ex->err == -ETIMEDOUT ? 0 : ex->err == -E2BIG ? 2 : 3;
		s->seen |= ex->err != -E2BIG;
		if (ex->err == 0) {
			ex->act = r.time_to_act;
			if (s->nresv < SEQ_RESV)
				s->resv[s->nresv++] = r;
			else
				s->resv[below(s, SEQ_RESV)] = r;
		}
		break;
	case TOKENBUCKET_REDIS_CANCEL:
		if (s->nresv > 0) {
			st->resv = (int)below(s, (uint64_t)s->nresv);
			r = s->resv[st->resv];
		} else {
			r = (struct tokenbucket_reservation){ .time_to_act = now, .tokens = 0 };
		}
		st->n = r.tokens;
		st->arg = r.time_to_act;
		tokenbucket_cancel_at(s->tb, &r, now);
		if (st->resv >= 0)
			s->resv[st->resv] = r;
		s->seen |= st->n > 0;
		break;
	case TOKENBUCKET_REDIS_REFUND:
		/* The script credits up to now, then gives back within burst;
		 * more than a burst is refused before either. */
		if (st->n > s->lim.burst) {
			ex->err = -E2BIG;
			ex->code = 2;
			break;
		}
		(void)tokenbucket_tokens_at(s->tb, now);
		tokenbucket_refund(s->tb, st->n);
		s->seen = true;
		break;
	case TOKENBUCKET_REDIS_TOKENS:
		ex->tokens = tokenbucket_tokens_at(s->tb, now);
		s->seen = true;
		break;
	case TOKENBUCKET_REDIS_RESET:
		ex->err = tokenbucket_reset_at(s->tb, now, st->n);
		s->seen = true;
		break;
	}
	return true;
}

/* ---- Several limits in one key ------------------------------------------- */

static size_t set_max;

int seq_set_start(struct seq_set *s, uint64_t seed, int steps, size_t max_count)
{
	memset(s, 0, sizeof(*s));
	seq_start(&s->base, seed, steps);
	set_max = max_count < 1 ? 1 : max_count > TOKENBUCKET_SET_MAX ? TOKENBUCKET_SET_MAX : max_count;
	s->count = 1 + below(&s->base, set_max);
	for (size_t i = 0; i < s->count; i++)
		s->lim[i] = random_limit(&s->base);
	return 0;
}

void seq_set_end(struct seq_set *s)
{
	for (size_t i = 0; i < TOKENBUCKET_SET_MAX; i++) {
		tokenbucket_free(s->tb[i]);
		s->tb[i] = NULL;
	}
}

/*
 * The local buckets as the call's limits leave them, as the script does: a
 * key never written is new; a limit past those stored is new and full; a
 * stored one whose configuration differs is reconfigured at now.
 */
static int set_configure(struct seq_set *s, int64_t now)
{
	for (size_t i = 0; i < s->count; i++) {
		struct seq one = { .tb = s->tb[i], .made = s->made[i], .lim = s->lim[i],
				   .seen = s->base.seen && i < s->have };
		int err = configure(&one, now);
		s->tb[i] = one.tb;
		s->made[i] = one.made;
		if (err != 0)
			return err;
		/* A limit added to a stored key starts full at the key's clock. */
		if (!one.seen && s->base.seen)
			(void)tokenbucket_tokens_at(s->tb[i], s->clock);
	}
	/* The key keeps no limit past count. */
	for (size_t i = s->count; i < TOKENBUCKET_SET_MAX; i++) {
		tokenbucket_free(s->tb[i]);
		s->tb[i] = NULL;
	}
	return 0;
}

bool seq_set_next(struct seq_set *s, struct seq_set_step *st, struct seq_set_expect *ex)
{
	struct seq *b = &s->base;
	if (b->left-- <= 0)
		return false;
	uint64_t k = below(b, 100);
	if (k < 4) {
		s->count = 1 + below(b, set_max);
		for (size_t i = 0; i < s->count; i++)
			if (s->lim[i].burst == 0 && s->lim[i].tokens == 0 && s->lim[i].period_ns == 0)
				s->lim[i] = random_limit(b);
	} else if (k < 10) {
		s->lim[below(b, s->count)] = random_limit(b);
	}
	for (size_t i = s->count; i < TOKENBUCKET_SET_MAX; i++)
		memset(&s->lim[i], 0, sizeof(s->lim[i]));
	b->lim = s->lim[0];
	int64_t now = next_time(b);
	if (now > b->t)
		b->t = now;
	memset(st, 0, sizeof(*st));
	memset(ex, 0, sizeof(*ex));
	st->now = now;
	st->count = s->count;
	memcpy(st->lim, s->lim, sizeof(st->lim));
	/* n against the smallest burst, so that most calls can be taken. */
	uint64_t least = s->lim[0].burst;
	for (size_t i = 1; i < s->count; i++)
		if (s->lim[i].burst < least)
			least = s->lim[i].burst;
	b->lim.burst = least;
	st->n = random_n(b);
	b->lim = s->lim[0];
	for (size_t i = 0; i < s->count; i++) {
		if (st->n > s->lim[i].burst) {
			/* Refused before anything is read or written. */
			ex->err = -E2BIG;
			return true;
		}
	}
	if (set_configure(s, now) != 0) {
		ex->err = -EFAULT;
		return true;
	}
	s->have = s->count;
	if (!b->seen || now > s->clock)
		s->clock = now;
	b->seen = true;
	/*
	 * Every limit of a key sees every call's time (one clock); locally a
	 * refused set leaves the buckets after the one short unexamined, on
	 * clocks of their own, from which their durations would be counted.
	 */
	for (size_t i = 0; i < s->count; i++)
		(void)tokenbucket_tokens_at(s->tb[i], now);
	int err = tokenbucket_allow_all_at(s->tb, s->count, now, st->n, &ex->res);
	if (err != 0) {
		ex->err = -EFAULT;
		return true;
	}
	if (!ex->res.allowed) {
		/* The script reports the lowest limit short of n; the local call may name another. */
		for (size_t i = 0; i < s->count; i++) {
			struct tokenbucket_result one;
			if (tokenbucket_allow_result_at(s->tb[i], now, 0, &one) != 0) {
				ex->err = -EFAULT;
				return true;
			}
			if (one.remaining < st->n) {
				ex->res.index = i;
				ex->res.limit = one.limit;
				ex->res.remaining = one.remaining;
				break;
			}
		}
	}
	return true;
}
