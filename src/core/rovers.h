/* SPDX-License-Identifier: MIT */
/*
 * The rovers: what every take, give-back and clock update of a bucket does
 * (rovers.c), and the fast paths inlined into the two faces.  core.h holds
 * the state and the arithmetic these read; the comments here state what
 * each helper promises and who may call it.
 */
#ifndef TOKENBUCKET_ROVERS_H
#define TOKENBUCKET_ROVERS_H

#include "core.h"

/* ---- rovers.c: the clock, takes, drops and give-backs -------------------- */

/* The clock's slow path: records now > seen; fixes the origin on the first time. */
int64_t tb__observe_later(struct tokenbucket *tb, int64_t now, int64_t seen);
/*
 * Past the view's horizon: under the writer lock, drops what is above burst
 * and moves the origin forward.  The caller takes its view again.  0, or
 * the negative errno of tb__writer_lock.
 */
int tb__normalize(struct tokenbucket *tb, int64_t at);
/* tb__normalize for a caller that holds the writer lock. */
void tb__normalize_locked(struct tokenbucket *tb, int64_t at);
/*
 * Drops what lies above burst at "at" by moving the tail (and, capped, ceil
 * with it); returns how many tokens were dropped.
 */
uint64_t tb__drop(struct tokenbucket *tb, const struct tb__view *v, int64_t at, uint64_t burst);
/* Capped release: lowers head so that the head at t does not pass ceil; true if it did. */
bool tb__cap_to_ceil(struct tokenbucket *tb, const struct tb__view *v, int64_t t);
/* Raises ceil by up to n, never past tail + burst; returns how much. */
uint64_t tb__raise_ceil(struct tokenbucket *tb, uint64_t n);
/* Gives n tokens back (refund, cancel) within burst at t, under view v; returns how many fitted. */
uint64_t tb__give_back(struct tokenbucket *tb, const struct tb__view *v, int64_t t, uint64_t n);

/*
 * Records now in the clock; returns the effective now, max(now, latest seen).
 * Sequentially consistent, read or CAS: a writer that reads the clock after
 * freezing the regime sees every time at which a take used it unfrozen.
 */
static inline int64_t tb__observe(struct tokenbucket *tb, int64_t now)
{
	now = tb__time(now);
	int64_t seen = atomic_load(&tb->clock);
	return now > seen ? tb__observe_later(tb, now, seen) : seen;
}

/*
 * What every call that passes a time does before it decides: read the
 * production in force, record now (the effective time goes to *at), with
 * capped release lose what ceil holds back, and drop what lies above burst
 * (unless the caller is a take that drops it in its own compare-and-swap).
 * The regime is read again after the clock: if a writer froze or changed it
 * meanwhile, the view is taken again.  A time past the horizon normalizes
 * the bucket first.  The usual case is inline; the rest is tb__enter_slow.
 * False when the bucket is corrupt (or its writer lock cannot be taken to
 * normalize it): the call fails, with -EBADMSG where it returns an errno.
 */
bool tb__enter_slow(struct tokenbucket *tb, int64_t now, struct tb__view *v, int64_t *at,
		    bool drop);

/* Whether the bucket holds more than burst at t (no division). */
static inline bool tb__over_burst(const struct tokenbucket *tb, const struct tb__view *v, int64_t t)
{
	uint64_t burst = atomic_load_explicit(&tb->burst, memory_order_relaxed);
	int64_t e = tb__level(atomic_load(&tb->head) + v->hoff, atomic_load(&tb->tail));
	return e > (int64_t)burst || tb__fine_at(v, t) >= (tb__u128)(burst + 1 - (uint64_t)e) * v->q;
}

static inline __attribute__((always_inline)) bool
tb__enter(struct tokenbucket *tb, int64_t now, struct tb__view *v, int64_t *at, bool drop)
{
	tb__view(tb, v);
	now = tb__time(now);
	int64_t seen = atomic_load(&tb->clock);
	if (now > seen) {
		if (seen == TB__NO_TIME || !atomic_compare_exchange_strong(&tb->clock, &seen, now))
			goto slow;
		seen = now;
	}
	if (__builtin_expect(atomic_load(&tb->gen) != v->gen || (v->gen & 1) ||
				     tb__past_horizon(v, seen) || tb__capped(tb),
			     0))
		goto slow;
	*at = seen;
	if (drop && tb__over_burst(tb, v, seen))
		tb__drop(tb, v, seen, atomic_load_explicit(&tb->burst, memory_order_relaxed));
	return true;
slow:
	return tb__enter_slow(tb, now, v, at, drop);
}

/*
 * The view at the clock, normalized first if the clock passed its horizon;
 * the clock goes to *at.  False as tb__enter_slow.  With capped release it also loses what ceil holds
 * back at the clock: the clock's mover does that only after its clock CAS,
 * and production above ceil read in between would look like tokens above
 * burst (a grab would drop them with ceil left behind, a give-back would
 * find no room), shrinking the bucket's room for good.
 */
static inline __attribute__((always_inline)) bool
tb__view_at_clock(struct tokenbucket *tb, struct tb__view *v, int64_t *at)
{
	for (int round = 0;; round++) {
		if (round == TB__ROUNDS_MAX)
			return tb__give_up(tb);
		tb__view(tb, v);
		*at = atomic_load(&tb->clock);
		/*
		 * gen read again after the clock (both sequentially consistent):
		 * unchanged, the clock was read before any freeze of this regime,
		 * so the rate change's own read of the clock sees it and its
		 * switch time is no earlier.  Changed, a rate change may have
		 * ended before the clock read: the old view would count its rate
		 * past the switch.
		 */
		if (atomic_load(&tb->gen) != v->gen)
			continue;
		if (__builtin_expect(*at == TB__NO_TIME || !tb__past_horizon(v, *at), 1)) {
			if (tb__capped(tb))
				tb__cap_to_ceil(tb, v, *at);
			return true;
		}
		/* Each normalization moves the horizon past the clock, unless the words forbid it. */
		if (tb__normalize(tb, *at))
			return false;
	}
}

/*
 * Where a take at t starts: tokens above burst are dropped first, by moving
 * the tail up to head + hoff + P(t) - burst.  Returns that base; *level gets
 * the level there, never above burst.
 */
static inline uint64_t tb__take_base(const struct tb__view *v, uint64_t head, uint64_t tail,
				     uint64_t burst, int64_t t, int64_t *level)
{
	tb__i128 raw = tb__raw_level(v, head, tail, t);
	if (raw > (tb__i128)burst) {
		*level = (int64_t)burst;
		return tb__head_at(v, head, t) - burst;
	}
	*level = (int64_t)raw;
	return tail;
}

/*
 * tb__take_base for a take of n <= burst that only needs to know whether
 * the level reaches n: no division unless the bucket holds more than burst.
 */
static inline bool tb__take_fast(const struct tb__view *v, uint64_t head, uint64_t tail,
				 uint64_t burst, int64_t t, uint64_t n, uint64_t *base)
{
	/* e <= burst unless a racing give-back left excess; then drop exactly. */
	int64_t e = tb__level(head + v->hoff, tail);
	if (e > (int64_t)burst)
		goto over;
	tb__u128 f = tb__fine_at(v, t);
	/* Both differences are below 2^64 (e > -2^63, burst and n <= 2^62). */
	if (f >= (tb__u128)(burst + 1 - (uint64_t)e) * v->q)
		goto over;
	*base = tail;
	return e >= (int64_t)n || f >= (tb__u128)(n - (uint64_t)e) * v->q;
over:
	*base = tb__head_at(v, head, t) - burst;
	return true;
}

/*
 * The fast paths read the regime into a local struct tb__view that never
 * escapes (so it stays in registers) with tb__load_regime, and validate it
 * with this after recording their time: gen unchanged (so the slot was of
 * one regime, and no writer froze it
 * since the time was recorded: sequentially consistent, as tb__enter) and
 * the time within the horizon (which also means the origin is fixed, and
 * a producing regime's F(t) is (t - origin) * p + fine0; one that produces
 * nothing stores p = 0).
 */
static inline __attribute__((always_inline)) bool
tb__fast_valid(const struct tokenbucket *tb, const struct tb__view *f, int64_t t)
{
	atomic_thread_fence(memory_order_acquire);
	/* No time seen yet (grab, deficiency): nothing is produced, the view holds. */
	return atomic_load(&tb->gen) == f->gen && (t < f->limit || t == TB__NO_TIME);
}


/* Records now in the clock, the usual way only: false sends the caller to the general path. */
static inline __attribute__((always_inline)) bool tb__fast_observe(struct tokenbucket *tb,
								   int64_t now, int64_t *at)
{
	now = tb__time(now);
	int64_t seen = atomic_load(&tb->clock);
	if (now > seen) {
		if (seen == TB__NO_TIME || !atomic_compare_exchange_strong(&tb->clock, &seen, now))
			return false;
		seen = now;
	}
	*at = seen;
	return true;
}

/* What the fast take of allow_at and reserve_at found. */
enum tb__fast_take {
	TB__FAST_TAKEN, /* n taken: *ticket is the tail after */
	TB__FAST_SHORT, /* fewer than n at *at, read with tail *seen_tail */
	TB__FAST_SLOW,  /* anything else: the general path decides */
};

/*
 * The usual take, in registers: a stable regime, a time within its horizon,
 * no capped release, not unlimited, and enough tokens; what lies above
 * burst is dropped in the same CAS when q = 1 (P(t) = F(t)).  When taken,
 * a caller that passes seen (else NULL, compiled away) gets the view the
 * take decided on and the head it read: the level just after the take is
 * head(at) - ticket under it.
 */
static inline __attribute__((always_inline)) enum tb__fast_take
tb__fast_take_seen(struct tokenbucket *tb, int64_t now, uint64_t n, uint64_t burst, int64_t *at,
		   uint64_t *ticket, uint64_t *seen_tail, struct tb__view *seen,
		   uint64_t *seen_head)
{
	struct tb__view f;
	if (tb__capped(tb) || tb__unlimited(tb) || !tb__load_regime(tb, &f))
		return TB__FAST_SLOW;
	uint64_t tail = atomic_load_explicit(&tb->tail, memory_order_acquire);
	uint64_t head = atomic_load_explicit(&tb->head, memory_order_acquire);
	if (!tb__fast_observe(tb, now, at) || !tb__fast_valid(tb, &f, *at))
		return TB__FAST_SLOW;
	int64_t e = tb__level(head + f.hoff, tail);
	if (e > (int64_t)burst)
		return TB__FAST_SLOW;
	tb__u128 fine = tb__fine_units(&f, *at);
	uint64_t base = tail;
	if (fine >= (tb__u128)(burst + 1 - (uint64_t)e) * f.q) {
		if (f.q != 1)
			return TB__FAST_SLOW;
		base = head + f.hoff + (uint64_t)fine - burst;
	} else if (e < (int64_t)n && fine < (tb__u128)(n - (uint64_t)e) * f.q) {
		*seen_tail = tail;
		return TB__FAST_SHORT;
	}
	if ((n == 0 && base == tail) || atomic_compare_exchange_strong(&tb->tail, &tail, base + n)) {
		*ticket = base + n;
		if (seen) {
			*seen = f;
			seen->until = TOKENBUCKET_NEVER;
			*seen_head = head;
		}
		return TB__FAST_TAKEN;
	}
	return TB__FAST_SLOW;
}

static inline __attribute__((always_inline)) enum tb__fast_take
tb__fast_take(struct tokenbucket *tb, int64_t now, uint64_t n, uint64_t burst, int64_t *at,
	      uint64_t *ticket, uint64_t *seen_tail)
{
	return tb__fast_take_seen(tb, now, n, burst, at, ticket, seen_tail, NULL, NULL);
}

#endif /* TOKENBUCKET_ROVERS_H */
