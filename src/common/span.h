/* SPDX-License-Identifier: MIT */
/*
 * The span between two times in nanoseconds, for the core's arithmetic of
 * a regime and the Redis module's alike.  Header-only, libc-free.
 */
#ifndef TOKENBUCKET_SPAN_H
#define TOKENBUCKET_SPAN_H

#include <stdint.h>

/* a - b for a >= b, exact: taken modulo 2^64, where int64_t's would overflow. */
static inline uint64_t tb__span(int64_t a, int64_t b)
{
	return (uint64_t)a - (uint64_t)b;
}

#endif /* TOKENBUCKET_SPAN_H */
