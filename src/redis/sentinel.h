/* SPDX-License-Identifier: MIT */
/*
 * Redis Sentinel (sentinel.c): the sentinels of a URL and the primary
 * they name.  Below the pool (pool.c), which asks it for the primary's
 * address each time it opens a connection, and below the asynchronous
 * engine (async_conn.c), which asks the same question on non-blocking
 * connections of its own with the parts below.  Not exported.
 */
#ifndef TOKENBUCKET_REDIS_SENTINEL_H
#define TOKENBUCKET_REDIS_SENTINEL_H

#include <stdint.h>
#include <sys/time.h>

#include "internal.h"

struct tbr__sentinel;

/*
 * "host[:port][,host[:port]...]/name[/db]" (what follows "redis-sentinel://";
 * port 26379 by default) into *sp and *db.  -EINVAL, -ENOMEM.
 */
int tbr__sentinel_parse(struct tbr__sentinel **sp, const char *spec, int *db);
void tbr__sentinel_free(struct tbr__sentinel *s);
/*
 * The address of the primary, as the first sentinel that answers names it
 * (each asked within connect_tv and timeout_ns, starting with the one that
 * answered last): *host (free()) and *port.  -EHOSTUNREACH when none knows
 * it; otherwise the last sentinel's connection error.  Safe from any thread.
 */
int tbr__sentinel_primary(struct tbr__sentinel *s, struct timeval connect_tv, int64_t timeout_ns,
			  char **host, int *port);
/* The same question to the sentinel that answered last only: 0, 1 (it names none) or -errno. */
int tbr__sentinel_ask_first(struct tbr__sentinel *s, struct timeval connect_tv, int64_t timeout_ns,
			    char **host, int *port);

/*
 * The parts of the question for a client that asks without blocking: the
 * master name, the sentinels (i < count), the one to ask first (the last
 * that answered; safe from any thread, as is noting which answered), and
 * a reply to SENTINEL get-master-addr-by-name: 0 with *host (free()) and
 * *port, 1 when it names no primary, or -ENOMEM.
 */
const char *tbr__sentinel_name(const struct tbr__sentinel *s);
size_t tbr__sentinel_count(const struct tbr__sentinel *s);
void tbr__sentinel_addr(const struct tbr__sentinel *s, size_t i, const char **host, int *port);
size_t tbr__sentinel_first(const struct tbr__sentinel *s);
void tbr__sentinel_answered(struct tbr__sentinel *s, size_t i);
/* A sentinel's answer: 0 with *host (malloc'd) and *port, 1 for none, -EPROTO, -ENOMEM. */
int tbr__sentinel_reply(const redisReply *rep, char **host, int *port);

#endif
