/* SPDX-License-Identifier: MIT */
/*
 * A decision as a server reports it (struct tokenbucket_result): the
 * arithmetic shared by single buckets and tables, and allow_result.
 */
#include <errno.h>

#include "rovers.h"

/* Nanoseconds from "at" until j more tokens than P(at) are there; NEVER if never. */
static int64_t until(const struct tb__view *v, int64_t at, uint64_t j)
{
	int64_t act;
	return tb__wait_of(v, at, j, &act);
}

void tb__result(const struct tb__view *v, int64_t at, uint64_t n, uint64_t burst, bool allowed,
		int64_t level, struct tokenbucket_result *res)
{
	*res = (struct tokenbucket_result){
		.allowed = allowed,
		.limit = burst,
		.remaining = level > 0 ? (uint64_t)level : 0,
	};
	if (allowed || level >= (int64_t)n)
		res->retry_after_ns = 0;
	else if (n > burst)
		res->retry_after_ns = TOKENBUCKET_NEVER;
	else
		res->retry_after_ns = until(v, at, n - (uint64_t)level);
	res->reset_after_ns = tb__reset_after(v, at, burst, level);
}

int64_t tb__reset_after(const struct tb__view *v, int64_t at, uint64_t burst, int64_t level)
{
	/* Unsigned: below n and burst (so below 2^64 even from a debt a corrupt bucket holds). */
	return level >= (int64_t)burst ? 0 : until(v, at, burst - (uint64_t)level);
}

int64_t tb__reset_seconds(const struct tb__view *v, int64_t at, uint64_t burst, int64_t level)
{
	return level >= (int64_t)burst ? 0 : tb__seconds_of(v, at, burst - (uint64_t)level);
}

int tb__report(struct tokenbucket *tb, uint64_t n, bool allowed, struct tokenbucket_result *res)
{
	uint64_t burst = atomic_load_explicit(&tb->burst, memory_order_relaxed);
	if (tb__unlimited(tb)) {
		*res = (struct tokenbucket_result){
			.allowed = true,
			.limit = burst,
			.remaining = burst,
		};
		return 0;
	}
	struct tb__view v;
	int64_t at;
	if (!tb__view_at_clock(tb, &v, &at))
		return -EBADMSG;
	int64_t level = (int64_t)burst;
	{
		/* The level with the tail it belongs to, as tokens_at reads it. */
		uint64_t tail = atomic_load(&tb->tail);
		tb__i128 raw;
		for (;;) {
			TB__ROUND();
			uint64_t head = atomic_load(&tb->head);
			raw = tb__raw_level(&v, head, tail, at);
			uint64_t again = atomic_load(&tb->tail);
			if (again == tail)
				break;
			tail = again;
		}
		level = tb__capped_level(raw, burst);
	}
	tb__result(&v, at, n, burst, allowed, level, res);
	return 0;
}

int tokenbucket_allow_result_at(struct tokenbucket *tb, int64_t now, uint64_t n,
				struct tokenbucket_result *res)
{
	if (tb == NULL || res == NULL)
		return -EINVAL;
	uint64_t burst = atomic_load_explicit(&tb->burst, memory_order_relaxed);
	bool allowed = tokenbucket_allow_at(tb, now, n);
	if (n > burst)
		tokenbucket_tokens_at(tb, now); /* refused at once: the report is at now */
	return tb__report(tb, n, allowed, res);
}

int tokenbucket_allow_result(struct tokenbucket *tb, uint64_t n, struct tokenbucket_result *res)
{
	return tokenbucket_allow_result_at(tb, tb__now(), n, res);
}
