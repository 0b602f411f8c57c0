/* SPDX-License-Identifier: MIT */
/*
 * The seconds until a bucket is full, inline for the report of a RateLimit
 * header (tokenbucket_table_allow_reset pays no call for it).  Apart from
 * core.h, which ratio.c (the long way) includes: a header that calls into
 * ratio.c is not one ratio.c reads.
 */
#ifndef TB_CORE_SECONDS_H
#define TB_CORE_SECONDS_H

#include "core.h"

/* tb__wait_of in whole seconds, rounded up, exactly; NEVER as it. */
static inline int64_t tb__seconds_of(const struct tb__view *v, int64_t at, uint64_t j)
{
	uint64_t per_s, far = tb__span(TOKENBUCKET_NEVER, at);
	if (far > (uint64_t)TOKENBUCKET_NEVER)
		far = (uint64_t)TOKENBUCKET_NEVER;
	/*
	 * ceil(ceil(need / p) / 10^9) = ceil(need / (p * 10^9)): one 64-bit
	 * division when both fit.  need below far: the wait (at most need) is
	 * not NEVER to tb__wait_of.
	 */
	if (tb__timed(v) && !__builtin_mul_overflow(v->p, (uint64_t)1000000000u, &per_s)) {
		tb__u128 need = tb__need_of(v, at, j);
		if (need < far) {
			uint64_t whole = (uint64_t)need / per_s;
			return (int64_t)(whole + ((uint64_t)need % per_s != 0));
		}
	}
	return tb__seconds_via_wait(v, at, j);
}

/* tb__reset_after in whole seconds, rounded up, exactly (tb__seconds_of). */
static inline int64_t tb__reset_seconds(const struct tb__view *v, int64_t at, uint64_t burst,
					int64_t level)
{
	return level >= (int64_t)burst ? 0 : tb__seconds_of(v, at, burst - (uint64_t)level);
}

#endif
