/* SPDX-License-Identifier: MIT */
/*
 * Joining a bucket in Redis as it is: libtokenbucket-redis reconfigures a
 * key to the limit each call carries, so tbrate reads the stored limit
 * first (GET, "tb1 clock level rem tokens period burst" as
 * tokenbucket-redis(7) documents it) and carries that one.
 */
#ifndef TBRATE_REDIS_JOIN_H
#define TBRATE_REDIS_JOIN_H

#include <tokenbucket-redis.h>

#include "units.h"

/*
 * 1 and *lim filled when key holds a bucket, 0 when the key does not exist,
 * a negative errno with a message in err otherwise (no server, another
 * type, a value that is not a bucket).  url as tokenbucket_redis_open takes it.
 */
int tbrate_redis_stored(const char *url, const char *key, struct tokenbucket_redis_limit *lim,
			char err[TBRATE_ERR_SIZE]);

#endif
