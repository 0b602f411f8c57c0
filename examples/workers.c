/* SPDX-License-Identifier: MIT */
/*
 * workers: pre-forked processes sharing one limit through a named bucket.
 *
 * A server that forks N workers and gives each its own bucket lets N times
 * the intended rate through.  Here every worker opens the same named bucket
 * (the first creates it, the others attach), so that together they are held
 * to 200 requests per second, burst 20, however many there are.  Each worker
 * serves requests for one second with tokenbucket_allow and counts what it
 * let through; the parent adds the counts up.
 *
 * usage: workers [N]   (4 workers by default)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <tokenbucket.h>

#define NAME "/example-workers"
#define RATE 200.0
#define BURST 20

static void die(const char *what, int err)
{
	fprintf(stderr, "workers: %s: %s\n", what, strerror(-err));
	exit(1);
}

/* One worker: serves until end; returns how many requests it let through. */
static int worker(int id, int64_t end)
{
	struct tokenbucket *tb;
	unsigned status;
	int err = tokenbucket_open(&tb, NAME, RATE, BURST, 0, 0600, &status);
	if (err < 0)
		die("tokenbucket_open", err);
	if (status & TOKENBUCKET_OPEN_DIFFERS)
		fprintf(stderr, "worker %d: the bucket exists with another rate or burst; using it\n",
			id);
	int served = 0;
	while (tokenbucket_now() < end) {
		if (tokenbucket_allow(tb, 1))
			served++; /* serve the request */
		else
			usleep(1000); /* refuse it; the next one comes a little later */
	}
	printf("worker %d (pid %ld)%s: %d requests\n", id, (long)getpid(),
	       status & TOKENBUCKET_OPEN_CREATED ? " created the bucket" : "", served);
	tokenbucket_close(tb);
	fflush(stdout);
	return served;
}

int main(int argc, char **argv)
{
	int n = argc > 1 ? atoi(argv[1]) : 4;
	if (n < 1 || n > 64) {
		fprintf(stderr, "usage: workers [1..64]\n");
		return 2;
	}
	/* Start from a new bucket: one a previous run left would be attached to as it is. */
	tokenbucket_unlink(NAME);
	int fds[2];
	if (pipe(fds) < 0) {
		perror("pipe");
		return 1;
	}
	/* Everyone serves until the same moment, one second from now. */
	int64_t end = tokenbucket_now() + 1000000000;
	for (int i = 0; i < n; i++) {
		pid_t pid = fork();
		if (pid < 0) {
			perror("fork");
			return 1;
		}
		if (pid == 0) {
			close(fds[0]);
			int served = worker(i, end);
			if (write(fds[1], &served, sizeof(served)) != sizeof(served))
				_exit(1);
			_exit(0);
		}
	}
	close(fds[1]);
	int total = 0, served;
	while (read(fds[0], &served, sizeof(served)) == sizeof(served))
		total += served;
	while (wait(NULL) > 0)
		;
	printf("%d workers served %d requests in 1 s: at most %.0f per second + a burst of %d\n",
	       n, total, RATE, BURST);
	tokenbucket_unlink(NAME);
	return 0;
}
