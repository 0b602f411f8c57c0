/* SPDX-License-Identifier: MIT */
/*
 * The Seastar face: grab a ticket, wait until it is covered, replenish from a
 * timer, release on completion.  Replenishment happens only when asked.
 * All functions are lock-free and may run in any number of threads at once.
 */
#include <errno.h>

#include "internal.h"

uint64_t tokenbucket_grab(struct tokenbucket *tb, uint64_t n)
{
	if (tb == NULL)
		return 0;
	uint64_t tail = atomic_load_explicit(&tb->tail, memory_order_relaxed);
	if (tb__unlimited(tb))
		return tail;
	uint64_t burst = atomic_load_explicit(&tb->burst, memory_order_relaxed);
	for (;;) {
		uint64_t head = atomic_load_explicit(&tb->head, memory_order_acquire);
		uint64_t base = tb__take_base(head, tail, burst);
		/* The most this grab may take before the debt passes TOKENBUCKET_DEBT_MAX. */
		int64_t most = tb__level(head, base) + (int64_t)TOKENBUCKET_DEBT_MAX;
		uint64_t take = most <= 0 ? 0 : n < (uint64_t)most ? n : (uint64_t)most;
		if (atomic_compare_exchange_weak(&tb->tail, &tail, base + take))
			return base + take;
	}
}

uint64_t tokenbucket_deficiency(const struct tokenbucket *tb, uint64_t ticket)
{
	if (tb == NULL)
		return 0;
	int64_t missing =
		tb__level(ticket, atomic_load_explicit(&tb->head, memory_order_acquire));
	return missing > 0 ? (uint64_t)missing : 0;
}

void tokenbucket_replenish(struct tokenbucket *tb, int64_t now)
{
	if (tb == NULL)
		return;
	now = tb__time(now);
	if (atomic_load_explicit(&tb->clock, memory_order_relaxed) == TB__NO_TIME) {
		tb__observe(tb, now); /* the first time passed fixes the clock */
		return;
	}
	if (now < tb__marker_next(tb))
		return;
	tb__produce(tb, now, atomic_load_explicit(&tb->threshold, memory_order_relaxed));
}

int tokenbucket_release(struct tokenbucket *tb, uint64_t n)
{
	if (tb == NULL)
		return -EINVAL;
	if (!(tb->flags & TOKENBUCKET_CAPPED_RELEASE))
		return -ENOTSUP;
	if (n > atomic_load_explicit(&tb->burst, memory_order_relaxed))
		return -EINVAL;
	tb__raise_ceil(tb, n);
	return 0;
}

void tokenbucket_refund(struct tokenbucket *tb, uint64_t n)
{
	if (tb == NULL || tb__unlimited(tb))
		return;
	tb__give_back(tb, n);
}

int64_t tokenbucket_duration_for(const struct tokenbucket *tb, uint64_t tokens)
{
	if (tb == NULL)
		return TOKENBUCKET_NEVER;
	struct tb__rate r;
	struct tb__marker m;
	tb__view(tb, &r, &m);
	return tb__duration(&r, tokens);
}

/* A writer: under tb->writer, so that a set_burst lowering the burst cannot
 * slip between the check and the store and leave threshold above burst. */
int tokenbucket_set_threshold(struct tokenbucket *tb, uint64_t threshold)
{
	if (tb == NULL || threshold == 0)
		return -EINVAL;
	int err = 0;
	pthread_mutex_lock(&tb->writer);
	if (threshold > atomic_load_explicit(&tb->burst, memory_order_relaxed))
		err = -EINVAL;
	else
		atomic_store(&tb->threshold, threshold);
	pthread_mutex_unlock(&tb->writer);
	return err;
}
