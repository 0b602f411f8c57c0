/* SPDX-License-Identifier: MIT */
/*
 * The SIGKILL storm of the table suites: processes that use a shared
 * table are killed at random instants (never while none has made a call
 * since the last kill) and replaced, until enough have died or time is up.
 */
#ifndef TB_TEST_STORM_H
#define TB_TEST_STORM_H

#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check_tb.h"

/* A child's body: runs until killed, never returns. */
typedef void (*storm_child_fn)(void *arg, unsigned seed);

/*
 * Kills one of the n processes in pids at random every 20-320 us of calls
 * (calls: what the children count), want times or for seconds at most,
 * starting a child with seed base + kills * n + i in the place of each;
 * then kills them all.  Every child must have died of the signal.  Returns
 * the kills.
 */
static inline int storm_run(pid_t *pids, int n, _Atomic long *calls, int want, int seconds,
			    unsigned rand_seed, unsigned base, storm_child_fn child, void *arg)
{
	int kills = 0;
	srand(rand_seed);
	int64_t end = tokenbucket_now() + seconds * SEC;
	while (kills < want && tokenbucket_now() < end) {
		long seen = atomic_load(calls);
		usleep((useconds_t)(20 + rand() % 300));
		while (atomic_load(calls) == seen)
			usleep(20);
		int i = rand() % n;
		kill(pids[i], SIGKILL);
		int st;
		ck_assert_int_eq(waitpid(pids[i], &st, 0), pids[i]);
		ck_assert_msg(WIFSIGNALED(st), "a child failed: status %d", st);
		kills++;
		pids[i] = fork();
		TBT_FORKED(pids[i]);
		if (pids[i] == 0)
			child(arg, base + (unsigned)(kills * n + i));
	}
	for (int i = 0; i < n; i++) {
		kill(pids[i], SIGKILL);
		waitpid(pids[i], NULL, 0);
	}
	return kills;
}

#endif
