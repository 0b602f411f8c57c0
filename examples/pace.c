/* SPDX-License-Identifier: MIT */
/*
 * pace: both faces of libtokenbucket at work.
 *
 * 1. A dispatcher (the Seastar face): two workers grab tokens for each job,
 *    wait until their ticket is covered, dispatch, and release the tokens on
 *    completion; a timer thread replenishes the bucket every millisecond.
 * 2. A client (the Go face): requests paced with tokenbucket_wait, and a
 *    burst of tokenbucket_allow calls showing what is refused.
 *
 * Each part prints what it did, so the rate being kept is plain to see.
 */
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <tokenbucket.h>

#define MS 1000000LL

static double seconds_since(int64_t start)
{
	return (double)(tokenbucket_now() - start) / 1e9;
}

static void die(const char *what, int err)
{
	fprintf(stderr, "pace: %s: %s\n", what, strerror(-err));
	exit(1);
}

/* ---- The dispatcher ------------------------------------------------------ */

struct dispatcher {
	struct tokenbucket *tb;
	int jobs_per_worker;
	uint64_t cost;
	atomic_uint jobs_done;
	atomic_bool stop;
};

static void *worker(void *arg)
{
	struct dispatcher *d = arg;
	for (int i = 0; i < d->jobs_per_worker; i++) {
		uint64_t ticket = tokenbucket_grab(d->tb, d->cost);
		while (tokenbucket_deficiency(d->tb, ticket))
			sched_yield();
		/* dispatch() would run here; on completion the tokens flow back. */
		atomic_fetch_add(&d->jobs_done, 1);
		int err = tokenbucket_release(d->tb, d->cost);
		if (err)
			die("release", err);
	}
	return NULL;
}

static void *replenisher(void *arg)
{
	struct dispatcher *d = arg;
	const struct timespec tick = { 0, MS };
	while (!atomic_load(&d->stop)) {
		tokenbucket_replenish(d->tb, tokenbucket_now());
		nanosleep(&tick, NULL);
	}
	return NULL;
}

static void run_dispatcher(void)
{
	const double rate = 2000; /* tokens per second */
	const uint64_t burst = 100;
	struct dispatcher d = { .jobs_per_worker = 100, .cost = 10 };
	int err = tokenbucket_create(&d.tb, rate, burst, TOKENBUCKET_CAPPED_RELEASE);
	if (err)
		die("create", err);
	int64_t start = tokenbucket_now();
	tokenbucket_replenish(d.tb, start);

	pthread_t workers[2], timer;
	pthread_create(&timer, NULL, replenisher, &d);
	for (int i = 0; i < 2; i++)
		pthread_create(&workers[i], NULL, worker, &d);
	for (int i = 0; i < 2; i++)
		pthread_join(workers[i], NULL);
	double took = seconds_since(start);
	atomic_store(&d.stop, true);
	pthread_join(timer, NULL);

	unsigned jobs = atomic_load(&d.jobs_done);
	double tokens = (double)jobs * (double)d.cost;
	printf("dispatcher: %u jobs of %llu tokens in %.3f s\n", jobs, (unsigned long long)d.cost, took);
	printf("            %.0f tokens/s after the first burst of %llu (rate %.0f/s)\n",
	       (tokens - (double)burst) / took, (unsigned long long)burst, rate);
	tokenbucket_free(d.tb);
}

/* ---- The client ---------------------------------------------------------- */

static void run_client(void)
{
	const double rate = 50; /* requests per second */
	const uint64_t burst = 5;
	struct tokenbucket *tb;
	int err = tokenbucket_create(&tb, rate, burst, 0);
	if (err)
		die("create", err);

	int64_t start = tokenbucket_now();
	printf("client: %d requests paced with tokenbucket_wait at %.0f/s, burst %llu\n", 20, rate,
	       (unsigned long long)burst);
	for (int i = 1; i <= 20; i++) {
		err = tokenbucket_wait(tb, 1, TOKENBUCKET_NEVER, -1);
		if (err)
			die("wait", err);
		if (i <= 6 || i % 5 == 0)
			printf("  request %2d sent at %6.1f ms\n", i, seconds_since(start) * 1e3);
	}
	double took = seconds_since(start);
	printf("  20 requests in %.3f s: %.1f/s after the burst\n", took, (20 - (double)burst) / took);

	/* A deadline the bucket cannot meet is refused at once, taking nothing. */
	err = tokenbucket_wait(tb, 5, tokenbucket_now() + 10 * MS, -1);
	printf("  wait for 5 with a 10 ms deadline: %s\n", err ? strerror(-err) : "ok");

	/* allow() never waits: of 10 instant requests, only what the bucket holds pass. */
	int allowed = 0;
	for (int i = 0; i < 10; i++)
		allowed += tokenbucket_allow(tb, 1);
	printf("  10 instant requests with tokenbucket_allow: %d allowed, %d refused\n", allowed,
	       10 - allowed);
	tokenbucket_free(tb);
}

int main(void)
{
	printf("libtokenbucket %s\n", tokenbucket_version_string());
	run_dispatcher();
	run_client();
	return 0;
}
