/* SPDX-License-Identifier: MIT */
/*
 * Redis Cluster (cluster.c): routing calls over the pools of its nodes.
 * Builds on pool.h; the client (client.c) sits above it.  Not exported.
 */
#ifndef TOKENBUCKET_REDIS_CLUSTER_H
#define TOKENBUCKET_REDIS_CLUSTER_H

#include <errno.h>
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
/* Where the cluster reads TOKENBUCKET_REDIS_MODULE_* for every call (the client's setting). */
void tbr__cluster_set_module(struct tbr__cluster *cl, const _Atomic int *mode);
/*
 * call routed to the primary of its key's slot; the whole call within the
 * timeout.  With down_returns, a CLUSTERDOWN answer returns -EAGAIN at once
 * instead of being tried again until the timeout (the caller has a
 * fallback to decide with).
 */
int tbr__cluster_exchange(struct tbr__cluster *cl, struct tokenbucket_redis_call *call,
			  struct tokenbucket_result *res, struct tokenbucket_reservation *rv,
			  double *tokens, bool down_returns);

/* The slot's primary, or any node (which redirects) while the map has none. */
struct tbr__node *tbr__cluster_route(struct tbr__cluster *cl, unsigned slot);
/*
 * rep (an error from node from) as a redirection: 1 when it is none; 0
 * with *to the node to send to (*ask: once, after ASKING; else the slot's
 * owner is updated and the map marked stale); -ENOMEM or -ENOSPC when the
 * node cannot be remembered (*to NULL).
 */
int tbr__cluster_redirect(struct tbr__cluster *cl, const struct tbr__node *from,
			  const redisReply *rep, struct tbr__node **to, bool *ask);
/* Redirections one call follows (blocking or asynchronous). */
#define TBR__REDIRECTS_MAX 16
/*
 * A call's error when its redirections run out: -ELOOP only when every
 * node named answered; a node that could not be reached (unreached, its
 * connection error, 0: none) was the fault, so its error, as a primary
 * killed gives.
 */
static inline int tbr__redirects_spent(int unreached)
{
	return unreached != 0 ? unreached : -ELOOP;
}
/* Replaces the map with the CLUSTER SLOTS reply rep of node n; 0 or a negative errno. */
int tbr__cluster_map(struct tbr__cluster *cl, const struct tbr__node *n, const redisReply *rep);
/* Whether the map may be wrong and wants a refresh; marking it so. */
bool tbr__cluster_stale(struct tbr__cluster *cl);
void tbr__cluster_set_stale(struct tbr__cluster *cl);
/* A call's whole time, in ns. */
int64_t tbr__cluster_timeout(const struct tbr__cluster *cl);

#endif
