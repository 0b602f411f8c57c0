/* SPDX-License-Identifier: MIT */
/*
 * The reference model of one bucket.  Everything happens under one mutex,
 * in one obvious step after another; the point is to be easy to check
 * against the header and the manual, not to be fast or lock-free.
 *
 * Production in the current regime is a function of time:
 *   F(t) = (t - start) * p + fine0   fine units (q fine units = 1 token)
 *   P(t) = floor(F(t) / q)           whole tokens
 * (t - start) < 2^64 and p < 2^64, and fine0 < q <= 2^63, so F fits in
 * unsigned 128 bits.  The tokens not yet claimed at t are P(t) - P(claimed).
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>

#include "model.h"

typedef unsigned __int128 u128;
typedef __int128 i128;

#define LOCK(m) pthread_mutex_lock(&(m)->lock)
#define UNLOCK(m) pthread_mutex_unlock(&(m)->lock)

/* INT64_MIN means "no time" and INT64_MAX "never": neither is a time seen. */
static int64_t norm_time(int64_t t)
{
	return t == INT64_MIN ? INT64_MIN + 1 : t == INT64_MAX ? INT64_MAX - 1 : t;
}

static int64_t level(const struct model *m)
{
	return (int64_t)(m->head - m->tail);
}

static bool capped(const struct model *m)
{
	return m->flags & TOKENBUCKET_CAPPED_RELEASE;
}

static uint64_t gcd(uint64_t a, uint64_t b)
{
	while (b != 0) {
		uint64_t r = a % b;
		a = b;
		b = r;
	}
	return a;
}

/* Fine units produced by time t >= start in the current regime. */
static u128 fine(const struct model *m, int64_t t)
{
	uint64_t span = (uint64_t)t - (uint64_t)m->start;
	return (u128)span * m->p + m->fine0;
}

static u128 produced(const struct model *m, int64_t t)
{
	if (m->kind != MODEL_FINITE)
		return 0;
	return fine(m, t) / m->q;
}

/* Whole tokens produced after the claimed point, up to t. */
static u128 unclaimed(const struct model *m, int64_t t)
{
	if (!m->has_time || t <= m->claimed)
		return 0;
	return produced(m, t) - produced(m, m->claimed);
}

/* Records a time: the first one fixes the clock and starts production. */
static int64_t observe(struct model *m, int64_t now)
{
	now = norm_time(now);
	if (!m->has_time) {
		m->has_time = true;
		m->clock = now;
		m->start = now;
		m->fine0 = 0;
		m->claimed = now;
		return now;
	}
	if (now > m->clock)
		m->clock = now;
	return m->clock;
}

#define DROP_MOST (UINT64_C(1) << 61)

/*
 * Credits k produced tokens: what ceil holds back (capped) is lost; what lies
 * beyond burst is dropped by moving tail and ceil up with the head.
 */
static void credit(struct model *m, u128 k)
{
	if (capped(m)) {
		int64_t to_ceil = (int64_t)(m->ceil - m->head);
		if (to_ceil <= 0)
			return;
		if (k > (u128)to_ceil)
			k = (u128)to_ceil;
	}
	u128 room = (u128)((i128)m->burst - level(m)); /* level <= burst */
	if (k <= room) {
		m->head += (uint64_t)k;
		return;
	}
	/*
	 * The rovers move up by at most 2^61 for a drop, so that older tickets
	 * stay comparable; more than that is lost without moving them.
	 */
	u128 d = k - room;
	uint64_t moved = d < DROP_MOST ? (uint64_t)d : DROP_MOST;
	m->head += (uint64_t)room + moved;
	m->tail += moved;
	if (capped(m))
		m->ceil += moved;
}

/* An unlimited rate fills the bucket: head up to burst, and capped, to ceil. */
static void fill(struct model *m)
{
	i128 room = (i128)m->burst - level(m);
	if (capped(m)) {
		i128 to_ceil = (int64_t)(m->ceil - m->head);
		if (to_ceil < room)
			room = to_ceil;
	}
	if (room > 0)
		m->head += (uint64_t)room;
}

/* Claims what is produced up to t if it is at least threshold tokens. */
static void claim(struct model *m, int64_t t, uint64_t threshold)
{
	u128 k = unclaimed(m, t);
	if (k == 0 || k < threshold)
		return;
	observe(m, t);
	m->claimed = t;
	credit(m, k);
}

/* What every Go-face call does first. */
static int64_t advance(struct model *m, int64_t now)
{
	int64_t t = observe(m, now);
	claim(m, t, 1);
	return t;
}

static void raise_ceil(struct model *m, uint64_t n)
{
	int64_t room = (int64_t)(m->tail + m->burst - m->ceil);
	if (room <= 0)
		return;
	m->ceil += n < (uint64_t)room ? n : (uint64_t)room;
}

/*
 * The give-back rule (docs/core.md, "Giving back"), for refund, cancel and
 * a set's refused take: add at head within burst; capped, the ceiling
 * follows.
 */
static void give_back(struct model *m, uint64_t n)
{
	i128 room = (i128)m->burst - level(m);
	if (room <= 0 || n == 0)
		return;
	uint64_t add = (u128)n < (u128)room ? n : (uint64_t)room;
	m->head += add;
	if (capped(m))
		raise_ceil(m, add);
}

/*
 * The first time t >= at with P(t) >= P(at) + debt.  With rem = F(at) mod q,
 * P(at + w) >= P(at) + debt exactly when w * p >= debt * q - rem.
 */
static int64_t covered_at(const struct model *m, int64_t at, uint64_t debt)
{
	if (m->kind != MODEL_FINITE)
		return TOKENBUCKET_NEVER;
	u128 rem = fine(m, at) % m->q;
	u128 need = (u128)debt * m->q - rem;
	u128 w = (need + m->p - 1) / m->p;
	if (w > (u128)((uint64_t)INT64_MAX - (uint64_t)at))
		return TOKENBUCKET_NEVER;
	return (int64_t)((uint64_t)at + (uint64_t)w);
}

/* Starts a new regime at time at; the claimed point is at. */
static void start_regime(struct model *m, int64_t at, enum model_kind kind, uint64_t p,
			 uint64_t q, uint64_t fine0)
{
	m->kind = kind;
	m->p = p;
	m->q = q;
	m->start = at;
	m->fine0 = fine0;
	m->claimed = at;
}

/*
 * The documented read-back of p tokens every q ns as tokens per second: one
 * correctly rounded division when p * 1e9 and q are below 2^53, else the
 * quotient in long double rounded to double.
 */
static double read_back(uint64_t p, uint64_t q)
{
	const uint64_t exact = (uint64_t)1 << 53;
	if (p < exact / 1000000000 && q < exact)
		return (double)(p * 1000000000) / (double)q;
	return (double)((long double)p * 1e9L / (long double)q);
}

/*
 * Exact continued fraction of num/den (both > 0): convergents h/k with
 * 1 <= h <= UINT64_MAX, k <= INT64_MAX; the first that reads back as rate;
 * failing that, the last one.
 */
static void convergent(double rate, u128 num, u128 den, uint64_t *p, uint64_t *q)
{
	u128 h0 = 0, h1 = 1, k0 = 1, k1 = 0;
	uint64_t bp = 1, bq = INT64_MAX;
	while (den != 0) {
		u128 a = num / den;
		if (a > UINT64_MAX)
			break; /* h would pass UINT64_MAX: h1 >= 1 once a term is taken */
		u128 h2 = a * h1 + h0, k2 = a * k1 + k0;
		if (h2 > UINT64_MAX || k2 > INT64_MAX)
			break;
		h0 = h1, h1 = h2, k0 = k1, k1 = k2;
		if (h1 != 0) {
			bp = (uint64_t)h1;
			bq = (uint64_t)k1;
			if (read_back(bp, bq) == rate)
				break;
		}
		u128 r = num % den;
		num = den;
		den = r;
	}
	*p = bp;
	*q = bq;
}

enum model_kind model_ratio_from_rate(double rate, uint64_t *p, uint64_t *q)
{
	if (rate == 0) {
		*p = 0;
		*q = 1;
		return MODEL_ZERO;
	}
	if (rate >= 0x1.fffffffffffffp+1023) { /* DBL_MAX and up */
		*p = 1;
		*q = 0;
		return MODEL_INF;
	}
	/* rate = mant * 2^e exactly; rate / 1e9 = num / den exactly. */
	int e;
	double f = frexp(rate, &e);
	uint64_t mant = (uint64_t)ldexp(f, 53);
	e -= 53;
	u128 num, den;
	if (e >= 0) {
		if (e > 127 - 53) { /* >= 2^126 tokens/s: far above UINT64_MAX per ns */
			*p = UINT64_MAX;
			*q = 1;
			return MODEL_FINITE;
		}
		num = (u128)mant << e;
		den = 1000000000;
	} else {
		if (-e > 127 - 30) { /* < 2^-45 tokens/s: far below 1 per INT64_MAX ns */
			*p = 1;
			*q = INT64_MAX;
			return MODEL_FINITE;
		}
		num = mant;
		den = (u128)1000000000 << -e;
	}
	/* Slower than 1 token per INT64_MAX ns: num / den <= 1 / INT64_MAX. */
	if (num <= den / INT64_MAX) {
		*p = 1;
		*q = INT64_MAX;
		return MODEL_FINITE;
	}
	/* Faster than UINT64_MAX tokens per ns. */
	if (num / den >= UINT64_MAX) {
		*p = UINT64_MAX;
		*q = 1;
		return MODEL_FINITE;
	}
	convergent(rate, num, den, p, q);
	return MODEL_FINITE;
}

static enum model_kind ratio_from_every(uint64_t tokens, int64_t period_ns, uint64_t *p,
					uint64_t *q)
{
	if (tokens == 0) {
		*p = 0;
		*q = 1;
		return MODEL_ZERO;
	}
	uint64_t g = gcd(tokens, (uint64_t)period_ns);
	*p = tokens / g;
	*q = (uint64_t)period_ns / g;
	return MODEL_FINITE;
}

static int model_new(struct model **mp, enum model_kind kind, uint64_t p, uint64_t q,
		     uint64_t burst, unsigned flags)
{
	if (flags & ~TOKENBUCKET_CAPPED_RELEASE)
		return -EINVAL;
	if (burst > TOKENBUCKET_BURST_MAX)
		return -ERANGE;
	struct model *m = calloc(1, sizeof(*m));
	if (m == NULL)
		return -ENOMEM;
	pthread_mutex_init(&m->lock, NULL);
	m->kind = kind;
	m->p = p;
	m->q = q;
	/* Full, no time seen; the ceiling starts where the tokens end. */
	m->tail = 0;
	m->head = burst;
	m->ceil = burst;
	m->burst = burst;
	m->threshold = 1;
	m->flags = flags;
	*mp = m;
	return 0;
}

int model_create(struct model **mp, double rate, uint64_t burst, unsigned flags)
{
	if (mp == NULL || isnan(rate) || rate < 0)
		return -EINVAL;
	uint64_t p, q;
	enum model_kind kind = model_ratio_from_rate(rate, &p, &q);
	return model_new(mp, kind, p, q, burst, flags);
}

int model_create_every(struct model **mp, uint64_t tokens, int64_t period_ns, uint64_t burst,
		       unsigned flags)
{
	if (mp == NULL || (tokens > 0 && period_ns <= 0))
		return -EINVAL;
	uint64_t p, q;
	enum model_kind kind = ratio_from_every(tokens, period_ns, &p, &q);
	return model_new(mp, kind, p, q, burst, flags);
}

void model_free(struct model *m)
{
	if (m == NULL)
		return;
	pthread_mutex_destroy(&m->lock);
	free(m);
}

bool model_allow_at(struct model *m, int64_t now, uint64_t n)
{
	if (m == NULL)
		return false;
	LOCK(m);
	bool ok = false;
	if (n > m->burst && m->kind != MODEL_INF)
		goto out; /* refused before looking at now */
	advance(m, now);
	if (m->kind == MODEL_INF) {
		ok = true;
	} else if ((i128)level(m) >= (i128)n) {
		m->tail += n;
		ok = true;
	}
out:
	UNLOCK(m);
	return ok;
}

int model_reserve_at(struct model *m, int64_t now, uint64_t n, int64_t max_wait,
		     struct tokenbucket_reservation *r)
{
	if (m == NULL || r == NULL)
		return -EINVAL;
	LOCK(m);
	int err = 0;
	if (n > m->burst && m->kind != MODEL_INF) {
		err = -E2BIG;
		goto out;
	}
	int64_t at = advance(m, now);
	if (m->kind == MODEL_INF) {
		*r = (struct tokenbucket_reservation){ .time_to_act = at, .tokens = 0, .ticket = m->tail };
		goto out;
	}
	i128 debt = (i128)n - level(m); /* the debt after taking n */
	if (debt > (i128)TOKENBUCKET_DEBT_MAX) {
		err = -EOVERFLOW;
		goto out;
	}
	int64_t act = debt > 0 ? covered_at(m, at, (uint64_t)debt) : at;
	/* The wait is a time span and may exceed INT64_MAX; NEVER means no limit. */
	i128 wait = 0;
	if (debt > 0)
		wait = act == TOKENBUCKET_NEVER ? (i128)TOKENBUCKET_NEVER : (i128)act - at;
	if (max_wait != TOKENBUCKET_NEVER && wait > max_wait) {
		err = -ETIMEDOUT;
		goto out;
	}
	m->tail += n;
	*r = (struct tokenbucket_reservation){ .time_to_act = act, .tokens = n, .ticket = m->tail };
out:
	UNLOCK(m);
	return err;
}

void model_cancel_at(struct model *m, struct tokenbucket_reservation *r, int64_t now)
{
	if (m == NULL || r == NULL)
		return;
	LOCK(m);
	uint64_t n = r->tokens;
	r->tokens = 0;
	if (n != 0 && m->kind != MODEL_INF) {
		/* At time_to_act itself it is not too late. */
		if (advance(m, now) <= r->time_to_act)
			give_back(m, n);
	}
	UNLOCK(m);
}

/* The exact value is level + rem / q, never above burst; rounded once to double. */
double model_tokens_at(struct model *m, int64_t now)
{
	if (m == NULL)
		return NAN;
	LOCK(m);
	int64_t t = advance(m, now);
	double v;
	if (m->kind == MODEL_INF) {
		v = (double)m->burst;
	} else {
		int64_t lv = level(m);
		uint64_t rem = 0;
		if (m->kind == MODEL_FINITE)
			rem = (uint64_t)(fine(m, t) % m->q);
		/* Production the ceiling holds back is not counted. */
		if (capped(m) && (int64_t)(m->ceil - m->head) <= 0)
			rem = 0;
		if ((i128)lv > (i128)m->burst || ((i128)lv == (i128)m->burst && rem > 0))
			v = (double)m->burst;
		else if (rem == 0)
			v = (double)lv;
		else
			v = (double)((long double)lv + (long double)rem / (long double)m->q);
	}
	UNLOCK(m);
	return v;
}

/* Credits the old rate up to the change, carries its fraction, starts the new rate. */
static void change_rate(struct model *m, int64_t now, enum model_kind kind, uint64_t p,
			uint64_t q)
{
	int64_t at = advance(m, now);
	uint64_t fine0 = 0;
	if (m->kind == MODEL_FINITE && kind == MODEL_FINITE) {
		/* Time the new rate needs for the old fraction, rounded down to 1 ns. */
		u128 rem = fine(m, at) % m->q;
		u128 carry_ns = rem * q / ((u128)m->q * p);
		/* The time base starts at INT64_MIN + 1: no carry reaches before it. */
		u128 room = (uint64_t)at - (uint64_t)(INT64_MIN + 1);
		if (carry_ns > room)
			carry_ns = room;
		fine0 = (uint64_t)(carry_ns * p);
	}
	start_regime(m, at, kind, p, q, fine0);
	if (kind == MODEL_INF)
		fill(m);
}

int model_set_rate_at(struct model *m, int64_t now, double rate)
{
	if (m == NULL || isnan(rate) || rate < 0)
		return -EINVAL;
	uint64_t p, q;
	enum model_kind kind = model_ratio_from_rate(rate, &p, &q);
	LOCK(m);
	change_rate(m, now, kind, p, q);
	UNLOCK(m);
	return 0;
}

int model_set_rate_every_at(struct model *m, int64_t now, uint64_t tokens, int64_t period_ns)
{
	if (m == NULL || (tokens > 0 && period_ns <= 0))
		return -EINVAL;
	uint64_t p, q;
	enum model_kind kind = ratio_from_every(tokens, period_ns, &p, &q);
	LOCK(m);
	change_rate(m, now, kind, p, q);
	UNLOCK(m);
	return 0;
}

int model_set_burst_at(struct model *m, int64_t now, uint64_t burst)
{
	if (m == NULL)
		return -EINVAL;
	if (burst > TOKENBUCKET_BURST_MAX)
		return -ERANGE;
	LOCK(m);
	advance(m, now); /* credited under the old burst */
	uint64_t old = m->burst;
	m->burst = burst;
	uint64_t most = burst == 0 ? 1 : burst;
	if (m->threshold > most)
		m->threshold = most;
	if (m->kind == MODEL_INF)
		fill(m); /* always full at an unlimited rate */
	uint64_t dropped = 0;
	if (level(m) > (int64_t)burst) {
		dropped = (uint64_t)level(m) - burst;
		m->tail += dropped;
	}
	/* The ceiling moves with the burst; dropped tokens are not in flight. */
	if (capped(m))
		m->ceil += burst - old + dropped;
	UNLOCK(m);
	return 0;
}

int model_reset_at(struct model *m, int64_t now, uint64_t tokens)
{
	if (m == NULL)
		return -EINVAL;
	LOCK(m);
	int err = 0;
	if (tokens > m->burst) {
		err = -EINVAL;
		goto out;
	}
	now = norm_time(now);
	m->has_time = true;
	m->clock = now;
	start_regime(m, now, m->kind, m->p, m->q, 0);
	if (m->kind == MODEL_INF)
		tokens = m->burst; /* an unlimited bucket is always full */
	/* Move one rover forward only. */
	if ((i128)level(m) <= (i128)tokens)
		m->head = m->tail + tokens;
	else
		m->tail = m->head - tokens;
	if (capped(m))
		m->ceil = m->tail + m->burst;
out:
	UNLOCK(m);
	return err;
}

uint64_t model_grab(struct model *m, uint64_t n)
{
	if (m == NULL)
		return 0;
	LOCK(m);
	if (m->kind != MODEL_INF) {
		/* The debt after the grab stays within TOKENBUCKET_DEBT_MAX. */
		i128 most = (i128)level(m) + (i128)TOKENBUCKET_DEBT_MAX;
		uint64_t take = most <= 0 ? 0 : (u128)n < (u128)most ? n : (uint64_t)most;
		m->tail += take;
	}
	uint64_t ticket = m->tail;
	UNLOCK(m);
	return ticket;
}

void model_replenish(struct model *m, int64_t now)
{
	if (m == NULL)
		return;
	LOCK(m);
	if (!m->has_time)
		observe(m, now); /* only fixes the clock */
	else
		claim(m, norm_time(now), m->threshold);
	UNLOCK(m);
}

int model_release(struct model *m, uint64_t n)
{
	if (m == NULL)
		return -EINVAL;
	if (!capped(m))
		return -ENOTSUP;
	LOCK(m);
	int err = 0;
	if (n > m->burst)
		err = -EINVAL;
	else
		raise_ceil(m, n);
	UNLOCK(m);
	return err;
}

void model_refund_at(struct model *m, int64_t now, uint64_t n)
{
	if (m == NULL)
		return;
	LOCK(m);
	/* n 0 changes nothing, the clock included (as cancel_at of 0 tokens). */
	if (n != 0 && m->kind != MODEL_INF) {
		advance(m, now);
		give_back(m, n);
	}
	UNLOCK(m);
}

void model_refund(struct model *m, uint64_t n)
{
	if (m == NULL)
		return;
	LOCK(m);
	if (m->kind != MODEL_INF)
		give_back(m, n);
	UNLOCK(m);
}

uint64_t model_deficiency(struct model *m, uint64_t ticket)
{
	if (m == NULL)
		return 0;
	LOCK(m);
	int64_t missing = (int64_t)(ticket - m->head);
	UNLOCK(m);
	return missing > 0 ? (uint64_t)missing : 0;
}

int model_set_threshold(struct model *m, uint64_t threshold)
{
	if (m == NULL || threshold == 0)
		return -EINVAL;
	LOCK(m);
	int err = 0;
	if (threshold > m->burst)
		err = -EINVAL;
	else
		m->threshold = threshold;
	UNLOCK(m);
	return err;
}

int64_t model_duration_for(struct model *m, uint64_t tokens)
{
	if (m == NULL)
		return TOKENBUCKET_NEVER;
	LOCK(m);
	int64_t d;
	if (tokens == 0 || m->kind == MODEL_INF) {
		d = 0;
	} else if (m->kind == MODEL_ZERO) {
		d = TOKENBUCKET_NEVER;
	} else {
		u128 ns = ((u128)tokens * m->q + m->p - 1) / m->p;
		d = ns >= (u128)INT64_MAX ? TOKENBUCKET_NEVER : (int64_t)ns;
	}
	UNLOCK(m);
	return d;
}

double model_rate(struct model *m)
{
	if (m == NULL)
		return NAN;
	LOCK(m);
	double r;
	if (m->kind == MODEL_INF)
		r = INFINITY;
	else if (m->kind == MODEL_ZERO)
		r = 0;
	else
		r = (double)((long double)m->p * 1e9L / (long double)m->q);
	UNLOCK(m);
	return r;
}

uint64_t model_burst(struct model *m)
{
	if (m == NULL)
		return 0;
	LOCK(m);
	uint64_t b = m->burst;
	UNLOCK(m);
	return b;
}
