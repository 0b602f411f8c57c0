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
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>

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

/* Spins a caller waits for another's claim before working around it. */
#define TBT_SPINS 64

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

/* Candidate i of a call: slot i % 4 of bucket i / 4 (two slots in each of its two lines). */
static inline struct tbt_slot *cand(const struct tbt_call *c, int i)
{
	return &c->bucket[i / TBT_BUCKET_SLOTS][(i % TBT_BUCKET_SLOTS) / 2].slot[i % 2];
}

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
static int64_t level_of(const struct tbt_call *c, int64_t at, uint64_t tail)
{
	if (full_at(c, at, tail))
		return (int64_t)c->burst;
	return tdiff(full_tail(c, at) + c->burst, tail);
}

/*
 * Whether the regime has produced TBT_ANCHOR tokens by "at": a call that
 * writes a tail then re-anchors the table first (reanchor), so that every
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
static bool table_give_up(struct tokenbucket_table *t)
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

/* The first call fixes the table's origin; returns it. */
static inline int64_t table_origin(struct tokenbucket_table *t, int64_t now)
{
	int64_t origin = atomic_load_explicit(&t->mem->header.h.origin, memory_order_acquire);
	if (__builtin_expect(origin == TB__NO_TIME, 0)) {
		if (atomic_compare_exchange_strong(&t->mem->header.h.origin, &origin, now))
			origin = now;
	}
	return origin;
}

static void writer_help(struct tokenbucket_table *t);

/*
 * Reads the regime in force into c (a seqlock on gen, as tb__view) and the
 * call's time: at least the table's origin and the regime's, so production
 * is never asked for before them.  The table's first call that records a
 * time fixes its origin: any call but one asking for more than burst
 * (most).  A regime found frozen whose writer died is repaired first
 * (writer_help, never waiting).  False, the table marked corrupt, for
 * words no table holds or a seqlock that never settles.
 */
static __attribute__((noinline)) bool read_regime_slow(struct tokenbucket_table *t,
						       struct tbt_call *c, uint64_t most)
{
	struct tbt_regimes *g = &t->mem->regimes;
	int64_t origin = atomic_load_explicit(&t->mem->header.h.origin, memory_order_acquire);
	for (int round = 0;; round++) {
		TB__ROUND();
		if (round == TB__ROUNDS_MAX || table_corrupt(t))
			return table_give_up(t);
		c->v.gen = atomic_load_explicit(&g->gen, memory_order_acquire);
		bool ok = load_slot(&g->slot[(c->v.gen >> 1) & 1], origin, c);
		if (c->v.gen & 1)
			c->v.until = atomic_load_explicit(&g->frozen_at, memory_order_relaxed);
		atomic_thread_fence(memory_order_acquire);
		if (atomic_load_explicit(&g->gen, memory_order_relaxed) != c->v.gen)
			continue;
		if (!ok)
			return table_give_up(t);
		if (__builtin_expect(origin == TB__NO_TIME, 0) && most <= c->burst) {
			origin = table_origin(t, c->now);
			continue;
		}
		if (__builtin_expect(c->v.gen & 1, 0) && round == 0) {
			writer_help(t);
			continue;
		}
		break;
	}
	c->at = c->now < origin ? origin : c->now;
	if (c->at < c->v.origin && c->v.origin != TB__NO_TIME)
		c->at = c->v.origin;
	return true;
}

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
		return read_regime_slow(t, c, most);
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

/*
 * Ends a claim without a key: the slot is empty (and full, whatever its
 * tail).  A claim keeps the emptiness of the slot it took: if the slot held
 * a key, that key is gone, and the keys in use are one fewer.
 */
static bool void_claim(struct tbt_counters *k, struct tbt_slot *s, uint64_t claimed)
{
	if (!atomic_compare_exchange_strong(&s->state, &claimed,
					    st_next(claimed, true, st_tail(claimed))))
		return false;
	if (!st_empty(claimed))
		atomic_fetch_sub_explicit(&k->in_use, 1, memory_order_relaxed);
	return true;
}

/*
 * What a slot is worth to a new key, best first.  A slot that is empty or
 * holds a full key is free (a full bucket is indistinguishable from a new
 * one, so it is reused without loss): free slots rank by how many slots of
 * their bucket hold live keys (not full) or claims, 0 to 3, so that the
 * two choices balance the live keys whatever earlier keys left behind;
 * among equals, an empty slot before a full key's.  Then a live key's slot
 * (TOKENBUCKET_TABLE_EVICT only); claimed slots are worth nothing.
 */
enum tbt_worth {
	TBT_FREE = 0, /* + 2 * live slots of its bucket, + 1 for a full key's */
	TBT_LOSSY = 2 * TBT_BUCKET_SLOTS,
	TBT_BUSY,
};

/*
 * After our claim of slot i carries the key's fingerprint: every other
 * candidate is checked for the same key (seq_cst, after our fingerprint
 * store: of two callers inserting one key, at least one sees the other).
 * Another's claim for the key is voided; a confirmed slot for it means we
 * give way.  Returns true if we may confirm.
 */
static bool rescan(struct tbt_counters *k, const struct tbt_call *c, int mine)
{
	for (int j = 0; j < c->nc; j++) {
		if (j == mine)
			continue;
		struct tbt_slot *s = cand(c, j);
		for (;;) {
			TB__ROUND();
			uint64_t st = atomic_load(&s->state);
			uint64_t f = atomic_load(&s->fp);
			if ((f & ~TBT_TAG_MASK) != c->fp)
				break;
			if (!st_claimed(st)) {
				if (!st_empty(st) && f == fp_for(c->fp, st))
					return false; /* confirmed for the key: give way */
				break;
			}
			/* A claim keeps the emptiness of the slot it took: it counts either way. */
			if ((f & TBT_TAG_MASK) != st_ver(st))
				break; /* a claim for another key, its fingerprint not written yet */
			if (void_claim(k, s, st))
				break;
		}
	}
	return true;
}

/*
 * Gives the key a slot, at the call's time: a free slot, else one whose key
 * is full, else (TOKENBUCKET_TABLE_EVICT) the fullest.  Returns the slot
 * with its confirmed state, or NULL when the policy refuses (counted).
 * The key is full in its new slot: its tail is at most Q(at) - burst.
 */
static struct tbt_slot *insert(struct tokenbucket_table *t, const struct tbt_call *c,
			       uint64_t *state)
{
	struct tbt_counters *k = &t->mem->counters;
	int spins = 0;
	/*
	 * Every round but a spin changes a slot (ours or another caller's); on
	 * slots no one else writes, a few rounds and the spins a claim is
	 * given.  Past the bound the key is refused, as when no slot is free.
	 */
	for (int round = 0;; round++) {
		TB__ROUND();
		if (round == TB__ROUNDS_MAX * TBT_CANDIDATES) {
			atomic_fetch_add_explicit(&k->refused, 1, memory_order_relaxed);
			return NULL;
		}
		int best = -1, busy = -1;
		enum tbt_worth worth = TBT_BUSY;
		uint64_t best_st = 0, best_fp = 0, busy_st = 0;
		bool pending = false;
		uint64_t sts[TBT_CANDIDATES], fps[TBT_CANDIDATES];
		bool full[TBT_CANDIDATES];
		int live[2] = {0, 0};
		for (int i = 0; i < c->nc; i++) {
			sts[i] = atomic_load(&cand(c, i)->state);
			fps[i] = atomic_load(&cand(c, i)->fp);
			full[i] = !st_claimed(sts[i]) && !st_empty(sts[i]) &&
				  full_at(c, c->at, st_tail(sts[i]));
			live[i / TBT_BUCKET_SLOTS] +=
				st_claimed(sts[i]) || (!st_empty(sts[i]) && !full[i]);
		}
		for (int i = 0; i < c->nc; i++) {
			struct tbt_slot *s = cand(c, i);
			uint64_t st = sts[i], f = fps[i];
			enum tbt_worth w;
			if (st_claimed(st)) {
				pending |= f == (c->fp | st_ver(st));
				busy = i;
				busy_st = st;
				continue;
			}
			if (!st_empty(st) && f == fp_for(c->fp, st)) {
				*state = st; /* someone else inserted it */
				return s;
			}
			if (st_empty(st) || full[i])
				w = (enum tbt_worth)(TBT_FREE + 2 * live[i / TBT_BUCKET_SLOTS] +
						     full[i]);
			else
				w = TBT_LOSSY;
			/* The best worth; among equals the fullest (smallest tail). */
			if (best < 0 || w < worth ||
			    (w == worth && tdiff(st_tail(st), st_tail(best_st)) < 0)) {
				best = i;
				worth = w;
				best_st = st;
				best_fp = f;
			}
		}
		if (pending && spins < TBT_SPINS) {
			/* Another caller is inserting this key: let it finish. */
			spins++;
			tb__cpu_relax();
			continue;
		}
		if (best < 0 || (worth == TBT_LOSSY && !(t->flags & TOKENBUCKET_TABLE_EVICT))) {
			if (busy >= 0) {
				if (spins++ < TBT_SPINS) {
					tb__cpu_relax();
					continue;
				}
				/*
				 * A claim that outlasts our patience may be a dead
				 * process's: void it (a live claimer then fails its
				 * confirm and starts again).
				 */
				void_claim(k, cand(c, busy), busy_st);
				spins = 0;
				continue;
			}
			atomic_fetch_add_explicit(&k->refused, 1, memory_order_relaxed);
			return NULL;
		}
		struct tbt_slot *s = cand(c, best);
		uint64_t claimed = st_next(best_st, st_empty(best_st), st_tail(best_st));
		if (!atomic_compare_exchange_strong(&s->state, &best_st, claimed))
			continue;
		/* One counter per insert: a key replaced leaves the keys in use as they are. */
		if (!st_empty(best_st))
			atomic_fetch_add_explicit(worth < TBT_LOSSY ? &k->lossless : &k->lossy, 1,
						  memory_order_relaxed);
		/*
		 * The fingerprint changes only from the value read before the
		 * claim: a claimer that lost its claim (voided) cannot write over
		 * the next owner's, whose tag differs.
		 */
		if (!atomic_compare_exchange_strong(&s->fp, &best_fp, c->fp | st_ver(claimed))) {
			void_claim(k, s, claimed);
			continue;
		}
		atomic_store(&s->clock, c->at);
		if (!rescan(k, c, best)) {
			void_claim(k, s, claimed);
			continue; /* the key was confirmed elsewhere: the next pass finds it */
		}
		uint64_t tail = st_tail(claimed);
		if (!full_at(c, c->at, tail))
			tail = full_tail(c, c->at);
		uint64_t confirmed = st_next(claimed, false, tail);
		if (!atomic_compare_exchange_strong(&s->state, &claimed, confirmed))
			continue; /* voided by someone else: start again */
		if (st_empty(claimed))
			atomic_fetch_add_explicit(&k->in_use, 1, memory_order_relaxed);
		*state = confirmed;
		return s;
	}
}

/* ---- Takes ------------------------------------------------------------------ */

static int tbt_lock(struct tokenbucket_table *t);
static int change_locked(struct tokenbucket_table *t, int64_t now, uint64_t p, uint64_t q,
			 uint64_t burst, bool exact);

/*
 * For a call about to write a tail at "at", past the TBT_ANCHOR tokens of
 * its regime: re-anchors the table, a change to the same rate and burst at
 * "at" (production starts again from 0 there, and every full key's tail
 * moves up to Q - burst, so that every tail stays within 2^54 of Q),
 * unless another call or change did so meanwhile; then reads the regime
 * again into c (fixing the origin as read_regime does for most).  Waits
 * for the writer mutex, at most TB__LOCK_WAIT_NS.  0, -EDEADLK, -EBADMSG.
 */
static __attribute__((noinline)) int reanchor(struct tokenbucket_table *t, struct tbt_call *c,
					      int64_t at, uint64_t most)
{
	int err = tbt_lock(t);
	if (err)
		return err;
	struct tbt_call cur = {.now = at};
	if (!read_regime(t, &cur, UINT64_MAX))
		err = -EBADMSG;
	else if (past_horizon(&cur, cur.at))
		err = change_locked(t, cur.at, cur.v.p, cur.v.q, cur.burst, true);
	pthread_mutex_unlock(&t->mem->lock.writer);
	if (err == 0 && !read_regime(t, c, most))
		err = -EBADMSG;
	return err;
}

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
		s = insert(t, c, &st);
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
			int err = ++rounds == TB__ROUNDS_MAX ? -EBADMSG : reanchor(t, c, at, n);
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

/*
 * allow on a warm key, in registers: the key in a slot, the regime in force
 * the one this handle keeps (cache_regime: read and checked by a general
 * call), the key's time within the horizon.  The same decision as take;
 * 1 allowed, 0 refused, -1 for anything else (no slot, no kept regime, a
 * change under way, a lost compare-and-swap), which allow_general decides
 * from the start.  Nothing the general path does not do is written: at most
 * the key's clock, which it would move to the same time.  With c, a grant
 * also leaves in c and *o the regime, time and level take reports, for
 * allow_result (a refusal is left to the general path's report).
 */
static inline __attribute__((always_inline)) int warm_allow(struct tokenbucket_table *t,
							    int64_t now, uint64_t h, uint64_t n,
							    struct tbt_call *c,
							    struct tbt_outcome *o)
{
	uint64_t a, b;
	tbt_buckets_of(h, t->lines / 2, &a, &b);
	__builtin_prefetch(&t->line[2 * b], 1);
	uint64_t fp = tbt_fingerprint(h), st;
	struct tbt_slot *s = find_in(&t->line[2 * a], fp, &st);
	if (s == NULL && a != b)
		s = find_in(&t->line[2 * b], fp, &st);
	if (s == NULL)
		return -1;
	const _Atomic uint64_t *gp = &t->mem->regimes.gen;
	uint64_t gen = atomic_load_explicit(gp, memory_order_acquire);
	const struct tbt_cached *e = &t->cached[(gen >> 1) & 1];
	if (atomic_load_explicit(&e->gen, memory_order_acquire) != gen)
		return -1;
	struct tb__view v = {
		.origin = atomic_load_explicit(&e->origin, memory_order_relaxed),
		.fine0 = atomic_load_explicit(&e->fine0, memory_order_relaxed),
		.p = atomic_load_explicit(&e->p, memory_order_relaxed),
		.q = atomic_load_explicit(&e->q, memory_order_relaxed),
		.hoff = atomic_load_explicit(&e->hoff, memory_order_relaxed),
		.until = TOKENBUCKET_NEVER,
	};
	uint64_t burst = atomic_load_explicit(&e->burst, memory_order_relaxed);
	uint64_t hspan = atomic_load_explicit(&e->hspan, memory_order_relaxed);
	atomic_thread_fence(memory_order_acquire);
	if (atomic_load_explicit(&e->gen, memory_order_relaxed) != gen)
		return -1;
	if (n > burst)
		return 0;
	int64_t at = tb__time(now);
	if (at < v.origin)
		at = v.origin;
	at = key_time(s, at);
	/* regime_holds, then past_horizon */
	if (atomic_load(gp) != gen || (uint64_t)at - (uint64_t)v.origin >= hspan)
		return -1;
	uint64_t tail = st_tail(st), base, seen = st;
	if (decide(&v, burst, at, tail, n, &base)) {
		uint64_t after = st_with_tail(st, base + n);
		if (after != st && !atomic_compare_exchange_strong(&s->state, &st, after))
			return -1;
		if (c != NULL) {
			/* As take reports a grant. */
			view_complete(&v);
			c->v = v;
			c->burst = burst;
			o->allowed = true;
			o->at = at;
			o->level = base != tail ? (int64_t)(burst - n) : level_of(c, at, base + n);
		}
		return 1;
	}
	if (c != NULL)
		return -1;
	/* Refused only on the state and time it was decided on. */
	return atomic_load_explicit(&s->state, memory_order_acquire) == seen &&
			       atomic_load(&s->clock) == at
		       ? 0
		       : -1;
}

/*
 * Keeps the regime c read, checked and in force (gen even, the table's
 * origin fixed), for warm_allow.  Skipped if the entry has it already or
 * another thread is filling it.  A filler that read an older regime may
 * overwrite a newer one; the warm path then misses until a call fills it
 * again.
 */
static void cache_regime(struct tokenbucket_table *t, const struct tbt_call *c)
{
	uint64_t gen = c->v.gen;
	struct tbt_cached *e = &t->cached[(gen >> 1) & 1];
	uint64_t old = atomic_load_explicit(&e->gen, memory_order_relaxed);
	if ((gen & 1) || c->v.origin == TB__NO_TIME || old == gen || old == TBT_FILLING ||
	    !atomic_compare_exchange_strong_explicit(&e->gen, &old, TBT_FILLING,
						     memory_order_relaxed, memory_order_relaxed))
		return;
	/* A reader that sees a word below reads TBT_FILLING (or later) after it. */
	atomic_thread_fence(memory_order_release);
	atomic_store_explicit(&e->origin, c->v.origin, memory_order_relaxed);
	atomic_store_explicit(&e->fine0, c->v.fine0, memory_order_relaxed);
	atomic_store_explicit(&e->p, c->v.p, memory_order_relaxed);
	atomic_store_explicit(&e->q, c->v.q, memory_order_relaxed);
	atomic_store_explicit(&e->hoff, c->v.hoff, memory_order_relaxed);
	atomic_store_explicit(&e->burst, c->burst, memory_order_relaxed);
	atomic_store_explicit(&e->hspan, c->hspan, memory_order_relaxed);
	atomic_store_explicit(&e->gen, gen, memory_order_release);
}

/* allow_at from the start, the key hashed to h. */
static __attribute__((noinline)) bool allow_general(struct tokenbucket_table *t, int64_t now,
						    uint64_t h, uint64_t n)
{
	struct tbt_call c;
	if (!call_init_hashed(t, now, h, n, &c) || n > c.burst)
		return false;
	struct tbt_outcome o = {0};
	if (__builtin_expect(past_horizon(&c, c.at), 0) && reanchor(t, &c, c.at, n) != 0)
		return false;
	if (take(t, &c, n, false, &o, NULL) != 0)
		return false;
	cache_regime(t, &c);
	return o.allowed;
}

bool tokenbucket_table_allow_at(struct tokenbucket_table *t, int64_t now, const void *key,
				size_t len, uint64_t n)
{
	if (t == NULL || bad_key(key, len))
		return false;
	uint64_t h = tb__siphash13_inline(t->k0, t->k1, key, len);
	int warm = warm_allow(t, now, h, n, NULL, NULL);
	return __builtin_expect(warm >= 0, 1) ? warm : allow_general(t, now, h, n);
}

bool tokenbucket_table_allow(struct tokenbucket_table *t, const void *key, size_t len, uint64_t n)
{
	return tokenbucket_table_allow_at(t, tb__now(), key, len, n);
}

/* The state of slot s read again after the key's clock: the latest of the same owner. */
static inline uint64_t state_again(struct tbt_slot *s, uint64_t st)
{
	uint64_t again = atomic_load_explicit(&s->state, memory_order_acquire);
	return st_ver(again) == st_ver(st) && !st_claimed(again) ? again : st;
}

/*
 * The key's time and level at the call's time, read without taking: the
 * report of a call that takes nothing, at now, which the key sees (as
 * tokens_at).
 */
static void peek(const struct tbt_call *c, struct tbt_outcome *o)
{
	uint64_t st;
	struct tbt_slot *s = find(c, &st);
	o->at = s ? key_time(s, c->at) : c->at;
	o->level = s ? level_of(c, o->at, st_tail(state_again(s, st))) : (int64_t)c->burst;
}

/* The result of a decision on one key, as allow_result reports it. */
static void report(const struct tbt_call *c, const struct tbt_outcome *o, uint64_t n,
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

int tokenbucket_table_allow_result_at(struct tokenbucket_table *t, int64_t now, const void *key,
				      size_t len, uint64_t n, struct tokenbucket_result *res)
{
	if (t == NULL || res == NULL || bad_key(key, len))
		return -EINVAL;
	uint64_t h = tb__siphash13_inline(t->k0, t->k1, key, len);
	struct tbt_call c;
	struct tbt_outcome o = {0};
	if (__builtin_expect(warm_allow(t, now, h, n, &c, &o) == 1, 1)) {
		report(&c, &o, n, res);
		return 0;
	}
	if (!call_init_hashed(t, now, h, 0, &c))
		return -EBADMSG;
	if (n > c.burst) {
		/* Refused at once. */
		peek(&c, &o);
	} else {
		int err = past_horizon(&c, c.at) ? reanchor(t, &c, c.at, n) : 0;
		if (err == 0)
			err = take(t, &c, n, true, &o, NULL);
		if (err)
			return err;
		cache_regime(t, &c);
	}
	report(&c, &o, n, res);
	return 0;
}

int tokenbucket_table_allow_result(struct tokenbucket_table *t, const void *key, size_t len,
				   uint64_t n, struct tokenbucket_result *res)
{
	return tokenbucket_table_allow_result_at(t, tb__now(), key, len, n, res);
}

int tokenbucket_table_reserve_at(struct tokenbucket_table *t, int64_t now, const void *key,
				 size_t len, uint64_t n, int64_t max_wait,
				 struct tokenbucket_reservation *r)
{
	if (t == NULL || r == NULL || bad_key(key, len))
		return -EINVAL;
	struct tbt_call c;
	if (!call_init(t, now, key, len, n, &c))
		return -EBADMSG;
	int rounds = 0;
	uint64_t st;
	struct tbt_slot *s;
again:
	if (n > c.burst)
		return -E2BIG;
	if (past_horizon(&c, c.at)) {
		int err = ++rounds == TB__ROUNDS_MAX ? -EBADMSG : reanchor(t, &c, c.at, n);
		if (err)
			return err;
		goto again;
	}
	s = find(&c, &st);
	if (s == NULL) {
		/* A key with no bucket is full: nothing to take for 0 tokens, no wait. */
		if (n == 0 && max_wait >= 0) {
			*r = (struct tokenbucket_reservation){.time_to_act = c.at};
			return 0;
		}
		/*
		 * A new key is full, so n <= burst is there at once: only a
		 * negative max_wait refuses, and a refusal takes no slot.
		 */
		if (n == 0 || max_wait < 0)
			return -ETIMEDOUT;
		s = insert(t, &c, &st);
		if (s == NULL) {
			if (!(t->flags & TOKENBUCKET_TABLE_FAIL_OPEN))
				return -EBUSY;
			*r = (struct tokenbucket_reservation){.time_to_act = c.at};
			return 0;
		}
	}
	for (;;) {
		TB__ROUND();
		int64_t at = key_time(s, c.at);
		int moved = regime_check(t, &c, n, &rounds);
		if (moved < 0)
			return moved;
		if (moved)
			goto again;
		if (past_horizon(&c, at)) {
			int err = ++rounds == TB__ROUNDS_MAX ? -EBADMSG : reanchor(t, &c, at, n);
			if (err)
				return err;
			goto again;
		}
		uint64_t tail = st_tail(st);
		bool full = full_at(&c, at, tail);
		uint64_t base = full ? full_tail(&c, at) : tail;
		int64_t level = full ? (int64_t)c.burst : level_of(&c, at, tail);
		/* Wide: a slot's tail may be any 55 bits in a corrupt table. */
		tb__i128 debt = (tb__i128)n - level;
		int64_t act = at, wait = 0;
		int err = 0;
		if (debt > 0) {
			if (debt > (tb__i128)TOKENBUCKET_TABLE_DEBT_MAX) {
				err = -EOVERFLOW;
			} else {
				/* Frozen or not, the tokens come at the rate in force. */
				struct tb__view v = c.v;
				v.until = TOKENBUCKET_NEVER;
				wait = tb__wait_of(&v, at, (uint64_t)debt, &act);
			}
		}
		if (!err && wait > max_wait)
			err = -ETIMEDOUT;
		uint64_t seen = st;
		if (err) {
			st = atomic_load_explicit(&s->state, memory_order_acquire);
			if (st == seen && atomic_load(&s->clock) == at)
				return err;
		} else {
			uint64_t after = st_with_tail(st, base + n);
			if (after == st || atomic_compare_exchange_strong(&s->state, &st, after)) {
				*r = (struct tokenbucket_reservation){
					.time_to_act = act,
					.tokens = n,
					.ticket = st_tail(after),
				};
				return 0;
			}
		}
		if (st_ver(st) != st_ver(seen) || st_claimed(st) || st_empty(st))
			goto again;
	}
}

int tokenbucket_table_reserve(struct tokenbucket_table *t, const void *key, size_t len,
			      uint64_t n, int64_t max_wait, struct tokenbucket_reservation *r)
{
	return tokenbucket_table_reserve_at(t, tb__now(), key, len, n, max_wait, r);
}

/*
 * The give-back rule on a key (docs/core.md, "Giving back"): at the key's
 * time, n tokens back, never above burst.  A key keeps only a tail, and
 * its level is min(burst, Q - tail), so that is the tail lowered by n,
 * but never below the full tail (which keeps tails within range of Q).
 * Nothing once the key's time is past time_to_act (Go's cancel; INT64_MAX
 * for a refund), and nothing for a key with no bucket or whose slot
 * changes hands meanwhile: it is full (docs/table.md, "Giving back").
 */
static void give_back_key(struct tokenbucket_table *t, struct tbt_call *c, uint64_t n,
			  int64_t time_to_act)
{
	int rounds = 0;
	uint64_t st;
again:;
	struct tbt_slot *s = find(c, &st);
	if (s == NULL)
		return;
	for (;;) {
		TB__ROUND();
		int64_t at = key_time(s, c->at);
		int moved = regime_check(t, c, 0, &rounds);
		if (moved < 0)
			return;
		if (moved)
			goto again;
		if (at > time_to_act)
			return; /* too late: the tokens were used */
		if (past_horizon(c, at)) {
			if (++rounds == TB__ROUNDS_MAX || reanchor(t, c, at, 0))
				return;
			goto again;
		}
		uint64_t tail = st_tail(st);
		if (full_at(c, at, tail))
			return; /* nothing fits under burst */
		uint64_t floor_tail = full_tail(c, at);
		uint64_t back = (uint64_t)tdiff(tail, floor_tail) > n ? tail - n : floor_tail;
		if (atomic_compare_exchange_strong(&s->state, &st, st_with_tail(st, back)))
			return;
		if (st_claimed(st) || st_empty(st) || atomic_load(&s->fp) != fp_for(c->fp, st))
			return; /* the slot changed hands: the key's bucket is gone, full */
	}
}

void tokenbucket_table_cancel_at(struct tokenbucket_table *t, const void *key, size_t len,
				 struct tokenbucket_reservation *r, int64_t now)
{
	if (t == NULL || r == NULL || bad_key(key, len))
		return;
	uint64_t n = r->tokens;
	r->tokens = 0;
	struct tbt_call c;
	if (n != 0 && call_init(t, now, key, len, 0, &c))
		give_back_key(t, &c, n, r->time_to_act);
}

int tokenbucket_table_refund_at(struct tokenbucket_table *t, int64_t now, const void *key,
				size_t len, uint64_t n)
{
	if (t == NULL || bad_key(key, len))
		return -EINVAL;
	struct tbt_call c;
	if (!call_init(t, now, key, len, 0, &c))
		return -EBADMSG;
	if (n != 0)
		give_back_key(t, &c, n, INT64_MAX);
	return 0;
}

int tokenbucket_table_refund(struct tokenbucket_table *t, const void *key, size_t len, uint64_t n)
{
	return tokenbucket_table_refund_at(t, tb__now(), key, len, n);
}

void tokenbucket_table_cancel(struct tokenbucket_table *t, const void *key, size_t len,
			      struct tokenbucket_reservation *r)
{
	tokenbucket_table_cancel_at(t, key, len, r, tb__now());
}

/* tokens_at's arithmetic: the level with the fraction of a token, as the bucket reports it. */
static double tokens_of(const struct tbt_call *c, int64_t at, uint64_t tail)
{
	int64_t level = level_of(c, at, tail);
	if (level >= (int64_t)c->burst)
		return (double)level;
	return tb__tokens_value(&c->v, level, at);
}

double tokenbucket_table_tokens_at(struct tokenbucket_table *t, int64_t now, const void *key,
				   size_t len)
{
	if (t == NULL || bad_key(key, len))
		return NAN;
	struct tbt_call c;
	if (!call_init(t, now, key, len, 0, &c))
		return NAN;
	uint64_t st;
	struct tbt_slot *s = find(&c, &st);
	if (s == NULL)
		return (double)c.burst;
	int64_t at = key_time(s, c.at);
	/* The state read after the clock: no older than any take at that time. */
	return tokens_of(&c, at, st_tail(state_again(s, st)));
}

double tokenbucket_table_tokens(struct tokenbucket_table *t, const void *key, size_t len)
{
	return tokenbucket_table_tokens_at(t, tb__now(), key, len);
}

/*
 * The table's wait after a sleep: whether the ticket is covered (Q(now) >=
 * ticket, the level the reservation left is back to 0 or more).
 */
int tbt_covered_at(struct tokenbucket_table *t, int64_t now, const void *key, size_t len,
		   uint64_t ticket, int64_t *pause)
{
	struct tbt_call c;
	if (!call_init(t, now, key, len, 0, &c))
		return -EBADMSG;
	uint64_t st;
	struct tbt_slot *s = find(&c, &st);
	if (s == NULL)
		return 0; /* no bucket: the key is full */
	int64_t at = key_time(s, c.at);
	/* Covered: Q(at) - ticket >= 0. */
	if (level_at_least(&c, at, ticket, 0))
		return 0;
	uint64_t missing = (uint64_t)tdiff(ticket, full_tail(&c, at) + c.burst);
	*pause = tb__duration(&c.v, missing);
	return 1;
}

/* ---- Inspection ------------------------------------------------------------- */

int tokenbucket_table_next(struct tokenbucket_table *t, uint64_t *cursor, int64_t now,
			   struct tokenbucket_table_entry *e)
{
	if (t == NULL || cursor == NULL || e == NULL)
		return -EINVAL;
	struct tbt_call c = {.now = tb__time(now)};
	if (!read_regime(t, &c, UINT64_MAX))
		return -EBADMSG;
	for (uint64_t i = *cursor; i < t->lines * 2; i++) {
		struct tbt_slot *s = &t->line[i / 2].slot[i % 2];
		uint64_t st = atomic_load_explicit(&s->state, memory_order_acquire);
		if (st_claimed(st) || st_empty(st))
			continue;
		uint64_t f = atomic_load_explicit(&s->fp, memory_order_acquire);
		int64_t clock = atomic_load(&s->clock);
		if (atomic_load(&s->state) != st || (f & TBT_TAG_MASK) != ((st_ver(st) - 1) & 0xff))
			continue;
		int64_t at = c.at < clock ? clock : c.at;
		double tokens = (double)c.burst;
		if (c.v.origin != TB__NO_TIME)
			tokens = tokens_of(&c, at, st_tail(st));
		*e = (struct tokenbucket_table_entry){
			.fingerprint = f >> 8,
			.clock = clock,
			.tokens = tokens,
		};
		*cursor = i + 1;
		return 0;
	}
	*cursor = t->lines * 2;
	return -ENOENT;
}

int tokenbucket_table_stats(struct tokenbucket_table *t, struct tokenbucket_table_stats *s)
{
	if (t == NULL || s == NULL)
		return -EINVAL;
	struct tbt_counters *k = &t->mem->counters;
	*s = (struct tokenbucket_table_stats){
		.capacity = t->lines * 2,
		.in_use = atomic_load(&k->in_use),
		.lossless = atomic_load(&k->lossless),
		.lossy = atomic_load(&k->lossy),
		.refused = atomic_load(&k->refused),
	};
	return 0;
}

/* ---- Life cycle --------------------------------------------------------------- */

size_t tokenbucket_table_size(uint64_t capacity)
{
	if (capacity == 0 || capacity > TOKENBUCKET_TABLE_CAPACITY_MAX)
		return 0;
	return offsetof(struct tbt_mem, line) + (size_t)tbt_lines(capacity) * sizeof(struct tbt_line);
}

/* The table's configuration, checked. */
struct tbt_config {
	uint64_t p, q, burst, capacity;
	unsigned flags;
};

/* The ns a regime's rate takes to produce j tokens (INT64_MAX: never). */
static int64_t horizon_span(uint64_t p, uint64_t q, uint64_t j)
{
	const struct tb__view v = {.p = p, .q = q, .kind = p ? TB__FINITE : TB__ZERO};
	return tb__duration(&v, j); /* TOKENBUCKET_NEVER is INT64_MAX */
}

/*
 * A regime's hspan: from its origin until it has produced TBT_ANCHOR
 * tokens, when the next call that writes a tail re-anchors the table (from
 * the fraction carried in, fine0, a nanosecond earlier: a token more).
 */
static int64_t regime_hspan(uint64_t p, uint64_t q)
{
	return horizon_span(p, q, TBT_ANCHOR);
}

/*
 * Rates whose 2^54 tokens take less than this (about 13 days) are refused:
 * above 16 tokens per ns (re-anchors then come every 6.5 days or less).
 */
#define TBT_HORIZON_MIN (INT64_C(1) << 50)

/* The rate and burst of a table, checked as every table function checks them. */
static int rate_check(uint64_t tokens, int64_t period_ns, uint64_t burst, uint64_t *p,
		      uint64_t *q)
{
	if (burst > TOKENBUCKET_TABLE_BURST_MAX)
		return -ERANGE;
	tb__ratio_from_every(tokens, period_ns, p, q);
	if (horizon_span(*p, *q, TBT_HORIZON) < TBT_HORIZON_MIN)
		return -ERANGE;
	return 0;
}

static int config_check(struct tbt_config *k, uint64_t tokens, int64_t period_ns, uint64_t burst,
			uint64_t capacity, unsigned flags)
{
	if (capacity == 0 || (tokens > 0 && period_ns <= 0) ||
	    (flags & ~(TOKENBUCKET_TABLE_FAIL_OPEN | TOKENBUCKET_TABLE_EVICT)) ||
	    flags == (TOKENBUCKET_TABLE_FAIL_OPEN | TOKENBUCKET_TABLE_EVICT))
		return -EINVAL;
	if (capacity > TOKENBUCKET_TABLE_CAPACITY_MAX)
		return -ERANGE;
	int err = rate_check(tokens, period_ns, burst, &k->p, &k->q);
	if (err)
		return err;
	k->burst = burst;
	k->capacity = capacity;
	k->flags = flags;
	return 0;
}

static int secret(uint64_t key[2])
{
	size_t got = 0;
	while (got < 2 * sizeof(uint64_t)) {
		ssize_t r = getrandom((char *)key + got, 2 * sizeof(uint64_t) - got, 0);
		if (r < 0) {
			if (errno == EINTR)
				continue;
			return -errno;
		}
		got += (size_t)r;
	}
	return 0;
}

/* Initialises a table in mem (size checked by the caller); ready is stored last. */
static int table_init(struct tbt_mem *m, const struct tbt_config *k)
{
	uint64_t key[2];
	int err = secret(key);
	if (err)
		return err;
	pthread_mutexattr_t attr;
	err = tb__shared_mutexattr(&attr);
	if (err)
		return err;
	atomic_store_explicit(&m->header.h.ready, 0, memory_order_relaxed);
	memset(&m->lock, 0, sizeof(m->lock));
	err = pthread_mutex_init(&m->lock.writer, &attr);
	pthread_mutexattr_destroy(&attr);
	if (err)
		return -err;
	uint64_t lines = tbt_lines(k->capacity);
	struct tbt_regimes *g = &m->regimes;
	atomic_store_explicit(&g->gen, 0, memory_order_relaxed);
	atomic_store_explicit(&g->frozen_at, 0, memory_order_relaxed);
	for (int i = 0; i < 2; i++) {
		struct tbt_regime *r = &g->slot[i];
		/* Q starts at the largest burst: a tail Q - burst is never below 0. */
		atomic_store_explicit(&r->origin, TB__NO_TIME, memory_order_relaxed);
		atomic_store_explicit(&r->fine0, 0, memory_order_relaxed);
		atomic_store_explicit(&r->p, k->p, memory_order_relaxed);
		atomic_store_explicit(&r->q, k->q, memory_order_relaxed);
		atomic_store_explicit(&r->hoff, TOKENBUCKET_TABLE_BURST_MAX, memory_order_relaxed);
		atomic_store_explicit(&r->burst, k->burst, memory_order_relaxed);
		atomic_store_explicit(&r->hspan, regime_hspan(k->p, k->q), memory_order_relaxed);
	}
	memset(&m->counters, 0, sizeof(m->counters));
	for (uint64_t i = 0; i < lines; i++) {
		for (int j = 0; j < 2; j++) {
			struct tbt_slot *s = &m->line[i].slot[j];
			atomic_store_explicit(&s->fp, 0, memory_order_relaxed);
			atomic_store_explicit(&s->state, TBT_EMPTY, memory_order_relaxed);
			atomic_store_explicit(&s->clock, TB__NO_TIME, memory_order_relaxed);
			atomic_store_explicit(&s->spare, 0, memory_order_relaxed);
		}
	}
	struct tbt_header *h = &m->header.h;
	h->magic = TBT_MAGIC;
	h->layout = TBT_LAYOUT;
	h->major = TOKENBUCKET_VERSION_MAJOR;
	h->header_size = offsetof(struct tbt_mem, line);
	h->line_size = sizeof(struct tbt_line);
	h->flags = k->flags;
	h->lines = lines;
	h->capacity = k->capacity;
	h->k0 = key[0];
	h->k1 = key[1];
	atomic_store_explicit(&h->origin, TB__NO_TIME, memory_order_relaxed);
	atomic_store_explicit(&h->corrupt, 0, memory_order_relaxed);
	atomic_store_explicit(&h->exact_carry, 0, memory_order_relaxed);
	atomic_store_explicit(&h->ready, TBT_READY, memory_order_release);
	return 0;
}

/* Whether a regime slot holds words a regime can: the checks load_slot makes, and the rate's. */
static bool regime_valid(const struct tbt_regime *r)
{
	struct tbt_call c;
	return load_slot(r, 0, &c) && horizon_span(c.v.p, c.v.q, TBT_HORIZON) >= TBT_HORIZON_MIN;
}

/*
 * The header's checks: what is not a table, another layout (a table of
 * 1.1 has layout 2: -EPROTO), a table not initialised yet, then a
 * configuration no table can have: the regime in force, and while a
 * change freezes it the next one, which a repair would publish, and the
 * writer mutex's kind.  Slots need no check: any word there yields a
 * defined state (docs/shm.md, "Corrupt mappings").
 */
static int table_check(const struct tbt_mem *m, size_t size)
{
	const struct tbt_header *h = &m->header.h;
	if (size < sizeof(struct tbt_header) || h->magic != TBT_MAGIC)
		return -EBADMSG;
	if (h->layout != TBT_LAYOUT || h->major != TOKENBUCKET_VERSION_MAJOR ||
	    h->header_size != offsetof(struct tbt_mem, line) ||
	    h->line_size != sizeof(struct tbt_line))
		return -EPROTO;
	if (atomic_load_explicit(&h->ready, memory_order_acquire) != TBT_READY)
		return -EAGAIN;
	if (h->capacity == 0 || h->capacity > TOKENBUCKET_TABLE_CAPACITY_MAX ||
	    h->lines != tbt_lines(h->capacity) || size < tokenbucket_table_size(h->capacity) ||
	    (h->flags & ~(TOKENBUCKET_TABLE_FAIL_OPEN | TOKENBUCKET_TABLE_EVICT)) ||
	    h->flags == (TOKENBUCKET_TABLE_FAIL_OPEN | TOKENBUCKET_TABLE_EVICT) ||
	    atomic_load(&h->corrupt) != 0)
		return -EBADMSG;
	uint64_t gen = atomic_load(&m->regimes.gen);
	if (!regime_valid(&m->regimes.slot[(gen >> 1) & 1]) ||
	    ((gen & 1) && !regime_valid(&m->regimes.slot[((gen >> 1) + 1) & 1])) ||
	    !tb__shared_mutex_valid(&m->lock.writer))
		return -EBADMSG;
	return 0;
}

/* A handle on checked memory; the constants are copied from the header once. */
static int handle(struct tokenbucket_table **tp, struct tbt_mem *m, enum tbt_owner owner,
		  size_t mapped)
{
	struct tokenbucket_table *t = malloc(sizeof(*t));
	if (t == NULL)
		return -ENOMEM;
	const struct tbt_header *h = &m->header.h;
	*t = (struct tokenbucket_table){
		.mem = m,
		.line = m->line,
		.lines = h->lines,
		.k0 = h->k0,
		.k1 = h->k1,
		.flags = h->flags,
		.owner = owner,
		.mapped = mapped,
	};
	for (int i = 0; i < 2; i++) {
		atomic_init(&t->cached[i].gen, TBT_UNKEPT);
		atomic_init(&t->cached[i].q, 1);
	}
	*tp = t;
	return 0;
}

int tokenbucket_table_create(struct tokenbucket_table **tp, uint64_t tokens, int64_t period_ns,
			     uint64_t burst, uint64_t capacity, unsigned flags)
{
	struct tbt_config k;
	if (tp == NULL)
		return -EINVAL;
	int err = config_check(&k, tokens, period_ns, burst, capacity, flags);
	if (err)
		return err;
	size_t size = tokenbucket_table_size(capacity);
	struct tbt_mem *m = aligned_alloc(TOKENBUCKET_TABLE_ALIGN, size);
	if (m == NULL)
		return -ENOMEM;
	err = table_init(m, &k);
	if (err == 0)
		err = handle(tp, m, TBT_HEAP, 0);
	if (err)
		free(m);
	return err;
}

static bool table_aligned(const void *mem)
{
	return ((uintptr_t)mem & (TOKENBUCKET_TABLE_ALIGN - 1)) == 0;
}

int tokenbucket_table_init_shared(struct tokenbucket_table **tp, void *mem, size_t size,
				  uint64_t tokens, int64_t period_ns, uint64_t burst,
				  uint64_t capacity, unsigned flags)
{
	struct tbt_config k;
	if (tp == NULL || mem == NULL || !table_aligned(mem))
		return -EINVAL;
	int err = config_check(&k, tokens, period_ns, burst, capacity, flags);
	if (err)
		return err;
	if (size < tokenbucket_table_size(capacity))
		return -EINVAL;
	if (!tb__atomics_shareable())
		return -ENOTSUP;
	err = table_init(mem, &k);
	return err ? err : handle(tp, mem, TBT_PLACED, 0);
}

int tokenbucket_table_attach_shared(struct tokenbucket_table **tp, void *mem, size_t size)
{
	if (tp == NULL || mem == NULL || !table_aligned(mem))
		return -EINVAL;
	if (!tb__atomics_shareable())
		return -ENOTSUP;
	int err = table_check(mem, size);
	return err ? err : handle(tp, mem, TBT_PLACED, 0);
}

static int table_init_cb(void *map, void *arg)
{
	return table_init(map, arg);
}

static int table_check_cb(const void *map, size_t have, void *arg)
{
	(void)arg;
	return table_check(map, have);
}

int tokenbucket_table_open(struct tokenbucket_table **tp, const char *name, uint64_t tokens,
			   int64_t period_ns, uint64_t burst, uint64_t capacity, unsigned flags,
			   unsigned mode, unsigned *status)
{
	struct tbt_config k;
	char path[TB__PATH_SIZE];
	if (tp == NULL || mode > 0777)
		return -EINVAL;
	int err = tb__shm_path(name, path, sizeof(path));
	if (err == 0)
		err = config_check(&k, tokens, period_ns, burst, capacity, flags);
	if (err)
		return err;
	if (!tb__atomics_shareable())
		return -ENOTSUP;
	const struct tb__shm_ops ops = {
		.map_size = 0,
		.create_size = tokenbucket_table_size(capacity),
		.min_size = sizeof(struct tbt_header),
		.init = table_init_cb,
		.check = table_check_cb,
		.arg = &k,
	};
	void *map;
	size_t mapped;
	bool created;
	err = tb__shm_open(name, mode, &ops, &map, &mapped, &created);
	if (err)
		return err;
	err = handle(tp, map, TBT_NAMED, mapped);
	if (err) {
		munmap(map, mapped);
		return err;
	}
	if (status) {
		/* The rate and burst in force, which a change may have made others. */
		const struct tbt_header *h = &((struct tbt_mem *)map)->header.h;
		struct tbt_call c = {.now = TB__NO_TIME + 1};
		if (!read_regime(*tp, &c, UINT64_MAX)) {
			tokenbucket_table_free(*tp);
			*tp = NULL;
			return -EBADMSG;
		}
		*status = created ? TOKENBUCKET_OPEN_CREATED
			  : c.v.p == k.p && c.v.q == k.q && c.burst == k.burst &&
					  h->capacity == k.capacity && h->flags == k.flags
				  ? 0
				  : TOKENBUCKET_OPEN_DIFFERS;
	}
	return 0;
}

void tokenbucket_table_free(struct tokenbucket_table *t)
{
	if (t == NULL)
		return;
	if (t->owner == TBT_HEAP)
		free(t->mem);
	else if (t->owner == TBT_NAMED)
		munmap(t->mem, t->mapped);
	free(t);
}

/* ---- Rate and burst changes (1.2) ------------------------------------------- */

/*
 * Finishes a change that froze the regime (gen odd), for the holder of the
 * writer mutex.  The change happens at T = max(frozen_at, every key's
 * clock): a call that used the old regime recorded its key's clock before
 * it read gen again, which was before the freeze, so the scan sees that
 * clock and no production is counted under two regimes; calls that saw
 * the freeze count production up to frozen_at only, less than either
 * regime would.  The next regime (its p, q and burst stored before the
 * freeze) gets origin T, the old fraction carried as for a bucket's
 * set_limit (tb__carry; whole in a re-anchor) and hoff = Q_old(T): Q is
 * continuous at T and live keys' tails do not move, so every key's level
 * is.  Every key full at T gets its tail moved up to Q_old(T) - old
 * burst, the drop a take would make there: a raised burst brings back
 * nothing the old one dropped, and no tail lags Q by more than one
 * regime's production (TBT_ANCHOR).  Every step is idempotent and T only grows, so a
 * writer that dies anywhere in here leaves work that a later finish
 * completes as if it had done it all (tbt_lock, writer_help).
 */
static void finish(struct tokenbucket_table *t)
{
	struct tbt_regimes *g = &t->mem->regimes;
	uint64_t gen = atomic_load(&g->gen);
	int64_t origin = atomic_load(&t->mem->header.h.origin);
	struct tbt_regime *nr = &g->slot[((gen >> 1) + 1) & 1];
	struct tbt_call old = {.v.until = TOKENBUCKET_NEVER}, next;
	if (!(gen & 1) || origin == TB__NO_TIME || !load_slot(&g->slot[(gen >> 1) & 1], origin, &old) ||
	    !load_slot(nr, origin, &next)) {
		table_give_up(t); /* only a writer freezes, after fixing the origin */
		return;
	}
	int64_t at = atomic_load(&g->frozen_at);
	if (at < old.v.origin)
		at = old.v.origin;
	uint64_t slots = t->lines * 2;
	for (uint64_t i = 0; i < slots; i++) {
		int64_t clock = atomic_load(&t->line[i / 2].slot[i % 2].clock);
		if (clock > at)
			at = clock;
	}
	uint64_t floor_tail = full_tail(&old, at);
	for (uint64_t i = 0; i < slots; i++) {
		struct tbt_slot *s = &t->line[i / 2].slot[i % 2];
		uint64_t st = atomic_load(&s->state);
		/* Each failure is a take's or a claim's progress; claims make full keys. */
		for (int round = 0; round < TB__ROUNDS_MAX; round++) {
			TB__ROUND();
			if (st_claimed(st) || !full_at(&old, at, st_tail(st)) ||
			    st_tail(st) == floor_tail ||
			    atomic_compare_exchange_strong(&s->state, &st,
							   st_with_tail(st, floor_tail)))
				break;
		}
	}
	uint64_t p = next.v.p, q = next.v.q;
	/*
	 * A re-anchor keeps the fraction whole (its rate is the same); a
	 * set_limit carries it as a bucket's does, to the nanosecond.
	 */
	bool exact = atomic_load(&t->mem->header.h.exact_carry) && p == old.v.p && q == old.v.q;
	uint64_t fine0 = exact ? tb__remainder(&old.v, at)
			 : old.v.p && p ? tb__carry(&old.v, p, q, at)
					: 0;
	uint64_t hoff = (old.v.hoff + (uint64_t)tb__whole(&old.v, fine_of(&old.v, at))) & TBT_TAIL_MASK;
	atomic_store_explicit(&nr->origin, at, memory_order_relaxed);
	atomic_store_explicit(&nr->fine0, fine0, memory_order_relaxed);
	atomic_store_explicit(&nr->hoff, hoff, memory_order_relaxed);
	atomic_store_explicit(&nr->hspan, regime_hspan(p, q), memory_order_relaxed);
	atomic_store(&g->gen, gen + 1);
}

/*
 * Takes the writer mutex, waiting at most TB__LOCK_WAIT_NS, and finishes a
 * change that its last holder left half done (it died: EOWNERDEAD; or a
 * freeze with the mutex free).  0, -EDEADLK (not released in time: a
 * stopped holder, or a lock word no live holder wrote), -EBADMSG (a
 * corrupt table, or a mutex that fails to lock: marked corrupt).
 */
static int tbt_lock(struct tokenbucket_table *t)
{
	if (table_corrupt(t))
		return -EBADMSG;
	pthread_mutex_t *m = &t->mem->lock.writer;
	int err = tb__lock_bounded(m);
	if (err == ETIMEDOUT)
		return -EDEADLK;
	if (err != 0 && err != EOWNERDEAD) {
		table_give_up(t);
		return -EBADMSG;
	}
	if (atomic_load(&t->mem->regimes.gen) & 1)
		finish(t);
	if (err == EOWNERDEAD && pthread_mutex_consistent(m) != 0)
		table_give_up(t);
	if (table_corrupt(t)) {
		pthread_mutex_unlock(m);
		return -EBADMSG;
	}
	return 0;
}

/*
 * For a call that found the regime frozen: finishes the change if no live
 * writer holds the mutex (its holder died, or it is free).  Never waits.
 */
static void writer_help(struct tokenbucket_table *t)
{
	pthread_mutex_t *m = &t->mem->lock.writer;
	int err = pthread_mutex_trylock(m);
	if (err != 0 && err != EOWNERDEAD)
		return; /* a live writer holds it: the freeze ends when it publishes */
	if (atomic_load(&t->mem->regimes.gen) & 1)
		finish(t);
	if (err == EOWNERDEAD)
		pthread_mutex_consistent(m);
	pthread_mutex_unlock(m);
}

int tokenbucket_table_set_limit_at(struct tokenbucket_table *t, int64_t now,
				   const struct tokenbucket_limit *lim)
{
	if (t == NULL || lim == NULL || lim->period_ns < 0)
		return -EINVAL;
	if (lim->tokens > 0 && lim->period_ns == 0)
		return -ERANGE; /* unlimited: no table has it */
	uint64_t p, q;
	int err = rate_check(lim->tokens, lim->period_ns, lim->burst, &p, &q);
	if (err)
		return err;
	err = tbt_lock(t);
	if (err)
		return err;
	err = change_locked(t, tb__time(now), p, q, lim->burst, false);
	pthread_mutex_unlock(&t->mem->lock.writer);
	return err;
}

/*
 * A change to p/q (lowest terms) and burst at now (checked), for the
 * holder of the writer mutex: writes the next regime's rate and burst,
 * freezes, and finishes.  exact: a re-anchor, whose fraction of a token is
 * carried whole.  0 or -EBADMSG.
 */
static int change_locked(struct tokenbucket_table *t, int64_t now, uint64_t p, uint64_t q,
			 uint64_t burst, bool exact)
{
	int64_t origin = table_origin(t, now);
	struct tbt_regimes *g = &t->mem->regimes;
	uint64_t gen = atomic_load(&g->gen); /* even: only writers change it, and we hold the lock */
	struct tbt_call old;
	if (!load_slot(&g->slot[(gen >> 1) & 1], origin, &old))
		return table_give_up(t), -EBADMSG;
	int64_t at = now < origin ? origin : now;
	if (at < old.v.origin)
		at = old.v.origin;
	/* The next regime's rate and burst first, in the slot no reader uses; finish does the rest. */
	struct tbt_regime *nr = &g->slot[((gen >> 1) + 1) & 1];
	atomic_store_explicit(&nr->origin, at, memory_order_relaxed);
	atomic_store_explicit(&nr->fine0, 0, memory_order_relaxed);
	atomic_store_explicit(&nr->p, p, memory_order_relaxed);
	atomic_store_explicit(&nr->q, q, memory_order_relaxed);
	atomic_store_explicit(&nr->burst, burst, memory_order_relaxed);
	atomic_store(&t->mem->header.h.exact_carry, exact);
	atomic_store(&g->frozen_at, at);
	atomic_store(&g->gen, gen + 1);
	finish(t);
	return table_corrupt(t) ? -EBADMSG : 0;
}

int tokenbucket_table_set_limit(struct tokenbucket_table *t, const struct tokenbucket_limit *lim)
{
	return tokenbucket_table_set_limit_at(t, tb__now(), lim);
}

int tokenbucket_table_get_limit(struct tokenbucket_table *t, struct tokenbucket_limit *lim)
{
	if (t == NULL || lim == NULL)
		return -EINVAL;
	struct tbt_call c = {.now = TB__NO_TIME + 1};
	if (!read_regime(t, &c, UINT64_MAX) || c.v.q > (uint64_t)INT64_MAX)
		return -EBADMSG;
	*lim = (struct tokenbucket_limit){c.v.p, (int64_t)c.v.q, c.burst};
	return 0;
}

/* ---- Several limits per key (1.2) ------------------------------------------ */

/*
 * A key decided on several tables at once: n from the key's bucket in
 * every table, or from none, as src/core/set.c does it for buckets (the
 * same check, takes in order and give-backs on a refusal, by the rule a
 * refund follows).  docs/table.md, "Several limits per key", has the
 * argument.
 */

/* -EINVAL for tables no set call accepts: NULL, empty, too long, a NULL or repeated table. */
static int check_tables(struct tokenbucket_table *const *tables, size_t count)
{
	if (tables == NULL || count == 0 || count > TOKENBUCKET_SET_MAX)
		return -EINVAL;
	for (size_t i = 0; i < count; i++) {
		if (tables[i] == NULL)
			return -EINVAL;
		/*
		 * Two handles on one table are one limit: the same memory, or the
		 * same 128-bit random secret (one table mapped at two addresses).
		 */
		for (size_t j = 0; j < i; j++)
			if (tables[j]->mem == tables[i]->mem ||
			    (tables[j]->k0 == tables[i]->k0 && tables[j]->k1 == tables[i]->k1))
				return -EINVAL;
	}
	return 0;
}

/*
 * Whether the key surely holds fewer than n tokens, read without taking
 * (its clock moves to the call's time, as any call's): only a level read
 * with the state and clock it was decided on refuses, as take refuses.
 * False when unsure, and for a key without a slot (full): the take decides.
 */
static bool key_short(const struct tokenbucket_table *t, const struct tbt_call *c, uint64_t n)
{
	uint64_t st;
	struct tbt_slot *s = find(c, &st);
	if (s == NULL)
		return false;
	int64_t at = key_time(s, c->at);
	/* decide's test without its division: a level of n or more, capped or not, passes. */
	if (!regime_holds(t, c) || past_horizon(c, at) || level_at_least(c, at, st_tail(st), n))
		return false;
	return atomic_load_explicit(&s->state, memory_order_acquire) == st &&
	       atomic_load(&s->clock) == at;
}

/*
 * Gives back the k->tokens a set's take took from its key, by the one rule
 * (give_back_key).  The usual case is an undo: the state is still the one
 * the take wrote, so its tail goes back to where the take found it, which
 * is that rule in one compare-and-swap (a key's level is capped at burst
 * when read, and that tail was no lower than full at the take).
 */
static void give_back(struct tokenbucket_table *t, struct tbt_call *c, struct tbt_taken *k)
{
	uint64_t n = k->tokens, st = k->after;
	k->tokens = 0;
	if (n == 0 || k->slot == NULL ||
	    atomic_compare_exchange_strong(&k->slot->state, &st, st_with_tail(st, k->base)))
		return;
	give_back_key(t, c, n, INT64_MAX);
}

/* Gives back k[0] to k[i - 1], the latest first (so that undoing is likelier). */
static void give_back_all(struct tokenbucket_table *const *tables, size_t i, struct tbt_call *c,
			  struct tbt_taken *k)
{
	while (i-- > 0)
		give_back(tables[i], &c[i], &k[i]);
}

int tokenbucket_table_allow_all_at(struct tokenbucket_table *const *tables, size_t count,
				   int64_t now, const void *key, size_t len, uint64_t n,
				   struct tokenbucket_set_result *res)
{
	if (res == NULL || bad_key(key, len))
		return -EINVAL;
	int err = check_tables(tables, count);
	if (err)
		return err;
	struct tbt_call c[TOKENBUCKET_SET_MAX];
	for (size_t i = 0; i < count; i++)
		if (!call_init(tables[i], now, key, len, n, &c[i]))
			return -EBADMSG;
	for (size_t i = 0; i < count; i++)
		if (n > c[i].burst)
			return -E2BIG;
	struct tbt_outcome o[TOKENBUCKET_SET_MAX];
	struct tbt_taken k[TOKENBUCKET_SET_MAX];
	size_t refused = count, decided = 0;
	/* A set that one table refuses is refused before anything is taken. */
	for (size_t i = 1; i < count; i++) {
		if (key_short(tables[i], &c[i], n)) {
			refused = i;
			break;
		}
	}
	for (size_t i = 0; refused == count && i < count; i++) {
		o[i] = (struct tbt_outcome){0};
		k[i] = (struct tbt_taken){0};
		err = past_horizon(&c[i], c[i].at) ? reanchor(tables[i], &c[i], c[i].at, n) : 0;
		if (err == 0)
			err = take(tables[i], &c[i], n, true, &o[i], &k[i]);
		if (err || !o[i].allowed) {
			give_back_all(tables, i, c, k);
			/* -EDEADLK, -EBADMSG: nothing taken. */
			if (err)
				return err;
			refused = i;
			decided = i + 1;
			break;
		}
		decided = i + 1;
	}
	bool allowed = refused == count;
	struct tokenbucket_set_result out = {.allowed = allowed, .index = refused};
	uint64_t fewest = UINT64_MAX;
	for (size_t i = 0; i < count; i++) {
		struct tokenbucket_result one;
		/* Allowed, each take saw its level; refused, the others are read as they are now. */
		if ((!allowed && i != refused) || i >= decided) {
			o[i] = (struct tbt_outcome){0};
			peek(&c[i], &o[i]);
		}
		report(&c[i], &o[i], n, &one);
		tb__set_fold(&out, i, refused, &one, &fewest);
	}
	*res = out;
	return 0;
}

int tokenbucket_table_allow_all(struct tokenbucket_table *const *tables, size_t count,
				const void *key, size_t len, uint64_t n,
				struct tokenbucket_set_result *res)
{
	return tokenbucket_table_allow_all_at(tables, count, tb__now(), key, len, n, res);
}
