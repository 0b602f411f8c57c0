/* SPDX-License-Identifier: MIT */
/*
 * The Seastar face: grab a ticket, wait until it is covered, replenish from a
 * timer, release on completion.  The head counts production up to the clock;
 * replenish moves the clock only once threshold tokens are there.  All
 * functions are lock-free and may run in any number of threads at once.
 */
#include <errno.h>

#include "rovers.h"

/* The general path of grab: any regime, level and debt. */
static uint64_t grab_slow(struct tokenbucket *tb, uint64_t n)
{
	uint64_t tail = atomic_load_explicit(&tb->tail, memory_order_acquire);
	if (tb__unlimited(tb))
		return tail;
	uint64_t burst = atomic_load_explicit(&tb->burst, memory_order_relaxed);
	struct tb__view v;
	int64_t at;
	if (!tb__view_at_clock(tb, &v, &at))
		return tail; /* a corrupt bucket: nothing taken */
	for (;;) {
		TB__ROUND();
		uint64_t head = atomic_load_explicit(&tb->head, memory_order_acquire);
		/* The most a grab may take keeps the debt within DEBT_MAX. */
		int64_t level;
		uint64_t base = tb__take_base(&v, head, tail, burst, at, &level);
		int64_t most = level + (int64_t)TOKENBUCKET_DEBT_MAX;
		uint64_t take = most <= 0 ? 0 : n < (uint64_t)most ? n : (uint64_t)most;
		if (atomic_compare_exchange_weak(&tb->tail, &tail, base + take))
			return base + take;
	}
}

uint64_t tokenbucket_grab(struct tokenbucket *tb, uint64_t n)
{
	if (tb == NULL)
		return 0;
	/* The usual grab, in registers: nothing above burst, the debt far from its bound. */
	uint64_t burst = atomic_load_explicit(&tb->burst, memory_order_relaxed);
	struct tb__view f;
	if (tb__unlimited(tb) || !tb__load_regime(tb, &f))
		goto slow;
	uint64_t tail = atomic_load_explicit(&tb->tail, memory_order_acquire);
	uint64_t head = atomic_load_explicit(&tb->head, memory_order_acquire);
	int64_t at = atomic_load(&tb->clock);
	if (!tb__fast_valid(tb, &f, at))
		goto slow;
	int64_t e = tb__level(head + f.hoff, tail);
	if (e > (int64_t)burst || (tb__i128)n > (tb__i128)e + (tb__i128)TOKENBUCKET_DEBT_MAX ||
	    tb__fine_units(&f, at) >= (tb__u128)(burst + 1 - (uint64_t)e) * f.q)
		goto slow;
	if (atomic_compare_exchange_strong(&tb->tail, &tail, tail + n))
		return tail + n;
slow:
	return grab_slow(tb, n);
}

/* The general path of deficiency. */
static uint64_t deficiency_slow(const struct tokenbucket *tb, uint64_t ticket)
{
	/*
	 * The head at the clock, no more than burst above the tail: what lies
	 * beyond is dropped by the next take, and covers no ticket.  The tail
	 * is read again so that head, tail and view belong together.
	 */
	uint64_t burst = atomic_load_explicit(&tb->burst, memory_order_relaxed);
	uint64_t tail = atomic_load_explicit(&tb->tail, memory_order_acquire);
	int64_t level;
	for (;;) {
		TB__ROUND();
		/* ceiled before head: a cap that lowered head moved ceiled after. */
		int64_t from = tb__capped(tb) ? atomic_load(&tb->ceiled) : 0;
		uint64_t head = atomic_load_explicit(&tb->head, memory_order_acquire);
		struct tb__view v;
		tb__view(tb, &v);
		int64_t at = atomic_load(&tb->clock);
		if (atomic_load(&tb->gen) != v.gen)
			continue; /* a rate change may have ended before "at" (tb__view_at_clock) */
		tb__i128 raw = tb__raw_level(&v, head, tail, at);
		if (tb__capped(tb) && from < at) {
			/*
			 * What tb__cap_to_ceil would leave at "at", unwritten (a
			 * clock mover may be between its two steps): production
			 * since "from" lifts the head no further than ceil, and a
			 * head already above ceil keeps what it had.
			 */
			tb__i128 to_ceil = tb__level(atomic_load(&tb->ceil), tail);
			tb__i128 kept = tb__raw_level(&v, head, tail, from);
			if (raw > to_ceil)
				raw = to_ceil > kept ? to_ceil : kept;
		}
		level = tb__capped_level(raw, burst);
		uint64_t again = atomic_load_explicit(&tb->tail, memory_order_acquire);
		if (again == tail)
			break;
		tail = again;
	}
	int64_t missing = tb__level(ticket, tail + (uint64_t)level);
	return missing > 0 ? (uint64_t)missing : 0;
}

uint64_t tokenbucket_deficiency(const struct tokenbucket *tb, uint64_t ticket)
{
	if (tb == NULL)
		return 0;
	/*
	 * A ticket not past head + hoff is covered, since the head at the clock
	 * is at least that (unless it is above burst over the tail: then the
	 * general path caps it).  Head is read before tail, so e is never more
	 * than the bucket had.
	 */
	uint64_t gen = atomic_load_explicit(&tb->gen, memory_order_acquire);
	const struct tb__slot *s = &tb->slot[(gen >> 1) & 1];
	uint64_t hoff = atomic_load_explicit(&s->hoff, memory_order_relaxed);
	int64_t limit = atomic_load_explicit(&s->limit, memory_order_relaxed);
	uint64_t head = atomic_load_explicit(&tb->head, memory_order_acquire);
	uint64_t tail = atomic_load_explicit(&tb->tail, memory_order_acquire);
	int64_t at = atomic_load(&tb->clock);
	uint64_t burst = atomic_load_explicit(&tb->burst, memory_order_relaxed);
	atomic_thread_fence(memory_order_acquire);
	/*
	 * ticket - head(clock) is ticket - (head + hoff) - P(clock), with
	 * P < 2^61 within the horizon: far from the wrap, no P is needed.
	 */
	int64_t ahead = tb__level(ticket, head + hoff);
	if (atomic_load(&tb->gen) == gen && (at < limit || at == TB__NO_TIME) &&
	    tb__level(head + hoff, tail) <= (int64_t)burst && ahead <= 0 && ahead > INT64_MIN / 2)
		return 0;
	return deficiency_slow(tb, ticket);
}

void tokenbucket_replenish(struct tokenbucket *tb, int64_t now)
{
	if (tb == NULL)
		return;
	now = tb__time(now);
	int64_t seen = atomic_load(&tb->clock);
	if (seen == TB__NO_TIME) {
		tb__observe(tb, now); /* the first time passed fixes the clock */
		return;
	}
	if (now <= seen)
		return;
	/* Credit (move the clock) only once threshold tokens are made since it. */
	uint64_t threshold = atomic_load_explicit(&tb->threshold, memory_order_relaxed);
	struct tb__view v;
	tb__view(tb, &v);
	tb__u128 made = tb__production(&v, now) - tb__production(&v, seen);
	if (made == 0 || made < threshold)
		return;
	int64_t at;
	tb__enter(tb, now, &v, &at, true); /* a corrupt bucket is left as it is */
}

int tokenbucket_release(struct tokenbucket *tb, uint64_t n)
{
	if (tb == NULL)
		return -EINVAL;
	if (!tb__capped(tb))
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
	struct tb__view v;
	int64_t at;
	if (tb__view_at_clock(tb, &v, &at))
		tb__give_back(tb, &v, at, n);
}

int64_t tokenbucket_duration_for(const struct tokenbucket *tb, uint64_t tokens)
{
	if (tb == NULL)
		return TOKENBUCKET_NEVER;
	struct tb__view v;
	tb__view(tb, &v);
	return tb__duration(&v, tokens);
}

/* A writer: under tb->writer, so that a set_burst lowering the burst cannot
 * slip between the check and the store and leave threshold above burst. */
int tokenbucket_set_threshold(struct tokenbucket *tb, uint64_t threshold)
{
	if (tb == NULL || threshold == 0)
		return -EINVAL;
	int err = tb__writer_lock(tb);
	if (err)
		return err;
	if (threshold > atomic_load_explicit(&tb->burst, memory_order_relaxed))
		err = -EINVAL;
	else
		atomic_store(&tb->threshold, threshold);
	pthread_mutex_unlock(&tb->writer);
	return err;
}
