/* SPDX-License-Identifier: MIT */
/*
 * Leases (docs/leases.md): a key's tokens taken from the shared bucket a
 * chunk at a time and spent from a local core bucket.
 *
 * The local bucket has rate 0, so only tokenbucket_refund() adds to it and
 * time means nothing to it (every call passes the time 0, reading no
 * clock).  Only the lease's thread adds tokens, and it adds only what it
 * took from Redis; callers only take.  So the tokens granted locally never
 * exceed those taken from the shared bucket less those given back, which
 * is the whole safety argument.
 *
 * Reservations queue for tokens the lease does not hold yet.  Every token
 * that lands (a refill, a cancelled reservation's covered part, held-over
 * overflow) goes through credit(): first to the queued reservations in
 * order, then into the local bucket up to its burst, and the rest into
 * overflow, which the next refill or give-back takes.  So a reservation
 * is covered only by tokens the shared bucket granted, and a cancel gives
 * back only the tokens its reservation was given.
 *
 * Threads: any number of callers at once (the core bucket is lock-free);
 * one refill thread per lease does every round trip, so a caller never
 * waits for Redis.  mu guards stop and the thread's sleeps; rmu guards the
 * queue, overflow and every addition to the local bucket (callers' takes
 * stay lock-free: a take only widens the room an addition sees).  Lock
 * order: the client's list of leases, then rmu; mu is never held with
 * either.
 *
 * A lease of an asynchronous client has no thread: its round trips are
 * that client's calls, started by its callers, its callbacks and a hook on
 * its loop's timer (quiet windows, contended turns), all on the loop's
 * thread, the only one that calls it.  The atomics are hints between callers and the thread (relaxed:
 * a stale hint costs a refill's lateness, never a token).
 */
#include <errno.h>
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include "async.h"
#include "client.h"
#include "sleep.h"

/* The longest window a lease takes: its sleeps and cadence stay far from overflow. */
#define LEASE_WINDOW_MAX (INT64_C(3600) * 1000000000)

/* A reservation still missing tokens, in the lease's queue. */
struct pending {
	struct pending *next;
	uint64_t ticket; /* the lease's count of reservations when it was made */
	uint64_t n;      /* reserved */
	uint64_t need;   /* of n, still missing; 0 once covered (then off the queue) */
	int wake_fd;     /* a waiter's eventfd, written when covered; or -1 */
};

struct tokenbucket_redis_lease {
	struct tokenbucket_redis *r;
	char *key;
	size_t keylen;
	struct tokenbucket_redis_limit lim;
	struct tokenbucket *local; /* rate 0, burst 2 * cap */
	uint64_t cap;              /* the most one round trip takes */
	uint64_t floor;            /* the least one asks for */
	int64_t window_ns;

	pthread_t thread;
	pthread_mutex_t mu;
	pthread_cond_t cv; /* CLOCK_MONOTONIC */
	bool stop;         /* under mu */

	atomic_bool wanted;        /* a caller found the chunk low */
	atomic_bool busy;          /* a call came since the thread last looked */
	atomic_bool starved;       /* a call was refused since the last refill */
	atomic_uint_least64_t low; /* ask for more below this many held */
	atomic_int_least64_t retry_ns; /* what a refused caller is told */
	atomic_int err;            /* the latest round trip's error, 0 if none */

	pthread_mutex_t rmu; /* guards the queue, overflow and additions to local */
	struct pending *queue, **queue_end;
	uint64_t missing;  /* sum of need over the queue */
	uint64_t assigned; /* tokens credited to queued reservations (sum of n - need) */
	uint64_t overflow; /* taken from Redis, not granted, with no room in local */
	uint64_t tickets;  /* reservations made that missed tokens */
	atomic_bool has_overflow;

	struct tbr__dependent dep; /* on r's list while the lease is attached */
	atomic_bool ended;         /* the client closed: r is gone, nothing lands */

	/* A lease of an asynchronous client (a non-NULL, r NULL): the loop's thread only. */
	struct tokenbucket_redis_async *a;
	struct tbr__async_hook hook; /* on a's loop while open */
	bool inflight;               /* a refill's call is on its way */
	bool second;                 /* that call is the refill's second try */
	bool contended;              /* the refill's first try found the key contended */
	bool closing;                /* closed while inflight: the callback frees */
	uint64_t inflight_want;
	int64_t inflight_t0;
	int64_t quiet_at;            /* mono_ns of the next look for a quiet window */

	/* The thread's own. */
	uint64_t chunk;
	int64_t last_refill;
	int64_t next_refill; /* mono_ns: not before, after a contended one */
	uint64_t rng;        /* xorshift64 state for the contended turns, never 0 */
};

static int64_t mono_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Whole tokens held locally (the level of a rate-0 bucket is whole). */
static uint64_t held(struct tokenbucket_redis_lease *l)
{
	double v = tokenbucket_tokens_at(l->local, 0);
	return v > 0 ? (uint64_t)v : 0;
}

/* Sleeps on cv until ns from now or a signal; mu held. */
static void nap(struct tokenbucket_redis_lease *l, int64_t ns)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	int64_t t = (int64_t)ts.tv_nsec + (ns > 0 ? ns : 0);
	ts.tv_sec += (time_t)(t / 1000000000);
	ts.tv_nsec = (long)(t % 1000000000);
	pthread_cond_timedwait(&l->cv, &l->mu, &ts);
}

/*
 * Hands x tokens that the shared bucket granted (or that a reservation
 * covered by such tokens gives back) to the queued reservations in order,
 * then to the local bucket up to its burst, and the rest to overflow.
 * rmu held.  Callers only take from local meanwhile, so the room seen here
 * can only grow: the refund never drops a token.
 */
static void credit(struct tokenbucket_redis_lease *l, uint64_t x)
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
	uint64_t h = held(l);
	uint64_t room = 2 * l->cap > h ? 2 * l->cap - h : 0;
	uint64_t put = x < room ? x : room;
	if (put > 0)
		tokenbucket_refund(l->local, put);
	if (x > put) {
		l->overflow += x - put;
		atomic_store_explicit(&l->has_overflow, true, memory_order_relaxed);
	}
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
static uint64_t collect(struct tokenbucket_redis_lease *l, bool all)
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
	for (;;) {
		uint64_t h = held(l);
		if (h == 0 || tokenbucket_allow_at(l->local, 0, h)) {
			total += h;
			break;
		}
		/* a caller took some meanwhile */
	}
	return total;
}

static int give_back(struct tokenbucket_redis_lease *l, bool all)
{
	uint64_t total = collect(l, all);
	/* In pieces of at most a burst: the server refuses more in one (2 cap may exceed it). */
	int err = 0;
	while (total > 0 && err == 0) {
		uint64_t piece = total < l->lim.burst ? total : l->lim.burst;
		err = tokenbucket_redis_refund(l->r, l->key, l->keylen, &l->lim, piece);
		total -= piece;
	}
	return err;
}

/* Whether the lease should ask for more now: reservations wait, or fewer than low held. rmu held. */
static bool short_of_tokens(struct tokenbucket_redis_lease *l)
{
	return l->missing > 0 || held(l) < atomic_load_explicit(&l->low, memory_order_relaxed);
}

/*
 * A refill's first half, at t0: overflow credited first, the chunk sized
 * to recent demand, within what the local bucket has room for.  False
 * when nothing is to be asked for; else *want is the tokens to ask for.
 */
static bool refill_plan(struct tokenbucket_redis_lease *l, int64_t t0, uint64_t *want_out)
{
	if (atomic_load_explicit(&l->has_overflow, memory_order_relaxed)) {
		/* Tokens already taken come before another round trip. */
		atomic_store_explicit(&l->wanted, false, memory_order_relaxed);
		pthread_mutex_lock(&l->rmu);
		uint64_t x = l->overflow;
		l->overflow = 0;
		atomic_store_explicit(&l->has_overflow, false, memory_order_relaxed);
		credit(l, x);
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
	uint64_t h = held(l);
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
static bool contended_by(const struct tokenbucket_result *res, uint64_t want)
{
	return !res->allowed || res->remaining < want;
}

/*
 * A refill's second half: the round trips from t0 to t1 ended with err
 * and res (valid when err is 0), having asked for want.  Returns the
 * error that stands (callers are refused until Redis answers), after
 * which the next try waits an eighth of a window.
 */
static int refill_landed(struct tokenbucket_redis_lease *l, int err,
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
	credit(l, want);
	bool more = l->missing > 0;
	pthread_mutex_unlock(&l->rmu);
	if (more) /* queued reservations took it all: go on */
		atomic_store_explicit(&l->wanted, true, memory_order_relaxed);
	l->last_refill = t1;
	return 0;
}

/* One refill on the lease's thread, its round trips blocking. */
static void refill(struct tokenbucket_redis_lease *l)
{
	int64_t t0 = mono_ns();
	if (t0 < l->next_refill) {
		pthread_mutex_lock(&l->mu);
		if (!l->stop)
			nap(l, l->next_refill - t0);
		pthread_mutex_unlock(&l->mu);
		t0 = mono_ns();
		if (t0 < l->next_refill)
			return; /* woken to stop, or early: the loop comes back */
	}
	uint64_t want;
	if (!refill_plan(l, t0, &want))
		return;
	struct tokenbucket_result res;
	int err = tokenbucket_redis_allow(l->r, l->key, l->keylen, &l->lim, want, &res);
	bool contended = err == 0 && contended_by(&res, want);
	if (err == 0 && !res.allowed && res.remaining > 0) {
		/* Fewer than a chunk there: take what is, in a second try. */
		want = res.remaining < want ? res.remaining : want;
		err = tokenbucket_redis_allow(l->r, l->key, l->keylen, &l->lim, want, &res);
	}
	if (refill_landed(l, err, &res, want, t0, mono_ns(), contended) != 0) {
		pthread_mutex_lock(&l->mu);
		if (!l->stop)
			nap(l, l->window_ns / 8);
		pthread_mutex_unlock(&l->mu);
	}
}

static void *run(void *arg)
{
	struct tokenbucket_redis_lease *l = arg;
	pthread_mutex_lock(&l->mu);
	while (!l->stop) {
		if (atomic_load_explicit(&l->wanted, memory_order_relaxed)) {
			pthread_mutex_unlock(&l->mu);
			refill(l);
			pthread_mutex_lock(&l->mu);
			continue;
		}
		nap(l, l->window_ns);
		if (l->stop || atomic_load_explicit(&l->wanted, memory_order_relaxed))
			continue;
		/* A whole window without a call: the key is quiet, its tokens go
		 * back and the next lease starts small. */
		if (!atomic_exchange_explicit(&l->busy, false, memory_order_relaxed) && held(l) > 0) {
			pthread_mutex_unlock(&l->mu);
			give_back(l, false);
			l->chunk = l->floor;
			l->last_refill = 0;
			atomic_store_explicit(&l->low, l->chunk / 2 + 1, memory_order_relaxed);
			pthread_mutex_lock(&l->mu);
		}
	}
	pthread_mutex_unlock(&l->mu);
	return NULL;
}

/* Frees what lease_open made; the thread, if any, has been joined. */
static void lease_free(struct tokenbucket_redis_lease *l)
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

static void lease_end(struct tbr__dependent *d);

/* A lease with no client yet, its arguments checked; lease_open's errors. */
static int lease_new(struct tokenbucket_redis_lease **lp, const void *key, size_t keylen,
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
		lease_free(l);
		return err;
	}
	l->keylen = keylen;
	l->lim = *lim;
	l->cap = cap;
	l->floor = cap / 64 > 0 ? cap / 64 : 1;
	l->chunk = l->floor;
	l->window_ns = window_ns;
	l->rng = ((uint64_t)(uintptr_t)l ^ (uint64_t)mono_ns()) | 1;
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

int tokenbucket_redis_lease_open(struct tokenbucket_redis_lease **lp, struct tokenbucket_redis *r,
				 const void *key, size_t keylen,
				 const struct tokenbucket_redis_limit *lim, double share,
				 int64_t window_ns)
{
	if (lp == NULL || r == NULL)
		return -EINVAL;
	struct tokenbucket_redis_lease *l;
	int err = lease_new(&l, key, keylen, lim, share, window_ns);
	if (err != 0)
		return err;
	l->r = r;
	err = -pthread_create(&l->thread, NULL, run, l);
	if (err != 0) {
		lease_free(l);
		return err;
	}
	l->dep.end = lease_end;
	tbr__client_attach(r, &l->dep);
	*lp = l;
	return 0;
}

/* ---- Leases of an asynchronous client ------------------------------------- */

static void lease_fire(struct tbr__async_hook *h);
static void lease_hook_end(struct tbr__async_hook *h);

static struct tokenbucket_redis_lease *lease_of_hook(struct tbr__async_hook *h)
{
	return (struct tokenbucket_redis_lease *)((char *)h -
						  offsetof(struct tokenbucket_redis_lease, hook));
}

static void dropped(void *arg, int err, const struct tokenbucket_result *res,
		    const struct tokenbucket_reservation *rv, double tokens)
{
	/* A give-back's outcome: lost or not, nothing more is owed to anyone. */
	(void)arg, (void)err, (void)res, (void)rv, (void)tokens;
}

/* A refund of n (at most a burst) through the asynchronous client: started, not awaited. */
static int refund_async(struct tokenbucket_redis_lease *l, uint64_t n)
{
	struct tokenbucket_redis_call c = { .op = TOKENBUCKET_REDIS_REFUND,
					    .key = l->key,
					    .keylen = l->keylen,
					    .limit = l->lim,
					    .n = n };
	return tokenbucket_redis_async_start(l->a, &c, dropped, NULL);
}

/* give_back through the asynchronous client, in pieces of at most a burst as give_back's. */
static int give_back_async(struct tokenbucket_redis_lease *l, bool all)
{
	uint64_t total = collect(l, all);
	int err = 0;
	while (total > 0 && err == 0) {
		uint64_t piece = total < l->lim.burst ? total : l->lim.burst;
		err = refund_async(l, piece);
		total -= piece;
	}
	return err;
}

/* Arms the lease's hook: the next look for a quiet window, or a refill wanted. */
static void async_schedule(struct tokenbucket_redis_lease *l)
{
	int64_t due = l->quiet_at;
	if (atomic_load_explicit(&l->wanted, memory_order_relaxed) && !l->inflight &&
	    l->next_refill < due)
		due = l->next_refill; /* in the past: as soon as the loop can */
	tbr__async_hook_due(l->a, &l->hook, due);
}

static void on_refill(void *arg, int err, const struct tokenbucket_result *res,
		      const struct tokenbucket_reservation *rv, double tokens);

/* Starts the round trip of a refill: the first try, or the second for want. */
static int refill_start(struct tokenbucket_redis_lease *l, uint64_t want, bool second)
{
	struct tokenbucket_redis_call c = { .op = TOKENBUCKET_REDIS_ALLOW,
					    .key = l->key,
					    .keylen = l->keylen,
					    .limit = l->lim,
					    .n = want };
	int err = tokenbucket_redis_async_start(l->a, &c, on_refill, l);
	if (err == 0) {
		l->inflight = true;
		l->second = second;
		l->inflight_want = want;
	}
	return err;
}

/* refill() for a lease of an asynchronous client: its first half, and the call started. */
static void async_refill(struct tokenbucket_redis_lease *l)
{
	int64_t t0 = mono_ns();
	uint64_t want;
	if (t0 < l->next_refill || !refill_plan(l, t0, &want))
		return;
	l->inflight_t0 = t0;
	l->contended = false;
	int err = refill_start(l, want, false);
	if (err != 0) {
		int64_t t1 = mono_ns();
		refill_landed(l, err, NULL, want, t0, t1, false);
		l->next_refill = t1 + l->window_ns / 8;
	}
}

static void on_refill(void *arg, int err, const struct tokenbucket_result *res,
		      const struct tokenbucket_reservation *rv, double tokens)
{
	(void)rv, (void)tokens;
	struct tokenbucket_redis_lease *l = arg;
	uint64_t want = l->inflight_want;
	l->inflight = false;
	if (l->closing) {
		/* Closed meanwhile: what this call took goes straight back. */
		if (err == 0 && res->allowed && !(res->flags & TOKENBUCKET_RESULT_LOCAL))
			refund_async(l, want); /* want <= cap <= burst */
		lease_free(l);
		return;
	}
	if (atomic_load_explicit(&l->ended, memory_order_acquire))
		return; /* the client is closing: its calls end cancelled, nothing lands */
	if (!l->second && err == 0) {
		l->contended = contended_by(res, want);
		if (!res->allowed && res->remaining > 0) {
			/* Fewer than a chunk there: take what is, in a second try. */
			err = refill_start(l, res->remaining < want ? res->remaining : want, true);
			if (err == 0)
				return;
		}
	}
	int64_t t1 = mono_ns();
	if (refill_landed(l, err, err == 0 ? res : NULL, want, l->inflight_t0, t1, l->contended) != 0)
		l->next_refill = t1 + l->window_ns / 8;
	async_schedule(l);
}

/* The lease's hook: a refill wanted and due, a window gone by. */
static void lease_fire(struct tbr__async_hook *h)
{
	struct tokenbucket_redis_lease *l = lease_of_hook(h);
	int64_t now = mono_ns();
	if (now >= l->quiet_at) {
		/* A whole window without a call: the key is quiet, its tokens go
		 * back and the next lease starts small (as run() does). */
		if (!atomic_load_explicit(&l->wanted, memory_order_relaxed) && !l->inflight &&
		    !atomic_exchange_explicit(&l->busy, false, memory_order_relaxed) && held(l) > 0) {
			give_back_async(l, false);
			l->chunk = l->floor;
			l->last_refill = 0;
			atomic_store_explicit(&l->low, l->chunk / 2 + 1, memory_order_relaxed);
		}
		l->quiet_at = now + l->window_ns;
	}
	if (atomic_load_explicit(&l->wanted, memory_order_relaxed) && !l->inflight)
		async_refill(l);
	async_schedule(l);
}

/*
 * The asynchronous client closes with the lease open: its calls are being
 * cancelled, so what the lease holds cannot go back; it is dropped (lost
 * to every client until the rate makes it again), and every later call on
 * the lease is refused with -ESHUTDOWN.
 */
static void lease_hook_end(struct tbr__async_hook *h)
{
	struct tokenbucket_redis_lease *l = lease_of_hook(h);
	collect(l, true);
	atomic_store_explicit(&l->err, -ESHUTDOWN, memory_order_relaxed);
	atomic_store_explicit(&l->ended, true, memory_order_release);
}

int tokenbucket_redis_async_lease_open(struct tokenbucket_redis_lease **lp,
				       struct tokenbucket_redis_async *a, const void *key,
				       size_t keylen, const struct tokenbucket_redis_limit *lim,
				       double share, int64_t window_ns)
{
	if (lp == NULL || a == NULL)
		return -EINVAL;
	struct tokenbucket_redis_lease *l;
	int err = lease_new(&l, key, keylen, lim, share, window_ns);
	if (err != 0)
		return err;
	l->a = a;
	l->hook.fire = lease_fire;
	l->hook.end = lease_hook_end;
	l->quiet_at = mono_ns() + window_ns;
	tbr__async_hook_add(a, &l->hook);
	async_schedule(l); /* the first lease is taken at once */
	*lp = l;
	return 0;
}

/* A caller wants a refill (wanted just set): the thread, or the loop, is told. */
static void wake(struct tokenbucket_redis_lease *l)
{
	if (l->a != NULL) {
		/* After the asynchronous client closed there is no loop to tell. */
		if (!atomic_load_explicit(&l->ended, memory_order_acquire))
			async_schedule(l);
		return;
	}
	pthread_mutex_lock(&l->mu);
	pthread_cond_signal(&l->cv);
	pthread_mutex_unlock(&l->mu);
}

int tokenbucket_redis_lease_allow(struct tokenbucket_redis_lease *l, uint64_t n,
				  struct tokenbucket_result *res)
{
	if (l == NULL)
		return -EINVAL;
	if (n > l->cap) {
		/* More than a lease holds: decided by Redis, call by call. */
		if (atomic_load_explicit(&l->ended, memory_order_acquire))
			return -ESHUTDOWN;
		if (l->a != NULL)
			return -E2BIG; /* a round trip would block the loop */
		return tokenbucket_redis_allow(l->r, l->key, l->keylen, &l->lim, n, res);
	}
	struct tokenbucket_result lr;
	tokenbucket_allow_result_at(l->local, 0, n, &lr);
	if (!atomic_load_explicit(&l->busy, memory_order_relaxed))
		atomic_store_explicit(&l->busy, true, memory_order_relaxed);
	if (lr.remaining < atomic_load_explicit(&l->low, memory_order_relaxed) &&
	    !atomic_load_explicit(&l->wanted, memory_order_relaxed) &&
	    !atomic_exchange_explicit(&l->wanted, true, memory_order_relaxed))
		wake(l);
	if (!lr.allowed && !atomic_load_explicit(&l->starved, memory_order_relaxed))
		atomic_store_explicit(&l->starved, true, memory_order_relaxed);
	if (res != NULL) {
		*res = (struct tokenbucket_result){
			.allowed = lr.allowed,
			.limit = l->lim.burst,
			.remaining = lr.remaining,
			.retry_after_ns = lr.allowed ? 0
					: atomic_load_explicit(&l->retry_ns, memory_order_relaxed),
			.reset_after_ns = 0,
		};
	}
	return 0;
}

int tokenbucket_redis_lease_tokens(struct tokenbucket_redis_lease *l, uint64_t *tokens)
{
	if (l == NULL || tokens == NULL)
		return -EINVAL;
	*tokens = held(l);
	return atomic_load_explicit(&l->err, memory_order_relaxed);
}

/* Stops the thread; the lease may then give back and be freed. */
static void stop_thread(struct tokenbucket_redis_lease *l)
{
	pthread_mutex_lock(&l->mu);
	l->stop = true;
	pthread_cond_signal(&l->cv);
	pthread_mutex_unlock(&l->mu);
	pthread_join(l->thread, NULL);
}

/*
 * tokenbucket_redis_close on a lease still open: everything the lease holds
 * goes back and it lets go of the client; l stays allocated, refusing
 * every call, until tokenbucket_redis_lease_close frees it.
 */
static void lease_end(struct tbr__dependent *d)
{
	struct tokenbucket_redis_lease *l = (struct tokenbucket_redis_lease *)((char *)d -
						offsetof(struct tokenbucket_redis_lease, dep));
	stop_thread(l);
	give_back(l, true);
	atomic_store_explicit(&l->err, -ESHUTDOWN, memory_order_relaxed);
	atomic_store_explicit(&l->ended, true, memory_order_release);
}

int tokenbucket_redis_lease_close(struct tokenbucket_redis_lease *l)
{
	if (l == NULL)
		return 0;
	int err = 0;
	if (atomic_load_explicit(&l->ended, memory_order_acquire)) {
		/* all went back, or was dropped, when the client closed */
	} else if (l->a != NULL) {
		tbr__async_hook_remove(l->a, &l->hook);
		err = give_back_async(l, true);
		if (l->inflight) {
			l->closing = true; /* on_refill frees l */
			return err;
		}
	} else {
		tbr__client_detach(l->r, &l->dep);
		stop_thread(l);
		err = give_back(l, true);
	}
	lease_free(l);
	return err;
}

/* Whole tokens of need, at the key's full rate, in ns: a lower bound of the refills' time. */
static int64_t refill_time(const struct tokenbucket_redis_lease *l, uint64_t need)
{
	if (l->lim.tokens == 0)
		return TOKENBUCKET_NEVER;
	long double t = ceill((long double)need * (long double)l->lim.period_ns /
			      (long double)l->lim.tokens);
	return t >= (long double)(TOKENBUCKET_NEVER / 2) ? TOKENBUCKET_NEVER : (int64_t)t;
}

/* Asks the thread for a refill now, and for a larger chunk. */
static void ask(struct tokenbucket_redis_lease *l)
{
	atomic_store_explicit(&l->starved, true, memory_order_relaxed);
	if (!atomic_exchange_explicit(&l->wanted, true, memory_order_relaxed))
		wake(l);
}

/*
 * The reservation of tokenbucket_redis_lease_reserve; with wake_fd
 * non-NULL, a reservation that must queue gets an eventfd written when it
 * is covered (*wake_fd, else -1).
 */
static int reserve(struct tokenbucket_redis_lease *l, uint64_t n, int64_t max_wait,
		   struct tokenbucket_reservation *rv, int *wake_fd)
{
	if (wake_fd != NULL)
		*wake_fd = -1;
	if (atomic_load_explicit(&l->ended, memory_order_acquire))
		return -ESHUTDOWN;
	if (n > l->cap)
		return -E2BIG;
	if (max_wait < 0)
		return -ETIMEDOUT;
	int64_t now = tokenbucket_now();
	atomic_store_explicit(&l->busy, true, memory_order_relaxed);
	pthread_mutex_lock(&l->rmu);
	/* Nobody queued: the tokens held serve at once, as an allow would. */
	if (l->missing == 0 && (n == 0 || tokenbucket_allow_at(l->local, 0, n))) {
		pthread_mutex_unlock(&l->rmu);
		*rv = (struct tokenbucket_reservation){ .time_to_act = now, .tokens = n };
		if (held(l) < atomic_load_explicit(&l->low, memory_order_relaxed))
			ask(l);
		return 0;
	}
	/* Behind those queued (tokens land for them first), then the rate. */
	uint64_t h = l->missing == 0 ? held(l) : 0;
	h = h < n ? h : n;
	int64_t rt = atomic_load_explicit(&l->retry_ns, memory_order_relaxed);
	int64_t est = refill_time(l, l->missing + n - h);
	if (est != TOKENBUCKET_NEVER)
		est += rt > 0 ? rt : 0;
	if (est > max_wait) {
		pthread_mutex_unlock(&l->rmu);
		/* Refused for want of tokens: that is demand, as a refused allow's. */
		ask(l);
		return -ETIMEDOUT;
	}
	struct pending *p = malloc(sizeof(*p));
	int fd = -1;
	int err = p == NULL ? -ENOMEM : 0;
	if (err == 0 && wake_fd != NULL) {
		fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
		err = fd < 0 ? -errno : 0;
	}
	if (err != 0) {
		pthread_mutex_unlock(&l->rmu);
		free(p);
		return err;
	}
	/* What local holds now is this reservation's first part. */
	while (h > 0 && !tokenbucket_allow_at(l->local, 0, h)) {
		uint64_t now_held = held(l);
		h = now_held < h ? now_held : h;
	}
	*p = (struct pending){ .ticket = ++l->tickets, .n = n, .need = n - h, .wake_fd = fd };
	if (p->need == 0) {
		/* A caller's take freed nothing, but refills may have landed meanwhile. */
		pthread_mutex_unlock(&l->rmu);
		free(p);
		if (fd >= 0)
			close(fd);
		*rv = (struct tokenbucket_reservation){ .time_to_act = now, .tokens = n };
		return 0;
	}
	l->missing += p->need;
	l->assigned += h;
	*l->queue_end = p;
	l->queue_end = &p->next;
	uint64_t ticket = p->ticket;
	pthread_mutex_unlock(&l->rmu);
	ask(l);
	if (wake_fd != NULL)
		*wake_fd = fd;
	*rv = (struct tokenbucket_reservation){
		.time_to_act = est >= TOKENBUCKET_NEVER - now ? TOKENBUCKET_NEVER - 1 : now + est,
		.tokens = n,
		.ticket = ticket,
	};
	return 0;
}

int tokenbucket_redis_lease_reserve(struct tokenbucket_redis_lease *l, uint64_t n,
				    int64_t max_wait, struct tokenbucket_reservation *rv)
{
	if (l == NULL || rv == NULL)
		return -EINVAL;
	return reserve(l, n, max_wait, rv, NULL);
}

/* The queued reservation with ticket t, or NULL (covered, or never queued).  rmu held. */
static struct pending **find(struct tokenbucket_redis_lease *l, uint64_t t)
{
	struct pending **pp = &l->queue;
	while (*pp != NULL && (*pp)->ticket != t)
		pp = &(*pp)->next;
	return *pp != NULL ? pp : NULL;
}

int tokenbucket_redis_lease_missing(struct tokenbucket_redis_lease *l,
				    const struct tokenbucket_reservation *rv, uint64_t *missing)
{
	if (l == NULL || rv == NULL || missing == NULL)
		return -EINVAL;
	if (rv->ticket > 0) {
		pthread_mutex_lock(&l->rmu);
		bool bad = rv->ticket > l->tickets;
		struct pending **pp = bad ? NULL : find(l, rv->ticket);
		*missing = pp != NULL ? (*pp)->need : 0;
		pthread_mutex_unlock(&l->rmu);
		if (bad)
			return -EINVAL;
	} else {
		*missing = 0;
	}
	return atomic_load_explicit(&l->ended, memory_order_acquire) ? -ESHUTDOWN : 0;
}

/* The cancel of tokenbucket_redis_lease_cancel. */
static int cancel(struct tokenbucket_redis_lease *l, struct tokenbucket_reservation *rv)
{
	if (rv->tokens == 0)
		return 0;
	if (rv->tokens > l->cap)
		return -EINVAL;
	pthread_mutex_lock(&l->rmu);
	if (rv->ticket > l->tickets) {
		pthread_mutex_unlock(&l->rmu);
		return -EINVAL;
	}
	uint64_t back = rv->tokens;
	struct pending **pp = rv->ticket > 0 ? find(l, rv->ticket) : NULL;
	if (pp != NULL) {
		/* Still queued: only what it was given goes back; what it
		 * missed was never taken from anyone. */
		struct pending *p = *pp;
		back = p->n - p->need;
		l->missing -= p->need;
		l->assigned -= back;
		*pp = p->next;
		if (l->queue_end == &p->next)
			l->queue_end = pp;
		free(p);
	}
	rv->tokens = 0;
	/* After the client closed, everything went back already: nothing lands. */
	if (!atomic_load_explicit(&l->ended, memory_order_acquire))
		credit(l, back);
	pthread_mutex_unlock(&l->rmu);
	return 0;
}

int tokenbucket_redis_lease_cancel(struct tokenbucket_redis_lease *l,
				   struct tokenbucket_reservation *rv)
{
	if (l == NULL || rv == NULL)
		return -EINVAL;
	return cancel(l, rv);
}

int tokenbucket_redis_lease_wait(struct tokenbucket_redis_lease *l, uint64_t n, int64_t deadline,
				 int cancel_fd)
{
	if (l == NULL)
		return -EINVAL;
	if (l->a != NULL)
		return -EDEADLK; /* its refills need the loop this would block */
	int err = tb__cancel_check(cancel_fd);
	if (err != 0)
		return err;
	if (n > l->cap) {
		if (atomic_load_explicit(&l->ended, memory_order_acquire))
			return -ESHUTDOWN;
		return tokenbucket_redis_wait(l->r, l->key, l->keylen, &l->lim, n, deadline,
					      cancel_fd);
	}
	struct tokenbucket_reservation rv;
	int wake;
	err = reserve(l, n, tb__max_wait_until(deadline, tokenbucket_now()), &rv, &wake);
	if (err != 0 || wake < 0)
		return err;
	for (;;) {
		pthread_mutex_lock(&l->rmu);
		bool queued = find(l, rv.ticket) != NULL;
		pthread_mutex_unlock(&l->rmu);
		if (!queued)
			break; /* covered */
		int64_t now = tokenbucket_now();
		if (deadline != TOKENBUCKET_NEVER && now >= deadline) {
			err = -ETIMEDOUT;
			break;
		}
		/* Sleep until covered, the deadline or a cancel; in slices
		 * with a cancel_fd, so that its closing is noticed. */
		int64_t left = deadline == TOKENBUCKET_NEVER ? TOKENBUCKET_NEVER : deadline - now;
		if (cancel_fd >= 0 && left > TB__CANCEL_SLICE_NS)
			left = TB__CANCEL_SLICE_NS;
		struct timespec ts = tb__timespec_of(left);
		struct pollfd pfd[2] = { { .fd = wake, .events = POLLIN },
					 { .fd = cancel_fd, .events = POLLIN } };
		int ready = ppoll(pfd, cancel_fd >= 0 ? 2 : 1,
				  left == TOKENBUCKET_NEVER ? NULL : &ts, NULL);
		if (ready < 0 && errno != EINTR) {
			err = -errno;
			break;
		}
		if (ready > 0 && cancel_fd >= 0) {
			if (pfd[1].revents & POLLNVAL) {
				err = -EBADF;
				break;
			}
			if (pfd[1].revents & (POLLIN | POLLHUP | POLLERR)) {
				err = -ECANCELED;
				break;
			}
		}
	}
	/* Covered meanwhile or not, a failed wait takes nothing. */
	if (err != 0)
		cancel(l, &rv);
	close(wake);
	return err;
}
