/* SPDX-License-Identifier: MIT */
/*
 * tokenbucket_redis_wait: reserve on the shared bucket, then sleep on this
 * machine's CLOCK_MONOTONIC for the delay the server computed, so that the
 * clients' and the server's clocks never need to agree.
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <time.h>

#include "internal.h"

/* The longest one ppoll sleeps: a closed cancel_fd does not wake it. */
#define SLICE_NS INT64_C(50000000)

static int cancel_state(int fd)
{
	struct pollfd p = { .fd = fd, .events = POLLIN };
	int n = poll(&p, 1, 0);
	if (n < 0)
		return -errno;
	if (n > 0 && (p.revents & POLLNVAL))
		return -EBADF;
	return n > 0 ? -ECANCELED : 0;
}

/* Sleeps until target on CLOCK_MONOTONIC; signals do not shorten it. */
static int sleep_until(int64_t target, int fd)
{
	for (;;) {
		int64_t left = target - tokenbucket_now();
		if (left <= 0)
			return fd >= 0 ? cancel_state(fd) : 0;
		if (fd < 0) {
			struct timespec ts = { .tv_sec = target / 1000000000, .tv_nsec = target % 1000000000 };
			clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL);
			continue;
		}
		int64_t slice = left < SLICE_NS ? left : SLICE_NS;
		struct timespec ts = { .tv_sec = slice / 1000000000, .tv_nsec = slice % 1000000000 };
		struct pollfd p = { .fd = fd, .events = POLLIN };
		int n = ppoll(&p, 1, &ts, NULL);
		if (n < 0 && errno != EINTR)
			return -errno;
		if (n > 0)
			return (p.revents & POLLNVAL) ? -EBADF : -ECANCELED;
	}
}

int tokenbucket_redis_wait(struct tokenbucket_redis *r, const void *key, size_t keylen,
			   const struct tokenbucket_redis_limit *lim, uint64_t n, int64_t deadline,
			   int cancel_fd)
{
	if (r == NULL || lim == NULL)
		return -EINVAL;
	if (cancel_fd >= 0) {
		if (fcntl(cancel_fd, F_GETFD) < 0)
			return -EBADF;
		int err = cancel_state(cancel_fd);
		if (err != 0)
			return err;
	} else if (cancel_fd != -1) {
		return -EBADF;
	}
	int64_t start = tokenbucket_now();
	int64_t max_wait = TOKENBUCKET_NEVER;
	if (deadline != TOKENBUCKET_NEVER)
		max_wait = deadline > start ? deadline - start : -1;
	struct tokenbucket_reservation rv;
	struct tokenbucket_result res;
	int err = tokenbucket_redis_reserve(r, key, keylen, lim, n, max_wait, &rv, &res);
	if (err != 0)
		return err;
	int64_t delay = res.retry_after_ns;
	int64_t target = delay >= TOKENBUCKET_NEVER - start ? TOKENBUCKET_NEVER - 1 : start + delay;
	err = sleep_until(target, cancel_fd);
	if (err != 0)
		tokenbucket_redis_cancel(r, key, keylen, lim, &rv);
	return err;
}
