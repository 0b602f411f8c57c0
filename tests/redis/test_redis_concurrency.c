/* SPDX-License-Identifier: MIT */
/*
 * 4 processes x 4 threads on one key, on the server's clock: the hard
 * bounds of the local concurrency suite hold across processes too.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check_redis.h"

#define PROCS 4
#define THREADS 4

struct worker {
	struct tokenbucket_redis *r;
	const struct tokenbucket_redis_limit *lim;
	int64_t until;
	bool conserve; /* reserve and cancel instead of allow */
	bool at;       /* conserve at one fixed time instead of the server's */
	uint64_t seed;
	long granted, calls, errors;
};

static void *work(void *arg)
{
	struct worker *w = arg;
	/* Reserve+cancel pairs also run a few times each however slow the machine. */
	while (tokenbucket_now() < w->until || (w->conserve && w->calls < 10)) {
		w->calls++;
		if (w->conserve) {
			struct tokenbucket_reservation r;
			uint64_t n = 1 + (w->seed = w->seed * 6364136223846793005u + 1) % 5;
			int err = w->at
				? tokenbucket_redis_reserve_at(w->r, KEY("shared"), w->lim, 0, n, TOKENBUCKET_NEVER, &r, NULL)
				: tokenbucket_redis_reserve(w->r, KEY("shared"), w->lim, n, TOKENBUCKET_NEVER, &r, NULL);
			if (err == 0)
				err = w->at ? tokenbucket_redis_cancel_at(w->r, KEY("shared"), w->lim, &r, 0)
					    : tokenbucket_redis_cancel(w->r, KEY("shared"), w->lim, &r);
			if (err != 0 || r.tokens != 0)
				w->errors++;
			continue;
		}
		struct tokenbucket_result res;
		if (tokenbucket_redis_allow(w->r, KEY("shared"), w->lim, 1, &res) != 0)
			w->errors++;
		else
			w->granted += res.allowed;
	}
	return NULL;
}

/* One process: THREADS threads on one client; writes granted, calls, errors to fd. */
static void process(const struct tokenbucket_redis_limit *lim, int64_t run_ns, bool conserve,
		    bool at, int fd, int index)
{
	struct tokenbucket_redis *r;
	if (tokenbucket_redis_open(&r, srv.url, SEC, 2 * SEC) != 0)
		_exit(2);
	/* The run starts here, once this process is up (slow under valgrind). */
	int64_t until = tokenbucket_now() + run_ns;
	struct worker w[THREADS];
	pthread_t t[THREADS];
	for (int i = 0; i < THREADS; i++) {
		w[i] = (struct worker){ .r = r, .lim = lim, .until = until, .conserve = conserve,
					.at = at, .seed = (uint64_t)(index * THREADS + i + 1) };
		if (pthread_create(&t[i], NULL, work, &w[i]) != 0)
			_exit(3);
	}
	long sums[3] = { 0, 0, 0 };
	for (int i = 0; i < THREADS; i++) {
		pthread_join(t[i], NULL);
		sums[0] += w[i].granted;
		sums[1] += w[i].calls;
		sums[2] += w[i].errors;
	}
	tokenbucket_redis_close(r);
	_exit(write(fd, sums, sizeof(sums)) == sizeof(sums) ? 0 : 4);
}

/* Runs PROCS processes for run_ns; totals in sums, the whole span in *elapsed. */
static void run_all(const struct tokenbucket_redis_limit *lim, int64_t run_ns, bool conserve,
		    bool at, long sums[3], int64_t *elapsed)
{
	int fds[2];
	ck_assert_int_eq(pipe(fds), 0);
	int64_t start = tokenbucket_now();
	pid_t pids[PROCS];
	for (int i = 0; i < PROCS; i++) {
		pids[i] = fork();
		TBT_FORKED(pids[i]);
		if (pids[i] == 0) {
			/* The test's own client is the parent's; this process opens its own. */
			tokenbucket_redis_close(cli);
			cli = NULL;
			close(fds[0]);
			process(lim, run_ns, conserve, at, fds[1], i);
		}
	}
	close(fds[1]);
	sums[0] = sums[1] = sums[2] = 0;
	for (int i = 0; i < PROCS; i++) {
		int status;
		ck_assert_int_eq(waitpid(pids[i], &status, 0), pids[i]);
		ck_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0);
		long part[3];
		ck_assert_int_eq(read(fds[0], part, sizeof(part)), sizeof(part));
		for (int j = 0; j < 3; j++)
			sums[j] += part[j];
	}
	*elapsed = tokenbucket_now() - start;
	close(fds[0]);
}

START_TEST(test_granted_bound)
{
	/* 2000 tokens per second, burst 100: far fewer than the calls made. */
	const struct tokenbucket_redis_limit lim = { .tokens = 2, .period_ns = MS, .burst = 100 };
	long sums[3];
	int64_t elapsed;
	run_all(&lim, SEC, false, false, sums, &elapsed);
	double bound = 100 + 2000.0 * (double)elapsed / 1e9;
	printf("redis concurrency: %d x %d threads, %ld calls in %.3f s (%.0f decisions/s), "
	       "%ld granted, bound %.0f\n", PROCS, THREADS, sums[1], (double)elapsed / 1e9,
	       (double)sums[1] * 1e9 / (double)elapsed, sums[0], bound);
	ck_assert_int_eq(sums[2], 0);
	ck_assert_msg(sums[0] <= bound, "granted %ld > %.1f", sums[0], bound);
	/* And it was not starved: half of what the rate made was granted, or
	 * half the calls where calls are fewer (a slow machine, valgrind). */
	double least = 0.5 * 2000.0 * (double)elapsed / 1e9;
	if (least > 0.5 * (double)sums[1])
		least = 0.5 * (double)sums[1];
	/*
	 * Under a sanitizer or memcheck (CK_TIMEOUT_MULTIPLIER set by
	 * .ci/sanitize) the clients stall and call in bunches, so tokens
	 * overflow the burst between them: the floor shrinks by that factor.
	 */
	const char *mult = getenv("CK_TIMEOUT_MULTIPLIER");
	if (mult != NULL && atof(mult) > 1)
		least /= atof(mult);
	ck_assert_msg(sums[0] >= least, "granted only %ld of %ld calls", sums[0], sums[1]);
}
END_TEST

/*
 * At rate 0, reserve then cancel gives back everything: at one fixed time
 * (as the local suite does) the bucket stays exactly full.  On the server's
 * clock a cancel comes after time_to_act unless the reservation is in debt
 * (time_to_act never), so there the bucket starts empty and stays exactly so.
 */
START_TEST(test_rate_zero_conserves)
{
	const struct tokenbucket_redis_limit lim = { .tokens = 0, .period_ns = 1, .burst = 1000 };
	long sums[3];
	int64_t elapsed;
	run_all(&lim, SEC / 2, true, true, sums, &elapsed);
	ck_assert_int_eq(sums[2], 0);
	ck_assert_int_gt(sums[1], 20);
	double tokens = 0;
	ck_assert_int_eq(tokenbucket_redis_tokens_at(cli, KEY("shared"), &lim, 0, &tokens, NULL), 0);
	ck_assert_msg(tokens == 1000, "tokens %.17g after %ld reserve+cancel pairs", tokens, sums[1]);

	ck_assert_int_eq(tokenbucket_redis_reset(cli, KEY("shared"), &lim, 0), 0);
	run_all(&lim, SEC / 2, true, false, sums, &elapsed);
	ck_assert_int_eq(sums[2], 0);
	ck_assert_int_gt(sums[1], 20);
	ck_assert_int_eq(tokenbucket_redis_tokens(cli, KEY("shared"), &lim, &tokens, NULL), 0);
	ck_assert_msg(tokens == 0, "tokens %.17g after %ld reserve+cancel pairs", tokens, sums[1]);
}
END_TEST

Suite *redis_concurrency_suite(void)
{
	Suite *s = suite_create("redis-concurrency");
	redis_tcase(s, "concurrency", redis_setup, 60,
		    (const TTest *const[]){ test_granted_bound, test_rate_zero_conserves, NULL });
	return s;
}
