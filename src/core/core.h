/* SPDX-License-Identifier: MIT */
/*
 * The bucket's state and the helpers the two faces share.  docs/core.md
 * explains the model; the comments here state what each field promises.
 *
 * Every shared word is a naturally aligned 8-byte (or smaller) atomic, so the
 * state is lock-free and address-free wherever 8-byte compare-and-swap is.
 */
#ifndef TOKENBUCKET_CORE_H
#define TOKENBUCKET_CORE_H

#include <pthread.h>
#include <stdalign.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "span.h"
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
 * a ticket stays comparable with the head (docs/core.md).
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
	 * Nonzero once a call found words no bucket can hold (docs/shm.md,
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

/* The greatest common divisor (a when b is 0): every reduction to lowest terms. */
tb__u128 tb__gcd(tb__u128 a, tb__u128 b);
/* Tokens per second as an exact p/q tokens per ns; returns the kind. */
enum tb__kind tb__ratio_from_rate(double rate, uint64_t *p, uint64_t *q);
/* Reduces tokens per period_ns to lowest terms; returns the kind. */
enum tb__kind tb__ratio_from_every(uint64_t tokens, int64_t period_ns, uint64_t *p,
				   uint64_t *q);
/*
 * The rate of a limit as a bucket stores it: kind, and p/q in lowest terms
 * (0/1 unless finite).  -EINVAL for a period no rate has.  (limit.c)
 */
int tb__limit_ratio(const struct tokenbucket_limit *lim, enum tb__kind *kind, uint64_t *p,
		    uint64_t *q);
/* The first time after "at" when j more tokens than P(at) are there. */
int64_t tb__time_of(const struct tb__view *v, int64_t at, uint64_t j);
/* Nanoseconds from "at" to tb__time_of (which goes to *act); NEVER if never or too far. */
int64_t tb__wait_of(const struct tb__view *v, int64_t at, uint64_t j, int64_t *act);
/* Whole seconds in ns, rounded up; NEVER stays NEVER. */
int64_t tb__seconds_up(int64_t ns);
/* tb__seconds_of (seconds.h) the long way: tb__seconds_up of tb__wait_of, out of line. */
int64_t tb__seconds_via_wait(const struct tb__view *v, int64_t at, uint64_t j);
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
/*
 * A level below burst plus the fraction made at t, as tokens_at reports it
 * (one rounding, from long double): buckets and tables alike.
 */
double tb__tokens_value(const struct tb__view *v, int64_t level, int64_t t);
/* Until when a regime may run before it must be normalized (INT64_MAX: for ever). */
int64_t tb__limit(int64_t origin, uint64_t p, uint64_t q, uint64_t fine0);

/* ---- result.c: a decision as a server reports it ------------------------- */

/*
 * Fills *res for a decision on n tokens at "at" under view v: level is the
 * whole tokens after it (never above burst; negative in debt).
 */
void tb__result(const struct tb__view *v, int64_t at, uint64_t n, uint64_t burst, bool allowed,
		int64_t level, struct tokenbucket_result *res);
/*
 * Fills *res for a decision on n tokens already made (allowed), at the
 * bucket's clock: the report of tokenbucket_allow_result_at.  0, or
 * -EBADMSG for a corrupt bucket.  (Sets report each bucket with it.)
 */
/* Nanoseconds until a bucket at level is full again (burst): 0 if full, NEVER if never. */
int64_t tb__reset_after(const struct tb__view *v, int64_t at, uint64_t burst, int64_t level);
int tb__report(struct tokenbucket *tb, uint64_t n, bool allowed, struct tokenbucket_result *res);
/*
 * Folds member i's result into the result of a set decision (buckets or
 * tables): the member reported is the one that refused (index refused) or,
 * if allowed, the first with the fewest whole tokens left (*fewest starts
 * at UINT64_MAX); the waits are the latest.  out starts as {allowed,
 * index = refused}; its retry_after_ns is 0 at the end if allowed.
 */
static inline void tb__set_fold(struct tokenbucket_set_result *out, size_t i, size_t refused,
				const struct tokenbucket_result *one, uint64_t *fewest)
{
	/* Inline: a set pays it per member, on the path its ratio goal is about. */
	if (out->allowed ? one->remaining < *fewest : i == refused) {
		*fewest = one->remaining;
		out->index = i;
		out->limit = one->limit;
		out->remaining = one->remaining;
	}
	if (one->retry_after_ns > out->retry_after_ns)
		out->retry_after_ns = one->retry_after_ns;
	if (one->reset_after_ns > out->reset_after_ns)
		out->reset_after_ns = one->reset_after_ns;
	if (out->allowed)
		out->retry_after_ns = 0;
}

/* ---- regime.c: life cycle and writers ----------------------------------- */

/* -EINVAL for unknown flags, -ERANGE for a burst beyond TOKENBUCKET_BURST_MAX. */
int tb__bucket_check(uint64_t burst, unsigned flags);
/*
 * Initialises a full bucket with no time seen in the memory at tb (checked
 * arguments); attr is the writer mutex's (NULL: the default).
 */
int tb__bucket_init(struct tokenbucket *tb, enum tb__kind kind, uint64_t p, uint64_t q,
		    uint64_t burst, unsigned flags, const pthread_mutexattr_t *attr);
/*
 * The writers' changes, for a caller that holds tb->writer: the rate (kind,
 * p/q as tb__ratio_from_* give them) and the burst (checked), at the latest
 * time seen, at least now.  0, or -EBADMSG for a corrupt bucket.
 */
int tb__change_rate(struct tokenbucket *tb, int64_t now, enum tb__kind kind, uint64_t p,
		    uint64_t q);
int tb__change_burst(struct tokenbucket *tb, int64_t now, uint64_t burst);

/* ---- writer.c: the writer lock, its repair, what writers publish ------ */

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
 * the mutex consistent (docs/shm.md, "Crashes"); a regime found frozen
 * with the lock taken is repaired the same way (no live writer froze it).
 * 0, -EBADMSG for a corrupt bucket or a mutex that fails to lock
 * (ENOTRECOVERABLE, EINVAL: marked corrupt), or -EDEADLK when the lock is
 * not released within TB__LOCK_WAIT_NS (a stopped holder, or a lock word
 * no live holder wrote).
 */
int tb__writer_lock(struct tokenbucket *tb);
/*
 * Locks a writer mutex (a bucket's or a table's), waiting at most
 * TB__LOCK_WAIT_NS: 0, EOWNERDEAD (locked: the caller repairs, then marks
 * it consistent), ETIMEDOUT, or another positive errno of the lock.
 */
int tb__lock_bounded(pthread_mutex_t *m);
/*
 * For a call that found the regime frozen (gen odd): if the writer that
 * froze it died holding the lock, repairs the bucket as tb__writer_lock
 * would.  Never waits: a live writer's lock is left alone.
 */
void tb__writer_help(struct tokenbucket *tb);
/* Writers only: makes n the regime in force (the next even gen). */
void tb__publish(struct tokenbucket *tb, const struct tb__view *n);
/* An unlimited rate means full: head rises to burst (capped: within ceil). */
void tb__fill(struct tokenbucket *tb, const struct tb__view *v, int64_t at);

/* ---- The arithmetic of a view, inline (tables use it too) ---------------- */

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

/* a / d and a % d exactly: one 64-bit division when a fits 64 bits (the usual case). */
static inline tb__u128 tb__div(tb__u128 a, uint64_t d)
{
	return (a >> 64) == 0 ? (uint64_t)a / d : a / d;
}
static inline uint64_t tb__mod(tb__u128 a, uint64_t d)
{
	return (a >> 64) == 0 ? (uint64_t)a % d : (uint64_t)(a % d);
}

/* Whole tokens in f units of 1/q token: f / q, exactly. */
static inline tb__u128 tb__whole(const struct tb__view *v, tb__u128 f)
{
	return v->q == 1 ? f : tb__div(f, v->q);
}

/* P(t): whole tokens produced from the origin to t (frozen at v->until), exactly. */
static inline tb__u128 tb__production(const struct tb__view *v, int64_t t)
{
	return tb__whole(v, tb__fine_at(v, t));
}

/* Whether tb__time_of can find a time: a finite rate producing from its origin. */
static inline bool tb__timed(const struct tb__view *v)
{
	return v->kind == TB__FINITE && v->p != 0 && v->q != 0 && v->origin != TB__NO_TIME;
}

/* The fine units still to produce from "at" until j more tokens than P(at) are there. */
static inline tb__u128 tb__need_of(const struct tb__view *v, int64_t at, uint64_t j)
{
	tb__u128 rem = at >= v->origin ? tb__mod(tb__fine_units(v, at), v->q) : 0;
	return (tb__u128)j * v->q - rem;
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

/* The head at t, modulo 2^64 like the rovers: head + hoff + P(t). */
static inline uint64_t tb__head_at(const struct tb__view *v, uint64_t head, int64_t t)
{
	return head + v->hoff + (uint64_t)tb__production(v, t);
}

/*
 * The level at t, head + hoff + P(t) - tail.  head + hoff - tail is a valid
 * int64_t (docs/core.md); P(t) may approach 2^128, so it is saturated at
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

#endif /* TOKENBUCKET_CORE_H */
