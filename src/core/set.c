/* SPDX-License-Identifier: MIT */
/*
 * Several limits in one decision: n tokens from every bucket of a set, or
 * from none.  Built on each bucket's own lock-free take; a refusal gives
 * back what the earlier buckets gave by the one give-back rule
 * (docs/core.md, "Giving back").  docs/sets.md has the model and the
 * bounds; every function here is lock-free and may run in any number of
 * threads at once.
 */
#include <errno.h>

#include "rovers.h"
#include "sleep.h"

/*
 * -EINVAL for a set no call accepts: NULL, empty, too long, a NULL or
 * repeated bucket; then, with n (not NULL), -E2BIG if some bucket of
 * finite rate could never hold *n.  One pass: a set's call pays it.
 */
static inline __attribute__((always_inline)) int check_set_for(struct tokenbucket *const *set,
							      size_t count, const uint64_t *n)
{
	if (set == NULL || count - 1 >= TOKENBUCKET_SET_MAX) /* count 0 wraps */
		return -EINVAL;
	int err = 0;
	for (size_t i = 0; i < count; i++) {
		if (set[i] == NULL)
			return -EINVAL;
		for (size_t j = 0; j < i; j++)
			if (set[j] == set[i])
				return -EINVAL;
		if (n != NULL && *n > atomic_load_explicit(&set[i]->burst, memory_order_relaxed) &&
		    !tb__unlimited(set[i]))
			err = -E2BIG;
	}
	return err;
}

static inline __attribute__((always_inline)) int check_set(struct tokenbucket *const *set,
								 size_t count)
{
	return check_set_for(set, count, NULL);
}

/* The checks of a call that takes n: its output (has_out), the set, then n. */
static inline __attribute__((always_inline)) int
check_take(bool has_out, struct tokenbucket *const *set, size_t count, uint64_t n)
{
	return has_out ? check_set_for(set, count, &n) : -EINVAL;
}

/*
 * Whether tb surely holds fewer than n tokens at now, read without taking
 * (the now is recorded, as any call does).  False when unsure: the take
 * then decides.  Only a level read with the tail it belongs to, at a time
 * no earlier than any drop in that tail, refuses (as tokenbucket_allow_at).
 */
static bool short_now(struct tokenbucket *tb, int64_t now, uint64_t n)
{
	/*
	 * Tokens only come: a level of n or more before this instant's
	 * production is surely not short.  The usual case, read from three
	 * words (a torn read only sends the set to its take).
	 */
	uint64_t gen = atomic_load_explicit(&tb->gen, memory_order_acquire);
	uint64_t hoff = atomic_load_explicit(&tb->slot[(gen >> 1) & 1].hoff, memory_order_relaxed);
	if (tb__level(atomic_load_explicit(&tb->head, memory_order_relaxed) + hoff,
		      atomic_load_explicit(&tb->tail, memory_order_relaxed)) >= (int64_t)n)
		return false;
	struct tb__view f;
	if (tb__capped(tb) || tb__unlimited(tb) || !tb__load_regime(tb, &f))
		return false;
	uint64_t burst = atomic_load_explicit(&tb->burst, memory_order_relaxed);
	uint64_t tail = atomic_load_explicit(&tb->tail, memory_order_acquire);
	uint64_t head = atomic_load_explicit(&tb->head, memory_order_acquire);
	int64_t at;
	if (n > burst || !tb__fast_observe(tb, now, &at) || !tb__fast_valid(tb, &f, at))
		return false;
	int64_t e = tb__level(head + f.hoff, tail);
	if (e > (int64_t)burst || e >= (int64_t)n ||
	    tb__fine_units(&f, at) >= (tb__u128)(n - (uint64_t)e) * f.q)
		return false;
	return atomic_load_explicit(&tb->tail, memory_order_acquire) == tail &&
	       atomic_load(&tb->clock) == at;
}

/*
 * What a take saw, for the report: on the fast path the view, the time
 * and the level just after the take (have); otherwise the report reads
 * the bucket again.
 */
struct seen {
	struct tb__view v;
	int64_t at;
	int64_t level;
	tb__u128 rem; /* F(at) mod q, the fine units short of a token (0 if not producing) */
	bool have;
};

/*
 * One bucket's take, as tokenbucket_reserve_at; what it saw goes to seen, for a report (NULL: none wanted, and
 * the production's division is not made).  Inline, so that a caller
 * passing NULL gets the path of tokenbucket_reserve_at and no more.
 */
static inline __attribute__((always_inline)) int
take_one(struct tokenbucket *tb, int64_t now, uint64_t n, int64_t max_wait,
	 struct tokenbucket_reservation *r, struct seen *seen)
{
	uint64_t burst = atomic_load_explicit(&tb->burst, memory_order_relaxed);
	if (seen != NULL)
		seen->have = false;
	if (n <= burst && max_wait >= 0) {
		int64_t at;
		uint64_t ticket, tail, head;
		if (tb__fast_take_seen(tb, now, n, burst, &at, &ticket, &tail,
				       seen != NULL ? &seen->v : NULL,
				       seen != NULL ? &head : NULL) == TB__FAST_TAKEN) {
			*r = (struct tokenbucket_reservation){
				.time_to_act = at,
				.tokens = n,
				.ticket = ticket,
			};
			if (seen == NULL)
				return 0;
			/* tb__head_at's production, its remainder kept for the wait until full. */
			tb__u128 fine = tb__fine_at(&seen->v, at);
			tb__u128 whole = tb__whole(&seen->v, fine);
			seen->at = at;
			seen->rem = fine - whole * seen->v.q;
			seen->level = tb__level(head + seen->v.hoff + (uint64_t)whole, ticket);
			seen->have = true;
			return 0;
		}
	}
	return tokenbucket_reserve_at(tb, now, n, max_wait, r);
}

/*
 * Gives back the r->tokens a set's take of r took from tb, by the one rule
 * (docs/core.md, "Giving back"): at max(now, clock), min(n, burst - level)
 * comes back, whatever ran on the bucket since.  The usual case is an
 * undo: the tail is still the take's ticket, so no call took or dropped
 * since, and moving it back by n is that rule in one compare-and-swap
 * (what it lifts above burst is dropped by the next call that records a
 * time, as the rule would not have added it).  Not under capped release,
 * where ceil - tail counts what is in flight.
 */
static inline __attribute__((always_inline)) void
give_back(struct tokenbucket *tb, int64_t now, struct tokenbucket_reservation *r)
{
	uint64_t n = r->tokens;
	r->tokens = 0;
	if (n == 0 || tb__unlimited(tb))
		return;
	tb__observe(tb, now);
	uint64_t expect = r->ticket;
	if (tb__capped(tb) || !atomic_compare_exchange_strong(&tb->tail, &expect, r->ticket - n))
		tokenbucket_refund(tb, n);
}

/* Gives back r[0] to r[k - 1], the latest first (so that undoing is likelier). */
static void give_back_all(struct tokenbucket *const *set, size_t k, int64_t now,
			  struct tokenbucket_reservation *r)
{
	while (k-- > 0)
		give_back(set[k], now, &r[k]);
}

/*
 * Takes from every bucket as take_one, or from none: 0, or the first
 * error (its bucket in *failed).  With act (not NULL), the latest of the
 * takes' times to act goes there.
 */
static inline __attribute__((always_inline)) int
take_all(struct tokenbucket *const *set, size_t count, int64_t now, uint64_t n, int64_t max_wait,
	 struct tokenbucket_reservation *r, struct seen *seen, size_t *failed, int64_t *act)
{
	for (size_t i = 0; i < count; i++) {
		int err = take_one(set[i], now, n, max_wait, &r[i], seen != NULL ? &seen[i] : NULL);
		if (err) {
			give_back_all(set, i, now, r);
			*failed = i;
			return err;
		}
		if (act != NULL && (i == 0 || r[i].time_to_act > *act))
			*act = r[i].time_to_act;
	}
	return 0;
}

/*
 * The latest of the times until full of an allowed set's buckets whose
 * takes saw their levels (seen[i].have): what folding tb__result's
 * reset_after_ns over them gives, with one exact division (the ceiling by p) for the
 * bucket found latest and for any other a double cannot tell from it,
 * instead of one per bucket.  A bucket's wait is ceil(x / p), x = j q -
 * rem fine units (tb__time_of); the ceiling is monotonic, so the largest
 * x / p has the largest wait.  An estimate is within 2^-51 of x / p, so
 * one below the largest by more than 2^-40 of it cannot be the latest.
 */
static int64_t latest_full(const struct seen *seen, const uint64_t *burst, size_t count)
{
	tb__u128 x[TOKENBUCKET_SET_MAX];
	uint64_t p[TOKENBUCKET_SET_MAX];
	double est[TOKENBUCKET_SET_MAX];
	size_t m = 0, top = 0;
	for (size_t i = 0; i < count; i++) {
		if (!seen[i].have)
			continue; /* reported by tb__report, its wait folded there */
		int64_t level = tb__capped_level(seen[i].level, burst[i]);
		if (level >= (int64_t)burst[i])
			continue;
		const struct tb__view *v = &seen[i].v;
		if (v->kind != TB__FINITE || v->p == 0 || v->q == 0 || v->origin == TB__NO_TIME)
			return TOKENBUCKET_NEVER;
		int64_t at = seen[i].at;
		uint64_t j = burst[i] - (uint64_t)level;
		tb__u128 need = (tb__u128)j * v->q - seen[i].rem;
		/* NEVER when the wait reaches TOKENBUCKET_NEVER - at or NEVER itself. */
		uint64_t lim = (uint64_t)TOKENBUCKET_NEVER - (uint64_t)at;
		if (lim > (uint64_t)TOKENBUCKET_NEVER)
			lim = (uint64_t)TOKENBUCKET_NEVER;
		if (lim == 0 || need >= (tb__u128)(lim - 1) * v->p + 1)
			return TOKENBUCKET_NEVER;
		x[m] = need;
		p[m] = v->p;
		est[m] = (need >> 64 ? (double)need : (double)(uint64_t)need) / (double)v->p;
		if (est[m] > est[top])
			top = m;
		m++;
	}
	if (m == 0)
		return 0;
	tb__u128 best = tb__div(x[top] + p[top] - 1, p[top]);
	for (size_t k = 0; k < m; k++) {
		if (k == top || est[k] * (1 + 0x1p-40) < est[top])
			continue;
		tb__u128 w = tb__div(x[k] + p[k] - 1, p[k]);
		if (w > best)
			best = w;
	}
	return (int64_t)best;
}

int tokenbucket_allow_all_at(struct tokenbucket *const *set, size_t count, int64_t now,
			     uint64_t n, struct tokenbucket_set_result *res)
{
	int err = check_take(res != NULL, set, count, n);
	if (err)
		return err;
	struct tokenbucket_reservation r[TOKENBUCKET_SET_MAX];
	struct seen seen[TOKENBUCKET_SET_MAX];
	size_t refused = count;
	/* A set that one bucket refuses is refused before anything is taken. */
	for (size_t i = 1; i < count; i++) {
		if (short_now(set[i], now, n)) {
			refused = i;
			break;
		}
	}
	if (refused == count) {
		err = take_all(set, count, now, n, 0, r, seen, &refused, NULL);
		/* -ETIMEDOUT, -EOVERFLOW (deep debt), -E2BIG (a burst lowered meanwhile) refuse. */
		if (err == -EBADMSG)
			return err;
	}
	bool allowed = refused == count;
	struct tokenbucket_set_result out = { .allowed = allowed, .index = refused };
	uint64_t fewest = UINT64_MAX;
	uint64_t burst[TOKENBUCKET_SET_MAX];
	for (size_t i = 0; i < count; i++) {
		struct tokenbucket_result one;
		/*
		 * Allowed, a fast take already saw the level just after it; its
		 * wait until full is left to latest_full, below.
		 */
		if (allowed && seen[i].have) {
			burst[i] = atomic_load_explicit(&set[i]->burst, memory_order_relaxed);
			int64_t level = tb__capped_level(seen[i].level, burst[i]);
			one = (struct tokenbucket_result){
				.allowed = true,
				.limit = burst[i],
				.remaining = level > 0 ? (uint64_t)level : 0,
			};
		} else if (tb__report(set[i], n, allowed, &one)) {
			if (allowed)
				give_back_all(set, count, now, r);
			return -EBADMSG;
		}
		tb__set_fold(&out, i, refused, &one, &fewest);
	}
	if (allowed) {
		int64_t full = latest_full(seen, burst, count);
		if (full > out.reset_after_ns)
			out.reset_after_ns = full;
	}
	*res = out;
	return 0;
}

int tokenbucket_allow_all(struct tokenbucket *const *set, size_t count, uint64_t n,
			  struct tokenbucket_set_result *res)
{
	return tokenbucket_allow_all_at(set, count, tb__now(), n, res);
}

int tokenbucket_reserve_all_at(struct tokenbucket *const *set, size_t count, int64_t now,
			       uint64_t n, int64_t max_wait, struct tokenbucket_reservation *r)
{
	int err = check_take(r != NULL, set, count, n);
	if (err)
		return err;
	struct tokenbucket_reservation taken[TOKENBUCKET_SET_MAX];
	size_t failed;
	/* The set acts when the last of its buckets has the tokens. */
	int64_t act;
	err = take_all(set, count, now, n, max_wait, taken, NULL, &failed, &act);
	if (err)
		return err;
	for (size_t i = 0; i < count; i++) {
		r[i] = taken[i];
		r[i].time_to_act = act;
	}
	return 0;
}

int tokenbucket_reserve_all(struct tokenbucket *const *set, size_t count, uint64_t n,
			    int64_t max_wait, struct tokenbucket_reservation *r)
{
	return tokenbucket_reserve_all_at(set, count, tb__now(), n, max_wait, r);
}

int tokenbucket_cancel_all_at(struct tokenbucket *const *set, size_t count, int64_t now,
			      struct tokenbucket_reservation *r)
{
	if (r == NULL)
		return -EINVAL;
	int err = check_set(set, count);
	if (err)
		return err;
	now = tb__time(now);
	for (size_t k = count; k-- > 0;) {
		if (now > r[k].time_to_act)
			r[k].tokens = 0; /* too late: the set acted, the tokens were used */
		else
			give_back(set[k], now, &r[k]);
	}
	return 0;
}

int tokenbucket_cancel_all(struct tokenbucket *const *set, size_t count,
			   struct tokenbucket_reservation *r)
{
	return tokenbucket_cancel_all_at(set, count, tb__now(), r);
}

/* Bounds of the pause between two checks of a set not yet covered (as wait.c). */
#define RECHECK_MIN_NS 1000000
#define RECHECK_MAX_NS 1000000000

/*
 * The most tokens any bucket of the set still misses for its
 * reservation, after crediting the production up to the present; the
 * pause the slowest needs goes to *pause.  -EBADMSG for a corrupt bucket.
 */
static int64_t missing_all(struct tokenbucket *const *set, size_t count,
			   const struct tokenbucket_reservation *r, int64_t *now, int64_t *pause)
{
	bool missing = false;
	*pause = 0;
	for (size_t i = 0; i < count; i++) {
		struct tb__view v;
		int64_t at;
		if (!tb__enter(set[i], tb__now(), &v, &at, true))
			return -EBADMSG;
		if (i == 0 || at > *now)
			*now = at;
		uint64_t m = tokenbucket_deficiency(set[i], r[i].ticket);
		if (m == 0)
			continue;
		missing = true;
		int64_t d = tokenbucket_duration_for(set[i], m);
		if (d > *pause)
			*pause = d;
	}
	return missing;
}

int tokenbucket_wait_all(struct tokenbucket *const *set, size_t count, uint64_t n,
			 int64_t deadline, int cancel_fd)
{
	int err = check_take(true, set, count, n);
	if (err)
		return err;
	err = tb__cancel_check(cancel_fd);
	if (err)
		return err;
	int64_t now = tb__now();
	struct tokenbucket_reservation r[TOKENBUCKET_SET_MAX];
	err = tokenbucket_reserve_all_at(set, count, now, n, tb__max_wait_until(deadline, now), r);
	if (err)
		return err;
	int64_t target = r[0].time_to_act;
	for (;;) {
		/* Never past the deadline (the buckets' clocks may run ahead of ours). */
		if (target > deadline)
			target = deadline;
		err = tb__sleep_until(target < 0 ? 0 : target, cancel_fd);
		if (err)
			break;
		int64_t pause;
		int64_t missing = missing_all(set, count, r, &now, &pause);
		if (missing <= 0) {
			err = (int)missing;
			if (err == 0)
				return 0;
			break;
		}
		if (now >= deadline) {
			err = -ETIMEDOUT;
			break;
		}
		pause = pause < RECHECK_MIN_NS ? RECHECK_MIN_NS
			: pause > RECHECK_MAX_NS ? RECHECK_MAX_NS
						  : pause;
		target = pause >= deadline - now ? deadline : now + pause;
	}
	/* A wait that fails takes nothing, even after time_to_act. */
	give_back_all(set, count, tb__now(), r);
	return err;
}
