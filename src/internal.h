/* SPDX-License-Identifier: MIT */
/*
 * The bucket's state and the helpers the two faces share.  docs/DESIGN.md
 * explains the model; the comments here state what each field promises.
 *
 * Every shared word is a naturally aligned 8-byte (or smaller) atomic, so the
 * state is lock-free and address-free wherever 8-byte compare-and-swap is.
 */
#ifndef TOKENBUCKET_INTERNAL_H
#define TOKENBUCKET_INTERNAL_H

#include <pthread.h>
#include <stdalign.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "tokenbucket.h"

typedef unsigned __int128 tb__u128;
typedef __int128 tb__i128;

/* "No time seen yet" in the clock; callers' INT64_MIN is read as INT64_MIN + 1. */
#define TB__NO_TIME INT64_MIN

/*
 * Production since a regime's origin stays below this many tokens: a call
 * whose time passes the regime's horizon normalizes the bucket first (see
 * tb__normalize), which keeps level - P(t) and tail - head within int64_t.
 */
#define TB__ANCHOR (UINT64_C(1) << 61)
/*
 * The most a drop moves the tail (and head) up: within the horizon a drop
 * is below it; past it, the rest is lost without moving the rovers, so that
 * a ticket stays comparable with the head (docs/DESIGN.md).
 */
#define TB__DROP_MOST (UINT64_C(1) << 61)

/* What a regime produces; mirrored in tokenbucket.kind for the fast paths. */
enum tb__kind {
	TB__FINITE = 0, /* p tokens every q ns, p >= 1, q >= 1 */
	TB__ZERO = 1,   /* never produces */
	TB__INF = 2,    /* unlimited: nothing is ever taken, the bucket stays full */
};

/*
 * A rate regime: production P(t) = floor(((t - origin) * p + fine0) / q)
 * whole tokens for t >= origin, 0 before.  Regime e lives in slot[e & 1]; a slot is
 * written only by a writer (under tb->writer) while no reader may use it,
 * and read under the seqlock of tb->gen.  Fields are atomics so that a
 * racing reader reads stale values, never torn ones, and then retries.
 */
struct tb__slot {
	_Atomic int64_t origin;   /* ns; TB__NO_TIME until the bucket's clock is fixed */
	_Atomic uint64_t fine0;   /* production carried in, in 1/q tokens: < q */
	_Atomic uint64_t p;       /* tokens per period; 0 for ZERO */
	_Atomic uint64_t q;       /* period in ns; 0 for INF */
	_Atomic uint64_t hoff;    /* head offset: the head is head + hoff + P(t), mod 2^64 */
	_Atomic int64_t limit;    /* P(t) < TB__ANCHOR for t < limit; INT64_MIN until origin is fixed */
	_Atomic uint32_t kind;    /* enum tb__kind */
};

/* A consistent view of the production in force, taken by tb__view(). */
struct tb__view {
	uint64_t gen;      /* tb->gen when it was taken */
	int64_t origin;
	uint64_t fine0;
	uint64_t p, q;
	uint64_t hoff;
	int64_t limit;
	enum tb__kind kind;
	int64_t until;     /* production counts up to this time only (a rate change runs) */
};

struct tokenbucket {
	/*
	 * Line 0: what takes write (tail, clock) and read.  Rovers count whole
	 * tokens modulo 2^64 and are compared as signed differences.  The head
	 * is implicit: tokens credited up to the clock are head + P(clock), so
	 * production is never claimed; it is there as soon as time says so.
	 *   level = head + P(clock) - tail; above burst the excess is dropped
	 *   by the next take (tail moves up to head + P - burst).
	 */
	alignas(64) _Atomic uint64_t tail; /* tokens taken or dropped; tickets are its values */
	_Atomic int64_t clock;             /* latest time seen, only grows (except reset) */
	_Atomic uint64_t head;             /* credits outside production: give-backs, carries */
	_Atomic uint64_t ceil;             /* capped release: head + P(clock) never passes it */
	_Atomic uint64_t burst;
	_Atomic uint32_t kind;             /* enum tb__kind of the current regime */
	uint32_t flags;                    /* TOKENBUCKET_CAPPED_RELEASE; fixed at create */
	_Atomic int64_t ceiled;            /* capped release: production up to here met ceil */
	/*
	 * Nonzero once a call found words no bucket can hold (docs/DESIGN.md,
	 * "Corrupt mappings"): the slow paths and writers then fail at once,
	 * and attach refuses the bucket.  Zero in every bucket 1.1 made.
	 */
	_Atomic uint64_t corrupt;

	/*
	 * Line 1: read by every take, written only by writers, so it stays
	 * shared in every core's cache.  gen is even while regime gen / 2 is in
	 * force, odd while a rate change freezes it at frozen_at.
	 */
	alignas(64) _Atomic uint64_t gen;
	_Atomic int64_t frozen_at;
	_Atomic uint64_t threshold;        /* replenish credits only this many at once */
	struct tb__slot slot[2];

	/* Writers only: set_*, reset_at, and a take that must re-anchor. */
	alignas(64) pthread_mutex_t writer;
};

_Static_assert(sizeof(struct tokenbucket) == 320 &&
		       offsetof(struct tokenbucket, gen) == 64 &&
		       offsetof(struct tokenbucket, writer) == 256,
	       "the shared layout (TB__LAYOUT 1) does not move");

/*
 * Rounds a retry loop that reads shared words may take before it gives up
 * on the bucket.  In a bucket no process is rewriting, every such loop
 * ends in a few rounds; racing writers may make a call retry, each retry
 * being their progress, and this many in a row do not happen in practice.
 */
#define TB__ROUNDS_MAX 1000

/*
 * TB__ROUND() marks one round of a loop that reads shared words.  The
 * mapping fuzzer's build defines TB__FUZZ_ROUNDS and counts them (a
 * watchdog in rounds, not in time); other builds compile it to nothing.
 */
#ifdef TB__FUZZ_ROUNDS
void tb__fuzz_round(void);
#define TB__ROUND() tb__fuzz_round()
#else
#define TB__ROUND() ((void)0)
#endif

/* Whether a call found the bucket corrupt (see struct tokenbucket). */
static inline bool tb__is_corrupt(const struct tokenbucket *tb)
{
	return atomic_load_explicit(&tb->corrupt, memory_order_relaxed) != 0;
}

/* Marks the bucket corrupt for every process that maps it; returns false for the caller. */
static inline bool tb__give_up(struct tokenbucket *tb)
{
	atomic_store_explicit(&tb->corrupt, 1, memory_order_relaxed);
	return false;
}

/* ---- ratio.c: exact arithmetic of a regime ------------------------------- */

/* Tokens per second as an exact p/q tokens per ns; returns the kind. */
enum tb__kind tb__ratio_from_rate(double rate, uint64_t *p, uint64_t *q);
/* Reduces tokens per period_ns to lowest terms; returns the kind. */
enum tb__kind tb__ratio_from_every(uint64_t tokens, int64_t period_ns, uint64_t *p,
				   uint64_t *q);
/* The first time after "at" when j more tokens than P(at) are there. */
int64_t tb__time_of(const struct tb__view *v, int64_t at, uint64_t j);
/* Nanoseconds from "at" to tb__time_of (which goes to *act); NEVER if never or too far. */
int64_t tb__wait_of(const struct tb__view *v, int64_t at, uint64_t j, int64_t *act);
/* The fraction of a token produced at t beyond P(t), in [0, 1). */
double tb__fraction(const struct tb__view *v, int64_t t);
/* Nanoseconds needed for n tokens, rounded up; NEVER when not representable. */
int64_t tb__duration(const struct tb__view *v, uint64_t n);
/* The regime's rate as a double in tokens per second. */
double tb__rate_value(const struct tb__view *v);
/*
 * At a rate change at "at": the fraction of a token the old regime had made,
 * as fine0 of the new rate p/q, rounded down to a nanosecond of the new rate.
 */
uint64_t tb__carry(const struct tb__view *old, uint64_t p, uint64_t q, int64_t at);
/* The fraction made at t, in 1/q tokens (fine0 of a regime that starts at t). */
uint64_t tb__remainder(const struct tb__view *v, int64_t t);
/* Until when a regime may run before it must be normalized (INT64_MAX: for ever). */
int64_t tb__limit(int64_t origin, uint64_t p, uint64_t q, uint64_t fine0);

/* ---- result.c: a decision as a server reports it ------------------------- */

/*
 * Fills *res for a decision on n tokens at "at" under view v: level is the
 * whole tokens after it (never above burst; negative in debt).
 */
void tb__result(const struct tb__view *v, int64_t at, uint64_t n, uint64_t burst, bool allowed,
		int64_t level, struct tokenbucket_result *res);

/* ---- regime.c: life cycle and writers ----------------------------------- */

/* -EINVAL for unknown flags, -ERANGE for a burst beyond TOKENBUCKET_BURST_MAX. */
int tb__bucket_check(uint64_t burst, unsigned flags);
/*
 * Initialises a full bucket with no time seen in the memory at tb (checked
 * arguments); attr is the writer mutex's (NULL: the default).
 */
int tb__bucket_init(struct tokenbucket *tb, enum tb__kind kind, uint64_t p, uint64_t q,
		    uint64_t burst, unsigned flags, const pthread_mutexattr_t *attr);
/* An unlimited rate means full: head rises to burst (capped: within ceil). */
void tb__fill(struct tokenbucket *tb, const struct tb__view *v, int64_t at);
/*
 * The writers' changes, for a caller that holds tb->writer: the rate (kind,
 * p/q as tb__ratio_from_* give them) and the burst (checked), at the latest
 * time seen, at least now.  0, or -EBADMSG for a corrupt bucket.
 */
int tb__change_rate(struct tokenbucket *tb, int64_t now, enum tb__kind kind, uint64_t p,
		    uint64_t q);
int tb__change_burst(struct tokenbucket *tb, int64_t now, uint64_t burst);

/* ---- shared.c: buckets in shared memory --------------------------------- */

/*
 * The longest a writer waits for tb->writer.  Holders keep it for a few
 * microseconds of bounded work, so a wait this long means a stopped holder
 * or a lock word that no live holder wrote; the fuzzer's build shortens it.
 */
#ifndef TB__LOCK_WAIT_NS
#define TB__LOCK_WAIT_NS INT64_C(2000000000)
#endif

/*
 * Takes tb->writer.  On a shared bucket whose last holder died holding it
 * (EOWNERDEAD), first repairs what that writer left half done, then marks
 * the mutex consistent (docs/DESIGN.md, "Crashes"); a regime found frozen
 * with the lock taken is repaired the same way (no live writer froze it).
 * 0, -EBADMSG for a corrupt bucket or a mutex that fails to lock
 * (ENOTRECOVERABLE, EINVAL: marked corrupt), or -EDEADLK when the lock is
 * not released within TB__LOCK_WAIT_NS (a stopped holder, or a lock word
 * no live holder wrote).
 */
int tb__writer_lock(struct tokenbucket *tb);
/*
 * For a call that found the regime frozen (gen odd): if the writer that
 * froze it died holding the lock, repairs the bucket as tb__writer_lock
 * would.  Never waits: a live writer's lock is left alone.
 */
void tb__writer_help(struct tokenbucket *tb);

/* Where named objects live, and the prefix that keeps them apart from others. */
#define TB__SHM_DIR "/dev/shm/"
#define TB__SHM_PREFIX "tokenbucket."
#define TB__PATH_SIZE (sizeof(TB__SHM_DIR TB__SHM_PREFIX) + TOKENBUCKET_NAME_MAX)

/*
 * tokenbucket_init_shared and tokenbucket_open with the rate as the bucket
 * stores it (kind, and p/q in lowest terms; 0/1 unless finite), for the
 * double and the exact (struct tokenbucket_limit) entry points alike.
 */
int tb__init_shared(struct tokenbucket **tbp, void *mem, size_t size, enum tb__kind kind,
		    uint64_t p, uint64_t q, uint64_t burst, unsigned flags);
int tb__open(struct tokenbucket **tbp, const char *name, enum tb__kind kind, uint64_t p,
	     uint64_t q, uint64_t burst, unsigned flags, unsigned mode, unsigned *status);

/* Whether 8-byte atomics are lock-free and address-free here. */
bool tb__atomics_shareable(void);
/* The file of a named object, or -EINVAL / -ENAMETOOLONG for a bad name. */
int tb__shm_path(const char *name, char *path, size_t size);

/* What tb__shm_open needs to know of a kind of named object. */
struct tb__shm_ops {
	size_t map_size;    /* bytes an existing object maps; 0: the whole file */
	size_t create_size; /* bytes a new object has */
	size_t min_size;    /* a shorter file is not one (-EBADMSG) */
	int (*init)(void *map, void *arg);                     /* a new object, in place */
	int (*check)(const void *map, size_t have, void *arg); /* an existing one: have bytes */
	void *arg;
};
/*
 * Opens the named object (a bucket or a table), creating it complete before
 * its name appears if it does not exist; *created says which.  0 or a
 * negative errno; *map and *mapped describe the mapping.
 */
int tb__shm_open(const char *name, unsigned mode, const struct tb__shm_ops *ops, void **map,
		 size_t *mapped, bool *created);

/* ---- rovers.c: the shared core ------------------------------------------- */

/* The clock's slow path: records now > seen; fixes the origin on the first time. */
int64_t tb__observe_later(struct tokenbucket *tb, int64_t now, int64_t seen);
/* Writers only: makes n the regime in force (the next even gen). */
void tb__publish(struct tokenbucket *tb, const struct tb__view *n);
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

/* Production since the origin in 1/q tokens: (t - origin) * p + fine0. */
static inline tb__u128 tb__fine_units(const struct tb__view *v, int64_t t)
{
	return (tb__u128)((uint64_t)t - (uint64_t)v->origin) * v->p + v->fine0;
}

/* A producing regime (writers store p = 0, q = 1 otherwise) at a time not before its origin. */
static inline bool tb__producing(const struct tb__view *v, int64_t t)
{
	return v->p != 0 && v->origin != TB__NO_TIME && t >= v->origin;
}

/* F(min(t, until)), 0 where nothing is produced. */
static inline tb__u128 tb__fine_at(const struct tb__view *v, int64_t t)
{
	if (t > v->until)
		t = v->until;
	return tb__producing(v, t) ? tb__fine_units(v, t) : 0;
}

/* P(t): whole tokens produced from the origin to t (frozen at v->until), exactly. */
static inline tb__u128 tb__production(const struct tb__view *v, int64_t t)
{
	tb__u128 f = tb__fine_at(v, t);
	if (v->q == 1)
		return f;
	if ((f >> 64) == 0)
		return (uint64_t)f / v->q; /* one 64-bit division in the usual case */
	return f / v->q;
}

/*
 * Reads the regime in force into *v (its gen, slot and kind; until is left
 * alone).  Returns false while a rate change freezes it (gen odd).  The
 * reads are validated by reading gen again after them (tb__view, or
 * tb__fast_valid on the fast paths).
 */
static inline __attribute__((always_inline)) bool tb__load_regime(const struct tokenbucket *tb,
								  struct tb__view *v)
{
	v->gen = atomic_load_explicit(&tb->gen, memory_order_acquire);
	const struct tb__slot *s = &tb->slot[(v->gen >> 1) & 1];
	v->origin = atomic_load_explicit(&s->origin, memory_order_relaxed);
	v->limit = atomic_load_explicit(&s->limit, memory_order_relaxed);
	v->fine0 = atomic_load_explicit(&s->fine0, memory_order_relaxed);
	v->p = atomic_load_explicit(&s->p, memory_order_relaxed);
	v->q = atomic_load_explicit(&s->q, memory_order_relaxed);
	v->hoff = atomic_load_explicit(&s->hoff, memory_order_relaxed);
	v->kind = (enum tb__kind)atomic_load_explicit(&s->kind, memory_order_relaxed);
	return (v->gen & 1) == 0;
}

/* Reads the production in force consistently: a seqlock on gen. */
static inline void tb__view(const struct tokenbucket *tb, struct tb__view *v)
{
	for (;;) {
		TB__ROUND();
		bool stable = tb__load_regime(tb, v);
		v->until = stable ? TOKENBUCKET_NEVER
				  : atomic_load_explicit(&tb->frozen_at, memory_order_relaxed);
		/*
		 * The slot of regime e is rewritten only for regime e + 2, after
		 * gen passed 2e + 1: if gen is unchanged after the reads, they
		 * were of one regime.
		 */
		atomic_thread_fence(memory_order_acquire);
		if (atomic_load_explicit(&tb->gen, memory_order_relaxed) == v->gen)
			return;
	}
}

/*
 * A caller's time as the bucket reads it: INT64_MIN is "no time seen yet"
 * and INT64_MAX is TOKENBUCKET_NEVER, so neither is a time the bucket sees.
 */
static inline int64_t tb__time(int64_t now)
{
	return now == TB__NO_TIME ? TB__NO_TIME + 1
	       : now == TOKENBUCKET_NEVER ? TOKENBUCKET_NEVER - 1
					  : now;
}

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

/* CLOCK_MONOTONIC in ns; inlined into the calls without _at (tokenbucket_now is this). */
static inline int64_t tb__now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* An unlimited rate: nothing is taken and the bucket stays full. */
static inline bool tb__unlimited(const struct tokenbucket *tb)
{
	return atomic_load_explicit(&tb->kind, memory_order_relaxed) == TB__INF;
}

static inline bool tb__capped(const struct tokenbucket *tb)
{
	return tb->flags & TOKENBUCKET_CAPPED_RELEASE;
}

static inline int64_t tb__level(uint64_t head, uint64_t tail)
{
	return (int64_t)(head - tail);
}

/*
 * Whether t lies past the view's horizon, where production may be too large
 * to use (or the origin is not fixed yet: limit is INT64_MIN until it is).
 */
static inline bool tb__past_horizon(const struct tb__view *v, int64_t t)
{
	return t >= v->limit;
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
		tb__view(tb, v);
		*at = atomic_load(&tb->clock);
		if (__builtin_expect(*at == TB__NO_TIME || !tb__past_horizon(v, *at), 1)) {
			if (tb__capped(tb))
				tb__cap_to_ceil(tb, v, *at);
			return true;
		}
		/* Each normalization moves the horizon past the clock, unless the words forbid it. */
		if (round == TB__ROUNDS_MAX)
			return tb__give_up(tb);
		if (tb__normalize(tb, *at))
			return false;
	}
}

/* The head at t, modulo 2^64 like the rovers: head + hoff + P(t). */
static inline uint64_t tb__head_at(const struct tb__view *v, uint64_t head, int64_t t)
{
	return head + v->hoff + (uint64_t)tb__production(v, t);
}

/*
 * The level at t, head + hoff + P(t) - tail.  head + hoff - tail is a valid
 * int64_t (docs/DESIGN.md); P(t) may approach 2^128, so it is saturated at
 * 2^126, far above any burst: the value is exact whenever it matters, and
 * amounts to move rovers by are taken modulo 2^64 from tb__head_at.
 */
static inline tb__i128 tb__sat(tb__u128 x)
{
	const tb__u128 sat = (tb__u128)1 << 126;
	return (tb__i128)(x < sat ? x : sat);
}

static inline tb__i128 tb__raw_level(const struct tb__view *v, uint64_t head, uint64_t tail,
				     int64_t t)
{
	return (tb__i128)tb__level(head + v->hoff, tail) + tb__sat(tb__production(v, t));
}

/* The level never reported above burst. */
static inline int64_t tb__capped_level(tb__i128 raw, uint64_t burst)
{
	return raw > (tb__i128)burst ? (int64_t)burst : (int64_t)raw;
}

/*
 * Whether head + hoff + P(t) - tail >= x, given e = head + hoff - tail: as
 * P(t) >= x - e, that is (t - origin) * p + fine0 >= (x - e) * q, with no
 * division (x - e < 2^64, so the product fits 128 bits).
 */
static inline bool tb__level_at_least(const struct tb__view *v, int64_t e, int64_t t, tb__i128 x)
{
	tb__i128 need = x - e;
	return need <= 0 || tb__fine_at(v, t) >= (tb__u128)need * v->q;
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
 * burst is dropped in the same CAS when q = 1 (P(t) = F(t)).
 */
static inline __attribute__((always_inline)) enum tb__fast_take
tb__fast_take(struct tokenbucket *tb, int64_t now, uint64_t n, uint64_t burst, int64_t *at,
	      uint64_t *ticket, uint64_t *seen_tail)
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
		return TB__FAST_TAKEN;
	}
	return TB__FAST_SLOW;
}

#endif /* TOKENBUCKET_INTERNAL_H */
