/* SPDX-License-Identifier: MIT */
/*
 * What the asynchronous client (async.c) takes from a blocking client
 * (client.c): its server, timeout, key prefix and local fallback.  Not
 * exported.
 */
#ifndef TOKENBUCKET_REDIS_CLIENT_H
#define TOKENBUCKET_REDIS_CLIENT_H

#include "pool.h"

/* r's server, or NULL for a cluster client. */
const struct tbr__node *tbr__client_node(const struct tokenbucket_redis *r);
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
