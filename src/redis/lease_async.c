/* SPDX-License-Identifier: MIT */
/*
 * Leases of an asynchronous client: no thread; the round trips are the
 * client's calls, started from a hook on its loop's timer and from the
 * refill's callback, all on the loop's thread.  docs/leases.md has the
 * model; lease.c's first comment the rest.
 */
#include <errno.h>
#include <stddef.h>

#include "lease_refill.h"

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

/* A give-back of n (at most a burst) of group through the asynchronous client: started, not awaited. */
static int refund_async(struct tokenbucket_redis_lease *l, uint64_t n, int64_t group)
{
	struct tokenbucket_redis_call c = { .op = TOKENBUCKET_REDIS_REFUND,
					    .flags = TBR__LEASE,
					    .key = l->key,
					    .keylen = l->keylen,
					    .limit = l->lim,
					    .n = n,
					    .arg = group };
	return tbr__async_start_call(l->a, &c, dropped, NULL);
}

/* give_back through the asynchronous client, each group in pieces of at most a burst as give_back's. */
int tbr__lease_give_back_async(struct tokenbucket_redis_lease *l, bool all)
{
	struct give g[LEASE_CHUNKS];
	size_t k = tbr__lease_collect_groups(l, all, g);
	int err = 0;
	for (size_t i = 0; i < k && err == 0; i++) {
		while (g[i].n > 0 && err == 0) {
			uint64_t piece = g[i].n < l->lim.burst ? g[i].n : l->lim.burst;
			err = refund_async(l, piece, g[i].group);
			g[i].n -= piece;
		}
	}
	return err;
}

/* Arms the lease's hook: the next look for a quiet window, or a refill wanted. */
void tbr__lease_async_schedule(struct tokenbucket_redis_lease *l)
{
	int64_t due = l->quiet_at;
	/* a chunk due: a quarter of its life before its deadline (tbr__lease_collect_due) */
	int64_t d = atomic_load_explicit(&l->next_deadline, memory_order_acquire);
	if (d != INT64_MAX && d - l->life_ns / 4 < due)
		due = d - l->life_ns / 4;
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
					    .flags = TBR__LEASE,
					    .key = l->key,
					    .keylen = l->keylen,
					    .limit = l->lim,
					    .n = want,
					    .arg = l->life_ns };
	int err = tbr__async_start_call(l->a, &c, on_refill, l);
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
	int64_t t0 = tbr__lease_mono_ns();
	uint64_t want;
	if (t0 < l->next_refill || !tbr__lease_refill_plan(l, t0, &want))
		return;
	l->inflight_t0 = t0;
	l->contended = false;
	int err = refill_start(l, want, false);
	if (err != 0) {
		int64_t t1 = tbr__lease_mono_ns();
		tbr__lease_refill_landed(l, err, NULL, want, t0, t1, false);
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
			refund_async(l, want, res->retry_after_ns); /* want <= cap <= burst */
		tbr__lease_free(l);
		return;
	}
	if (atomic_load_explicit(&l->ended, memory_order_acquire))
		return; /* the client is closing: its calls end cancelled, nothing lands */
	if (!l->second && err == 0) {
		l->contended = tbr__lease_contended_by(res, want);
		if (!res->allowed && res->remaining > 0) {
			/* Fewer than a chunk there: take what is, in a second try. */
			err = refill_start(l, res->remaining < want ? res->remaining : want, true);
			if (err == 0)
				return;
		}
	}
	int64_t t1 = tbr__lease_mono_ns();
	if (tbr__lease_refill_landed(l, err, err == 0 ? res : NULL, want, l->inflight_t0, t1,
				     l->contended) != 0)
		l->next_refill = t1 + l->window_ns / 8;
	tbr__lease_async_schedule(l);
}

/* The lease's hook: a refill wanted and due, a chunk due, a window gone by. */
static void lease_fire(struct tbr__async_hook *h)
{
	struct tokenbucket_redis_lease *l = lease_of_hook(h);
	int64_t now = tbr__lease_mono_ns();
	struct give g[LEASE_CHUNKS];
	int64_t next;
	size_t k = tbr__lease_collect_due(l, now, g, &next);
	for (size_t i = 0; i < k; i++) {
		while (g[i].n > 0) {
			uint64_t piece = g[i].n < l->lim.burst ? g[i].n : l->lim.burst;
			if (refund_async(l, piece, g[i].group) != 0)
				break;
			g[i].n -= piece;
		}
	}
	if (now >= l->quiet_at) {
		/* A whole window without a call: the key is quiet, its tokens go
		 * back and the next lease starts small (as run() does). */
		if (!atomic_load_explicit(&l->wanted, memory_order_relaxed) && !l->inflight &&
		    !atomic_exchange_explicit(&l->busy, false, memory_order_relaxed) &&
		    tbr__lease_held(l) > 0) {
			tbr__lease_give_back_async(l, false);
			l->chunk = l->floor;
			l->last_refill = 0;
			atomic_store_explicit(&l->low, l->chunk / 2 + 1, memory_order_relaxed);
		}
		l->quiet_at = now + l->window_ns;
	}
	if (atomic_load_explicit(&l->wanted, memory_order_relaxed) && !l->inflight)
		async_refill(l);
	tbr__lease_async_schedule(l);
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
	tbr__lease_collect(l, true);
	atomic_store_explicit(&l->err, -ESHUTDOWN, memory_order_relaxed);
	atomic_store_explicit(&l->ended, true, memory_order_release);
}

int tokenbucket_redis_async_lease_open(struct tokenbucket_redis_lease **lp,
				       struct tokenbucket_redis_async *a, const void *key,
				       size_t keylen, const struct tokenbucket_limit *limit,
				       double share, int64_t window_ns)
{
	if (lp == NULL || a == NULL)
		return -EINVAL;
	struct tokenbucket_redis_lease *l;
	if (limit == NULL)
		return -EINVAL;
	const struct tokenbucket_redis_limit lim = tbr__limit(limit);
	int err = tbr__lease_new(&l, key, keylen, &lim, share, window_ns);
	if (err != 0)
		return err;
	l->a = a;
	l->hook.fire = lease_fire;
	l->hook.end = lease_hook_end;
	l->quiet_at = tbr__lease_mono_ns() + window_ns;
	tbr__async_hook_add(a, &l->hook);
	tbr__lease_async_schedule(l); /* the first lease is taken at once */
	*lp = l;
	return 0;
}
