/* SPDX-License-Identifier: MIT */
/*
 * The Go face, after golang.org/x/time/rate: every call first credits what
 * was produced up to its "now", then decides.  All functions are lock-free and
 * may run in any number of threads at once.
 */
#include <errno.h>
#include <math.h>

#include "internal.h"

bool tokenbucket_allow_at(struct tokenbucket *tb, int64_t now, uint64_t n)
{
	if (tb == NULL)
		return false;
	uint64_t burst = atomic_load_explicit(&tb->burst, memory_order_relaxed);
	bool inf = tb__unlimited(tb);
	if (n > burst && !inf)
		return false;
	tb__advance(tb, now);
	if (inf)
		return true;
	uint64_t tail = atomic_load_explicit(&tb->tail, memory_order_relaxed);
	for (;;) {
		uint64_t head = atomic_load_explicit(&tb->head, memory_order_acquire);
		/* head only grows while takes run, so a level seen is a level had. */
		if (tb__level(head, tail) < (int64_t)n)
			return false;
		if (n == 0)
			return true;
		uint64_t base = tb__take_base(head, tail, burst);
		if (atomic_compare_exchange_weak(&tb->tail, &tail, base + n))
			return true;
	}
}

bool tokenbucket_allow(struct tokenbucket *tb, uint64_t n)
{
	return tokenbucket_allow_at(tb, tb__now(), n);
}

/* When `debt` more tokens than head holds will have been produced. */
static int64_t covered_at(const struct tokenbucket *tb, int64_t at, uint64_t debt)
{
	struct tb__rate r;
	struct tb__marker m;
	tb__view(tb, &r, &m);
	/* Tokens up to m.next - 1 are claimed; head holds them (or lost them to burst). */
	int64_t claimed = m.next == TB__NO_TIME ? at : m.next - 1;
	int64_t t = tb__time_of(&r, claimed, debt);
	return t < at ? at : t;
}

int tokenbucket_reserve_at(struct tokenbucket *tb, int64_t now, uint64_t n, int64_t max_wait,
			   struct tokenbucket_reservation *r)
{
	if (tb == NULL || r == NULL)
		return -EINVAL;
	uint64_t burst = atomic_load_explicit(&tb->burst, memory_order_relaxed);
	bool inf = tb__unlimited(tb);
	if (n > burst && !inf)
		return -E2BIG;
	int64_t at = tb__advance(tb, now);
	if (inf) {
		/* Nothing is taken, so there is nothing to give back: tokens is 0. */
		*r = (struct tokenbucket_reservation){
			.time_to_act = at,
			.tokens = 0,
			.ticket = atomic_load(&tb->tail),
		};
		return 0;
	}
	uint64_t tail = atomic_load_explicit(&tb->tail, memory_order_relaxed);
	for (;;) {
		uint64_t head = atomic_load_explicit(&tb->head, memory_order_acquire);
		uint64_t after = tb__take_base(head, tail, burst) + n;
		int64_t debt = tb__level(after, head);
		int64_t act = at, wait = 0;
		if (debt > 0) {
			if ((uint64_t)debt > TOKENBUCKET_DEBT_MAX)
				return -EOVERFLOW;
			act = covered_at(tb, at, (uint64_t)debt);
			/* act - at can pass INT64_MAX (at far below 0): saturate to NEVER. */
			uint64_t span = (uint64_t)act - (uint64_t)at;
			wait = act == TOKENBUCKET_NEVER || span >= (uint64_t)TOKENBUCKET_NEVER
				       ? TOKENBUCKET_NEVER
				       : (int64_t)span;
		}
		if (wait > max_wait)
			return -ETIMEDOUT;
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

void tokenbucket_cancel_at(struct tokenbucket *tb, struct tokenbucket_reservation *r,
			   int64_t now)
{
	if (tb == NULL || r == NULL)
		return;
	uint64_t n = r->tokens;
	r->tokens = 0;
	if (n == 0 || tb__unlimited(tb))
		return;
	if (tb__advance(tb, now) > r->time_to_act)
		return; /* too late: the tokens were used */
	tb__give_back(tb, n);
}

void tokenbucket_cancel(struct tokenbucket *tb, struct tokenbucket_reservation *r)
{
	tokenbucket_cancel_at(tb, r, tb__now());
}

double tokenbucket_tokens_at(struct tokenbucket *tb, int64_t now)
{
	if (tb == NULL)
		return NAN;
	int64_t at = tb__advance(tb, now);
	double burst = (double)atomic_load_explicit(&tb->burst, memory_order_relaxed);
	if (tb__unlimited(tb))
		return burst;
	struct tb__rate r;
	struct tb__marker m;
	tb__view(tb, &r, &m);
	uint64_t head = atomic_load(&tb->head);
	int64_t level = tb__level(head, atomic_load(&tb->tail));
	/* What is produced but not credited: the fraction, and whole tokens a racing claim holds. */
	double pending = 0;
	if (m.next != TB__NO_TIME && r.kind == TB__FINITE && at >= r.origin) {
		uint64_t whole = at >= m.next ? tb__produced(&r, m.next - 1, at) : 0;
		pending = (double)whole + tb__fraction(&r, at);
		if (tb->flags & TOKENBUCKET_CAPPED_RELEASE) {
			int64_t room = tb__level(atomic_load(&tb->ceil), head);
			pending = room <= 0 ? 0 : pending < (double)room ? pending : (double)room;
		}
	}
	double tokens = (double)level + pending;
	return tokens > burst ? burst : tokens;
}

double tokenbucket_tokens(struct tokenbucket *tb)
{
	return tokenbucket_tokens_at(tb, tb__now());
}
