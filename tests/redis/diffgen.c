/* SPDX-License-Identifier: MIT */
/*
 * usage: tokenbucket-redis-diffgen SEED SEQUENCES STEPS
 *
 * Writes random call sequences, each on a key of its own, with the local
 * library's answer to every step, in the line format tests/redis/driver.lua
 * reads:  key op now tokens period burst n arg | code act tokens
 * (code: the script's reply code, or E for an error reply; act: the
 * reservation's time_to_act or "-"; tokens: tokens_at's value or "-").
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>

#include "sequence.h"

static const char *const ops[] = { "allow", "reserve", "cancel", "tokens", "reset", "refund" };

int main(int argc, char **argv)
{
	if (argc != 4) {
		fprintf(stderr, "usage: %s SEED SEQUENCES STEPS\n", argv[0]);
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
