/* SPDX-License-Identifier: MIT */
/*
 * 1.2: a rate and burst said one exact way, struct tokenbucket_limit, the
 * entry points that take it, and the twins without _at that 1.1 lacked.
 * Each is a front to the code that holds the work (ratio.c, regime.c,
 * shared.c, table.c): a limit means exactly what the same tokens per
 * period_ns means to the _every functions, bit for bit.
 */
#include <errno.h>
#include <math.h>

#include "internal.h"

/*
 * The rate of a limit as a bucket stores it: kind, and p/q in lowest terms
 * (0/1 unless finite).  -EINVAL for a period no rate has.
 */
static int limit_ratio(const struct tokenbucket_limit *lim, enum tb__kind *kind, uint64_t *p,
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
	if (tbp == NULL || lim == NULL || limit_ratio(lim, &kind, &p, &q))
		return -EINVAL;
	/* The 1.0 entry points, with the same ratio: nothing is converted twice. */
	if (kind == TB__INF)
		return tokenbucket_create(tbp, TOKENBUCKET_INF, lim->burst, flags);
	return tokenbucket_create_every(tbp, lim->tokens, lim->period_ns, lim->burst, flags);
}

int tokenbucket_init_shared_limit(struct tokenbucket **tbp, void *mem, size_t size,
				  const struct tokenbucket_limit *lim, unsigned flags)
{
	enum tb__kind kind;
	uint64_t p, q;
	if (tbp == NULL || lim == NULL || limit_ratio(lim, &kind, &p, &q))
		return -EINVAL;
	return tb__init_shared(tbp, mem, size, kind, p, q, lim->burst, flags);
}

int tokenbucket_open_limit(struct tokenbucket **tbp, const char *name,
			   const struct tokenbucket_limit *lim, unsigned flags, unsigned mode,
			   unsigned *status)
{
	enum tb__kind kind;
	uint64_t p, q;
	if (tbp == NULL || lim == NULL || limit_ratio(lim, &kind, &p, &q))
		return -EINVAL;
	return tb__open(tbp, name, kind, p, q, lim->burst, flags, mode, status);
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
	if (tb == NULL || lim == NULL || limit_ratio(lim, &kind, &p, &q))
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

/*
 * The tokens and period_ns a table function gets for a limit: a table has
 * no unlimited rate, so such a limit goes as the fastest ratio there is,
 * which the table functions refuse with -ERANGE after every -EINVAL of the
 * other arguments.  -EINVAL for lim NULL or a negative period.
 */
static int table_ratio(const struct tokenbucket_limit *lim, uint64_t *tokens, int64_t *period_ns)
{
	if (lim == NULL || lim->period_ns < 0)
		return -EINVAL;
	bool unlimited = lim->tokens > 0 && lim->period_ns == 0;
	*tokens = unlimited ? UINT64_MAX : lim->tokens;
	*period_ns = unlimited ? 1 : lim->period_ns;
	return 0;
}

int tokenbucket_table_create_limit(struct tokenbucket_table **tp,
				   const struct tokenbucket_limit *lim, uint64_t capacity,
				   unsigned flags)
{
	uint64_t tokens;
	int64_t period;
	if (tp == NULL || table_ratio(lim, &tokens, &period))
		return -EINVAL;
	return tokenbucket_table_create(tp, tokens, period, lim->burst, capacity, flags);
}

int tokenbucket_table_init_shared_limit(struct tokenbucket_table **tp, void *mem, size_t size,
					const struct tokenbucket_limit *lim, uint64_t capacity,
					unsigned flags)
{
	uint64_t tokens;
	int64_t period;
	if (tp == NULL || table_ratio(lim, &tokens, &period))
		return -EINVAL;
	return tokenbucket_table_init_shared(tp, mem, size, tokens, period, lim->burst, capacity,
					     flags);
}

int tokenbucket_table_open_limit(struct tokenbucket_table **tp, const char *name,
				 const struct tokenbucket_limit *lim, uint64_t capacity,
				 unsigned flags, unsigned mode, unsigned *status)
{
	uint64_t tokens;
	int64_t period;
	if (tp == NULL || table_ratio(lim, &tokens, &period))
		return -EINVAL;
	return tokenbucket_table_open(tp, name, tokens, period, lim->burst, capacity, flags, mode,
				      status);
}
