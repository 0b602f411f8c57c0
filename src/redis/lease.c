/* SPDX-License-Identifier: MIT */
/*
 * Leases (docs/leases.md): a key's tokens taken from the shared bucket a
 * chunk at a time and spent from a local core bucket.
 *
 * The local bucket has rate 0, so only tokenbucket_refund() adds to it and
 * time means nothing to it (every call passes the time 0).  Only the
 * lease's thread adds tokens, and it adds only what it took from Redis;
 * callers only take.  Each take went into a lease group of the shared
 * bucket, which counts it as held until the group expires; the lease
 * uses it only until then (the chunks of lease_refill.c, checked before
 * every take), so what it can grant is always within what the shared
 * bucket counts as held (docs/leases.md, "Safety").
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
 *
 * Here: the lease's thread and the calls of every lease; the state and a
 * refill's two halves in lease_refill.c, the leases of an asynchronous
 * client in lease_async.c.
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

#include "lease_refill.h"
#include "sleep.h"

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
 * Gives back g[0..k), each naming its group, in pieces of at most a burst:
 * the server refuses more in one (2 cap may exceed it).  Stops at the
 * first error, which it returns.
 */
static int give_groups(struct tokenbucket_redis_lease *l, struct give *g, size_t k)
{
	int err = 0;
	for (size_t i = 0; i < k && err == 0; i++) {
		while (g[i].n > 0 && err == 0) {
			uint64_t piece = g[i].n < l->lim.burst ? g[i].n : l->lim.burst;
			err = tbr__lease_call(l->r, l->key, l->keylen, &l->lim, TOKENBUCKET_REDIS_REFUND,
					      piece, g[i].group, NULL);
			g[i].n -= piece;
		}
	}
	return err;
}

static int give_back(struct tokenbucket_redis_lease *l, bool all)
{
	struct give g[LEASE_CHUNKS];
	size_t k = tbr__lease_collect_groups(l, all, g);
	return give_groups(l, g, k);
}

/* Gives back what chunks due soon still have (tbr__lease_collect_due); when the next is due. */
static int64_t give_due(struct tokenbucket_redis_lease *l)
{
	struct give g[LEASE_CHUNKS];
	int64_t next;
	size_t k = tbr__lease_collect_due(l, tbr__lease_mono_ns(), g, &next);
	give_groups(l, g, k); /* a failed give-back is lost, never doubled */
	return next;
}

/* One refill on the lease's thread, its round trips blocking. */
static void refill(struct tokenbucket_redis_lease *l)
{
	int64_t t0 = tbr__lease_mono_ns();
	if (t0 < l->next_refill) {
		pthread_mutex_lock(&l->mu);
		if (!l->stop)
			nap(l, l->next_refill - t0);
		pthread_mutex_unlock(&l->mu);
		t0 = tbr__lease_mono_ns();
		if (t0 < l->next_refill)
			return; /* woken to stop, or early: the loop comes back */
	}
	uint64_t want;
	if (!tbr__lease_refill_plan(l, t0, &want))
		return;
	struct tokenbucket_result res;
	int err = tbr__lease_call(l->r, l->key, l->keylen, &l->lim, TOKENBUCKET_REDIS_ALLOW, want,
				  l->life_ns, &res);
	bool contended = err == 0 && tbr__lease_contended_by(&res, want);
	if (err == 0 && !res.allowed && res.remaining > 0) {
		/* Fewer than a chunk there: take what is, in a second try. */
		want = res.remaining < want ? res.remaining : want;
		err = tbr__lease_call(l->r, l->key, l->keylen, &l->lim, TOKENBUCKET_REDIS_ALLOW, want,
				      l->life_ns, &res);
	}
	int64_t t1 = tbr__lease_mono_ns();
	if (tbr__lease_refill_landed(l, err, &res, want, t0, t1, contended) != 0) {
		pthread_mutex_lock(&l->mu);
		if (!l->stop)
			nap(l, l->window_ns / 8);
		pthread_mutex_unlock(&l->mu);
	}
}

static void *run(void *arg)
{
	struct tokenbucket_redis_lease *l = arg;
	int64_t quiet_at = tbr__lease_mono_ns() + l->window_ns;
	pthread_mutex_lock(&l->mu);
	while (!l->stop) {
		if (atomic_load_explicit(&l->wanted, memory_order_relaxed)) {
			pthread_mutex_unlock(&l->mu);
			refill(l);
			pthread_mutex_lock(&l->mu);
			continue;
		}
		pthread_mutex_unlock(&l->mu);
		int64_t due = give_due(l), now = tbr__lease_mono_ns();
		pthread_mutex_lock(&l->mu);
		if (l->stop || atomic_load_explicit(&l->wanted, memory_order_relaxed))
			continue;
		nap(l, (due < quiet_at ? due : quiet_at) - now);
		now = tbr__lease_mono_ns();
		if (l->stop || atomic_load_explicit(&l->wanted, memory_order_relaxed) || now < quiet_at)
			continue;
		quiet_at = now + l->window_ns;
		/* A whole window without a call: the key is quiet, its tokens go
		 * back and the next lease starts small. */
		if (!atomic_exchange_explicit(&l->busy, false, memory_order_relaxed) &&
		    tbr__lease_held(l) > 0) {
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

static void lease_end(struct tbr__dependent *d);

int tokenbucket_redis_lease_open(struct tokenbucket_redis_lease **lp, struct tokenbucket_redis *r,
				 const void *key, size_t keylen,
				 const struct tokenbucket_limit *limit, double share,
				 int64_t window_ns)
{
	if (lp == NULL || r == NULL)
		return -EINVAL;
	struct tokenbucket_redis_lease *l;
	if (limit == NULL)
		return -EINVAL;
	const struct tokenbucket_redis_limit lim = tbr__limit(limit);
	int err = tbr__lease_new(&l, key, keylen, &lim, share, window_ns);
	if (err != 0)
		return err;
	l->r = r;
	err = -pthread_create(&l->thread, NULL, run, l);
	if (err != 0) {
		tbr__lease_free(l);
		return err;
	}
	l->dep.end = lease_end;
	tbr__client_attach(r, &l->dep);
	*lp = l;
	return 0;
}


/* A caller wants a refill (wanted just set): the thread, or the loop, is told. */
static void wake(struct tokenbucket_redis_lease *l)
{
	if (l->a != NULL) {
		/* After the asynchronous client closed there is no loop to tell. */
		if (!atomic_load_explicit(&l->ended, memory_order_acquire))
			tbr__lease_async_schedule(l);
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
	tbr__lease_expire_due(l);
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
	tbr__lease_expire_due(l);
	*tokens = tbr__lease_held(l);
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
		err = tbr__lease_give_back_async(l, true);
		if (l->inflight) {
			l->closing = true; /* on_refill frees l */
			return err;
		}
	} else {
		tbr__client_detach(l->r, &l->dep);
		stop_thread(l);
		err = give_back(l, true);
	}
	tbr__lease_free(l);
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
	tbr__lease_expire_due(l);
	pthread_mutex_lock(&l->rmu);
	/* Nobody queued: the tokens held serve at once, as an allow would. */
	if (l->missing == 0 && (n == 0 || tokenbucket_allow_at(l->local, 0, n))) {
		pthread_mutex_unlock(&l->rmu);
		*rv = (struct tokenbucket_reservation){ .time_to_act = now, .tokens = n };
		if (tbr__lease_held(l) < atomic_load_explicit(&l->low, memory_order_relaxed))
			ask(l);
		return 0;
	}
	/* Behind those queued (tokens land for them first), then the rate. */
	uint64_t h = l->missing == 0 ? tbr__lease_held(l) : 0;
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
		uint64_t now_held = tbr__lease_held(l);
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

int tokenbucket_redis_lease_deficiency(struct tokenbucket_redis_lease *l,
				       const struct tokenbucket_reservation *rv, uint64_t *deficiency)
{
	if (l == NULL || rv == NULL || deficiency == NULL)
		return -EINVAL;
	if (rv->ticket > 0) {
		pthread_mutex_lock(&l->rmu);
		bool bad = rv->ticket > l->tickets;
		struct pending **pp = bad ? NULL : find(l, rv->ticket);
		*deficiency = pp != NULL ? (*pp)->need : 0;
		pthread_mutex_unlock(&l->rmu);
		if (bad)
			return -EINVAL;
	} else {
		*deficiency = 0;
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
	/* After the client closed, everything went back already: nothing lands.
	 * What lands counts against the live chunks as any token the lease
	 * holds: covered tokens whose chunk is gone are forfeited. */
	if (!atomic_load_explicit(&l->ended, memory_order_acquire)) {
		tbr__lease_credit(l, back);
		tbr__lease_settle(l, tbr__lease_mono_ns());
	}
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
