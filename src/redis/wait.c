/* SPDX-License-Identifier: MIT */
/*
 * tokenbucket_redis_wait: reserve on the shared bucket, then sleep on this
 * machine's CLOCK_MONOTONIC for the delay the server computed, so that the
 * clients' and the server's clocks never need to agree.
 */
#include <errno.h>

#include "sleep.h"
#include "internal.h"

int tokenbucket_redis_wait(struct tokenbucket_redis *r, const void *key, size_t keylen,
			   const struct tokenbucket_redis_limit *lim, uint64_t n, int64_t deadline,
			   int cancel_fd)
{
	if (r == NULL || lim == NULL)
		return -EINVAL;
	int err = tb__cancel_check(cancel_fd);
	if (err != 0)
		return err;
	int64_t start = tokenbucket_now();
	int64_t max_wait = TOKENBUCKET_NEVER;
	if (deadline != TOKENBUCKET_NEVER)
		max_wait = deadline > start ? deadline - start : -1;
	struct tokenbucket_reservation rv;
	struct tokenbucket_result res;
	err = tokenbucket_redis_reserve(r, key, keylen, lim, n, max_wait, &rv, &res);
	if (err != 0)
		return err;
	int64_t delay = res.retry_after_ns;
	int64_t target = delay >= TOKENBUCKET_NEVER - start ? TOKENBUCKET_NEVER - 1 : start + delay;
	err = tb__sleep_until(target, cancel_fd);
	if (err != 0) {
		/*
		 * A wait that fails takes nothing: Go's cancel that is never too
		 * late is the refund rule, to Redis or to the fallback's bucket
		 * that granted the reservation, whatever the server's clock says.
		 */
		rv.time_to_act = TOKENBUCKET_NEVER;
		tokenbucket_redis_cancel(r, key, keylen, lim, &rv);
	}
	return err;
}
