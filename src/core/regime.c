/* SPDX-License-Identifier: MIT */
/*
 * Life cycle and the writers: rate changes, burst changes and reset.
 * Writers hold tb->writer, so at most one runs at a time; they stay correct
 * while any number of lock-free calls run beside them.
 *
 * A rate change freezes the regime in force (gen odd: production counts up
 * to frozen_at only), reads the clock again, and publishes the new regime
 * from there.  A take that used the unfrozen regime recorded its time in
 * the clock before it looked at gen again (sequentially consistent, both),
 * so the writer's second read of the clock sees that time: no production is
 * counted under two regimes, and a take that saw the freeze counts less
 * than either would.
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "rovers.h"

int tb__bucket_check(uint64_t burst, unsigned flags)
{
	if (flags & ~TOKENBUCKET_CAPPED_RELEASE)
		return -EINVAL;
	if (burst > TOKENBUCKET_BURST_MAX)
		return -ERANGE;
	return 0;
}

int tb__bucket_init(struct tokenbucket *tb, enum tb__kind kind, uint64_t p, uint64_t q,
		    uint64_t burst, unsigned flags, const pthread_mutexattr_t *attr)
{
	if (kind != TB__FINITE) {
		p = 0; /* a regime that produces nothing: F is 0 */
		q = 1;
	}
	memset(tb, 0, sizeof(*tb));
	int err = pthread_mutex_init(&tb->writer, attr);
	if (err)
		return -err;
	/* Full, with no time seen: the first call that passes a time fixes the clock. */
	atomic_init(&tb->tail, 0);
	atomic_init(&tb->head, burst);
	atomic_init(&tb->ceil, burst);
	atomic_init(&tb->clock, TB__NO_TIME);
	atomic_init(&tb->ceiled, TB__NO_TIME);
	atomic_init(&tb->burst, burst);
	atomic_init(&tb->kind, kind);
	tb->flags = flags;
	atomic_init(&tb->gen, 0);
	atomic_init(&tb->frozen_at, 0);
	atomic_init(&tb->threshold, 1);
	for (int i = 0; i < 2; i++) {
		atomic_init(&tb->slot[i].origin, TB__NO_TIME);
		atomic_init(&tb->slot[i].fine0, 0);
		atomic_init(&tb->slot[i].p, p);
		atomic_init(&tb->slot[i].q, q);
		atomic_init(&tb->slot[i].hoff, 0);
		atomic_init(&tb->slot[i].limit, INT64_MIN); /* no origin yet */
		atomic_init(&tb->slot[i].kind, kind);
	}
	return 0;
}

static int bucket_new(struct tokenbucket **tbp, enum tb__kind kind, uint64_t p, uint64_t q,
		      uint64_t burst, unsigned flags)
{
	int err = tb__bucket_check(burst, flags);
	if (err)
		return err;
	struct tokenbucket *tb = aligned_alloc(alignof(struct tokenbucket), sizeof(*tb));
	if (tb == NULL)
		return -ENOMEM;
	err = tb__bucket_init(tb, kind, p, q, burst, flags, NULL);
	if (err) {
		free(tb);
		return err;
	}
	*tbp = tb;
	return 0;
}

int tokenbucket_create(struct tokenbucket **tbp, double rate, uint64_t burst, unsigned flags)
{
	if (tbp == NULL || isnan(rate) || rate < 0)
		return -EINVAL;
	uint64_t p, q;
	enum tb__kind kind = tb__ratio_from_rate(rate, &p, &q);
	return bucket_new(tbp, kind, p, q, burst, flags);
}

int tokenbucket_create_every(struct tokenbucket **tbp, uint64_t tokens, int64_t period_ns,
			     uint64_t burst, unsigned flags)
{
	if (tbp == NULL || (tokens > 0 && period_ns <= 0))
		return -EINVAL;
	uint64_t p, q;
	enum tb__kind kind = tb__ratio_from_every(tokens, period_ns, &p, &q);
	return bucket_new(tbp, kind, p, q, burst, flags);
}

void tokenbucket_free(struct tokenbucket *tb)
{
	if (tb == NULL)
		return;
	pthread_mutex_destroy(&tb->writer);
	free(tb);
}

/*
 * tb__enter for a writer, which holds the lock that normalizing takes:
 * the effective time goes to *at.  Normalizing moves the horizon past it
 * in a round or two; false (the bucket marked corrupt) if the words keep
 * it from doing so.
 */
static bool writer_enter(struct tokenbucket *tb, int64_t now, struct tb__view *v, int64_t *at)
{
	for (int round = 0;; round++) {
		if (round == TB__ROUNDS_MAX)
			return tb__give_up(tb);
		tb__view(tb, v);
		*at = tb__observe(tb, now);
		if (!tb__past_horizon(v, *at))
			break;
		tb__normalize_locked(tb, *at);
	}
	if (tb__capped(tb))
		tb__cap_to_ceil(tb, v, *at);
	return true;
}

/*
 * Switches to a new rate at the latest time seen, at least now (see the
 * top).  0, or -EBADMSG for a corrupt bucket.
 */
int tb__change_rate(struct tokenbucket *tb, int64_t now, enum tb__kind kind, uint64_t p,
		    uint64_t q)
{
	struct tb__view old;
	int64_t at;
	if (!writer_enter(tb, now, &old, &at))
		return -EBADMSG;
	tb__drop(tb, &old, at, atomic_load(&tb->burst));
	atomic_store(&tb->frozen_at, at);
	atomic_store(&tb->gen, old.gen + 1);
	int64_t seen = atomic_load(&tb->clock);
	if (seen > at) {
		/* Takes used the old rate up to seen: it ends there. */
		at = seen;
		if (tb__capped(tb))
			tb__cap_to_ceil(tb, &old, at);
		tb__drop(tb, &old, at, atomic_load(&tb->burst));
	}
	if (kind != TB__FINITE) {
		p = 0; /* a regime that produces nothing: F is 0 */
		q = 1;
	}
	struct tb__view n = {
		.origin = at,
		.fine0 = old.kind == TB__FINITE && kind == TB__FINITE ? tb__carry(&old, p, q, at) : 0,
		.p = p,
		.q = q,
		.hoff = old.hoff + (uint64_t)tb__production(&old, at),
		.kind = kind,
	};
	n.limit = tb__limit(at, p, q, n.fine0);
	tb__publish(tb, &n);
	if (kind == TB__INF) {
		n.until = TOKENBUCKET_NEVER;
		tb__fill(tb, &n, at);
	}
	return 0;
}

int tokenbucket_set_rate_at(struct tokenbucket *tb, int64_t now, double rate)
{
	if (tb == NULL || isnan(rate) || rate < 0)
		return -EINVAL;
	uint64_t p, q;
	enum tb__kind kind = tb__ratio_from_rate(rate, &p, &q);
	int err = tb__writer_lock(tb);
	if (err)
		return err;
	err = tb__change_rate(tb, now, kind, p, q);
	pthread_mutex_unlock(&tb->writer);
	return err;
}

int tokenbucket_set_rate(struct tokenbucket *tb, double rate)
{
	return tokenbucket_set_rate_at(tb, tb__now(), rate);
}

int tokenbucket_set_rate_every_at(struct tokenbucket *tb, int64_t now, uint64_t tokens,
				  int64_t period_ns)
{
	if (tb == NULL || (tokens > 0 && period_ns <= 0))
		return -EINVAL;
	uint64_t p, q;
	enum tb__kind kind = tb__ratio_from_every(tokens, period_ns, &p, &q);
	int err = tb__writer_lock(tb);
	if (err)
		return err;
	err = tb__change_rate(tb, now, kind, p, q);
	pthread_mutex_unlock(&tb->writer);
	return err;
}

int tokenbucket_set_burst_at(struct tokenbucket *tb, int64_t now, uint64_t burst)
{
	if (tb == NULL)
		return -EINVAL;
	if (burst > TOKENBUCKET_BURST_MAX)
		return -ERANGE;
	int err = tb__writer_lock(tb);
	if (err)
		return err;
	err = tb__change_burst(tb, now, burst);
	pthread_mutex_unlock(&tb->writer);
	return err;
}

int tb__change_burst(struct tokenbucket *tb, int64_t now, uint64_t burst)
{
	struct tb__view v;
	int64_t at;
	if (!writer_enter(tb, now, &v, &at))
		return -EBADMSG;
	/* What lies above the old burst was lost at that burst: a higher one does not bring it back. */
	uint64_t old = atomic_load(&tb->burst);
	tb__drop(tb, &v, at, old);
	atomic_store(&tb->burst, burst);
	uint64_t max_threshold = burst ? burst : 1;
	if (atomic_load(&tb->threshold) > max_threshold)
		atomic_store(&tb->threshold, max_threshold);
	if (tb__unlimited(tb))
		tb__fill(tb, &v, at);
	/* Tokens above the new burst are dropped by taking them. */
	tb__drop(tb, &v, at, burst);
	/* Capped release: ceil - tail stays burst minus what is in flight. */
	if (tb__capped(tb))
		atomic_fetch_add(&tb->ceil, burst - old);
	return 0;
}

int tokenbucket_set_burst(struct tokenbucket *tb, uint64_t burst)
{
	return tokenbucket_set_burst_at(tb, tb__now(), burst);
}

int tokenbucket_reset_at(struct tokenbucket *tb, int64_t now, uint64_t tokens)
{
	if (tb == NULL)
		return -EINVAL;
	now = tb__time(now);
	int err = tb__writer_lock(tb);
	if (err)
		return err;
	uint64_t burst = atomic_load(&tb->burst); /* stable: set_burst needs the lock */
	if (tokens > burst) {
		pthread_mutex_unlock(&tb->writer);
		return -EINVAL;
	}
	/* Unlimited means full, whatever level was asked for. */
	if (tb__unlimited(tb))
		tokens = burst;
	/*
	 * Freeze the regime at the clock as it stands: production after it is
	 * forgotten, and takes racing the reset see none.
	 */
	struct tb__view old;
	tb__view(tb, &old);
	int64_t seen = atomic_load(&tb->clock);
	atomic_store(&tb->frozen_at, seen);
	atomic_store(&tb->gen, old.gen + 1);
	old.until = seen;
	atomic_store(&tb->clock, now);
	/*
	 * Set the level by moving a rover forward only: the tail up if the
	 * bucket holds more than tokens, else the head (the new hoff).  Either
	 * way every outstanding ticket ends up covered.
	 */
	uint64_t tail = atomic_load(&tb->tail), head;
	for (;;) {
		TB__ROUND();
		head = atomic_load(&tb->head);
		int64_t level = tb__capped_level(tb__raw_level(&old, head, tail, seen), burst);
		if (level <= (int64_t)tokens)
			break;
		uint64_t down = tail + (uint64_t)(level - (int64_t)tokens);
		if (atomic_compare_exchange_weak(&tb->tail, &tail, down)) {
			tail = down;
			break;
		}
	}
	struct tb__view n = {
		.origin = now,
		.fine0 = 0,
		.p = old.p,
		.q = old.q,
		.hoff = tail + tokens - head,
		.kind = old.kind,
	};
	n.limit = tb__limit(now, n.p, n.q, 0);
	tb__publish(tb, &n);
	if (tb__capped(tb)) {
		atomic_store(&tb->ceil, atomic_load(&tb->tail) + burst);
		atomic_store(&tb->ceiled, now);
	}
	pthread_mutex_unlock(&tb->writer);
	return 0;
}

double tokenbucket_rate(const struct tokenbucket *tb)
{
	if (tb == NULL)
		return NAN;
	struct tb__view v;
	tb__view(tb, &v);
	return tb__rate_value(&v);
}

uint64_t tokenbucket_burst(const struct tokenbucket *tb)
{
	return tb ? atomic_load_explicit(&tb->burst, memory_order_relaxed) : 0;
}
