/* SPDX-License-Identifier: MIT */
/*
 * The asynchronous engine's connections (async_conn.c): which one an op
 * goes on, opening one, the cluster map asked for again, the sentinels
 * asked.  Above async_queue.c, below async.c.  Not exported.
 */
#ifndef TOKENBUCKET_REDIS_ASYNC_CONN_H
#define TOKENBUCKET_REDIS_ASYNC_CONN_H

#include <stdbool.h>
#include <stdint.h>

#include "async_queue.h"

bool tbr__async_load_function(struct conn *c);
struct conn *tbr__async_conn_of(struct tokenbucket_redis_async *a, const struct op *o,
				struct tbr__node *n);
struct tbr__node *tbr__async_target(struct tokenbucket_redis_async *a, const struct op *o);
int tbr__async_conn_open(struct conn *c, bool spare);
void tbr__async_refresh(struct tokenbucket_redis_async *a, int64_t now);
void tbr__async_sentinel_step(struct tokenbucket_redis_async *a, int64_t now);

#endif
