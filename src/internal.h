/* SPDX-License-Identifier: MIT */
/*
 * The bucket's state and the helpers the two faces share.  docs/DESIGN.md
 * explains the model; the comments here state what each field promises.
 */
#ifndef TOKENBUCKET_INTERNAL_H
#define TOKENBUCKET_INTERNAL_H

#include <pthread.h>
#include <stdalign.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <time.h>

#include "tokenbucket.h"

/* "No time seen yet" in the clock; callers' INT64_MIN is read as INT64_MIN + 1. */
#define TB__NO_TIME INT64_MIN

/* What a regime produces; mirrored in tokenbucket.kind for the fast paths. */
enum tb__kind {
	TB__FINITE = 0, /* p tokens every q ns, p >= 1, q >= 1 */
	TB__ZERO = 1,   /* never produces */
	TB__INF = 2,    /* unlimited: nothing is ever taken, the bucket stays full */
};

/*
 * A rate regime: production P(t) = floor((t - origin) * p / q) whole tokens
 * for t >= origin.  A slot is written only by a writer (under tb->writer)
 * while it is not the current regime, and read by anyone.  Fields are atomics
 * so that a reader racing a writer two regimes later reads stale values, never
 * torn ones; the reader then notices the regime moved and retries.
 */
struct tb__slot {
	_Atomic int64_t origin; /* ns; TB__NO_TIME until the bucket's clock is fixed */
	_Atomic uint64_t p;     /* tokens per period; 0 for ZERO */
	_Atomic uint64_t q;     /* period in ns; 0 for INF */
	_Atomic uint32_t kind;  /* enum tb__kind */
};

/*
 * The production claim.  next is the first time at which a whole token not
 * yet claimed appears (TOKENBUCKET_NEVER: none will; TB__NO_TIME: the clock is
 * not fixed yet).  Claiming the tokens produced up to now moves next past now.
 * regime counts rate changes and resets; it makes a claim computed under an
 * old regime fail its compare-and-swap.  16 bytes, changed only by a 16-byte
 * CAS; accessed only through the tb__marker_* helpers below.
 */
struct tb__marker {
	int64_t next;
	uint64_t regime;
} __attribute__((aligned(16)));

/* A consistent view of the current regime, taken by tb__view(). */
struct tb__rate {
	int64_t origin;
	uint64_t p;
	uint64_t q;
	enum tb__kind kind;
};

struct tokenbucket {
	/*
	 * Line 0: all that allow, grab and deficiency write or read, except
	 * marker.next.  Rovers count whole tokens modulo 2^64 and are compared
	 * as signed differences:
	 *   level = head - tail, -TOKENBUCKET_DEBT_MAX <= level <= burst.
	 * tail and clock are written by every take; head by credits and refunds.
	 */
	alignas(64) _Atomic uint64_t tail; /* tokens ever taken; tickets are its values */
	_Atomic int64_t clock;             /* latest time seen, only grows (except reset) */
	_Atomic uint64_t head;             /* tokens ever credited or given back */
	_Atomic uint64_t ceil;             /* capped release: head never passes it */
	_Atomic uint64_t burst;
	_Atomic uint64_t threshold;        /* replenish credits only this many at once */
	_Atomic uint32_t kind;             /* enum tb__kind of the current regime */
	uint32_t flags;                    /* TOKENBUCKET_CAPPED_RELEASE; fixed at create */

	/*
	 * Line 1: production claim and rate regimes, written once per claim and
	 * read by every take (marker.next: is there anything to claim?), so
	 * takes keep it shared in their caches between claims.
	 */
	alignas(64) struct tb__marker marker;
	_Atomic uint64_t regime; /* marker.regime as last published; lags it, never leads */
	struct tb__slot slot[2]; /* regime e lives in slot[e & 1] */

	/* Writers only: set_*, reset_at. */
	alignas(64) pthread_mutex_t writer;
};

/* ---- ratio.c: exact arithmetic of a regime ------------------------------- */

/* Tokens per second as an exact p/q tokens per ns; returns the kind. */
enum tb__kind tb__ratio_from_rate(double rate, uint64_t *p, uint64_t *q);
/* Reduces tokens per period_ns to lowest terms; returns the kind. */
enum tb__kind tb__ratio_from_every(uint64_t tokens, int64_t period_ns, uint64_t *p,
				   uint64_t *q);
/* P(b) - P(a) for origin <= a <= b, saturating at UINT64_MAX. */
uint64_t tb__produced(const struct tb__rate *r, int64_t a, int64_t b);
/*
 * tb__produced(r, a, b) and, in *next, tb__time_of(r, b, 1), with the fewest
 * divisions: what a claim from a to b needs.  Nothing to claim (a >= b, or
 * no finite rate) gives 0 and *next NEVER.
 */
uint64_t tb__claimable(const struct tb__rate *r, int64_t a, int64_t b, int64_t *next);
/* The first time after the claimed point "at" when j more tokens are there. */
int64_t tb__time_of(const struct tb__rate *r, int64_t at, uint64_t j);
/* The fraction of a token produced at t beyond P(t), in [0, 1). */
double tb__fraction(const struct tb__rate *r, int64_t t);
/* Nanoseconds needed for n tokens, rounded up; NEVER when not representable. */
int64_t tb__duration(const struct tb__rate *r, uint64_t n);
/* The regime's rate as a double in tokens per second. */
double tb__rate_value(const struct tb__rate *r);
/* An origin at "at" minus the time the new rate needs for the fraction carried. */
int64_t tb__carry_origin(const struct tb__rate *old, const struct tb__rate *new, int64_t at);

/* ---- rovers.c: the shared core ------------------------------------------- */

/* The clock's slow path: records now > seen; fixes the origin on the first time. */
int64_t tb__observe_later(struct tokenbucket *tb, int64_t now, int64_t seen);
/* Claims and credits the tokens produced up to now, if at least threshold. */
uint64_t tb__produce(struct tokenbucket *tb, int64_t now, uint64_t threshold);
/* Adds up to k tokens to head, within burst (from tail_before) and ceil. */
uint64_t tb__credit(struct tokenbucket *tb, uint64_t k, uint64_t tail_before);
/* Raises ceil by up to n, never past tail + burst; returns how much. */
uint64_t tb__raise_ceil(struct tokenbucket *tb, uint64_t n);
/* Gives n tokens back (refund, cancel); returns how many fitted. */
uint64_t tb__give_back(struct tokenbucket *tb, uint64_t n);
/* Reads a slot; a slot torn by a concurrent writer reads as an inert ZERO regime. */
void tb__load_slot(const struct tb__slot *s, struct tb__rate *r);
/* Reads the current regime and marker consistently. */
void tb__view(const struct tokenbucket *tb, struct tb__rate *r, struct tb__marker *m);

/*
 * The marker, through GCC's __atomic builtins (clang has them too): a 16-byte
 * load or CAS (libatomic: cmpxchg16b on x86-64, casp on aarch64), and plain
 * 8-byte loads of either half.  A half-load is single-copy atomic for its
 * half; a pair of them may be torn, so it only seeds a CAS, which checks it.
 */
static inline int64_t tb__marker_next(const struct tokenbucket *tb)
{
	return __atomic_load_n(&tb->marker.next, __ATOMIC_RELAXED);
}

static inline struct tb__marker tb__marker_peek(const struct tokenbucket *tb)
{
	/* Acquire, so that a later load of next cannot move before them. */
	return (struct tb__marker){
		__atomic_load_n(&tb->marker.next, __ATOMIC_ACQUIRE),
		__atomic_load_n(&tb->marker.regime, __ATOMIC_ACQUIRE),
	};
}

static inline struct tb__marker tb__marker_load(const struct tokenbucket *tb)
{
	/* libatomic's 16-byte load may be a CAS writing back what it read: hence the cast. */
	struct tb__marker m;
	__atomic_load((struct tb__marker *)&tb->marker, &m, __ATOMIC_SEQ_CST);
	return m;
}

/* On failure *expected becomes the marker's current value (read atomically). */
static inline bool tb__marker_cas(struct tokenbucket *tb, struct tb__marker *expected,
				  struct tb__marker desired)
{
	return __atomic_compare_exchange(&tb->marker, expected, &desired, false,
					 __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
}

/*
 * A caller's time as the bucket reads it: INT64_MIN is "no time seen yet"
 * and INT64_MAX is TOKENBUCKET_NEVER (a claim's next time saturates there),
 * so neither is ever a time the bucket has seen.
 */
static inline int64_t tb__time(int64_t now)
{
	return now == TB__NO_TIME ? TB__NO_TIME + 1
	       : now == TOKENBUCKET_NEVER ? TOKENBUCKET_NEVER - 1
					  : now;
}

/* Records now in the clock; returns the effective now, max(now, latest seen). */
static inline int64_t tb__observe(struct tokenbucket *tb, int64_t now)
{
	now = tb__time(now);
	int64_t seen = atomic_load_explicit(&tb->clock, memory_order_relaxed);
	return now > seen ? tb__observe_later(tb, now, seen) : seen;
}

/* CLOCK_MONOTONIC in ns; inlined into the calls without _at (tokenbucket_now is this). */
static inline int64_t tb__now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* The Go face's entry: observe now and credit everything produced up to it. */
static inline int64_t tb__advance(struct tokenbucket *tb, int64_t now)
{
	now = tb__observe(tb, now);
	if (now >= tb__marker_next(tb))
		tb__produce(tb, now, 1);
	return now;
}

/* An unlimited rate: nothing is taken and the bucket stays full. */
static inline bool tb__unlimited(const struct tokenbucket *tb)
{
	return atomic_load_explicit(&tb->kind, memory_order_relaxed) == TB__INF;
}

static inline int64_t tb__level(uint64_t head, uint64_t tail)
{
	return (int64_t)(head - tail);
}

/* Where a take starts: tokens above burst (left by a lowered burst) are dropped first. */
static inline uint64_t tb__take_base(uint64_t head, uint64_t tail, uint64_t burst)
{
	return tb__level(head, tail) > (int64_t)burst ? head - burst : tail;
}

#endif /* TOKENBUCKET_INTERNAL_H */
