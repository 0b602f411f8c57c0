/* SPDX-License-Identifier: MIT */
/*
 * Random call sequences on one key at explicit times, with what the local
 * library answers to each step.  The differential tests run the same steps
 * through Redis (test_redis_diff.c) and through lua5.1 (diffgen.c) and
 * compare.
 */
#ifndef TOKENBUCKET_SEQUENCE_H
#define TOKENBUCKET_SEQUENCE_H

#include <stdbool.h>
#include <stdint.h>

#include <tokenbucket.h>
#include <tokenbucket-redis.h>

struct seq_step {
	enum tokenbucket_redis_op op;
	int64_t now;
	struct tokenbucket_redis_limit lim; /* the configuration the call carries */
	uint64_t n;
	int64_t arg;                        /* RESERVE: max_wait; CANCEL: time_to_act */
	int resv;                           /* CANCEL: which reservation, or -1 */
};

/* What the local library answered. */
struct seq_expect {
	int err;         /* 0 or the negative errno the Redis call must return */
	bool allowed;    /* ALLOW */
	int code;        /* the script's reply code; -1 for an error reply */
	int64_t act;     /* RESERVE that succeeded: time_to_act */
	double tokens;   /* TOKENS */
};

#define SEQ_RESV 8

struct seq {
	uint64_t rng;
	int left;
	int64_t t;
	struct tokenbucket_redis_limit lim; /* what the next calls carry */
	struct tokenbucket_redis_limit made; /* the local bucket's configuration */
	struct tokenbucket *tb;
	bool seen; /* the local bucket has seen a time (a stored key exists) */
	struct tokenbucket_reservation resv[SEQ_RESV];
	int nresv;
};

uint64_t seq_rand(uint64_t *state);
/* t - now as the client reads a reply: at least 0; never, and a span no int64_t holds, never. */
int64_t seq_until(int64_t t, int64_t now);
/* A new sequence of steps from seed; 0 or a negative errno. */
int seq_start(struct seq *s, uint64_t seed, int steps);
/* The next step and the local answer; false when the sequence is over. */
bool seq_next(struct seq *s, struct seq_step *st, struct seq_expect *ex);
void seq_end(struct seq *s);

/*
 * Sequences of allow_all on one key holding several limits
 * (tokenbucket_redis_allow_all_at), against local buckets taken as a set
 * (tokenbucket_allow_all_at).  Now and then a limit's configuration
 * changes, and so does the number of limits.
 */
struct seq_set_step {
	int64_t now;
	size_t count;
	struct tokenbucket_redis_limit lim[TOKENBUCKET_SET_MAX];
	uint64_t n;
};

/* What the local buckets answered, index as the script reports it (the lowest limit short). */
struct seq_set_expect {
	int err; /* 0 or -E2BIG */
	struct tokenbucket_set_result res;
};

struct seq_set {
	struct seq base; /* its rng, time and lim (the first limit) drive the steps */
	size_t count;
	struct tokenbucket_redis_limit lim[TOKENBUCKET_SET_MAX];
	struct tokenbucket_redis_limit made[TOKENBUCKET_SET_MAX];
	struct tokenbucket *tb[TOKENBUCKET_SET_MAX];
	size_t have;   /* limits the key holds */
	int64_t clock; /* the key's clock */
};

int seq_set_start(struct seq_set *s, uint64_t seed, int steps, size_t max_count);
/* The next step and the local answer; false when the sequence is over.  ex->err -EFAULT: the local library refused. */
bool seq_set_next(struct seq_set *s, struct seq_set_step *st, struct seq_set_expect *ex);
void seq_set_end(struct seq_set *s);

#endif
