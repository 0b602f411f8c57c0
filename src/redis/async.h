/* SPDX-License-Identifier: MIT */
/*
 * The asynchronous engine (async.c): calls pipelined on non-blocking
 * connections, driven by an event loop.  Builds on the pool, the cluster
 * map and the fallback; the client (client.c) makes one from its own
 * settings.  Not exported.
 */
#ifndef TOKENBUCKET_REDIS_ASYNC_H
#define TOKENBUCKET_REDIS_ASYNC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "async_hook.h"
#include "cluster.h"
#include "fallback.h"

/* What an engine serves and how; the pointers must outlive it. */
struct tbr__async_config {
	struct tbr__node *node;       /* one server, or NULL with cluster */
	struct tbr__cluster *cluster;
	int64_t timeout_ns;           /* a call's whole time */
	const char *prefix;           /* put before every key (copied) */
	size_t prefixlen;
	struct tbr__fallback *fallback; /* decides for an unavailable server, or NULL */
	const _Atomic int *module;    /* TOKENBUCKET_REDIS_MODULE_*, read for every call */
	const _Atomic int *connections; /* per server, at most (NULL: 1), read for every call */
};

/* An engine for cfg, driven by loop (copied); -EINVAL, -ENOMEM. */
int tbr__async_open(struct tokenbucket_redis_async **ap, const struct tbr__async_config *cfg,
		    const struct tokenbucket_redis_loop *loop);

/*
 * For a fork()ed child only: frees the engine a thread of the parent was
 * running (not within one of its frames: bridge.c sees to that) with the
 * calls in flight, and runs none of their callbacks (their waiters and
 * locks are the parent's).
 */
void tbr__async_forget(struct tokenbucket_redis_async *a);
/* tokenbucket_redis_async_start for the library's own calls: flags as tbr__args takes them (TBR__LEASE). */
int tbr__async_start_call(struct tokenbucket_redis_async *a, const struct tokenbucket_redis_call *call,
			  tokenbucket_redis_done_fn *done, void *arg);

/* Hooks (async_hook.h): due starts at INT64_MAX. */
void tbr__async_hook_add(struct tokenbucket_redis_async *a, struct tbr__async_hook *h);
void tbr__async_hook_remove(struct tokenbucket_redis_async *a, struct tbr__async_hook *h);
/* Sets h->due and arms the loop's timer for it (at once outside the library's frames). */
void tbr__async_hook_due(struct tokenbucket_redis_async *a, struct tbr__async_hook *h,
			 int64_t due);
/*
 * Calls started between the two (tokenbucket_redis_async_start) are
 * appended only, and sent together by _end, which writes what may go at
 * once rather than on the loop's next turn.  Callbacks may run in _end.
 * For the I/O thread of bridge.c, which starts a queue of calls at a time.
 */
void tbr__async_batch_begin(struct tokenbucket_redis_async *a);
void tbr__async_batch_end(struct tokenbucket_redis_async *a);

#endif
