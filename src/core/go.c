/* SPDX-License-Identifier: MIT */
/*
 * The Go face, after golang.org/x/time/rate.  Production is a function of
 * time, so a call needs no claim: it records now, reads the level at now,
 * and decides with one compare-and-swap on the tail, which also drops what
 * lies above burst.  All functions are lock-free and may run in any number
 * of threads at once.
 */
#include <errno.h>
#include <math.h>

#include "rovers.h"

/* The general path of allow_at: any regime, time and level. */
static bool allow_slow(struct tokenbucket *tb, int64_t now, uint64_t n)
{
	uint64_t burst = atomic_load_explicit(&tb->burst, memory_order_relaxed);
	bool inf = tb__unlimited(tb);
	if (n > burst && !inf)
		return false;
	struct tb__view v;
	int64_t at;
	uint64_t tail = atomic_load_explicit(&tb->tail, memory_order_acquire);
	if (!tb__enter(tb, now, &v, &at, false))
		return false;
	if (inf)
		return true;
	for (;;) {
		TB__ROUND();
		uint64_t head = atomic_load_explicit(&tb->head, memory_order_acquire);
		uint64_t base;
		if (!tb__take_fast(&v, head, tail, burst, at, n, &base)) {
			/*
			 * Only a level read with the tail it belongs to refuses,
			 * and at a time no earlier than the one a drop in that
			 * tail was made at.
			 */
			uint64_t again = atomic_load_explicit(&tb->tail, memory_order_acquire);
			int64_t seen = atomic_load(&tb->clock);
			if (seen > at) {
				if (!tb__enter(tb, seen, &v, &at, false))
					return false;
				tail = atomic_load_explicit(&tb->tail, memory_order_acquire);
				continue;
			}
			if (again == tail)
				return false;
			tail = again;
			continue;
		}
		/* allow(0) writes only to drop what lies above burst. */
		if ((n == 0 && base == tail) ||
		    atomic_compare_exchange_weak(&tb->tail, &tail, base + n))
			return true;
	}
}

bool tokenbucket_allow_at(struct tokenbucket *tb, int64_t now, uint64_t n)
{
	if (tb == NULL)
		return false;
	uint64_t burst = atomic_load_explicit(&tb->burst, memory_order_relaxed);
	int64_t at;
	uint64_t ticket, tail;
	if (n <= burst) {
		switch (tb__fast_take(tb, now, n, burst, &at, &ticket, &tail)) {
		case TB__FAST_TAKEN:
			return true;
		case TB__FAST_SHORT:
			/*
			 * Refused, if the level was read with the tail it belongs
			 * to and at a time no earlier than any drop in that tail:
			 * the tail again (read before head, so head is no newer
			 * than it) and the clock again.
			 */
			if (atomic_load_explicit(&tb->tail, memory_order_acquire) == tail &&
			    atomic_load(&tb->clock) == at)
				return false;
			break;
		case TB__FAST_SLOW:
			break;
		}
	}
	return allow_slow(tb, now, n);
}

bool tokenbucket_allow(struct tokenbucket *tb, uint64_t n)
{
	return tokenbucket_allow_at(tb, tb__now(), n);
}

/* The general path of reserve_at: any regime, time and level, debt included. */
static int reserve_slow(struct tokenbucket *tb, int64_t now, uint64_t n, int64_t max_wait,
			struct tokenbucket_reservation *r)
{
	uint64_t burst = atomic_load_explicit(&tb->burst, memory_order_relaxed);
	bool inf = tb__unlimited(tb);
	if (n > burst && !inf)
		return -E2BIG;
	struct tb__view v;
	int64_t at;
	uint64_t tail = atomic_load_explicit(&tb->tail, memory_order_acquire);
	if (!tb__enter(tb, now, &v, &at, false))
		return -EBADMSG;
	if (inf) {
		/* Nothing is taken, so there is nothing to give back: tokens is 0. */
		*r = (struct tokenbucket_reservation){
			.time_to_act = at,
			.tokens = 0,
			.ticket = atomic_load(&tb->tail),
		};
		return 0;
	}
	for (;;) {
		TB__ROUND();
		uint64_t head = atomic_load_explicit(&tb->head, memory_order_acquire);
		int64_t level = (int64_t)n;
		uint64_t base;
		/* The exact level (a division) is needed only in debt. */
		if (!tb__take_fast(&v, head, tail, burst, at, n, &base))
			base = tb__take_base(&v, head, tail, burst, at, &level);
		uint64_t after = base + n;
		/* Wide: a corrupt shared bucket may hold any level. */
		tb__i128 debt = (tb__i128)n - level;
		int64_t act = at, wait = 0;
		int err = 0;
		if (debt > 0) {
			/* The debt is about the time a drop in this tail was made at, at least. */
			int64_t seen = atomic_load(&tb->clock);
			if (seen > at) {
				if (!tb__enter(tb, seen, &v, &at, false))
					return -EBADMSG;
				tail = atomic_load_explicit(&tb->tail, memory_order_acquire);
				continue;
			}
			if (debt > (tb__i128)TOKENBUCKET_DEBT_MAX) {
				err = -EOVERFLOW;
			} else {
				/* When P has made debt more tokens than it had at "at". */
				wait = tb__wait_of(&v, at, (uint64_t)debt, &act);
			}
		}
		if (!err && wait > max_wait)
			err = -ETIMEDOUT;
		if (err) {
			/* Refused, but the time was seen: what lies above burst is dropped. */
			if (after - n == tail) {
				uint64_t again = atomic_load_explicit(&tb->tail, memory_order_acquire);
				if (again == tail)
					return err;
				tail = again;
				continue;
			}
			if (atomic_compare_exchange_weak(&tb->tail, &tail, after - n))
				return err;
			continue;
		}
		if (atomic_compare_exchange_weak(&tb->tail, &tail, after)) {
			*r = (struct tokenbucket_reservation){
				.time_to_act = act,
				.tokens = n,
				.ticket = after,
			};
			return 0;
		}
	}
}

/* The usual reservation is a fast take with the tokens there now; debt takes the general path. */
int tokenbucket_reserve_at(struct tokenbucket *tb, int64_t now, uint64_t n, int64_t max_wait,
			   struct tokenbucket_reservation *r)
{
	if (tb == NULL || r == NULL)
		return -EINVAL;
	uint64_t burst = atomic_load_explicit(&tb->burst, memory_order_relaxed);
	int64_t at;
	uint64_t ticket, tail;
	if (n <= burst && max_wait >= 0 &&
	    tb__fast_take(tb, now, n, burst, &at, &ticket, &tail) == TB__FAST_TAKEN) {
		*r = (struct tokenbucket_reservation){
			.time_to_act = at,
			.tokens = n,
			.ticket = ticket,
		};
		return 0;
	}
	return reserve_slow(tb, now, n, max_wait, r);
}

int tokenbucket_reserve(struct tokenbucket *tb, uint64_t n, int64_t max_wait,
			struct tokenbucket_reservation *r)
{
	return tokenbucket_reserve_at(tb, tb__now(), n, max_wait, r);
}

int64_t tokenbucket_reservation_delay(const struct tokenbucket_reservation *r, int64_t now)
{
	if (r == NULL || r->time_to_act == TOKENBUCKET_NEVER)
		return TOKENBUCKET_NEVER;
	if (now >= r->time_to_act)
		return 0;
	uint64_t d = (uint64_t)r->time_to_act - (uint64_t)now;
	return d >= (uint64_t)TOKENBUCKET_NEVER ? TOKENBUCKET_NEVER : (int64_t)d;
}

/* The general path of a cancel of n tokens reserved for time_to_act. */
static void cancel_slow(struct tokenbucket *tb, int64_t now, int64_t time_to_act, uint64_t n)
{
	struct tb__view v;
	int64_t at;
	if (!tb__enter(tb, now, &v, &at, true) || at > time_to_act)
		return; /* a corrupt bucket, or too late: the tokens were used */
	tb__give_back(tb, &v, at, n);
}

void tokenbucket_cancel_at(struct tokenbucket *tb, struct tokenbucket_reservation *r,
			   int64_t now)
{
	if (tb == NULL || r == NULL)
		return;
	uint64_t n = r->tokens;
	r->tokens = 0;
	if (n == 0 || tb__unlimited(tb))
		return;
	/* The usual cancel, in registers: nothing to drop, and all of n fits under burst. */
	uint64_t burst = atomic_load_explicit(&tb->burst, memory_order_relaxed);
	struct tb__view f;
	int64_t at;
	if (n > burst || tb__capped(tb) || !tb__load_regime(tb, &f))
		goto slow;
	uint64_t head = atomic_load_explicit(&tb->head, memory_order_acquire);
	uint64_t tail = atomic_load_explicit(&tb->tail, memory_order_acquire);
	if (!tb__fast_observe(tb, now, &at) || !tb__fast_valid(tb, &f, at))
		goto slow;
	int64_t e = tb__level(head + f.hoff, tail);
	if (e > (int64_t)(burst - n))
		goto slow;
	/* level + n <= burst, so nothing lies above burst either. */
	if (tb__fine_units(&f, at) >= (tb__u128)(burst - n + 1 - (uint64_t)e) * f.q)
		goto slow;
	if (at > r->time_to_act)
		return; /* too late: the tokens were used */
	if (atomic_compare_exchange_strong(&tb->head, &head, head + n))
		return;
slow:
	cancel_slow(tb, now, r->time_to_act, n);
}

void tokenbucket_cancel(struct tokenbucket *tb, struct tokenbucket_reservation *r)
{
	tokenbucket_cancel_at(tb, r, tb__now());
}

double tokenbucket_tokens_at(struct tokenbucket *tb, int64_t now)
{
	if (tb == NULL)
		return NAN;
	struct tb__view v;
	int64_t at;
	if (!tb__enter(tb, now, &v, &at, true))
		return NAN;
	uint64_t burst = atomic_load_explicit(&tb->burst, memory_order_relaxed);
	if (tb__unlimited(tb))
		return (double)burst;
	uint64_t tail = atomic_load(&tb->tail), head;
	tb__i128 raw;
	for (;;) {
		TB__ROUND();
		head = atomic_load(&tb->head);
		raw = tb__raw_level(&v, head, tail, at);
		uint64_t again = atomic_load(&tb->tail);
		if (again == tail)
			break;
		tail = again;
	}
	if (raw > (tb__i128)burst)
		return (double)burst;
	double fraction = tb__fraction(&v, at);
	/* Production that ceil holds back is not counted. */
	if (tb__capped(tb) && fraction > 0) {
		uint64_t now_head = head + v.hoff + (uint64_t)tb__production(&v, at);
		if (tb__level(atomic_load(&tb->ceil), now_head) <= 0)
			fraction = 0;
	}
	if (raw == (tb__i128)burst)
		return (double)burst;
	if (fraction == 0)
		return (double)(int64_t)raw;
	return tb__tokens_value(&v, (int64_t)raw, at);
}

double tokenbucket_tokens(struct tokenbucket *tb)
{
	return tokenbucket_tokens_at(tb, tb__now());
}
