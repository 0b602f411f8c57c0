/* SPDX-License-Identifier: MIT */
/*
 * usage: tokenbucket-redis-lease-bench URL MODE PROCS SECONDS [KEYS]
 *
 * PROCS processes, one deciding thread each, call allow(1) for SECONDS:
 *   local  on a local core bucket of each process's own (the floor);
 *   calls  on the key in Redis, a round trip per decision;
 *   lease  on the key through a lease (tokenbucket_redis_lease_*), so that
 *          the processes share one exact limit;
 *   reserve  the same through lease_reserve(1, max_wait 0), kept;
 *   wait   the same through lease_wait(1), at most 10 ms each;
 *   cold   on random keys out of KEYS (default 10^5) at 10 tokens/s, call
 *          by call;
 *   coldlease  the same while the client holds a lease on the hot key
 *          (what opting one key in costs the others; the hot key is
 *          untouched during the run).
 * The hot key makes 10^6 tokens/s, burst 10^5 (a lease's cap: 5000).
 * Prints "decisions granted cpu_ns_per_decision wall_ns" for the whole run:
 * the deciding threads' CPU time over their decisions, and the run's span
 * from the first start to the last end.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <tokenbucket-redis.h>

/* The hot key's limit, for the 1.0 calls and for the lease (1.2). */
#define HOT { .tokens = 1, .period_ns = 1000, .burst = 100000 }
static const struct tokenbucket_redis_limit hot = HOT;
static const struct tokenbucket_limit hot_limit = HOT;
static const struct tokenbucket_redis_limit cold = { .tokens = 10, .period_ns = 1000000000,
						     .burst = 10 };

static int64_t clock_ns(clockid_t id)
{
	struct timespec ts;
	clock_gettime(id, &ts);
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

struct tally {
	long decisions, granted;
	int64_t cpu_ns, first, last;
};

static int one(const char *url, const char *mode, int64_t run_ns, long keys, int64_t start,
	       struct tally *t)
{
	struct tokenbucket_redis *r = NULL;
	struct tokenbucket_redis_lease *l = NULL;
	struct tokenbucket *tb = NULL;
	bool is_local = strcmp(mode, "local") == 0, is_lease = strcmp(mode, "lease") == 0;
	bool is_reserve = strcmp(mode, "reserve") == 0, is_wait = strcmp(mode, "wait") == 0;
	bool is_cold = strncmp(mode, "cold", 4) == 0;
	bool cold_lease = strcmp(mode, "coldlease") == 0;
	if (is_local) {
		if (tokenbucket_create_every(&tb, hot.tokens, hot.period_ns, hot.burst, 0) != 0)
			return 2;
	} else {
		if (tokenbucket_redis_open(&r, url, 1000000000, 1000000000) != 0)
			return 2;
		if ((is_lease || is_reserve || is_wait || cold_lease) &&
		    tokenbucket_redis_lease_open(&l, r, "hot", 3, &hot_limit, 0.25, 5000000) != 0)
			return 2;
	}
	while (clock_ns(CLOCK_MONOTONIC) < start)
		usleep(1000);
	uint64_t seed = (uint64_t)getpid() * 0x9e3779b97f4a7c15u;
	t->first = clock_ns(CLOCK_MONOTONIC);
	int64_t cpu0 = clock_ns(CLOCK_THREAD_CPUTIME_ID);
	int64_t until = t->first + run_ns;
	char key[32];
	for (;;) {
		/* The clock every 256 decisions: a read costs as much as a local decision. */
		if ((t->decisions & 255) == 0 && clock_ns(CLOCK_MONOTONIC) >= until)
			break;
		bool ok = false;
		struct tokenbucket_result res;
		if (is_local) {
			ok = tokenbucket_allow(tb, 1);
		} else if (is_lease) {
			ok = tokenbucket_redis_lease_allow(l, 1, &res) == 0 && res.allowed;
		} else if (is_reserve) {
			/* Only what the lease holds (max_wait 0): kept, as an allow's grant. */
			struct tokenbucket_reservation rv;
			ok = tokenbucket_redis_lease_reserve(l, 1, 0, &rv) == 0;
		} else if (is_wait) {
			/* Sleeps for a refill when the lease is empty, at most 10 ms. */
			ok = tokenbucket_redis_lease_wait(l, 1, clock_ns(CLOCK_MONOTONIC) + 10000000,
							  -1) == 0;
		} else if (is_cold) {
			seed = seed * 6364136223846793005u + 1442695040888963407u;
			int n = snprintf(key, sizeof(key), "cold:%" PRIu64, (seed >> 33) % (uint64_t)keys);
			ok = tokenbucket_redis_allow(r, key, (size_t)n, &cold, 1, &res) == 0 && res.allowed;
		} else {
			ok = tokenbucket_redis_allow(r, "hot", 3, &hot, 1, &res) == 0 && res.allowed;
		}
		t->decisions++;
		t->granted += ok;
	}
	t->cpu_ns = clock_ns(CLOCK_THREAD_CPUTIME_ID) - cpu0;
	t->last = clock_ns(CLOCK_MONOTONIC);
	tokenbucket_redis_lease_close(l);
	tokenbucket_redis_close(r);
	tokenbucket_free(tb);
	return 0;
}

int main(int argc, char **argv)
{
	if (argc < 5 || argc > 6) {
		fprintf(stderr, "usage: %s URL local|calls|lease|reserve|wait|cold|coldlease PROCS SECONDS [KEYS]\n", argv[0]);
		return 2;
	}
	const char *url = argv[1], *mode = argv[2];
	int procs = atoi(argv[3]);
	int64_t run_ns = (int64_t)(atof(argv[4]) * 1e9);
	long keys = argc == 6 ? atol(argv[5]) : 100000;
	if (procs < 1 || procs > 64 || run_ns <= 0 || keys < 1)
		return 2;
	int fds[2];
	if (pipe(fds) != 0)
		return 1;
	/* Every process opens its client and lease first, then all start together. */
	int64_t start = clock_ns(CLOCK_MONOTONIC) + 300000000;
	for (int i = 0; i < procs; i++) {
		pid_t pid = fork();
		if (pid < 0)
			return 1;
		if (pid == 0) {
			close(fds[0]);
			struct tally t = { 0 };
			int err = one(url, mode, run_ns, keys, start, &t);
			_exit(err != 0 ? err : write(fds[1], &t, sizeof(t)) == sizeof(t) ? 0 : 3);
		}
	}
	close(fds[1]);
	struct tally sum = { .first = INT64_MAX, .last = INT64_MIN };
	int status = 0;
	for (int i = 0; i < procs; i++) {
		int st;
		if (wait(&st) < 0 || !WIFEXITED(st) || WEXITSTATUS(st) != 0)
			status = 1;
		struct tally t;
		if (read(fds[0], &t, sizeof(t)) != sizeof(t)) {
			status = 1;
			continue;
		}
		sum.decisions += t.decisions;
		sum.granted += t.granted;
		sum.cpu_ns += t.cpu_ns;
		sum.first = t.first < sum.first ? t.first : sum.first;
		sum.last = t.last > sum.last ? t.last : sum.last;
	}
	if (status != 0 || sum.decisions == 0)
		return 1;
	printf("%ld %ld %.2f %" PRId64 "\n", sum.decisions, sum.granted,
	       (double)sum.cpu_ns / (double)sum.decisions, sum.last - sum.first);
	return 0;
}
