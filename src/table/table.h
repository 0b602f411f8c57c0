/* SPDX-License-Identifier: MIT */
/*
 * The per-key table's memory layout and the helpers its tests share.
 * docs/table.md explains the protocol; the comments here state
 * what each word promises.
 *
 * Memory: a header (128 bytes), the regimes (128), the writer mutex (128),
 * a counters line, then `lines` cache lines of two 32-byte slots, paired
 * into buckets of four slots (128 bytes, aligned).
 * A key hashes (SipHash-1-3, the table's secret) to a 56-bit fingerprint
 * and two buckets; it lives in one of their eight slots.
 * Every word is an 8-byte atomic holding no pointer, so a table works in
 * memory shared between processes at any address.
 */
#ifndef TOKENBUCKET_TABLE_H
#define TOKENBUCKET_TABLE_H

#include <pthread.h>
#include <stdalign.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

/* "TBTABLE\0" read as a little-endian word. */
#define TBT_MAGIC UINT64_C(0x00454c4241544254)
/*
 * The layout of header, counters and slots, and where a key lives (its
 * buckets); raised whenever any of them changes.
 */
#define TBT_LAYOUT 3
/* The last word initialisation writes. */
#define TBT_READY UINT32_C(0x52454459)

/*
 * A slot's state word: [version:8 | empty:1 | tail:55].  The version is odd
 * while the slot is claimed (being given to a new key); every claim and every
 * end of a claim (confirm or void) moves it on, so a taker's CAS against the
 * state it read fails if the slot changed hands meanwhile.  The tail counts,
 * in tokens modulo 2^55, what the key has taken plus what was dropped above
 * burst, with level(t) = min(burst, Q(t) - tail) on the table's cumulative
 * production Q(t) = hoff + P(t) of the regime in force (struct tbt_regime).
 */
#define TBT_VER_SHIFT 56
#define TBT_EMPTY (UINT64_C(1) << 55)
#define TBT_TAIL_MASK (TBT_EMPTY - 1)
/*
 * Tails and Q are read modulo 2^55, relative to each other: every tail a
 * call writes lies within 2^54 of Q, because a regime produces at most
 * TBT_ANCHOR tokens before the next call that writes a tail re-anchors the
 * table (a change to the same limit, which moves every full key's tail up
 * to Q - burst).  So a table has no horizon.  TBT_HORIZON bounds the rate:
 * a table takes no rate that makes that many tokens in under 2^50 ns.
 */
#define TBT_HORIZON (UINT64_C(1) << 54)
#define TBT_ANCHOR (UINT64_C(1) << 53)
/* The fingerprint word: [fingerprint:56 | version of the claim that wrote it:8]. */
#define TBT_TAG_MASK UINT64_C(0xff)

/* Slots a key may live in: two buckets of TBT_BUCKET_SLOTS (two lines each). */
#define TBT_BUCKET_SLOTS 4
#define TBT_CANDIDATES (2 * TBT_BUCKET_SLOTS)

struct tbt_slot {
	_Atomic uint64_t fp;      /* fingerprint and claim tag; meaningful while state is even, not empty */
	_Atomic uint64_t state;   /* version, empty, tail */
	_Atomic int64_t clock;    /* the key's latest time: its calls never run backwards */
	_Atomic uint64_t spare;   /* zero in a new table; unused, so any value is safe */
};

struct tbt_line {
	alignas(64) struct tbt_slot slot[2];
};

/* Lines a table of capacity slots has: whole buckets. */
static inline uint64_t tbt_lines(uint64_t capacity)
{
	return (capacity + TBT_BUCKET_SLOTS - 1) / TBT_BUCKET_SLOTS * 2;
}

/*
 * A rate regime: Q(t) = hoff + floor(((t - origin) * p + fine0) / q) for t
 * not before origin, and the burst.  Written only by the holder of the
 * writer mutex into the slot no reader uses, read under the seqlock of
 * tbt_regimes.gen (as the core's struct tb__slot).
 */
struct tbt_regime {
	_Atomic int64_t origin;  /* ns; TB__NO_TIME: the table's origin (regime 0 only) */
	_Atomic uint64_t fine0;  /* production carried in, in 1/q tokens: < q */
	_Atomic uint64_t p, q;   /* p tokens every q ns, lowest terms; 0/1 for rate 0 */
	_Atomic uint64_t hoff;   /* Q at the origin, modulo 2^55; TOKENBUCKET_TABLE_BURST_MAX in regime 0 */
	_Atomic uint64_t burst;
	_Atomic int64_t hspan;   /* ns from the origin to TBT_ANCHOR tokens (INT64_MAX: never) */
};

/*
 * gen is even while regime gen / 2 (in slot[(gen / 2) & 1]) is in force,
 * odd while a change freezes it: production then counts up to frozen_at
 * only, and slot[(gen / 2 + 1) & 1] holds the next regime's p, q, burst.
 */
struct tbt_regimes {
	alignas(128) _Atomic uint64_t gen;
	struct tbt_regime slot[2];
	_Atomic int64_t frozen_at;
};

struct tbt_header {
	uint64_t magic;
	_Atomic uint32_t ready;    /* TBT_READY once everything behind it is initialised */
	uint32_t layout;           /* TBT_LAYOUT */
	uint32_t major;            /* TOKENBUCKET_VERSION_MAJOR of the initialiser */
	uint32_t header_size;      /* offsetof(struct tbt_mem, line) */
	uint32_t line_size;        /* sizeof(struct tbt_line) */
	uint32_t flags;            /* the policy flags */
	uint64_t lines;            /* lines of slots behind the counters */
	uint64_t capacity;         /* slots asked for (lines * 2 is capacity rounded up to 4) */
	uint64_t k0, k1;           /* the SipHash secret, from getrandom(2) */
	_Atomic int64_t origin;    /* the first time any call passed; TB__NO_TIME before */
	/*
	 * Nonzero once a call found words no table can hold (docs/shm.md,
	 * "Corrupt mappings"): calls then fail at once and attach refuses.
	 */
	_Atomic uint64_t corrupt;
	/*
	 * Written before a change freezes the regime, read by whoever finishes
	 * it: 1 for a re-anchor (the same rate, the fraction carried exactly),
	 * 0 for tokenbucket_table_set_limit (carried as a bucket's set_limit).
	 */
	_Atomic uint64_t exact_carry;
};

/* Statistics, written on the insert paths only (never by a warm take). */
struct tbt_counters {
	alignas(128) _Atomic uint64_t in_use;
	_Atomic uint64_t lossless;
	_Atomic uint64_t lossy;
	_Atomic uint64_t refused;
};

struct tbt_mem {
	union {
		struct tbt_header h;
		alignas(128) unsigned char pad[128];
	} header;
	struct tbt_regimes regimes;
	/* Rate and burst changes only: process-shared and robust. */
	union {
		pthread_mutex_t writer;
		alignas(128) unsigned char pad[128];
	} lock;
	struct tbt_counters counters;
	struct tbt_line line[];
};

_Static_assert(sizeof(struct tbt_header) <= 128, "the header fits its two lines");
_Static_assert(sizeof(struct tbt_line) == 64 && sizeof(struct tbt_slot) == 32,
	       "a line is one cache line of two slots");
_Static_assert(sizeof(struct tbt_regimes) == 128 && offsetof(struct tbt_mem, line) == 512,
	       "the shared layout (TBT_LAYOUT 3) does not move");

struct tokenbucket_table;
/*
 * For the table's wait: 0 if the tokens of a reservation with this ticket
 * on key are there at now (or the key's bucket is gone, which is full),
 * else 1 with *pause the ns the rate in force needs for the rest, or a
 * negative errno (-EBADMSG: a corrupt table).
 */
int tbt_covered_at(struct tokenbucket_table *t, int64_t now, const void *key, size_t len,
		   uint64_t ticket, int64_t *pause);

/*
 * The two buckets of a hash among `buckets` (at most 2^30), by
 * multiply-shift of two 32-bit words, each with the 8 hash bits the
 * fingerprint lacks in its top byte: two hashes with one fingerprint differ
 * there, so from 256 buckets up their first buckets differ, and so do
 * their second ones unless one was moved off its first (see docs/table.md,
 * "Where a key lives").  The second differs from the first whenever there
 * are two buckets.
 */
static inline void tbt_buckets_of(uint64_t h, uint64_t buckets, uint64_t *a, uint64_t *b)
{
	uint64_t low = h & TBT_TAG_MASK;
	uint64_t x = (h >> 32) ^ (low << 24);
	uint64_t y = ((h >> 8) & 0xffffff) | (low << 24);
	*a = (x * buckets) >> 32;
	*b = (y * buckets) >> 32;
	if (*b == *a && buckets > 1)
		*b = *a + 1 == buckets ? 0 : *a + 1;
}

/* The fingerprint a hash gives (the tag bits clear). */
static inline uint64_t tbt_fingerprint(uint64_t h)
{
	return h & ~TBT_TAG_MASK;
}

#endif /* TOKENBUCKET_TABLE_H */
