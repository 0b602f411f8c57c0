/* SPDX-License-Identifier: MIT */
/*
 * Blocking calls pipelined over the asynchronous engine on an I/O thread
 * (bridge.c).  The client (client.c) sits above it.  Not exported.
 */
#ifndef TOKENBUCKET_REDIS_BRIDGE_H
#define TOKENBUCKET_REDIS_BRIDGE_H

#include <stdbool.h>

#include "async.h"

struct tbr__bridge;

/* An I/O thread running an engine for cfg; -ENOMEM, -EAGAIN, -EMFILE, -EINVAL. */
int tbr__bridge_open(struct tbr__bridge **bp, const struct tbr__async_config *cfg);
/* Whether b's I/O thread runs in this process (not in a fork()ed child). */
bool tbr__bridge_here(const struct tbr__bridge *b);
/* Stops the thread and frees b (NULL: nothing); no call may be waiting. */
void tbr__bridge_close(struct tbr__bridge *b);
/*
 * call (its key prefixed) through the engine, waiting for its answer; the
 * outputs as a blocking round trip fills them.  Any number of threads.
 */
int tbr__bridge_call(struct tbr__bridge *b, const struct tokenbucket_redis_call *call,
		     struct tokenbucket_result *res, struct tokenbucket_reservation *rv,
		     double *tokens);

#endif
