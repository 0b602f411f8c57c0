/* SPDX-License-Identifier: MIT */
/*
 * A lease's state and what lease.c (the thread, every lease's calls) and
 * lease_async.c (the leases of an asynchronous client) share: the local
 * bucket's credits and give-backs, a refill's plan and landing, whoever
 * makes the round trip.  docs/leases.md has the model; lease.c's first
 * comment the safety argument and who holds which lock.
 */
#ifndef TOKENBUCKET_REDIS_LEASE_REFILL_H
#define TOKENBUCKET_REDIS_LEASE_REFILL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "async.h"
#include "client.h"

/* The longest window a lease takes: its sleeps and cadence stay far from overflow. */
#define LEASE_WINDOW_MAX (INT64_C(3600) * 1000000000)

/* The chunks a lease tracks at once (the server keeps 4 groups live). */
#define LEASE_CHUNKS 8

/*
 * Tokens the shared bucket granted into one of its lease groups: usable
 * until deadline, on this process's monotonic clock, timed from before
 * the request was sent, so never after the server's expiry of the group.
 */
struct chunk {
	uint64_t count;   /* the group's count as the server keeps it, of this lease's */
	int64_t deadline; /* mono_ns */
	int64_t group;    /* the group's expiry on the server's clock: its name */
};

/* A piece of a give-back: n tokens of the group named. */
struct give {
	int64_t group;
	uint64_t n;
};

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
	int64_t life_ns;           /* a chunk's group's, asked of the server */

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
	struct chunk chunks[LEASE_CHUNKS]; /* deadline ascending */
	int nchunks;
	int64_t coarse_step; /* CLOCK_MONOTONIC_COARSE's, which lags by less */
	atomic_int_least64_t next_deadline; /* the first chunk's deadline, INT64_MAX: none */

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

/* lease_refill.c */
int64_t tbr__lease_mono_ns(void);
void tbr__lease_settle(struct tokenbucket_redis_lease *l, int64_t now);
void tbr__lease_expire_due(struct tokenbucket_redis_lease *l);
size_t tbr__lease_collect_due(struct tokenbucket_redis_lease *l, int64_t now,
			      struct give out[LEASE_CHUNKS], int64_t *next);
size_t tbr__lease_collect_groups(struct tokenbucket_redis_lease *l, bool all,
				 struct give out[LEASE_CHUNKS]);
uint64_t tbr__lease_held(struct tokenbucket_redis_lease *l);
void tbr__lease_credit(struct tokenbucket_redis_lease *l, uint64_t x);
uint64_t tbr__lease_collect(struct tokenbucket_redis_lease *l, bool all);
bool tbr__lease_refill_plan(struct tokenbucket_redis_lease *l, int64_t t0, uint64_t *want_out);
bool tbr__lease_contended_by(const struct tokenbucket_result *res, uint64_t want);
int tbr__lease_refill_landed(struct tokenbucket_redis_lease *l, int err,
			     const struct tokenbucket_result *res, uint64_t want, int64_t t0,
			     int64_t t1, bool contended);
void tbr__lease_free(struct tokenbucket_redis_lease *l);
int tbr__lease_new(struct tokenbucket_redis_lease **lp, const void *key, size_t keylen,
		   const struct tokenbucket_redis_limit *lim, double share, int64_t window_ns);

/* lease_async.c */
int tbr__lease_give_back_async(struct tokenbucket_redis_lease *l, bool all);
void tbr__lease_async_schedule(struct tokenbucket_redis_lease *l);

#endif /* TOKENBUCKET_REDIS_LEASE_REFILL_H */
