/* SPDX-License-Identifier: MIT */
/*
 * What the asynchronous client (async.c) takes from a blocking client
 * (client.c): its server or cluster, timeout, key prefix and local
 * fallback.  Not exported.
 */
#ifndef TOKENBUCKET_REDIS_CLIENT_H
#define TOKENBUCKET_REDIS_CLIENT_H

#include "cluster.h"

/* r's server, or NULL for a cluster client. */
struct tbr__node *tbr__client_node(struct tokenbucket_redis *r);
/* r's cluster, or NULL for a one-server client. */
struct tbr__cluster *tbr__client_cluster(struct tokenbucket_redis *r);
/* Whether CLUSTERDOWN to call returns at once, for r's fallback to decide. */
bool tbr__client_down_returns(const struct tokenbucket_redis *r,
			      const struct tokenbucket_redis_call *call);
/* r's command timeout in ns (> 0). */
int64_t tbr__client_timeout(const struct tokenbucket_redis *r);
/* r's prefix and key in a new buffer *full (free()) of *len bytes; -EINVAL, -ENOMEM. */
int tbr__client_key(const struct tokenbucket_redis *r, const void *key, size_t keylen,
		    char **full, size_t *len);
/*
 * err, the outcome of call (its key prefixed) on the server, or what r's
 * local fallback decides instead when err says the server is unavailable
 * and call is an allow or a reserve.  Safe from any thread.
 */
int tbr__client_fallback(struct tokenbucket_redis *r, const struct tokenbucket_redis_call *call,
			 int err, struct tokenbucket_result *res, struct tokenbucket_reservation *rv);

#endif
