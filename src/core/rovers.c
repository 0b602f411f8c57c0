/* SPDX-License-Identifier: MIT */
/*
 * The rover core both faces share: the clock, the view of the regime in
 * force, and the moves of head and ceil.  Every function here except
 * tb__normalize is lock-free and may run in any number of threads at once;
 * each retry of a loop means another thread changed the word first, so some
 * thread always makes progress.
 *
 * Read-modify-writes and the loads of clock and gen are sequentially
 * consistent (on x86-64 the loads are plain moves); loads that only seed a
 * CAS are relaxed, since the CAS checks them.
 */
#include "rovers.h"

/*
 * The first caller that passes a time fixes the origin of the regime in
 * force: regime 0's, or one that a writer killed in a reset of a bucket
 * with no time seen left to be published again with no origin (recover in
 * writer.c).  A slot is rewritten only two regimes later, by a writer that
 * fixed the origin first, so a CAS from "no time" meets no other regime.
 */
static void fix_origin(struct tokenbucket *tb, int64_t now)
{
	uint64_t gen = atomic_load(&tb->gen);
	struct tb__slot *s = &tb->slot[(gen >> 1) & 1];
	int64_t unset = TB__NO_TIME;
	if (!atomic_compare_exchange_strong(&s->origin, &unset, now))
		return; /* a writer started a regime of its own first */
	/* Until this store the limit keeps readers on the slow path. */
	atomic_store(&s->limit, tb__limit(now, atomic_load(&s->p), atomic_load(&s->q),
					  atomic_load(&s->fine0)));
}

int64_t tb__observe_later(struct tokenbucket *tb, int64_t now, int64_t seen)
{
	while (now > seen) {
		TB__ROUND();
		if (atomic_compare_exchange_weak(&tb->clock, &seen, now)) {
			if (seen == TB__NO_TIME)
				fix_origin(tb, now);
			return now;
		}
	}
	return seen;
}

uint64_t tb__drop(struct tokenbucket *tb, const struct tb__view *v, int64_t at, uint64_t burst)
{
	uint64_t tail = atomic_load(&tb->tail);
	for (;;) {
		TB__ROUND();
		uint64_t head = atomic_load(&tb->head);
		/* Nothing above burst, the usual case: decided with no division. */
		if (!tb__level_at_least(v, tb__level(head + v->hoff, tail), at, (tb__i128)burst + 1))
			return 0;
		int64_t level;
		uint64_t base = tb__take_base(v, head, tail, burst, at, &level);
		if (base == tail)
			return 0;
		if (atomic_compare_exchange_weak(&tb->tail, &tail, base)) {
			/* Dropped tokens are not in flight: ceil - tail stays what it was. */
			if (tb__capped(tb))
				atomic_fetch_add(&tb->ceil, base - tail);
			return base - tail;
		}
	}
}

/*
 * The regime restarts at "at" with the fraction made so far as fine0: P
 * shifts by P(at) tokens and hoff takes them over, so the head is the same
 * function of time and production starts again from 0.  What lies above
 * burst at "at" is dropped first, as a take would drop it.  A reader that
 * sees the dropped tail also sees the clock at "at" (the drop comes after
 * it), which is past the old horizon, so it comes here and waits for the
 * lock instead of using the old view with the new tail.
 */
void tb__normalize_locked(struct tokenbucket *tb, int64_t at)
{
	struct tb__view v;
	tb__view(tb, &v);
	if (v.origin == TB__NO_TIME && at != TB__NO_TIME && !(v.gen & 1)) {
		/*
		 * The caller that saw the first time has not fixed the origin:
		 * in a shared bucket it may be a process that was killed.
		 */
		fix_origin(tb, at);
		return;
	}
	if ((v.gen & 1) || at == TB__NO_TIME || v.origin == TB__NO_TIME || !tb__past_horizon(&v, at))
		return;
	uint64_t burst = atomic_load(&tb->burst), lost = 0;
	if (tb__capped(tb) && tb__cap_to_ceil(tb, &v, at)) {
		/*
		 * The head at "at" is ceil now, but head + hoff - tail no longer
		 * fits until hoff takes P(at) below: drop from ceil directly.
		 */
		uint64_t tail = atomic_load(&tb->tail);
		for (;;) {
			TB__ROUND();
			/* Wide: a corrupt shared bucket may hold any ceil - tail. */
			tb__i128 excess =
				(tb__i128)tb__level(atomic_load(&tb->ceil), tail) - (tb__i128)burst;
			if (excess <= 0)
				break;
			if (atomic_compare_exchange_weak(&tb->tail, &tail, tail + (uint64_t)excess)) {
				atomic_fetch_add(&tb->ceil, (uint64_t)excess);
				break;
			}
		}
	} else {
		/*
		 * Past the horizon the excess may be anything up to 2^128: the
		 * tail moves up by at most TB__DROP_MOST, so that older tickets
		 * stay comparable, and hoff loses the rest.
		 */
		uint64_t tail = atomic_load(&tb->tail);
		for (;;) {
			TB__ROUND();
			uint64_t head = atomic_load(&tb->head);
			tb__i128 excess = tb__raw_level(&v, head, tail, at) - (tb__i128)burst;
			if (excess <= 0)
				break;
			uint64_t moved = excess < (tb__i128)TB__DROP_MOST ? (uint64_t)excess
									 : TB__DROP_MOST;
			if (atomic_compare_exchange_weak(&tb->tail, &tail, tail + moved)) {
				lost = tb__head_at(&v, head, at) - burst - tail - moved;
				break;
			}
		}
	}
	struct tb__view n = v;
	n.origin = at;
	n.fine0 = tb__remainder(&v, at);
	n.hoff = v.hoff + (uint64_t)tb__production(&v, at) - lost;
	n.limit = tb__limit(n.origin, n.p, n.q, n.fine0);
	tb__publish(tb, &n);
}

int tb__normalize(struct tokenbucket *tb, int64_t at)
{
	int err = tb__writer_lock(tb);
	if (err)
		return err;
	tb__normalize_locked(tb, at);
	pthread_mutex_unlock(&tb->writer);
	return 0;
}

bool tb__cap_to_ceil(struct tokenbucket *tb, const struct tb__view *v, int64_t t)
{
	int64_t from = atomic_load(&tb->ceiled);
	uint64_t head = atomic_load_explicit(&tb->head, memory_order_relaxed);
	bool lowered = false;
	while (from < t) {
		TB__ROUND();
		/*
		 * Production since "from" that would lift the head at t above
		 * ceil is lost; a head already above ceil (a burst lowered below
		 * what is in flight) keeps what it had.  How far the head is
		 * above ceil does not depend on the tail.
		 */
		uint64_t tail = atomic_load(&tb->tail);
		uint64_t ceil = atomic_load(&tb->ceil);
		tb__i128 over = tb__raw_level(v, head, tail, t) - (tb__i128)tb__level(ceil, tail);
		if (over > 0) {
			/* over > made, the production since from, exactly when this is > 0. */
			tb__i128 rest = (tb__i128)tb__level(head + v->hoff, tail) -
					(tb__i128)tb__level(ceil, tail) + tb__sat(tb__production(v, from));
			uint64_t cut = rest > 0 ? (uint64_t)(tb__production(v, t) - tb__production(v, from))
						: tb__head_at(v, head, t) - ceil;
			if (!atomic_compare_exchange_weak(&tb->head, &head, head - cut))
				continue;
			lowered = true;
		}
		if (atomic_compare_exchange_weak(&tb->ceiled, &from, t))
			break;
	}
	return lowered;
}

bool tb__enter_slow(struct tokenbucket *tb, int64_t now, struct tb__view *v, int64_t *at,
		    bool drop)
{
	/*
	 * Each round either finds the regime usable or does what makes it so
	 * (repairs a dead writer's freeze, fixes the origin, normalizes), or
	 * another thread changed it meanwhile: in a bucket no one rewrites,
	 * a few rounds.  More mean words that no bucket holds.
	 */
	for (int round = 0;; round++) {
		if (round == TB__ROUNDS_MAX)
			return tb__give_up(tb);
		if (tb__is_corrupt(tb))
			return false;
		tb__view(tb, v);
		/* A frozen regime whose writer died produces nothing until repaired. */
		if (v->gen & 1)
			tb__writer_help(tb);
		*at = tb__observe(tb, now);
		/*
		 * The first time seen fixes the origin of regime 0 (or is being
		 * fixed by another thread: until then nothing is produced).
		 */
		if (v->origin == TB__NO_TIME && *at != TB__NO_TIME) {
			/* Not fixed yet by the thread that saw the first time: help. */
			fix_origin(tb, *at);
			continue;
		}
		if (atomic_load(&tb->gen) != v->gen)
			continue;
		if (tb__past_horizon(v, *at)) {
			if (tb__normalize(tb, *at))
				return false;
			continue;
		}
		break;
	}
	if (tb__capped(tb))
		tb__cap_to_ceil(tb, v, *at);
	if (drop)
		tb__drop(tb, v, *at, atomic_load_explicit(&tb->burst, memory_order_relaxed));
	return true;
}

/* Raises ceil by up to n, never past tail + burst (nothing can be in flight beyond that). */
uint64_t tb__raise_ceil(struct tokenbucket *tb, uint64_t n)
{
	uint64_t burst = atomic_load_explicit(&tb->burst, memory_order_relaxed);
	uint64_t ceil = atomic_load_explicit(&tb->ceil, memory_order_relaxed);
	for (;;) {
		TB__ROUND();
		uint64_t limit = atomic_load(&tb->tail) + burst;
		int64_t room = tb__level(limit, ceil);
		if (room <= 0)
			return 0;
		uint64_t add = n < (uint64_t)room ? n : (uint64_t)room;
		if (atomic_compare_exchange_weak(&tb->ceil, &ceil, ceil + add))
			return add;
	}
}

uint64_t tb__give_back(struct tokenbucket *tb, const struct tb__view *v, int64_t t, uint64_t n)
{
	uint64_t burst = atomic_load_explicit(&tb->burst, memory_order_relaxed);
	uint64_t head = atomic_load_explicit(&tb->head, memory_order_relaxed);
	uint64_t add;
	if (n == 0)
		return 0;
	for (;;) {
		TB__ROUND();
		/* The room under burst at t; all of n fits is decided with no division. */
		uint64_t tail = atomic_load(&tb->tail);
		add = n;
		if (tb__level_at_least(v, tb__level(head + v->hoff, tail), t,
				       (tb__i128)burst - (tb__i128)n + 1)) {
			tb__i128 room = (tb__i128)burst - tb__raw_level(v, head, tail, t);
			if (room <= 0)
				return 0;
			add = (uint64_t)room;
		}
		if (atomic_compare_exchange_weak(&tb->head, &head, head + add))
			break;
	}
	/* Given-back tokens are no longer in flight: keep head <= ceil. */
	if (tb__capped(tb))
		tb__raise_ceil(tb, add);
	return add;
}
