/* SPDX-License-Identifier: MIT */
/*
 * The local fallback (fallback.c), shared by the blocking client
 * (client.c) and the asynchronous one (async.c).  Needs the core's public
 * buckets only.  Not exported.
 */
#ifndef TOKENBUCKET_REDIS_FALLBACK_H
#define TOKENBUCKET_REDIS_FALLBACK_H

#include <pthread.h>
#include <stdbool.h>

#include "internal.h"

struct tbr__local;

struct tbr__fallback {
	double share;             /* 0: off; set before the client is shared */
	pthread_mutex_t lock;     /* local */
	struct tbr__local *local; /* allocated on first use */
};

void tbr__fallback_init(struct tbr__fallback *fb);
void tbr__fallback_fini(struct tbr__fallback *fb);
/*
 * err, the outcome of call (its key prefixed) on the server; or, when err
 * says the server is unavailable and call is an allow, a reserve or an
 * allow_all, what the local bucket (or buckets) decide instead (flagged
 * TOKENBUCKET_RESULT_LOCAL; a local reservation is marked rv->reserved = 1).
 */
int tbr__fallback_apply(struct tbr__fallback *fb, const struct tokenbucket_redis_call *call,
			int err, struct tokenbucket_result *res, struct tokenbucket_reservation *rv);
/* Whether CLUSTERDOWN to call returns at once, for the fallback to decide. */
bool tbr__fallback_down_returns(const struct tbr__fallback *fb,
				const struct tokenbucket_redis_call *call);
/* Gives a local reservation on key (prefixed, len bytes) back to its bucket; rv->tokens = 0. */
void tbr__fallback_cancel(struct tbr__fallback *fb, const char *key, size_t len,
			  struct tokenbucket_reservation *rv);

#endif
