/* SPDX-License-Identifier: MIT */
/*
 * SipHash-1-3 (Aumasson and Bernstein's keyed hash with one compression
 * round per 8-byte block and three finalisation rounds) with a 64-bit
 * output.  It keys the per-key tables: without the 128-bit secret, nobody
 * can choose keys that land in the same lines (docs/DESIGN.md, "Tables").
 */
#include <string.h>

#include "table.h"

static inline uint64_t rotl(uint64_t x, int b)
{
	return (x << b) | (x >> (64 - b));
}

#define SIPROUND                                                                \
	do {                                                                    \
		v0 += v1;                                                       \
		v1 = rotl(v1, 13);                                              \
		v1 ^= v0;                                                       \
		v0 = rotl(v0, 32);                                              \
		v2 += v3;                                                       \
		v3 = rotl(v3, 16);                                              \
		v3 ^= v2;                                                       \
		v0 += v3;                                                       \
		v3 = rotl(v3, 21);                                              \
		v3 ^= v0;                                                       \
		v2 += v1;                                                       \
		v1 = rotl(v1, 17);                                              \
		v1 ^= v2;                                                       \
		v2 = rotl(v2, 32);                                              \
	} while (0)

/* Little-endian 8-byte load at any alignment. */
static inline uint64_t load64(const unsigned char *p)
{
	uint64_t x;
	memcpy(&x, p, sizeof(x));
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
	x = __builtin_bswap64(x);
#endif
	return x;
}

uint64_t tb__siphash13(uint64_t k0, uint64_t k1, const void *data, size_t len)
{
	const unsigned char *in = data;
	uint64_t v0 = k0 ^ UINT64_C(0x736f6d6570736575);
	uint64_t v1 = k1 ^ UINT64_C(0x646f72616e646f6d);
	uint64_t v2 = k0 ^ UINT64_C(0x6c7967656e657261);
	uint64_t v3 = k1 ^ UINT64_C(0x7465646279746573);
	const unsigned char *end = in + (len & ~(size_t)7);
	for (; in != end; in += 8) {
		uint64_t m = load64(in);
		v3 ^= m;
		SIPROUND;
		v0 ^= m;
	}
	uint64_t b = (uint64_t)len << 56;
	switch (len & 7) {
	case 7:
		b |= (uint64_t)in[6] << 48;
		/* fallthrough */
	case 6:
		b |= (uint64_t)in[5] << 40;
		/* fallthrough */
	case 5:
		b |= (uint64_t)in[4] << 32;
		/* fallthrough */
	case 4:
		b |= (uint64_t)in[3] << 24;
		/* fallthrough */
	case 3:
		b |= (uint64_t)in[2] << 16;
		/* fallthrough */
	case 2:
		b |= (uint64_t)in[1] << 8;
		/* fallthrough */
	case 1:
		b |= (uint64_t)in[0];
		break;
	case 0:
		break;
	}
	v3 ^= b;
	SIPROUND;
	v0 ^= b;
	v2 ^= 0xff;
	SIPROUND;
	SIPROUND;
	SIPROUND;
	return v0 ^ v1 ^ v2 ^ v3;
}
