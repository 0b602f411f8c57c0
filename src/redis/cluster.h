/* SPDX-License-Identifier: MIT */
/*
 * Redis Cluster (cluster.c): routing calls over the pools of its nodes.
 * Builds on pool.h; the client (client.c) sits above it.  Not exported.
 */
#ifndef TOKENBUCKET_REDIS_CLUSTER_H
#define TOKENBUCKET_REDIS_CLUSTER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/time.h>

#include "pool.h"

struct tbr__cluster;

/* A cluster client knowing seeds (redis:// URLs, db 0); -EINVAL, -ENOMEM. */
int tbr__cluster_open(struct tbr__cluster **cp, const char *const *seeds, size_t nseeds,
		      struct timeval connect_tv, int64_t timeout_ns);
void tbr__cluster_close(struct tbr__cluster *cl);
/*
 * call routed to the primary of its key's slot; the whole call within the
 * timeout.  With down_returns, a CLUSTERDOWN answer returns -EAGAIN at once
 * instead of being tried again until the timeout (the caller has a
 * fallback to decide with).
 */
int tbr__cluster_exchange(struct tbr__cluster *cl, struct tokenbucket_redis_call *call,
			  struct tokenbucket_result *res, struct tokenbucket_reservation *rv,
			  double *tokens, bool down_returns);

#endif
