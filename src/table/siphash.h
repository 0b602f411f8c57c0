/* SPDX-License-Identifier: MIT */
/*
 * SipHash-1-3 (Aumasson and Bernstein's keyed hash with one compression
 * round per 8-byte block and three finalisation rounds) with a 64-bit
 * output.  It keys the per-key tables: without the 128-bit secret, nobody
 * can choose keys that land in the same lines (docs/table.md).
 * Inline, so that a table's lookup pays no call; tb__siphash13 (below)
 * is the same function out of line, for the tests and the benchmark.
 */
#ifndef TOKENBUCKET_SIPHASH_H
#define TOKENBUCKET_SIPHASH_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

struct tb__sip {
	uint64_t v0, v1, v2, v3;
};

static inline uint64_t tb__rotl(uint64_t x, int b)
{
	return (x << b) | (x >> (64 - b));
}

static inline __attribute__((always_inline)) void tb__sipround(struct tb__sip *s)
{
	s->v0 += s->v1;
	s->v1 = tb__rotl(s->v1, 13);
	s->v1 ^= s->v0;
	s->v0 = tb__rotl(s->v0, 32);
	s->v2 += s->v3;
	s->v3 = tb__rotl(s->v3, 16);
	s->v3 ^= s->v2;
	s->v0 += s->v3;
	s->v3 = tb__rotl(s->v3, 21);
	s->v3 ^= s->v0;
	s->v2 += s->v1;
	s->v1 = tb__rotl(s->v1, 17);
	s->v1 ^= s->v2;
	s->v2 = tb__rotl(s->v2, 32);
}

/* Little-endian 8-byte load at any alignment. */
static inline uint64_t tb__load64(const unsigned char *p)
{
	uint64_t x;
	memcpy(&x, p, sizeof(x));
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
	x = __builtin_bswap64(x);
#endif
	return x;
}

/* SipHash-1-3 of len bytes at data (any alignment) under the secret (k0, k1). */
static inline __attribute__((always_inline)) uint64_t
tb__siphash13_inline(uint64_t k0, uint64_t k1, const void *data, size_t len)
{
	const unsigned char *in = data;
	struct tb__sip s = {
		k0 ^ UINT64_C(0x736f6d6570736575),
		k1 ^ UINT64_C(0x646f72616e646f6d),
		k0 ^ UINT64_C(0x6c7967656e657261),
		k1 ^ UINT64_C(0x7465646279746573),
	};
	const unsigned char *end = in + (len & ~(size_t)7);
	for (; in != end; in += 8) {
		uint64_t m = tb__load64(in);
		s.v3 ^= m;
		tb__sipround(&s);
		s.v0 ^= m;
	}
	/* The last block: the bytes left over, and the length's low byte on top. */
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
	s.v3 ^= b;
	tb__sipround(&s);
	s.v0 ^= b;
	s.v2 ^= 0xff;
	tb__sipround(&s);
	tb__sipround(&s);
	tb__sipround(&s);
	return s.v0 ^ s.v1 ^ s.v2 ^ s.v3;
}

/* The same, out of line (siphash.c), for the tests and the benchmark. */
uint64_t tb__siphash13(uint64_t k0, uint64_t k1, const void *data, size_t len);

#endif /* TOKENBUCKET_SIPHASH_H */
