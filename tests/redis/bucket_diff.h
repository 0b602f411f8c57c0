/* SPDX-License-Identifier: MIT */
/*
 * The module's arithmetic (src/redis/module/bucket.c) against the local
 * library, without a server; shared by the redis-module-bucket suite and
 * the fuzzer tests/fuzz/fuzz_module_bucket.c.  Each returns true, or false
 * with what differed in why.
 */
#ifndef TOKENBUCKET_BUCKET_DIFF_H
#define TOKENBUCKET_BUCKET_DIFF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "sequence.h"

/*
 * One sequence of sequence.c's steps (seed, steps; starting on first when
 * not NULL) through tbm_call on the value it stores: every code, a
 * reservation's time_to_act and tokens_at's value as the library's, the key
 * held exactly when the library has seen a time, and after every step the
 * level (tokens_at, bit for bit), whole tokens and time until full.
 */
bool bd_sequence(uint64_t seed, int steps, const struct tokenbucket_redis_limit *first, char *why,
		 size_t size);

/* One sequence of allow_all on up to max_count limits (sequence.c's) through tbm_call_all. */
bool bd_set_sequence(uint64_t seed, int steps, size_t max_count, char *why, size_t size);

/*
 * Any bytes as the stored value of op (0-5 as enum tokenbucket_redis_op,
 * 6 allow_all) at now (server_clock: on the server's clock, read as now)
 * with limit l, n and arg: the documented refusal (TBCORRUPT for a value
 * of the wrong form, the argument errors) writing nothing, or a decision
 * with a documented code whose value written is read back as one, and
 * which on the server's clock writes nothing when refused.
 */
bool bd_any_value(const char *v, size_t len, int op, int64_t now, bool server_clock,
		  const struct tokenbucket_redis_limit *l, uint64_t n, int64_t arg, char *why,
		  size_t size);

#endif
