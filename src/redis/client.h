/* SPDX-License-Identifier: MIT */
/*
 * What a client knows of the objects built on it (client.c).  Leases
 * (lease.c) attach themselves, so that tokenbucket_redis_close can end
 * them before it frees what they use; the client calls them back through
 * a pointer and knows nothing else of them.
 */
#ifndef TOKENBUCKET_REDIS_CLIENT_H
#define TOKENBUCKET_REDIS_CLIENT_H

#include "tokenbucket-redis.h"

/*
 * Something that must end before its client.  end() is called once, from
 * tokenbucket_redis_close, for each one still attached, in no set order,
 * with the client's list locked: it may make calls on the client, but must
 * not attach or detach anything.
 */
struct tbr__dependent {
	void (*end)(struct tbr__dependent *d);
	struct tbr__dependent *prev, *next;
};

/* Both are safe from any thread, but not during tokenbucket_redis_close. */
/* A lease's own call (TBR__LEASE): op ALLOW (arg the window) or REFUND (arg the group). */
int tbr__lease_call(struct tokenbucket_redis *r, const void *key, size_t keylen,
		    const struct tokenbucket_redis_limit *lim, enum tokenbucket_redis_op op, uint64_t n,
		    int64_t arg, struct tokenbucket_result *res);
void tbr__client_attach(struct tokenbucket_redis *r, struct tbr__dependent *d);
void tbr__client_detach(struct tokenbucket_redis *r, struct tbr__dependent *d);

#endif
