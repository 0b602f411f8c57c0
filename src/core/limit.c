/* SPDX-License-Identifier: MIT */
/*
 * 1.2: a rate and burst said one exact way, struct tokenbucket_limit, the
 * core's entry points that take it, and the twins without _at that 1.1
 * lacked.  Each is a front to the code that holds the work (ratio.c,
 * regime.c): a limit means exactly what the same tokens per period_ns means
 * to the _every functions, bit for bit.  Shared buckets take limits in
 * src/shm/limit.c, tables in src/table/limit.c.
 */
#include <errno.h>
#include <math.h>

#include "core.h"

int tb__limit_ratio(const struct tokenbucket_limit *lim, enum tb__kind *kind, uint64_t *p,
		    uint64_t *q)
{
	if (lim->period_ns < 0)
		return -EINVAL;
	if (lim->tokens > 0 && lim->period_ns == 0) {
		*kind = TB__INF;
		*p = 0;
		*q = 1;
		return 0;
	}
	*kind = tb__ratio_from_every(lim->tokens, lim->period_ns, p, q);
	return 0;
}

/* A ratio as a limit says it: {0, 1} for rate 0, {1, 0} for unlimited. */
static struct tokenbucket_limit limit_of(enum tb__kind kind, uint64_t p, uint64_t q,
					 uint64_t burst)
{
	switch (kind) {
	case TB__FINITE:
		return (struct tokenbucket_limit){p, (int64_t)q, burst};
	case TB__ZERO:
		return (struct tokenbucket_limit){0, 1, burst};
	default:
		return (struct tokenbucket_limit){1, 0, burst};
	}
}

int tokenbucket_limit_from_rate(struct tokenbucket_limit *lim, double rate, uint64_t burst)
{
	if (lim == NULL || isnan(rate) || rate < 0)
		return -EINVAL;
	uint64_t p, q;
	enum tb__kind kind = tb__ratio_from_rate(rate, &p, &q);
	*lim = limit_of(kind, p, q, burst);
	return 0;
}

int tokenbucket_get_limit(const struct tokenbucket *tb, struct tokenbucket_limit *lim)
{
	if (tb == NULL || lim == NULL)
		return -EINVAL;
	struct tb__view v;
	tb__view(tb, &v);
	/* Shared memory is input: a finite rate's period must fit period_ns. */
	if (v.kind == TB__FINITE ? v.p == 0 || v.q == 0 || v.q > (uint64_t)INT64_MAX
				 : v.kind != TB__ZERO && v.kind != TB__INF)
		return -EBADMSG;
	*lim = limit_of(v.kind, v.p, v.q, atomic_load_explicit(&tb->burst, memory_order_relaxed));
	return 0;
}

int tokenbucket_create_limit(struct tokenbucket **tbp, const struct tokenbucket_limit *lim,
			     unsigned flags)
{
	enum tb__kind kind;
	uint64_t p, q;
	if (tbp == NULL || lim == NULL || tb__limit_ratio(lim, &kind, &p, &q))
		return -EINVAL;
	/* The 1.0 entry points, with the same ratio: nothing is converted twice. */
	if (kind == TB__INF)
		return tokenbucket_create(tbp, TOKENBUCKET_INF, lim->burst, flags);
	return tokenbucket_create_every(tbp, lim->tokens, lim->period_ns, lim->burst, flags);
}

int tokenbucket_reset(struct tokenbucket *tb, uint64_t tokens)
{
	return tokenbucket_reset_at(tb, tb__now(), tokens);
}

int tokenbucket_set_rate_every(struct tokenbucket *tb, uint64_t tokens, int64_t period_ns)
{
	return tokenbucket_set_rate_every_at(tb, tb__now(), tokens, period_ns);
}

int tokenbucket_set_limit_at(struct tokenbucket *tb, int64_t now,
			     const struct tokenbucket_limit *lim)
{
	enum tb__kind kind;
	uint64_t p, q;
	if (tb == NULL || lim == NULL || tb__limit_ratio(lim, &kind, &p, &q))
		return -EINVAL;
	if (lim->burst > TOKENBUCKET_BURST_MAX)
		return -ERANGE;
	int err = tb__writer_lock(tb);
	if (err)
		return err;
	/* Rate first: what the old rate made up to now is credited within the old burst. */
	err = tb__change_rate(tb, now, kind, p, q);
	if (err == 0)
		err = tb__change_burst(tb, now, lim->burst);
	pthread_mutex_unlock(&tb->writer);
	return err;
}

int tokenbucket_set_limit(struct tokenbucket *tb, const struct tokenbucket_limit *lim)
{
	return tokenbucket_set_limit_at(tb, tb__now(), lim);
}
