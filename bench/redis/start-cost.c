/* SPDX-License-Identifier: MIT */
/*
 * usage: tokenbucket-redis-start-cost URL
 *
 * The asynchronous client's cost of a start against the calls in flight:
 * for 10^2, 10^4 and 10^5 calls started outside any callback (one turn of
 * a libevent loop, nothing answered yet), the client CPU of 1000 more
 * starts, per start.  Then the loop answers them all.  Prints "in_flight
 * us_per_start errors" a row.  A start should cost the same on every row.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <event2/event.h>

#include <tokenbucket-redis-libevent.h>
#include <tokenbucket-redis.h>

#define MEASURED 1000

static long done_calls, errors;

static void on_done(void *arg, int err, const struct tokenbucket_result *res,
		    const struct tokenbucket_reservation *rv, double tokens)
{
	(void)arg;
	(void)res;
	(void)rv;
	(void)tokens;
	done_calls++;
	errors += err != 0;
}

static int64_t cpu_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

int main(int argc, char **argv)
{
	if (argc != 2) {
		fprintf(stderr, "usage: %s URL\n", argv[0]);
		return 2;
	}
	struct tokenbucket_redis *r;
	/* A timeout none of the rows reaches: a start's cost is measured, not the server's. */
	if (tokenbucket_redis_open(&r, argv[1], 1000000000, INT64_C(30000000000)) != 0) {
		fprintf(stderr, "cannot open %s\n", argv[1]);
		return 1;
	}
	struct event_base *base = event_base_new();
	struct tokenbucket_redis_async *a;
	if (base == NULL || tokenbucket_redis_libevent_open(&a, r, base) != 0)
		return 1;
	const struct tokenbucket_redis_limit lim = { .tokens = 1, .period_ns = 1000000, .burst = 100 };
	const struct tokenbucket_redis_call call = {
		.op = TOKENBUCKET_REDIS_ALLOW, .key = "start-cost", .keylen = 10, .limit = lim, .n = 1,
	};
	static const long rows[] = { 100, 10000, 100000 };
	for (size_t i = 0; i < sizeof(rows) / sizeof(rows[0]); i++) {
		done_calls = errors = 0;
		for (long k = 0; k < rows[i]; k++)
			if (tokenbucket_redis_async_start(a, &call, on_done, NULL) != 0)
				return 1;
		int64_t t0 = cpu_ns();
		for (int k = 0; k < MEASURED; k++)
			if (tokenbucket_redis_async_start(a, &call, on_done, NULL) != 0)
				return 1;
		int64_t t1 = cpu_ns();
		while (done_calls < rows[i] + MEASURED)
			event_base_loop(base, EVLOOP_ONCE);
		printf("%ld %.3f %ld\n", rows[i], (double)(t1 - t0) / MEASURED / 1e3, errors);
	}
	tokenbucket_redis_async_close(a);
	event_base_free(base);
	tokenbucket_redis_close(r);
	return 0;
}
