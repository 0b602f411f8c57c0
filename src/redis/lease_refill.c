/* SPDX-License-Identifier: MIT */
/*
 * A lease's tokens, whoever makes its round trips: the local bucket's
 * credits and what a give-back collects, a refill's plan and landing, and
 * a lease made and freed.  docs/leases.md has the model; lease.c's first
 * comment the safety argument and the locks.
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "lease_refill.h"

int64_t tbr__lease_mono_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* The coarse clock's step: it lags the monotonic clock by less. */
static int64_t coarse_step(void)
{
	struct timespec ts;
	if (clock_getres(CLOCK_MONOTONIC_COARSE, &ts) != 0)
		return 0;
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Whole tokens held locally (the level of a rate-0 bucket is whole). */
uint64_t tbr__lease_held(struct tokenbucket_redis_lease *l)
{
	double v = tokenbucket_tokens_at(l->local, 0);
	return v > 0 ? (uint64_t)v : 0;
}

/*
 * Hands x tokens that the shared bucket granted (or that a reservation
 * covered by such tokens gives back) to the queued reservations in order,
 * then to the local bucket up to its burst, and the rest to overflow.
 * rmu held.  Callers only take from local meanwhile, so the room seen here
 * can only grow: the refund never drops a token.
 */
void tbr__lease_credit(struct tokenbucket_redis_lease *l, uint64_t x)
{
	while (x > 0 && l->queue != NULL) {
		struct pending *p = l->queue;
		uint64_t take = p->need < x ? p->need : x;
		p->need -= take;
		l->missing -= take;
		l->assigned += take;
		x -= take;
		if (p->need > 0)
			break;
		/* Covered: its tokens are the reserver's now. */
		l->assigned -= p->n;
		l->queue = p->next;
		if (l->queue == NULL)
			l->queue_end = &l->queue;
		if (p->wake_fd >= 0) {
			uint64_t one = 1;
			ssize_t w = write(p->wake_fd, &one, sizeof(one));
			(void)w; /* an eventfd write below its maximum cannot fail */
		}
		free(p);
	}
	if (x == 0)
		return;
	uint64_t h = tbr__lease_held(l);
	uint64_t room = 2 * l->cap > h ? 2 * l->cap - h : 0;
	uint64_t put = x < room ? x : room;
	if (put > 0)
		tokenbucket_refund(l->local, put);
	if (x > put) {
		l->overflow += x - put;
		atomic_store_explicit(&l->has_overflow, true, memory_order_relaxed);
	}
}

/* Takes up to x held tokens out of local; what it took. */
static uint64_t take_held(struct tokenbucket_redis_lease *l, uint64_t x)
{
	for (;;) {
		uint64_t h = tbr__lease_held(l);
		uint64_t t = h < x ? h : x;
		if (t == 0 || tokenbucket_allow_at(l->local, 0, t))
			return t;
		/* a caller took some meanwhile */
	}
}

/*
 * Takes up to x of what the lease can grant: from overflow, then local,
 * then the credit of queued reservations, the latest first (they miss it
 * again).  rmu held; what it took.
 */
static uint64_t withdraw(struct tokenbucket_redis_lease *l, uint64_t x)
{
	uint64_t want = x;
	uint64_t o = l->overflow < x ? l->overflow : x;
	l->overflow -= o, x -= o;
	if (l->overflow == 0)
		atomic_store_explicit(&l->has_overflow, false, memory_order_relaxed);
	x -= take_held(l, x);
	while (x > 0 && l->assigned > 0) {
		struct pending *last = NULL;
		for (struct pending *p = l->queue; p != NULL; p = p->next)
			if (p->n > p->need)
				last = p;
		if (last == NULL)
			break;
		uint64_t t = last->n - last->need < x ? last->n - last->need : x;
		last->need += t, l->missing += t, l->assigned -= t, x -= t;
	}
	return want - x;
}

/*
 * The chunks brought up to date at now (rmu held): those past their
 * deadline go, and if the lease could then grant more than the live ones
 * count (what the server still counts as leased), the excess is
 * forfeited.  So what the lease can grant never exceeds what its live
 * groups hold in the shared bucket (docs/leases.md, "Safety"); which
 * chunk a spent token came from does not matter.
 */
void tbr__lease_settle(struct tokenbucket_redis_lease *l, int64_t now)
{
	uint64_t can = l->overflow + tbr__lease_held(l) + l->assigned, live = 0;
	int k = 0;
	for (int i = 0; i < l->nchunks; i++) {
		if (l->chunks[i].count > 0 && l->chunks[i].deadline > now) {
			l->chunks[k++] = l->chunks[i];
			live += l->chunks[i].count;
		}
	}
	l->nchunks = k;
	if (can > live)
		withdraw(l, can - live);
	atomic_store_explicit(&l->next_deadline, k > 0 ? l->chunks[0].deadline : INT64_MAX,
			      memory_order_release);
}

/*
 * Callers' check before they take: a chunk past its deadline is settled
 * first.  The coarse clock (cheaper) lags the monotonic one by less than
 * its step, so only within a step of the deadline is the exact clock read.
 */
void tbr__lease_expire_due(struct tokenbucket_redis_lease *l)
{
	int64_t due = atomic_load_explicit(&l->next_deadline, memory_order_acquire);
	if (due == INT64_MAX)
		return;
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
	if ((int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec < due - l->coarse_step)
		return;
	int64_t now = tbr__lease_mono_ns();
	if (now < due)
		return;
	pthread_mutex_lock(&l->rmu);
	tbr__lease_settle(l, now);
	pthread_mutex_unlock(&l->rmu);
}

/* A grant of x into group, usable until deadline: the chunk it joins or starts. rmu held. */
static void add_chunk(struct tokenbucket_redis_lease *l, uint64_t x, int64_t group,
		      int64_t deadline, int64_t now)
{
	tbr__lease_settle(l, now);
	for (int i = 0; i < l->nchunks; i++) {
		if (l->chunks[i].group == group) {
			l->chunks[i].count += x;
			if (deadline < l->chunks[i].deadline)
				l->chunks[i].deadline = deadline; /* the earlier: still sorted */
			goto placed;
		}
	}
	if (l->nchunks == LEASE_CHUNKS) {
		/* No slot: the first chunk goes early, which is never late. */
		l->chunks[0].deadline = INT64_MIN;
		tbr__lease_settle(l, now);
	}
	int i = l->nchunks++;
	while (i > 0 && l->chunks[i - 1].deadline > deadline) {
		l->chunks[i] = l->chunks[i - 1];
		i--;
	}
	l->chunks[i] = (struct chunk){ .count = x, .deadline = deadline, .group = group };
placed:
	atomic_store_explicit(&l->next_deadline, l->chunks[0].deadline, memory_order_release);
}

/*
 * Gives back to the shared bucket every token held locally and in
 * overflow, and with all (the lease ends), those credited to queued
 * reservations (collect() empties them, give_back() sends them).  A
 * give-back that fails loses them: it may
 * have been applied (a timeout after the server ran it), so keeping them
 * could count them twice.  Lost tokens are granted to no one, which costs
 * others, never the limit.
 */
uint64_t tbr__lease_collect(struct tokenbucket_redis_lease *l, bool all)
{
	pthread_mutex_lock(&l->rmu);
	uint64_t total = l->overflow;
	l->overflow = 0;
	atomic_store_explicit(&l->has_overflow, false, memory_order_relaxed);
	if (all) {
		/* Queued reservations stay queued, never to be covered. */
		total += l->assigned;
		l->assigned = 0;
	}
	pthread_mutex_unlock(&l->rmu);
	return total + take_held(l, UINT64_MAX);
}

/*
 * What must go back before the chunks due by now (a quarter of their life before
 * their deadline) expire: what the lease can grant beyond what the other
 * chunks count, each piece naming a due chunk's group, the earliest first
 * (so that an idle lease loses nothing to expiry).  Taken from the lease;
 * the count of pieces.  *next: when the next chunk falls due (INT64_MAX:
 * none).
 */
size_t tbr__lease_collect_due(struct tokenbucket_redis_lease *l, int64_t now,
			      struct give out[LEASE_CHUNKS], int64_t *next)
{
	int64_t guard = l->life_ns / 4;
	size_t k = 0;
	pthread_mutex_lock(&l->rmu);
	tbr__lease_settle(l, now);
	*next = INT64_MAX;
	int due = 0;
	uint64_t rest = 0;
	for (int i = 0; i < l->nchunks; i++) {
		if (l->chunks[i].deadline - guard <= now)
			due = i + 1;
		else
			rest += l->chunks[i].count;
	}
	if (due < l->nchunks)
		*next = l->chunks[due].deadline - guard;
	uint64_t can = l->overflow + tbr__lease_held(l) + l->assigned;
	uint64_t excess = can > rest ? can - rest : 0;
	for (int i = 0; i < due && excess > 0; i++) {
		struct chunk *c = &l->chunks[i];
		uint64_t t = withdraw(l, c->count < excess ? c->count : excess);
		if (t > 0)
			out[k++] = (struct give){ .group = c->group, .n = t };
		c->count -= t, excess -= t;
	}
	tbr__lease_settle(l, now);
	bool more = l->missing > 0;
	pthread_mutex_unlock(&l->rmu);
	if (k > 0 && more)
		atomic_store_explicit(&l->wanted, true, memory_order_relaxed);
	return k;
}

/*
 * tbr__lease_collect, each token named by a live chunk's group (settle
 * keeps them enough), into out; the count of pieces.
 */
size_t tbr__lease_collect_groups(struct tokenbucket_redis_lease *l, bool all,
				 struct give out[LEASE_CHUNKS])
{
	pthread_mutex_lock(&l->rmu);
	tbr__lease_settle(l, tbr__lease_mono_ns());
	pthread_mutex_unlock(&l->rmu);
	uint64_t total = tbr__lease_collect(l, all);
	pthread_mutex_lock(&l->rmu);
	size_t k = 0;
	for (int i = 0; i < l->nchunks && total > 0; i++) {
		struct chunk *c = &l->chunks[i];
		uint64_t t = c->count < total ? c->count : total;
		if (t > 0)
			out[k++] = (struct give){ .group = c->group, .n = t };
		c->count -= t, total -= t;
	}
	tbr__lease_settle(l, tbr__lease_mono_ns());
	pthread_mutex_unlock(&l->rmu);
	return k;
}

/* Whether the lease should ask for more now: reservations wait, or fewer than low held. rmu held. */
static bool short_of_tokens(struct tokenbucket_redis_lease *l)
{
	return l->missing > 0 ||
	       tbr__lease_held(l) < atomic_load_explicit(&l->low, memory_order_relaxed);
}

/*
 * A refill's first half, at t0: overflow credited first, the chunk sized
 * to recent demand, within what the local bucket has room for.  False
 * when nothing is to be asked for; else *want is the tokens to ask for.
 */
bool tbr__lease_refill_plan(struct tokenbucket_redis_lease *l, int64_t t0, uint64_t *want_out)
{
	if (atomic_load_explicit(&l->has_overflow, memory_order_relaxed)) {
		/* Tokens already taken come before another round trip. */
		atomic_store_explicit(&l->wanted, false, memory_order_relaxed);
		pthread_mutex_lock(&l->rmu);
		uint64_t x = l->overflow;
		l->overflow = 0;
		atomic_store_explicit(&l->has_overflow, false, memory_order_relaxed);
		tbr__lease_credit(l, x);
		bool more = short_of_tokens(l);
		pthread_mutex_unlock(&l->rmu);
		if (!more)
			return false;
		atomic_store_explicit(&l->wanted, true, memory_order_relaxed);
	}
	/* The chunk follows the client's own demand d: used up within a
	 * window (d above chunk / window), or a caller refused, it doubles up
	 * to cap; lasting two windows, it halves.  So it settles between d
	 * and 2 d tokens per window. */
	bool starved = atomic_exchange_explicit(&l->starved, false, memory_order_relaxed);
	if (l->last_refill != 0) {
		int64_t lasted = t0 - l->last_refill;
		if ((starved || lasted < l->window_ns) && l->chunk < l->cap)
			l->chunk = l->chunk > l->cap / 2 ? l->cap : l->chunk * 2;
		else if (!starved && lasted > 2 * l->window_ns && l->chunk / 2 >= l->floor)
			l->chunk /= 2;
	}
	uint64_t h = tbr__lease_held(l);
	uint64_t room = 2 * l->cap > h ? 2 * l->cap - h : 0;
	uint64_t want = l->chunk < room ? l->chunk : room;
	/* Queued reservations go first: at least what they miss, up to cap
	 * (they take it, so it needs no room in local). */
	pthread_mutex_lock(&l->rmu);
	uint64_t queued = l->missing < l->cap ? l->missing : l->cap;
	pthread_mutex_unlock(&l->rmu);
	if (want < queued)
		want = queued;
	if (want == 0) {
		atomic_store_explicit(&l->wanted, false, memory_order_relaxed);
		return false;
	}
	*want_out = want;
	return true;
}

/*
 * Contended: the shared bucket could not give this chunk, or not another
 * one after it.  Judged by the bucket, not by this take, so that a small
 * chunk does not count as plenty.
 */
bool tbr__lease_contended_by(const struct tokenbucket_result *res, uint64_t want)
{
	return !res->allowed || res->remaining < want;
}

/*
 * A refill's second half: the round trips from t0 to t1 ended with err
 * and res (valid when err is 0), having asked for want.  Returns the
 * error that stands (callers are refused until Redis answers), after
 * which the next try waits an eighth of a window.
 */
int tbr__lease_refill_landed(struct tokenbucket_redis_lease *l, int err,
			 const struct tokenbucket_result *res, uint64_t want, int64_t t0,
			 int64_t t1, bool contended)
{
	if (err == 0 && res->allowed && (res->flags & TOKENBUCKET_RESULT_LOCAL)) {
		/* The client's fallback decided, not the shared bucket: its
		 * tokens are no lease, and giving them back would invent some. */
		err = -EAGAIN;
	}
	atomic_store_explicit(&l->err, err, memory_order_relaxed);
	if (err != 0) {
		/* Redis cannot answer: callers are refused until it can. */
		atomic_store_explicit(&l->retry_ns, t1 - t0, memory_order_relaxed);
		return err;
	}
	if (contended) {
		/* A contended key: this client's next refill waits its turn
		 * (below), whatever it took now: a quarter window on average,
		 * drawn from [1/8, 3/8) of it, so that the clients' turns do
		 * not lock into one order (a lease that always comes first
		 * after the longest gap would take most of every round). */
		int64_t q = l->window_ns / 4;
		l->rng ^= l->rng << 13;
		l->rng ^= l->rng >> 7;
		l->rng ^= l->rng << 17;
		l->next_refill = t1 + q / 2 + (q > 0 ? (int64_t)(l->rng % (uint64_t)q) : 0);
	}
	if (!res->allowed) {
		/* The shared bucket is empty.  Waiting for a whole chunk would
		 * let whoever wakes first take all of it, every time, and a
		 * wait that depends on the chunk lets the smallest chunk poll
		 * fastest.  Every contending client polls every quarter
		 * window instead and takes what is there: equal periods, so
		 * equal shares on average, at 4 polls a window each.  Nothing
		 * waits in the shared bucket longer than that, so nothing
		 * overflows its burst as long as the rate makes less than a
		 * burst in 3/8 of a window (docs/leases.md). */
		atomic_store_explicit(&l->retry_ns, l->next_refill - t1, memory_order_relaxed);
		return 0;
	}
	/* Clear the request before the tokens land, so that a caller who
	 * drains them asks again. */
	atomic_store_explicit(&l->wanted, false, memory_order_relaxed);
	atomic_store_explicit(&l->low, l->chunk / 2 + 1, memory_order_relaxed);
	atomic_store_explicit(&l->retry_ns, t1 - t0, memory_order_relaxed);
	pthread_mutex_lock(&l->rmu);
	/* The chunk's deadline: its group's lifetime from t0, before the
	 * request left (a lease's result: tbr__lease_call). */
	int64_t dur = res->reset_after_ns;
	int64_t deadline = dur >= INT64_MAX - t0 ? INT64_MAX - 1 : t0 + dur;
	add_chunk(l, want, res->retry_after_ns, deadline, t1);
	tbr__lease_credit(l, want);
	bool more = l->missing > 0;
	pthread_mutex_unlock(&l->rmu);
	if (more) /* queued reservations took it all: go on */
		atomic_store_explicit(&l->wanted, true, memory_order_relaxed);
	l->last_refill = t1;
	return 0;
}

/* Frees what lease_open made; the thread, if any, has been joined. */
void tbr__lease_free(struct tokenbucket_redis_lease *l)
{
	while (l->queue != NULL) {
		struct pending *p = l->queue;
		l->queue = p->next;
		free(p);
	}
	pthread_mutex_destroy(&l->rmu);
	pthread_cond_destroy(&l->cv);
	pthread_mutex_destroy(&l->mu);
	tokenbucket_free(l->local);
	free(l->key);
	free(l);
}

/* A lease with no client yet, its arguments checked; lease_open's errors. */
int tbr__lease_new(struct tokenbucket_redis_lease **lp, const void *key, size_t keylen,
		     const struct tokenbucket_redis_limit *lim, double share, int64_t window_ns)
{
	if (lim == NULL || (key == NULL && keylen > 0) || isnan(share) ||
	    share <= 0 || share > 1 || window_ns <= 0 || (lim->tokens > 0 && lim->period_ns <= 0))
		return -EINVAL;
	if (lim->burst > TOKENBUCKET_BURST_MAX || window_ns > LEASE_WINDOW_MAX)
		return -ERANGE;
	/* Tokens wait in the shared bucket up to 3/8 of a window between a
	 * contended lease's takes: the rate must make less than a burst in
	 * that time, or the bucket drops what the fleet was owed. */
	if (lim->tokens > 0 && (long double)lim->tokens * (long double)window_ns * 3 / 8 >=
				       (long double)lim->burst * (long double)lim->period_ns)
		return -ERANGE;
	/* cap: share of the burst, and what the rate makes in a window. */
	uint64_t cap = (uint64_t)floorl((long double)share * (long double)lim->burst);
	if (lim->tokens > 0) {
		long double w = (long double)lim->tokens * (long double)window_ns /
				(long double)lim->period_ns;
		if (w < (long double)cap)
			cap = (uint64_t)floorl(w);
	}
	if (cap == 0)
		return -EINVAL;
	struct tokenbucket_redis_lease *l = calloc(1, sizeof(*l));
	if (l == NULL)
		return -ENOMEM;
	pthread_condattr_t ca;
	pthread_condattr_init(&ca);
	pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
	pthread_cond_init(&l->cv, &ca);
	pthread_condattr_destroy(&ca);
	pthread_mutex_init(&l->mu, NULL);
	pthread_mutex_init(&l->rmu, NULL);
	l->queue_end = &l->queue;
	l->key = malloc(keylen > 0 ? keylen : 1);
	int err = l->key == NULL ? -ENOMEM : 0;
	if (err == 0) {
		if (keylen > 0)
			memcpy(l->key, key, keylen);
		err = tokenbucket_create_every(&l->local, 0, 1, 2 * cap, 0);
	}
	if (err == 0)
		err = tokenbucket_reset_at(l->local, 0, 0);
	if (err != 0) {
		tbr__lease_free(l);
		return err;
	}
	l->keylen = keylen;
	l->lim = *lim;
	l->cap = cap;
	l->floor = cap / 64 > 0 ? cap / 64 : 1;
	l->chunk = l->floor;
	l->window_ns = window_ns;
	/* A chunk's group lives eight windows, time to spend a chunk sized to
	 * a window's demand with room to spare, but at most burst / (2 rate):
	 * spent tokens count against the shared bucket until their group
	 * expires, and so the leases' spending at the full rate holds at most
	 * half the burst (docs/leases.md, "The cost"). */
	l->life_ns = window_ns <= LEASE_WINDOW_MAX / 8 ? 8 * window_ns : window_ns;
	/* At rate 0 nothing refills the headroom anyway: a chunk lives long. */
	if (lim->tokens == 0)
		l->life_ns = LEASE_WINDOW_MAX;
	if (lim->tokens > 0) {
		long double h = (long double)lim->burst * (long double)lim->period_ns /
				(2 * (long double)lim->tokens);
		if (h < (long double)l->life_ns)
			l->life_ns = h >= 1 ? (int64_t)h : 1;
	}
	l->coarse_step = coarse_step();
	atomic_init(&l->next_deadline, INT64_MAX);
	l->rng = ((uint64_t)(uintptr_t)l ^ (uint64_t)tbr__lease_mono_ns()) | 1;
	atomic_init(&l->wanted, true); /* the first lease is taken at once */
	atomic_init(&l->busy, true);
	atomic_init(&l->starved, false);
	atomic_init(&l->low, l->chunk / 2 + 1);
	atomic_init(&l->retry_ns, 0);
	atomic_init(&l->err, 0);
	atomic_init(&l->has_overflow, false);
	atomic_init(&l->ended, false);
	*lp = l;
	return 0;
}
