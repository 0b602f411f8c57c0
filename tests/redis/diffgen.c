/* SPDX-License-Identifier: MIT */
/*
 * usage: tokenbucket-redis-diffgen [set] SEED SEQUENCES STEPS
 *
 * Writes random call sequences, each on a key of its own, with the local
 * library's answer to every step, in the line format tests/redis/driver.lua
 * reads:  key op now tokens period burst n arg | code act tokens
 * (code: the script's reply code, or E for an error reply; act: the
 * reservation's time_to_act or "-"; tokens: tokens_at's value or "-").
 * With "set", sequences of allow_all on keys of several limits, for
 * tests/redis/driver-set.lua:
 *   key now n count tokens period burst ... | allowed index limit remaining retry reset
 * or "| E2BIG" for n above a burst.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sequence.h"

static const char *const ops[] = { "allow", "reserve", "cancel", "tokens", "reset", "refund" };

static int sets(uint64_t seed, long count, int steps)
{
	for (long i = 0; i < count; i++) {
		struct seq_set s;
		struct seq_set_step st;
		struct seq_set_expect ex;
		seq_set_start(&s, seed + (uint64_t)i * 0x632be59bd9b4e019u, steps, 4);
		while (seq_set_next(&s, &st, &ex)) {
			if (ex.err == -EFAULT) {
				fprintf(stderr, "the local library refused a step of sequence %ld\n", i);
				return 1;
			}
			printf("s%ld %" PRId64 " %" PRIu64 " %zu", i, st.now, st.n, st.count);
			for (size_t k = 0; k < st.count; k++)
				printf(" %" PRIu64 " %" PRId64 " %" PRIu64, st.lim[k].tokens,
				       st.lim[k].tokens ? st.lim[k].period_ns : 1, st.lim[k].burst);
			if (ex.err != 0)
				printf(" | E2BIG\n");
			else
				printf(" | %d %zu %" PRIu64 " %" PRIu64 " %" PRId64 " %" PRId64 "\n",
				       ex.res.allowed, ex.res.index, ex.res.limit, ex.res.remaining,
				       ex.res.retry_after_ns, ex.res.reset_after_ns);
		}
		seq_set_end(&s);
	}
	return 0;
}

int main(int argc, char **argv)
{
	if (argc == 5 && strcmp(argv[1], "set") == 0)
		return sets(strtoull(argv[2], NULL, 0), strtol(argv[3], NULL, 0), atoi(argv[4]));
	if (argc != 4) {
		fprintf(stderr, "usage: %s [set] SEED SEQUENCES STEPS\n", argv[0]);
		return 2;
	}
	uint64_t seed = strtoull(argv[1], NULL, 0);
	long count = strtol(argv[2], NULL, 0);
	int steps = atoi(argv[3]);
	for (long i = 0; i < count; i++) {
		struct seq s;
		struct seq_step st;
		struct seq_expect ex;
		uint64_t sseed = seed + (uint64_t)i * 0x632be59bd9b4e019u;
		seq_start(&s, sseed, steps);
		while (seq_next(&s, &st, &ex)) {
			if (ex.err == -EFAULT) {
				fprintf(stderr, "the local library refused step of sequence %ld\n", i);
				return 1;
			}
			printf("k%ld %s %" PRId64 " %" PRIu64 " %" PRId64 " %" PRIu64 " %" PRIu64 " %" PRId64
			       " | ", i, ops[st.op], st.now, st.lim.tokens,
			       st.lim.tokens ? st.lim.period_ns : 1, st.lim.burst, st.n,
			       (st.op == TOKENBUCKET_REDIS_RESERVE || st.op == TOKENBUCKET_REDIS_CANCEL) ? st.arg : 0);
			if (ex.code < 0)
				printf("E - -\n");
			else if (st.op == TOKENBUCKET_REDIS_RESERVE && ex.code == 1)
				printf("%d %" PRId64 " -\n", ex.code, ex.act);
			else if (st.op == TOKENBUCKET_REDIS_TOKENS)
				printf("%d - %.17g\n", ex.code, ex.tokens);
			else
				printf("%d - -\n", ex.code);
		}
		seq_end(&s);
	}
	return 0;
}
