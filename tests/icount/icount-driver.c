/* SPDX-License-Identifier: MIT */
/*
 * Runs one hot path a fixed number of times on a fixed schedule of times, so
 * that callgrind's instruction count per call is the same on every run.
 *
 * usage: icount-driver WORKLOAD CALLS
 *   allow_at        allow_at(t, 1), t += 100 ns; rate 1 token per 1000 ns,
 *                   so every tenth call finds a new token (both paths counted)
 *   grab            grab(1)
 *   reserve_cancel  reserve_at(t, 1) then cancel_at(t), t += 100 ns
 *   reserve_cancel_2  reserve_all_at(t, 1) then cancel_all_at(t) on a set
 *                   of two such buckets, t += 100 ns
 *   allow_result_at allow_result_at(t, 1), t += 100 ns
 *   allow_all_2     allow_all_at(t, 1) on the set of two, t += 100 ns
 *   table_warm      table allow_at(t, key, 1) on one warm key, t += 100 ns, the
 *                   same rate and a burst that never empties
 *   table_keys      the same on 1000 warm keys in turn (a table of 4096 slots)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <tokenbucket.h>

int main(int argc, char **argv)
{
	if (argc != 3) {
		fprintf(stderr, "usage: %s allow_at|grab|reserve_cancel|reserve_cancel_2|"
				"allow_result_at|allow_all_2|table_warm|table_keys CALLS\n", argv[0]);
		return 2;
	}
	const char *workload = argv[1];
	long calls = strtol(argv[2], NULL, 10);
	struct tokenbucket *tb, *tb2;
	/* A burst that never empties: the take path, not the refusal, is counted. */
	if (tokenbucket_create_every(&tb, 1, 1000, TOKENBUCKET_BURST_MAX, 0) != 0)
		return 1;
	if (tokenbucket_create_every(&tb2, 1, 1000, TOKENBUCKET_BURST_MAX, 0) != 0)
		return 1;
	struct tokenbucket *set[2] = { tb, tb2 };
	int64_t t = 1000000000;
	unsigned long sink = 0;
	if (strcmp(workload, "allow_at") == 0) {
		for (long i = 0; i < calls; i++, t += 100)
			sink += tokenbucket_allow_at(tb, t, 1);
	} else if (strcmp(workload, "grab") == 0) {
		for (long i = 0; i < calls; i++)
			sink += tokenbucket_grab(tb, 1);
	} else if (strcmp(workload, "reserve_cancel") == 0) {
		struct tokenbucket_reservation r;
		for (long i = 0; i < calls; i++, t += 100) {
			if (tokenbucket_reserve_at(tb, t, 1, TOKENBUCKET_NEVER, &r) != 0)
				return 1;
			tokenbucket_cancel_at(tb, &r, t);
			sink += r.ticket;
		}
	} else if (strcmp(workload, "reserve_cancel_2") == 0) {
		struct tokenbucket_reservation r[2];
		for (long i = 0; i < calls; i++, t += 100) {
			if (tokenbucket_reserve_all_at(set, 2, t, 1, TOKENBUCKET_NEVER, r) != 0)
				return 1;
			tokenbucket_cancel_all_at(set, 2, t, r);
			sink += r[1].ticket;
		}
	} else if (strcmp(workload, "allow_result_at") == 0) {
		struct tokenbucket_result res;
		for (long i = 0; i < calls; i++, t += 100) {
			if (tokenbucket_allow_result_at(tb, t, 1, &res) != 0)
				return 1;
			sink += res.allowed;
		}
	} else if (strcmp(workload, "allow_all_2") == 0) {
		struct tokenbucket_set_result res;
		for (long i = 0; i < calls; i++, t += 100) {
			if (tokenbucket_allow_all_at(set, 2, t, 1, &res) != 0)
				return 1;
			sink += res.allowed;
		}
	} else if (strcmp(workload, "table_warm") == 0 || strcmp(workload, "table_keys") == 0) {
		struct tokenbucket_table *tt;
		if (tokenbucket_table_create(&tt, 1, 1000, TOKENBUCKET_TABLE_BURST_MAX, 4096, 0) != 0)
			return 1;
		unsigned keys = strcmp(workload, "table_keys") == 0 ? 1000 : 1;
		/* Every key warm (its bucket in place) before the counted calls, which are allow_at's. */
		for (unsigned k = 0; k < keys; k++) {
			struct tokenbucket_reservation r;
			if (tokenbucket_table_reserve_at(tt, t, &k, sizeof(k), 1, 0, &r) != 0)
				return 1;
		}
		for (long i = 0; i < calls; i++, t += 100) {
			unsigned k = (unsigned)(i % keys);
			sink += tokenbucket_table_allow_at(tt, t, &k, sizeof(k), 1);
		}
		tokenbucket_table_free(tt);
	} else {
		fprintf(stderr, "%s: unknown workload %s\n", argv[0], workload);
		return 2;
	}
	tokenbucket_free(tb);
	tokenbucket_free(tb2);
	return sink == 0; /* every workload takes something; 0 means it did not run */
}
