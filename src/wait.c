/* SPDX-License-Identifier: MIT */
/*
 * The clock and the sleeping path.  tokenbucket_wait sleeps on
 * CLOCK_MONOTONIC towards an absolute time, resumes after signals, and
 * watches the cancel descriptor while it sleeps; it never busy-waits.
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <time.h>

#include <bsd/sys/time.h>

#include "internal.h"

int64_t tokenbucket_now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static struct timespec timespec_of(int64_t ns)
{
	return (struct timespec){ .tv_sec = ns / 1000000000, .tv_nsec = ns % 1000000000 };
}

/* 1 if fd is readable or hung up, 0 if not, or a negative errno. */
static int cancel_requested(int fd)
{
	struct pollfd pfd = { .fd = fd, .events = POLLIN };
	int ready;
	do
		ready = poll(&pfd, 1, 0);
	while (ready < 0 && errno == EINTR);
	if (ready < 0)
		return -errno;
	if (pfd.revents & POLLNVAL)
		return -EBADF;
	return ready > 0;
}

/*
 * Sleeps until r->time_to_act.  Without a descriptor, clock_nanosleep with
 * TIMER_ABSTIME; with one, ppoll with the time left, recomputed from the
 * absolute target after every wake-up so that signals neither shorten nor
 * lengthen the wait.
 */
static int sleep_until(struct tokenbucket *tb, struct tokenbucket_reservation *r, int cancel_fd)
{
	struct timespec target = timespec_of(r->time_to_act);
	int err;
	for (;;) {
		if (cancel_fd < 0) {
			err = clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &target, NULL);
			if (err == 0)
				return 0;
			if (err == EINTR)
				continue;
			err = -err;
			break;
		}
		struct timespec now, left;
		clock_gettime(CLOCK_MONOTONIC, &now);
		if (!timespeccmp(&now, &target, <))
			return 0;
		timespecsub(&target, &now, &left);
		struct pollfd pfd = { .fd = cancel_fd, .events = POLLIN };
		int ready = ppoll(&pfd, 1, &left, NULL);
		if (ready == 0 || (ready < 0 && errno == EINTR))
			continue;
		if (ready < 0)
			err = -errno;
		else
			err = (pfd.revents & POLLNVAL) ? -EBADF : -ECANCELED;
		break;
	}
	tokenbucket_cancel_at(tb, r, tokenbucket_now());
	return err;
}

/* The shortest pause between two checks of a capped-release bucket. */
#define CAPPED_RECHECK_NS 1000000

/*
 * Sleeps until the reservation is covered.  time_to_act counts the rate
 * only; with TOKENBUCKET_CAPPED_RELEASE, ceil can hold head back for longer,
 * and tokenbucket_release() wakes no one.  So a capped bucket is checked
 * again after each sleep, sleeping at least CAPPED_RECHECK_NS or the time
 * the rate needs for what is missing, until the deadline.  A reservation
 * still not covered by then is given back whole.
 */
static int sleep_until_covered(struct tokenbucket *tb, struct tokenbucket_reservation *r,
			       int64_t deadline, int cancel_fd)
{
	for (;;) {
		int err = sleep_until(tb, r, cancel_fd);
		if (err || !(tb->flags & TOKENBUCKET_CAPPED_RELEASE))
			return err;
		int64_t now = tb__advance(tb, tokenbucket_now());
		uint64_t missing = tokenbucket_deficiency(tb, r->ticket);
		if (missing == 0)
			return 0;
		if (now >= deadline) {
			tb__give_back(tb, r->tokens);
			r->tokens = 0;
			return -ETIMEDOUT;
		}
		int64_t pause = tokenbucket_duration_for(tb, missing);
		if (pause < CAPPED_RECHECK_NS)
			pause = CAPPED_RECHECK_NS;
		/* Moving time_to_act keeps a cancel while sleeping in time to give back. */
		r->time_to_act = pause >= deadline - now ? deadline : now + pause;
	}
}

int tokenbucket_wait(struct tokenbucket *tb, uint64_t n, int64_t deadline, int cancel_fd)
{
	if (tb == NULL)
		return -EINVAL;
	if (n > tokenbucket_burst(tb) && !tb__unlimited(tb))
		return -E2BIG;
	if (cancel_fd != -1) {
		if (cancel_fd < 0 || fcntl(cancel_fd, F_GETFD) == -1)
			return -EBADF;
		int cancel = cancel_requested(cancel_fd);
		if (cancel)
			return cancel < 0 ? cancel : -ECANCELED;
	}
	int64_t now = tokenbucket_now();
	/* TOKENBUCKET_NEVER - 1 as the limit: a wait that never ends is refused. */
	int64_t max_wait = deadline == TOKENBUCKET_NEVER ? TOKENBUCKET_NEVER - 1
			   : deadline < now		  ? -1
							  : deadline - now;
	struct tokenbucket_reservation r;
	int err = tokenbucket_reserve_at(tb, now, n, max_wait, &r);
	if (err)
		return err;
	return sleep_until_covered(tb, &r, deadline, cancel_fd);
}
