/* SPDX-License-Identifier: MIT */
/*
 * Life cycle and the writers: rate changes, burst changes and reset.
 * Writers hold tb->writer, so at most one runs at a time; they stay correct
 * while any number of lock-free calls run beside them.  A rate change or a
 * reset publishes a new regime in the spare slot and switches the claim
 * marker to it with one compare-and-swap; claims computed under the old
 * regime then fail and are redone under the new one.
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

static void store_slot(struct tb__slot *s, const struct tb__rate *r)
{
	/* Readers validate against the regime mirror, stored before this (see tb__view). */
	atomic_thread_fence(memory_order_release);
	atomic_store_explicit(&s->origin, r->origin, memory_order_relaxed);
	atomic_store_explicit(&s->p, r->p, memory_order_relaxed);
	atomic_store_explicit(&s->q, r->q, memory_order_relaxed);
	atomic_store_explicit(&s->kind, r->kind, memory_order_relaxed);
}

/* After the marker switched to n: make the mirrors follow. */
static void publish_regime(struct tokenbucket *tb, const struct tb__marker *n, enum tb__kind kind)
{
	atomic_store(&tb->regime, n->regime);
	atomic_store(&tb->kind, kind);
	/* Unlimited means full: INF takes nothing, so the bucket stays so. */
	if (kind == TB__INF)
		tb__credit(tb, UINT64_MAX, atomic_load(&tb->tail));
}

static int bucket_new(struct tokenbucket **tbp, enum tb__kind kind, uint64_t p, uint64_t q,
		      uint64_t burst, unsigned flags)
{
	if (flags & ~TOKENBUCKET_CAPPED_RELEASE)
		return -EINVAL;
	if (burst > TOKENBUCKET_BURST_MAX)
		return -ERANGE;
	struct tokenbucket *tb = aligned_alloc(alignof(struct tokenbucket), sizeof(*tb));
	if (tb == NULL)
		return -ENOMEM;
	memset(tb, 0, sizeof(*tb));
	int err = pthread_mutex_init(&tb->writer, NULL);
	if (err) {
		free(tb);
		return -err;
	}
	/* Full, with no time seen: the first call that passes a time fixes the clock. */
	atomic_init(&tb->tail, 0);
	atomic_init(&tb->head, burst);
	atomic_init(&tb->ceil, burst);
	atomic_init(&tb->clock, TB__NO_TIME);
	atomic_init(&tb->burst, burst);
	atomic_init(&tb->threshold, 1);
	atomic_init(&tb->kind, kind);
	tb->flags = flags;
	tb->marker = (struct tb__marker){ TB__NO_TIME, 0 }; /* not yet shared */
	atomic_init(&tb->regime, 0);
	for (int i = 0; i < 2; i++) {
		atomic_init(&tb->slot[i].origin, TB__NO_TIME);
		atomic_init(&tb->slot[i].p, p);
		atomic_init(&tb->slot[i].q, q);
		atomic_init(&tb->slot[i].kind, kind);
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
 * Switches to a new rate at the latest time seen, at least now.  Tokens the
 * old rate produced up to that time are credited first.  A claim under the
 * old regime always follows the clock's record of its time, so if the clock
 * still reads "at" when the marker switches, no claim reached beyond "at".
 */
static void change_rate(struct tokenbucket *tb, int64_t now, enum tb__kind kind, uint64_t p,
			uint64_t q)
{
	int64_t at = tb__observe(tb, now);
	struct tb__marker m, n;
	for (;;) {
		tb__produce(tb, at, 1);
		m = tb__marker_load(tb);
		int64_t seen = atomic_load(&tb->clock);
		if (seen > at) {
			at = seen;
			continue;
		}
		struct tb__rate old, new = { .origin = at, .p = p, .q = q, .kind = kind };
		tb__load_slot(&tb->slot[m.regime & 1], &old);
		if (m.next != TB__NO_TIME)
			new.origin = tb__carry_origin(&old, &new, at);
		n = (struct tb__marker){ tb__time_of(&new, at, 1), m.regime + 1 };
		store_slot(&tb->slot[n.regime & 1], &new);
		if (tb__marker_cas(tb, &m, n))
			break;
	}
	publish_regime(tb, &n, kind);
}

int tokenbucket_set_rate_at(struct tokenbucket *tb, int64_t now, double rate)
{
	if (tb == NULL || isnan(rate) || rate < 0)
		return -EINVAL;
	uint64_t p, q;
	enum tb__kind kind = tb__ratio_from_rate(rate, &p, &q);
	pthread_mutex_lock(&tb->writer);
	change_rate(tb, now, kind, p, q);
	pthread_mutex_unlock(&tb->writer);
	return 0;
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
	pthread_mutex_lock(&tb->writer);
	change_rate(tb, now, kind, p, q);
	pthread_mutex_unlock(&tb->writer);
	return 0;
}

int tokenbucket_set_burst_at(struct tokenbucket *tb, int64_t now, uint64_t burst)
{
	if (tb == NULL)
		return -EINVAL;
	if (burst > TOKENBUCKET_BURST_MAX)
		return -ERANGE;
	pthread_mutex_lock(&tb->writer);
	tb__advance(tb, now);
	uint64_t old = atomic_load(&tb->burst);
	atomic_store(&tb->burst, burst);
	uint64_t max_threshold = burst ? burst : 1;
	if (atomic_load(&tb->threshold) > max_threshold)
		atomic_store(&tb->threshold, max_threshold);
	if (tb__unlimited(tb))
		tb__credit(tb, UINT64_MAX, atomic_load(&tb->tail));
	/* Tokens above the new burst are dropped by taking them. */
	uint64_t dropped = 0, tail = atomic_load(&tb->tail);
	for (;;) {
		uint64_t head = atomic_load(&tb->head);
		if (tb__level(head, tail) <= (int64_t)burst)
			break;
		if (atomic_compare_exchange_weak(&tb->tail, &tail, head - burst)) {
			dropped = head - burst - tail;
			break;
		}
	}
	/* Capped release: ceil - tail stays burst minus what is in flight. */
	if (tb->flags & TOKENBUCKET_CAPPED_RELEASE)
		atomic_fetch_add(&tb->ceil, burst - old + dropped);
	pthread_mutex_unlock(&tb->writer);
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
	pthread_mutex_lock(&tb->writer);
	uint64_t burst = atomic_load(&tb->burst); /* stable: set_burst needs the lock */
	if (tokens > burst) {
		pthread_mutex_unlock(&tb->writer);
		return -EINVAL;
	}
	/* Unlimited means full, whatever level was asked for (see publish_regime). */
	if (tb__unlimited(tb))
		tokens = burst;
	atomic_store(&tb->clock, now);
	struct tb__marker m = tb__marker_load(tb), n;
	for (;;) {
		struct tb__rate r;
		tb__load_slot(&tb->slot[m.regime & 1], &r);
		r.origin = now;
		n = (struct tb__marker){ tb__time_of(&r, now, 1), m.regime + 1 };
		store_slot(&tb->slot[n.regime & 1], &r);
		if (tb__marker_cas(tb, &m, n))
			break;
		/* m now holds the marker a concurrent claim left; retry from it. */
	}
	publish_regime(tb, &n, (enum tb__kind)atomic_load(&tb->kind));
	/*
	 * Set the level by moving a rover forward only, so that concurrent
	 * takes either see the old state and fail their CAS, or the new one;
	 * every outstanding ticket ends up covered.
	 */
	uint64_t tail = atomic_load(&tb->tail), head = atomic_load(&tb->head);
	for (;;) {
		if (tb__level(head, tail) <= (int64_t)tokens) {
			if (atomic_compare_exchange_weak(&tb->head, &head, tail + tokens))
				break;
			tail = atomic_load(&tb->tail);
		} else {
			if (atomic_compare_exchange_weak(&tb->tail, &tail, head - tokens))
				break;
			head = atomic_load(&tb->head);
		}
	}
	if (tb->flags & TOKENBUCKET_CAPPED_RELEASE)
		atomic_store(&tb->ceil, atomic_load(&tb->tail) + burst);
	pthread_mutex_unlock(&tb->writer);
	return 0;
}

double tokenbucket_rate(const struct tokenbucket *tb)
{
	if (tb == NULL)
		return NAN;
	struct tb__rate r;
	struct tb__marker m;
	tb__view(tb, &r, &m);
	return tb__rate_value(&r);
}

uint64_t tokenbucket_burst(const struct tokenbucket *tb)
{
	return tb ? atomic_load_explicit(&tb->burst, memory_order_relaxed) : 0;
}
