/* SPDX-License-Identifier: MIT */
/*
 * A reference model of one token bucket, for differential testing.
 *
 * It implements the sequential semantics that include/tokenbucket.h,
 * docs/core.md and the manual pages promise, in the plainest way: one
 * mutex around everything, 128-bit integers for production, and state kept
 * as counters.  It shares no code with src/; only the public constants and
 * struct tokenbucket_reservation come from the public header.
 */
#ifndef TOKENBUCKET_FUZZ_MODEL_H
#define TOKENBUCKET_FUZZ_MODEL_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include <tokenbucket.h>

enum model_kind {
	MODEL_FINITE, /* p tokens every q ns, lowest terms */
	MODEL_ZERO,   /* never produces */
	MODEL_INF,    /* unlimited */
};

struct model {
	pthread_mutex_t lock;

	/* The regime: production at t >= start is floor(((t - start) * p + fine0) / q). */
	enum model_kind kind;
	uint64_t p, q;
	int64_t start;
	uint64_t fine0; /* fine units (token * q) carried in from the previous regime */

	bool has_time;   /* false until the first call that passes a time */
	int64_t clock;   /* the latest time seen */
	int64_t claimed; /* production up to this time has been claimed */

	/*
	 * Rovers, modulo 2^64 as documented: level = head - tail <= burst.
	 * Tokens credited beyond burst are dropped by moving the tail (and,
	 * capped, ceil) up by as much, as the library's takes do.
	 */
	uint64_t tail, head, ceil;
	uint64_t burst, threshold;
	unsigned flags;
};

/* The documented conversion of a double rate (tokens/s) to p tokens every q ns. */
enum model_kind model_ratio_from_rate(double rate, uint64_t *p, uint64_t *q);

int model_create(struct model **mp, double rate, uint64_t burst, unsigned flags);
int model_create_every(struct model **mp, uint64_t tokens, int64_t period_ns, uint64_t burst,
		       unsigned flags);
void model_free(struct model *m);

bool model_allow_at(struct model *m, int64_t now, uint64_t n);
int model_reserve_at(struct model *m, int64_t now, uint64_t n, int64_t max_wait,
		     struct tokenbucket_reservation *r);
void model_cancel_at(struct model *m, struct tokenbucket_reservation *r, int64_t now);
double model_tokens_at(struct model *m, int64_t now);
int model_set_rate_at(struct model *m, int64_t now, double rate);
int model_set_rate_every_at(struct model *m, int64_t now, uint64_t tokens, int64_t period_ns);
int model_set_burst_at(struct model *m, int64_t now, uint64_t burst);
int model_reset_at(struct model *m, int64_t now, uint64_t tokens);

uint64_t model_grab(struct model *m, uint64_t n);
void model_replenish(struct model *m, int64_t now);
int model_release(struct model *m, uint64_t n);
void model_refund(struct model *m, uint64_t n);
/* refund at now: the clock moves to now first, as a table key's refund_at does; n 0 changes nothing. */
void model_refund_at(struct model *m, int64_t now, uint64_t n);
uint64_t model_deficiency(struct model *m, uint64_t ticket);
int model_set_threshold(struct model *m, uint64_t threshold);
int64_t model_duration_for(struct model *m, uint64_t tokens);

double model_rate(struct model *m);
uint64_t model_burst(struct model *m);

#endif /* TOKENBUCKET_FUZZ_MODEL_H */
