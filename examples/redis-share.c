/* SPDX-License-Identifier: MIT */
/*
 * Two processes share one limit through Redis.
 *
 * usage: redis-share [URL]   (default redis://127.0.0.1:6379)
 *
 * Each process asks for a token as fast as it can for one second, on the
 * same key, against a limit of 100 tokens per second with a burst of 10.
 * Between them they get about 110, however the calls interleave; each alone
 * would have got as many.  Exits 0 when the total is within the limit.
 */
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <tokenbucket-redis.h>

static const struct tokenbucket_redis_limit limit = {
	.tokens = 100, .period_ns = 1000000000, .burst = 10,
};

/* One process: allow calls for a second; the granted count, or -1. */
static long run(const char *url, const char *key, int id)
{
	struct tokenbucket_redis *r;
	int err = tokenbucket_redis_open(&r, url, 1000000000, 1000000000);
	if (err != 0) {
		fprintf(stderr, "open %s: %s\n", url, strerror(-err));
		return -1;
	}
	long granted = 0, calls = 0;
	int64_t end = tokenbucket_now() + 1000000000;
	while (tokenbucket_now() < end) {
		struct tokenbucket_result res;
		err = tokenbucket_redis_allow(r, key, strlen(key), &limit, 1, &res);
		if (err != 0) {
			fprintf(stderr, "process %d: %s\n", id, strerror(-err));
			granted = -1;
			break;
		}
		calls++;
		granted += res.allowed;
	}
	if (granted >= 0)
		printf("process %d: %ld granted of %ld calls\n", id, granted, calls);
	tokenbucket_redis_close(r);
	return granted;
}

int main(int argc, char **argv)
{
	const char *url = argc > 1 ? argv[1] : "redis://127.0.0.1:6379";
	char key[64];
	snprintf(key, sizeof(key), "example:share:%ld", (long)getpid());
	int fds[2];
	if (pipe(fds) != 0)
		return EXIT_FAILURE;
	int64_t start = tokenbucket_now();
	for (int id = 0; id < 2; id++) {
		pid_t pid = fork();
		if (pid < 0)
			return EXIT_FAILURE;
		if (pid == 0) {
			long granted = run(url, key, id);
			fflush(stdout);
			_exit(write(fds[1], &granted, sizeof(granted)) == sizeof(granted) ? 0 : 1);
		}
	}
	long total = 0;
	bool ok = true;
	for (int id = 0; id < 2; id++) {
		long granted;
		wait(NULL);
		if (read(fds[0], &granted, sizeof(granted)) != sizeof(granted) || granted < 0)
			ok = false;
		else
			total += granted;
	}
	double seconds = (double)(tokenbucket_now() - start) / 1e9;
	/* The bucket runs on the server's clock, this span on ours: allow one
	 * token for the two disagreeing by a slew. */
	double most = 10 + 100 * seconds + 1;
	printf("together: %ld granted in %.2f s, at most %.0f allowed\n", total, seconds, most);
	return ok && total <= most ? EXIT_SUCCESS : EXIT_FAILURE;
}
