/* SPDX-License-Identifier: MIT */
/*
 * What the inline paths of table_internal.h call out of line, and what
 * that calls in turn: the slow read of a regime (a seqlock that retries, a
 * frozen regime, the origin not fixed yet), giving a new key a slot, the
 * re-anchor, the checks of a rate, and the changes of rate and burst
 * (1.2) with the repair of one a dead writer left.  docs/table.md has the
 * model of slots, regimes and changes.
 */
#include "table_internal.h"

/* ---- Regimes and production ---------------------------------------------- */

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
__attribute__((noinline)) bool tb__table_read_regime_slow(struct tokenbucket_table *t,
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

/* ---- Lookup -------------------------------------------------------------- */

/* Spins a caller waits for another's claim before working around it. */
#define TBT_SPINS 64

/* Candidate i of a call: slot i % 4 of bucket i / 4 (two slots in each of its two lines). */
static inline struct tbt_slot *cand(const struct tbt_call *c, int i)
{
	return &c->bucket[i / TBT_BUCKET_SLOTS][(i % TBT_BUCKET_SLOTS) / 2].slot[i % 2];
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
struct tbt_slot *tb__table_insert(struct tokenbucket_table *t, const struct tbt_call *c,
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

/* ---- Re-anchors ---------------------------------------------------------- */

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
__attribute__((noinline)) int tb__table_reanchor(struct tokenbucket_table *t, struct tbt_call *c,
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

/* ---- Rates a table takes ------------------------------------------------- */

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
int64_t tb__table_regime_hspan(uint64_t p, uint64_t q)
{
	return horizon_span(p, q, TBT_ANCHOR);
}

/*
 * Rates whose 2^54 tokens take less than this (about 13 days) are refused:
 * above 16 tokens per ns (re-anchors then come every 6.5 days or less).
 */
#define TBT_HORIZON_MIN (INT64_C(1) << 50)

/* The rate and burst of a table, checked as every table function checks them. */
int tb__table_rate_check(uint64_t tokens, int64_t period_ns, uint64_t burst, uint64_t *p,
			 uint64_t *q)
{
	if (burst > TOKENBUCKET_TABLE_BURST_MAX)
		return -ERANGE;
	tb__ratio_from_every(tokens, period_ns, p, q);
	if (horizon_span(*p, *q, TBT_HORIZON) < TBT_HORIZON_MIN)
		return -ERANGE;
	return 0;
}

/* Whether a regime slot holds words a regime can: the checks load_slot makes, and the rate's. */
bool tb__table_regime_valid(const struct tbt_regime *r)
{
	struct tbt_call c;
	return load_slot(r, 0, &c) && horizon_span(c.v.p, c.v.q, TBT_HORIZON) >= TBT_HORIZON_MIN;
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
	atomic_store_explicit(&nr->hspan, tb__table_regime_hspan(p, q), memory_order_relaxed);
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
	int err = tb__table_rate_check(lim->tokens, lim->period_ns, lim->burst, &p, &q);
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
