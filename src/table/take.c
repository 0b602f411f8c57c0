/* SPDX-License-Identifier: MIT */
/*
 * A table's calls on one key: allow (its warm path and the general one),
 * allow_result, reserve, the give-back of cancel and refund, and tokens.
 * The take itself is inline in table_internal.h; docs/table.md has the
 * model.
 */
#include <math.h>

#include "seconds.h"
#include "table_internal.h"

/* ---- Takes --------------------------------------------------------------- */

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
	if (__builtin_expect(past_horizon(&c, c.at), 0) && tb__table_reanchor(t, &c, c.at, n) != 0)
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
void tb__table_peek(const struct tbt_call *c, struct tbt_outcome *o)
{
	uint64_t st;
	struct tbt_slot *s = find(c, &st);
	o->at = s ? key_time(s, c->at) : c->at;
	o->level = s ? level_of(c, o->at, st_tail(state_again(s, st))) : (int64_t)c->burst;
}


/*
 * allow_result's decision on the key hashed to h, leaving in *c and *o what
 * its report is made of: 0, or the library's error.
 */
static inline __attribute__((always_inline)) int allow_outcome(struct tokenbucket_table *t,
							       int64_t now, uint64_t h, uint64_t n,
							       struct tbt_call *c,
							       struct tbt_outcome *o)
{
	if (__builtin_expect(warm_allow(t, now, h, n, c, o) == 1, 1))
		return 0;
	if (!call_init_hashed(t, now, h, 0, c))
		return -EBADMSG;
	if (n > c->burst) {
		/* Refused at once. */
		tb__table_peek(c, o);
		return 0;
	}
	int err = past_horizon(c, c->at) ? tb__table_reanchor(t, c, c->at, n) : 0;
	if (err == 0)
		err = take(t, c, n, true, o, NULL);
	if (err)
		return err;
	cache_regime(t, c);
	return 0;
}

int tokenbucket_table_allow_result_at(struct tokenbucket_table *t, int64_t now, const void *key,
				      size_t len, uint64_t n, struct tokenbucket_result *res)
{
	if (t == NULL || res == NULL || bad_key(key, len))
		return -EINVAL;
	uint64_t h = tb__siphash13_inline(t->k0, t->k1, key, len);
	struct tbt_call c;
	struct tbt_outcome o = {0};
	int err = allow_outcome(t, now, h, n, &c, &o);
	if (err)
		return err;
	report(&c, &o, n, res);
	return 0;
}

/*
 * The same decision as allow_result_at, reporting only what a RateLimit
 * header shows: no retry time, no record to fill.
 */
int tokenbucket_table_allow_reset_at(struct tokenbucket_table *t, int64_t now, const void *key,
				     size_t len, uint64_t n, uint64_t *remaining,
				     int64_t *reset_s)
{
	if (t == NULL || remaining == NULL || reset_s == NULL || bad_key(key, len))
		return -EINVAL;
	uint64_t h = tb__siphash13_inline(t->k0, t->k1, key, len);
	struct tbt_call c;
	struct tbt_outcome o = {0};
	int err = allow_outcome(t, now, h, n, &c, &o);
	if (err)
		return err;
	*remaining = o.level > 0 ? (uint64_t)o.level : 0;
	*reset_s = tb__reset_seconds(&c.v, o.at, c.burst, o.level);
	return o.allowed;
}

int tokenbucket_table_allow_reset(struct tokenbucket_table *t, const void *key, size_t len,
				  uint64_t n, uint64_t *remaining, int64_t *reset_s)
{
	return tokenbucket_table_allow_reset_at(t, tb__now(), key, len, n, remaining, reset_s);
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
		int err = ++rounds == TB__ROUNDS_MAX ? -EBADMSG : tb__table_reanchor(t, &c, c.at, n);
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
		s = tb__table_insert(t, &c, &st);
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
			int err = ++rounds == TB__ROUNDS_MAX ? -EBADMSG : tb__table_reanchor(t, &c, at, n);
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
void tb__table_give_back_key(struct tokenbucket_table *t, struct tbt_call *c, uint64_t n,
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
			if (++rounds == TB__ROUNDS_MAX || tb__table_reanchor(t, c, at, 0))
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
		tb__table_give_back_key(t, &c, n, r->time_to_act);
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
		tb__table_give_back_key(t, &c, n, INT64_MAX);
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
double tb__table_tokens_of(const struct tbt_call *c, int64_t at, uint64_t tail)
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
	return tb__table_tokens_of(&c, at, st_tail(state_again(s, st)));
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
