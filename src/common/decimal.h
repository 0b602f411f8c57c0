/* SPDX-License-Identifier: MIT */
/*
 * Decimal texts by hand, for what the client sends Redis, what the Redis
 * module stores and the nginx module's RateLimit headers: printf's parsing
 * of a format costs more than the rest of a call.  Pure, no locale.
 */
#ifndef TB_DECIMAL_H
#define TB_DECIMAL_H

#include <stddef.h>
#include <stdint.h>

/*
 * v's digits written backwards, the last just before end: returns where
 * they start, at most 20 characters before end.  For a text that stays
 * where it is written (the nginx module's headers); put_u64 on it.
 */
static inline char *put_u64_back(char *end, uint64_t v)
{
	/* Two digits a step, from the end. */
	static const char pairs[] = "00010203040506070809101112131415161718192021222324"
				    "25262728293031323334353637383940414243444546474849"
				    "50515253545556575859606162636465666768697071727374"
				    "75767778798081828384858687888990919293949596979899";
	char *p = end;
	while (v >= 100) {
		unsigned k = (unsigned)(v % 100) * 2;
		v /= 100;
		*--p = pairs[k + 1];
		*--p = pairs[k];
	}
	if (v >= 10) {
		*--p = pairs[v * 2 + 1];
		*--p = pairs[v * 2];
	} else {
		*--p = (char)('0' + v);
	}
	return p;
}

/* Each writes at most 20 characters (21 with a sign) and returns how many. */
static inline size_t put_u64(char *d, uint64_t v)
{
	static const uint64_t p10[20] = {
		1ULL, 10ULL, 100ULL, 1000ULL, 10000ULL, 100000ULL, 1000000ULL, 10000000ULL,
		100000000ULL, 1000000000ULL, 10000000000ULL, 100000000000ULL, 1000000000000ULL,
		10000000000000ULL, 100000000000000ULL, 1000000000000000ULL, 10000000000000000ULL,
		100000000000000000ULL, 1000000000000000000ULL, 10000000000000000000ULL,
	};
	/*
	 * The digits counted first, so that they are written in place: v below
	 * 2^bits has t = bits * 1233 >> 12 (bits log10(2), floored) of them, or
	 * t + 1 from 10^t on.
	 */
	unsigned t = (unsigned)(64 - __builtin_clzll(v | 1)) * 1233 >> 12;
	size_t n = t + ((v | 1) >= p10[t]);
	put_u64_back(d + n, v);
	return n;
}

static inline size_t put_i64(char *d, int64_t v)
{
	if (v >= 0)
		return put_u64(d, (uint64_t)v);
	d[0] = '-';
	return 1 + put_u64(d + 1, 0 - (uint64_t)v);
}

#endif
