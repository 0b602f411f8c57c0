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
 * Threads: any number of callers at once (the core bucket is lock-free);
 * one refill thread per lease does every round trip, so a caller never
 * waits for Redis.  mu guards stop and the thread's sleeps; the atomics
 * are hints between callers and the thread (relaxed: a stale hint costs a
 * refill's lateness, never a token).
 */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <tokenbucket-redis.h>

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

	/* The thread's own. */
	uint64_t chunk;
	int64_t last_refill;
	int64_t next_refill; /* mono_ns: not before, after a contended one */
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
 * Takes every token held locally and gives it back to the shared bucket.
 * A give-back that fails loses them: it may have been applied (a timeout
 * after the server ran it), so keeping them could count them twice.  Lost
 * tokens are granted to no one, which costs others, never the limit.
 */
static int give_back(struct tokenbucket_redis_lease *l)
{
	for (;;) {
		uint64_t h = held(l);
		if (h == 0)
			return 0;
		if (!tokenbucket_allow_at(l->local, 0, h))
			continue; /* a caller took some meanwhile */
		return tokenbucket_redis_refund(l->r, l->key, l->keylen, &l->lim, h);
	}
}

/* One refill: a chunk sized to recent demand, within what the local bucket has room for. */
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
	if (want == 0) {
		atomic_store_explicit(&l->wanted, false, memory_order_relaxed);
		return;
	}
	struct tokenbucket_result res;
	int err = tokenbucket_redis_allow(l->r, l->key, l->keylen, &l->lim, want, &res);
	/* Contended: the shared bucket could not give this chunk, or not
	 * another one after it.  Judged by the bucket, not by this take, so
	 * that a small chunk does not count as plenty. */
	bool contended = err == 0 && (!res.allowed || res.remaining < want);
	if (err == 0 && !res.allowed && res.remaining > 0) {
		/* Fewer than a chunk there: take what is, in a second try. */
		want = res.remaining < want ? res.remaining : want;
		err = tokenbucket_redis_allow(l->r, l->key, l->keylen, &l->lim, want, &res);
	}
	int64_t t1 = mono_ns();
	if (err == 0 && res.allowed && (res.flags & TOKENBUCKET_RESULT_LOCAL)) {
		/* The client's fallback decided, not the shared bucket: its
		 * tokens are no lease, and giving them back would invent some. */
		err = -EAGAIN;
	}
	atomic_store_explicit(&l->err, err, memory_order_relaxed);
	if (err != 0) {
		/* Redis cannot answer: callers are refused until it can. */
		atomic_store_explicit(&l->retry_ns, t1 - t0, memory_order_relaxed);
		pthread_mutex_lock(&l->mu);
		if (!l->stop)
			nap(l, l->window_ns / 8);
		pthread_mutex_unlock(&l->mu);
		return;
	}
	if (contended) {
		/* A contended key: this client's next refill waits its turn
		 * (below), whatever it took now. */
		l->next_refill = t1 + l->window_ns / 4;
	}
	if (!res.allowed) {
		/* The shared bucket is empty.  Waiting for a whole chunk would
		 * let whoever wakes first take all of it, every time, and a
		 * wait that depends on the chunk lets the smallest chunk poll
		 * fastest.  Every contending client polls every quarter
		 * window instead and takes what is there: equal periods, so
		 * equal shares on average, at 4 polls a window each.  Nothing
		 * waits in the shared bucket longer than that, so nothing
		 * overflows its burst as long as the rate makes less than a
		 * burst in a quarter window (docs/leases.md). */
		atomic_store_explicit(&l->retry_ns, l->next_refill - t1, memory_order_relaxed);
		return;
	}
	/* Clear the request before the tokens land, so that a caller who
	 * drains them asks again. */
	atomic_store_explicit(&l->wanted, false, memory_order_relaxed);
	atomic_store_explicit(&l->low, l->chunk / 2 + 1, memory_order_relaxed);
	atomic_store_explicit(&l->retry_ns, t1 - t0, memory_order_relaxed);
	tokenbucket_refund(l->local, want);
	l->last_refill = t1;
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
			give_back(l);
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
	pthread_cond_destroy(&l->cv);
	pthread_mutex_destroy(&l->mu);
	tokenbucket_free(l->local);
	free(l->key);
	free(l);
}

int tokenbucket_redis_lease_open(struct tokenbucket_redis_lease **lp, struct tokenbucket_redis *r,
				 const void *key, size_t keylen,
				 const struct tokenbucket_redis_limit *lim, double share,
				 int64_t window_ns)
{
	if (lp == NULL || r == NULL || lim == NULL || (key == NULL && keylen > 0) || isnan(share) ||
	    share <= 0 || share > 1 || window_ns <= 0 || (lim->tokens > 0 && lim->period_ns <= 0))
		return -EINVAL;
	if (lim->burst > TOKENBUCKET_BURST_MAX)
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
	l->r = r;
	l->keylen = keylen;
	l->lim = *lim;
	l->cap = cap;
	l->floor = cap / 64 > 0 ? cap / 64 : 1;
	l->chunk = l->floor;
	l->window_ns = window_ns;
	atomic_init(&l->wanted, true); /* the first lease is taken at once */
	atomic_init(&l->busy, true);
	atomic_init(&l->starved, false);
	atomic_init(&l->low, l->chunk / 2 + 1);
	atomic_init(&l->retry_ns, 0);
	atomic_init(&l->err, 0);
	err = -pthread_create(&l->thread, NULL, run, l);
	if (err != 0) {
		lease_free(l);
		return err;
	}
	*lp = l;
	return 0;
}

int tokenbucket_redis_lease_allow(struct tokenbucket_redis_lease *l, uint64_t n,
				  struct tokenbucket_result *res)
{
	if (l == NULL)
		return -EINVAL;
	if (n > l->cap) {
		/* More than a lease holds: decided by Redis, call by call. */
		return tokenbucket_redis_allow(l->r, l->key, l->keylen, &l->lim, n, res);
	}
	struct tokenbucket_result lr;
	tokenbucket_allow_result_at(l->local, 0, n, &lr);
	if (!atomic_load_explicit(&l->busy, memory_order_relaxed))
		atomic_store_explicit(&l->busy, true, memory_order_relaxed);
	if (lr.remaining < atomic_load_explicit(&l->low, memory_order_relaxed) &&
	    !atomic_load_explicit(&l->wanted, memory_order_relaxed) &&
	    !atomic_exchange_explicit(&l->wanted, true, memory_order_relaxed)) {
		pthread_mutex_lock(&l->mu);
		pthread_cond_signal(&l->cv);
		pthread_mutex_unlock(&l->mu);
	}
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

int tokenbucket_redis_lease_close(struct tokenbucket_redis_lease *l)
{
	if (l == NULL)
		return 0;
	pthread_mutex_lock(&l->mu);
	l->stop = true;
	pthread_cond_signal(&l->cv);
	pthread_mutex_unlock(&l->mu);
	pthread_join(l->thread, NULL);
	int err = give_back(l);
	lease_free(l);
	return err;
}
