/* SPDX-License-Identifier: MIT */
/*
 * Per-key tables: one bucket per key in a fixed array of slots, lock-free,
 * placeable in shared memory.
 *
 * Every key shares the table's cumulative production Q(t) = hoff + P(t) of
 * the regime in force and keeps only a tail: level(t) = min(burst, Q(t) -
 * tail).  A new key gets tail <= Q(t) - burst (full), so each key is
 * exactly a single bucket whose origin is the table's.  A rate or burst
 * change (1.2) publishes a new regime whose Q continues the old one's at
 * the time of the change, so live keys' tails never move for it; tails
 * are read modulo 2^55 relative to Q, and a re-anchor (the same change to
 * the same limit) every TBT_ANCHOR tokens keeps them within range, so a
 * table has no horizon.  A slot changes hands by a claim (state
 * version made odd), a fingerprint written under the claim, and a confirm
 * (version made even); a taker compares-and-swaps the state it read, so a
 * take never lands on a slot that changed hands.  docs/table.md
 * gives the argument and what a crash at each step leaves.
 *
 * What the table's files share: the handle, the state words, the reading
 * of regimes and production, the lookup and the take, inline for the
 * allow path; what they call out of line is declared beside them
 * (tb__table_*, internal to the library).
 */
#ifndef TOKENBUCKET_TABLE_INTERNAL_H
#define TOKENBUCKET_TABLE_INTERNAL_H

#include <errno.h>
#include <stdbool.h>

#include "relax.h"
#include "siphash.h"
#include "shm.h"
#include "table.h"

/* Table handles say how their memory was obtained. */
enum tbt_owner {
	TBT_HEAP,   /* tokenbucket_table_create: freed with the handle */
	TBT_PLACED, /* caller memory: left alone */
	TBT_NAMED,  /* tokenbucket_table_open: unmapped with the handle */
};

/*
 * A process's handle: the memory, and the constants of its header copied
 * and checked once, so that the hot paths read private memory and a
 * header changed behind our back cannot send an index out of bounds.  The
 * rate and burst may change: every call reads them from the regimes.
 */
/*
 * A handle's private copy of a regime it read and checked, for allow's warm
 * path: a call that finds the shared gen equal to an entry's gen reads these
 * words instead of the shared slot, and none of the checks.  Entry
 * (gen / 2) & 1, so that the regimes on either side of a change stay side
 * by side.  Threads share the handle: a filler takes an entry by moving its
 * gen to TBT_FILLING with a compare-and-swap, and a reader reads gen again
 * after the values (a seqlock per entry, with one writer at a time).  Every
 * word an entry ever holds comes from a checked regime (or is the neutral
 * start, TBT_UNKEPT: q 1, hspan 0, which no call passes), so even a shared
 * gen that a stray write set to either mark gives wrong answers, never a
 * division by 0.
 */
#define TBT_FILLING UINT64_MAX
#define TBT_UNKEPT (UINT64_MAX - 1)
struct tbt_cached {
	_Atomic uint64_t gen;
	_Atomic int64_t origin; /* the regime's, or the table's for regime 0 */
	_Atomic uint64_t fine0, p, q, hoff, burst, hspan;
};

struct tokenbucket_table {
	struct tbt_mem *mem;
	struct tbt_line *line;
	uint64_t lines;
	uint64_t k0, k1;
	unsigned flags;
	enum tbt_owner owner;
	size_t mapped;
	struct tbt_cached cached[2];
};

/* ---- State words ---------------------------------------------------------- */

static inline uint64_t st_ver(uint64_t st)
{
	return st >> TBT_VER_SHIFT;
}

static inline bool st_claimed(uint64_t st)
{
	return st_ver(st) & 1;
}

static inline bool st_empty(uint64_t st)
{
	return st & TBT_EMPTY;
}

static inline uint64_t st_tail(uint64_t st)
{
	return st & TBT_TAIL_MASK;
}

/* The state after st with the version moved on by one, emptiness and tail given. */
static inline uint64_t st_next(uint64_t st, bool empty, uint64_t tail)
{
	return (((st_ver(st) + 1) & 0xff) << TBT_VER_SHIFT) | (empty ? TBT_EMPTY : 0) | tail;
}

/* A take: the same version and emptiness, another tail. */
static inline uint64_t st_with_tail(uint64_t st, uint64_t tail)
{
	/* Masked: in a corrupt table a tail may outgrow its bits, never the version's. */
	return (st & ~TBT_TAIL_MASK) | (tail & TBT_TAIL_MASK);
}

/* The fingerprint word a confirmed state st must find for key fingerprint fp. */
static inline uint64_t fp_for(uint64_t fp, uint64_t st)
{
	return fp | ((st_ver(st) - 1) & TBT_TAG_MASK);
}

/* ---- Regimes and production ---------------------------------------------- */

/* Everything a call on one key works with. */
struct tbt_call {
	uint64_t fp;             /* the key's fingerprint, tag bits clear */
	struct tbt_line *bucket[2]; /* its two buckets' first lines (the same if one bucket) */
	int nc;                     /* its candidates: the slots of bucket a, then of bucket b */
	int64_t now;             /* the caller's time, as tb__time reads it */
	int64_t at;              /* the table's time of the call (origin applied) */
	/*
	 * The regime in force when the call read it: origin resolved, until =
	 * frozen_at while a change freezes it, hoff.  The table's production
	 * is a regime of the core's, read through the core's arithmetic
	 * (core.h, ratio.c).
	 */
	struct tb__view v;
	uint64_t burst;
	uint64_t hspan; /* ns from v.origin to the horizon */
};

/*
 * F(at) in 1/q tokens, frozen at until.  A call's time is never before its
 * regime's origin (read_regime), nor is frozen_at, so F needs none of
 * tb__fine_at's checks.
 */
static inline tb__u128 fine_of(const struct tb__view *v, int64_t at)
{
	return tb__fine_units(v, at > v->until ? v->until : at);
}

/*
 * a - b for two tails (or a tail and Q) modulo 2^55, as a signed value:
 * tails are read relative to Q, and every tail a call writes lies within
 * 2^54 of Q (a regime produces at most TBT_ANCHOR tokens before the table
 * is re-anchored), so the difference is exact.
 */
static inline int64_t tdiff(uint64_t a, uint64_t b)
{
	return (int64_t)((a - b) << (64 - TBT_VER_SHIFT + 1)) >> (64 - TBT_VER_SHIFT + 1);
}

/*
 * Whether Q(at) - tail >= x (x a level, at most 2^40 beyond a burst):
 * P(at) >= tail + x - hoff, with no division.
 */
static inline bool level_at_least(const struct tbt_call *c, int64_t at, uint64_t tail, uint64_t x)
{
	int64_t need = tdiff(tail + x, c->v.hoff);
	return need <= 0 || fine_of(&c->v, at) >= (tb__u128)(uint64_t)need * c->v.q;
}

/* Whether a tail is full at "at": Q(at) - tail >= burst. */
static inline bool full_at(const struct tbt_call *c, int64_t at, uint64_t tail)
{
	return level_at_least(c, at, tail, c->burst);
}

/* Q(at) - burst modulo 2^55, the tail of a full key, exactly: one division. */
static inline uint64_t full_tail(const struct tbt_call *c, int64_t at)
{
	return (c->v.hoff + (uint64_t)tb__whole(&c->v, fine_of(&c->v, at)) - c->burst) &
	       TBT_TAIL_MASK;
}

/* The level at "at" of tail: Q(at) - tail, never above burst. */
static inline int64_t level_of(const struct tbt_call *c, int64_t at, uint64_t tail)
{
	if (full_at(c, at, tail))
		return (int64_t)c->burst;
	return tdiff(full_tail(c, at) + c->burst, tail);
}

/*
 * Whether the regime has produced TBT_ANCHOR tokens by "at": a call that
 * writes a tail then re-anchors the table first (tb__table_reanchor), so that every
 * tail written lies within 2^54 of Q.  A call's time is never before its
 * regime's origin.
 */
static inline bool past_horizon(const struct tbt_call *c, int64_t at)
{
	return (uint64_t)at - (uint64_t)c->v.origin >= c->hspan;
}

static inline bool table_corrupt(const struct tokenbucket_table *t)
{
	return atomic_load_explicit(&t->mem->header.h.corrupt, memory_order_relaxed) != 0;
}

/* Marks the table corrupt for every process that maps it; returns false. */
static inline bool table_give_up(struct tokenbucket_table *t)
{
	atomic_store_explicit(&t->mem->header.h.corrupt, 1, memory_order_relaxed);
	return false;
}

/* What a view holds beyond a regime's words, in force (not frozen). */
static inline void view_complete(struct tb__view *v)
{
	v->kind = v->p ? TB__FINITE : TB__ZERO;
	v->limit = INT64_MAX; /* the core's horizon: the table keeps its own (hspan) */
	v->until = TOKENBUCKET_NEVER;
}

/*
 * Reads regime slot r into c (v, burst, hspan), with origin resolved (the
 * table's for regime 0), without the seqlock; false for words no regime
 * holds: q 0 (fine0 < q fails), a burst above the most.  A rate 0 with q
 * above 1 produces nothing all the same (F = fine0 < q).
 */
static inline __attribute__((always_inline)) bool load_slot(const struct tbt_regime *r,
							    int64_t table_origin,
							    struct tbt_call *c)
{
	struct tb__view *v = &c->v;
	int64_t origin = atomic_load_explicit(&r->origin, memory_order_relaxed);
	v->origin = origin == TB__NO_TIME ? table_origin : origin;
	v->fine0 = atomic_load_explicit(&r->fine0, memory_order_relaxed);
	v->p = atomic_load_explicit(&r->p, memory_order_relaxed);
	v->q = atomic_load_explicit(&r->q, memory_order_relaxed);
	v->hoff = atomic_load_explicit(&r->hoff, memory_order_relaxed);
	c->burst = atomic_load_explicit(&r->burst, memory_order_relaxed);
	c->hspan = (uint64_t)atomic_load_explicit(&r->hspan, memory_order_relaxed);
	view_complete(v);
	return v->fine0 < v->q && c->burst <= TOKENBUCKET_TABLE_BURST_MAX;
}

bool tb__table_read_regime_slow(struct tokenbucket_table *t, struct tbt_call *c, uint64_t most);

/*
 * read_regime's usual case, inline: the origin fixed, the regime stable
 * and valid, read once.  Everything else goes the slow way, which also
 * fails fast on a table marked corrupt.
 */
static inline __attribute__((always_inline)) bool read_regime(struct tokenbucket_table *t,
							      struct tbt_call *c, uint64_t most)
{
	const struct tbt_regimes *g = &t->mem->regimes;
	int64_t origin = atomic_load_explicit(&t->mem->header.h.origin, memory_order_acquire);
	uint64_t gen = atomic_load_explicit(&g->gen, memory_order_acquire);
	bool ok = load_slot(&g->slot[(gen >> 1) & 1], origin, c);
	atomic_thread_fence(memory_order_acquire);
	if (__builtin_expect(!ok || (gen & 1) || origin == TB__NO_TIME ||
				     atomic_load_explicit(&g->gen, memory_order_relaxed) != gen,
			     0))
		return tb__table_read_regime_slow(t, c, most);
	c->v.gen = gen;
	/* A regime's origin is never before the table's: writers start it at a later time. */
	c->at = c->now < c->v.origin ? c->v.origin : c->now;
	return true;
}

/*
 * Whether the regime the call read is still in force, read after the
 * key's clock (sequentially consistent, both): a writer's scan that
 * follows its freeze then sees that clock, so the change happens no
 * earlier than the call.
 */
static inline bool regime_holds(const struct tokenbucket_table *t, const struct tbt_call *c)
{
	return atomic_load(&t->mem->regimes.gen) == c->v.gen;
}

/* ---- Time ------------------------------------------------------------------- */

/*
 * The key's effective time: its clock moves up to at, and a time earlier
 * than its clock is read as the clock (time never runs backwards per key).
 * Sequentially consistent, like the bucket's clock: a state read before it
 * was written after the clock its writer recorded.
 */
static inline int64_t key_time(struct tbt_slot *s, int64_t at)
{
	int64_t c = atomic_load(&s->clock);
	while (at > c) {
		TB__ROUND();
		if (atomic_compare_exchange_weak(&s->clock, &c, at))
			return at;
	}
	return c;
}

/* ---- Lookup ----------------------------------------------------------------- */

static inline bool bad_key(const void *key, size_t len)
{
	return key == NULL && len != 0;
}

/*
 * Prepares the call of the key whose hash is h: candidates, the regime and
 * the table's time (fixing the origin unless most > burst, see
 * read_regime).  False for a corrupt table.
 */
static inline __attribute__((always_inline)) bool call_init_hashed(struct tokenbucket_table *t,
								   int64_t now, uint64_t h,
								   uint64_t most, struct tbt_call *c)
{
	uint64_t a, b;
	tbt_buckets_of(h, t->lines / 2, &a, &b);
	c->fp = tbt_fingerprint(h);
	c->bucket[0] = &t->line[2 * a];
	c->bucket[1] = &t->line[2 * b];
	/*
	 * The key is in either bucket: fetch both at once, not one miss after
	 * another.  Only their first lines: the rest would crowd the cache of
	 * a warm table for the few keys that live there.
	 */
	__builtin_prefetch(c->bucket[0], 1);
	__builtin_prefetch(c->bucket[1], 1);
	c->nc = a == b ? TBT_BUCKET_SLOTS : TBT_CANDIDATES;
	c->now = tb__time(now);
	return read_regime(t, c, most);
}

/* call_init_hashed of the key's hash under the table's secret. */
static inline __attribute__((always_inline)) bool call_init(struct tokenbucket_table *t, int64_t now, const void *key,
			     size_t len, uint64_t most, struct tbt_call *c)
{
	return call_init_hashed(t, now, tb__siphash13_inline(t->k0, t->k1, key, len), most, c);
}

/*
 * The key's slot, with the state read (acquire, before the fingerprint: a
 * fingerprint read after an even state belongs to it if that state is still
 * there when the caller compares-and-swaps it).  NULL if the key has none.
 */
static inline __attribute__((always_inline)) struct tbt_slot *
find_in(struct tbt_line *bucket, uint64_t fp, uint64_t *state)
{
	/* A bucket's slots lie one after another in its two lines: j * 32 bytes on. */
	for (int j = 0; j < TBT_BUCKET_SLOTS; j++) {
		struct tbt_slot *s = (struct tbt_slot *)(void *)((char *)bucket +
								 (size_t)j * sizeof(struct tbt_slot));
		uint64_t st = atomic_load_explicit(&s->state, memory_order_acquire);
		if (st_claimed(st) || st_empty(st))
			continue;
		if (atomic_load_explicit(&s->fp, memory_order_acquire) == fp_for(fp, st)) {
			*state = st;
			return s;
		}
	}
	return NULL;
}

/* find_in over the call's buckets, first a then b. */
static inline __attribute__((always_inline)) struct tbt_slot *find(const struct tbt_call *c,
								   uint64_t *state)
{
	struct tbt_slot *s = find_in(c->bucket[0], c->fp, state);
	return s != NULL || c->nc == TBT_BUCKET_SLOTS ? s : find_in(c->bucket[1], c->fp, state);
}

struct tbt_slot *tb__table_insert(struct tokenbucket_table *t, const struct tbt_call *c,
				  uint64_t *state);

/* ---- Takes --------------------------------------------------------------- */

int tb__table_reanchor(struct tokenbucket_table *t, struct tbt_call *c, int64_t at, uint64_t most);

/*
 * A take of n at "at" from a key's tail: whether the level Q(at) - tail
 * (at most burst) reaches n, with *base the tail to take from: tail, or
 * Q(at) - burst when the key is full (what lies above burst is dropped;
 * one division, only then).
 */
static inline __attribute__((always_inline)) bool decide(const struct tb__view *v, uint64_t burst,
							 int64_t at, uint64_t tail, uint64_t n,
							 uint64_t *base)
{
	tb__u128 f = fine_of(v, at);
	/* As level_at_least. */
	int64_t need = tdiff(tail + burst, v->hoff);
	if (need <= 0 || f >= (tb__u128)(uint64_t)need * v->q) {
		*base = v->hoff + (uint64_t)tb__whole(v, f) - burst;
		return true;
	}
	*base = tail;
	need = tdiff(tail + n, v->hoff);
	return need <= 0 || f >= (tb__u128)(uint64_t)need * v->q;
}

/*
 * What a set's take took from one key, for its give-back: the slot, the
 * state the take wrote and the tail it took from (after its drop).  slot
 * NULL: nothing was taken (no bucket, or tokens 0).
 */
struct tbt_taken {
	struct tbt_slot *slot;
	uint64_t after, base, tokens;
};

/* What a take decided, for the result. */
struct tbt_outcome {
	bool allowed;
	bool no_bucket;
	int64_t at;      /* the key's effective time */
	int64_t level;   /* the level after the decision (exact only when asked for) */
};

/*
 * After the key's clock: whether the call may go on with the regime it
 * read.  If a change published another, the call reads it and starts
 * again (*rounds counts that, bounded).  Returns 0 to go on, 1 to start
 * again, -EBADMSG for a corrupt table.
 */
static inline __attribute__((always_inline)) int regime_check(struct tokenbucket_table *t, struct tbt_call *c, uint64_t most,
			       int *rounds)
{
	if (__builtin_expect(regime_holds(t, c), 1))
		return 0;
	if (++*rounds == TB__ROUNDS_MAX || !read_regime(t, c, most))
		return table_give_up(t), -EBADMSG;
	return 1;
}

/*
 * The take of allow: n tokens if the level at the key's time reaches n.
 * exact asks for the level after (one division); a plain allow divides
 * only when it drops what lies above burst.  0, -ERANGE past the horizon,
 * -EBADMSG for a corrupt table.
 */
static inline __attribute__((always_inline)) int take(struct tokenbucket_table *t,
							      struct tbt_call *c, uint64_t n,
							      bool exact, struct tbt_outcome *o,
							      struct tbt_taken *k)
{
	uint64_t st;
	struct tbt_slot *s;
	int rounds = 0;
again:
	s = find(c, &st);
	if (s == NULL) {
		if (n == 0) {
			/* A key with no bucket is full: nothing to record. */
			o->allowed = true;
			o->at = c->at;
			o->level = (int64_t)c->burst;
			return 0;
		}
		s = tb__table_insert(t, c, &st);
		if (s == NULL) {
			o->allowed = t->flags & TOKENBUCKET_TABLE_FAIL_OPEN;
			o->no_bucket = true;
			o->at = c->at;
			o->level = (int64_t)c->burst;
			return 0;
		}
	}
	for (;;) {
		TB__ROUND();
		int64_t at = key_time(s, c->at);
		int moved = regime_check(t, c, n, &rounds);
		if (moved < 0)
			return moved;
		if (moved) {
			if (n > c->burst) {
				/* A change lowered the burst under n meanwhile: refused as allow refuses it. */
				o->allowed = false;
				o->at = c->at;
				o->level = (int64_t)c->burst;
				return 0;
			}
			goto again;
		}
		if (__builtin_expect(past_horizon(c, at), 0)) {
			int err = ++rounds == TB__ROUNDS_MAX ? -EBADMSG : tb__table_reanchor(t, c, at, n);
			if (err)
				return err;
			goto again;
		}
		uint64_t tail = st_tail(st), base;
		bool ok = decide(&c->v, c->burst, at, tail, n, &base);
		o->at = at;
		uint64_t seen = st;
		if (ok) {
			uint64_t after = st_with_tail(st, base + n);
			if (after == st || atomic_compare_exchange_strong(&s->state, &st, after)) {
				o->allowed = true;
				/* A key taken from full (decide dropped: base moved) has burst - n left, no division. */
				if (exact)
					o->level = base != tail ? (int64_t)(c->burst - n)
								: level_of(c, at, base + n);
				if (k)
					*k = (struct tbt_taken){
						.slot = s,
						.after = after,
						.base = base & TBT_TAIL_MASK,
						.tokens = n,
					};
				return 0;
			}
		} else {
			/* Refused only on the state and time it was decided on. */
			st = atomic_load_explicit(&s->state, memory_order_acquire);
			if (st == seen && atomic_load(&s->clock) == at) {
				o->allowed = false;
				if (exact)
					o->level = level_of(c, at, tail);
				return 0;
			}
		}
		if (st_ver(st) != st_ver(seen) || st_claimed(st) || st_empty(st))
			goto again; /* the slot changed hands: find the key again */
	}
}

/* The result of a decision on one key, as allow_result reports it. */
static inline void report(const struct tbt_call *c, const struct tbt_outcome *o, uint64_t n,
			  struct tokenbucket_result *res)
{
	tb__result(&c->v, o->at, n, c->burst, o->allowed, o->level, res);
	if (o->no_bucket) {
		res->flags |= TOKENBUCKET_RESULT_NO_BUCKET;
		/* Refused for want of a slot: one frees within the time a bucket refills. */
		if (!o->allowed)
			res->retry_after_ns = tb__duration(&c->v, c->burst);
	}
}

/* take.c */
void tb__table_peek(const struct tbt_call *c, struct tbt_outcome *o);
void tb__table_give_back_key(struct tokenbucket_table *t, struct tbt_call *c, uint64_t n,
			     int64_t time_to_act);
double tb__table_tokens_of(const struct tbt_call *c, int64_t at, uint64_t tail);

/* ---- Rates a table takes ------------------------------------------------- */

int64_t tb__table_regime_hspan(uint64_t p, uint64_t q);
int tb__table_rate_check(uint64_t tokens, int64_t period_ns, uint64_t burst, uint64_t *p,
			 uint64_t *q);
bool tb__table_regime_valid(const struct tbt_regime *r);

#endif /* TOKENBUCKET_TABLE_INTERNAL_H */
