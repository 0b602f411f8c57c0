/* SPDX-License-Identifier: MIT */
/*
 * Sleeping with a cancel descriptor, for tokenbucket_wait and
 * tokenbucket_redis_wait alike.  Header-only: libtokenbucket-redis sits
 * above the core and uses only its public functions, so it takes this
 * helper as source rather than as a private symbol of the core.  Needs
 * only libc; safe from any thread.
 */
#ifndef TOKENBUCKET_SLEEP_H
#define TOKENBUCKET_SLEEP_H

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdint.h>
#include <sys/time.h>
#include <time.h>

/*
 * The longest one ppoll sleeps.  Closing a descriptor does not wake a ppoll
 * that watches it, but the next ppoll reports it (POLLNVAL): sleeping in
 * slices notices a closed cancel descriptor within one slice.
 */
#define TB__CANCEL_SLICE_NS INT64_C(50000000)

static inline struct timespec tb__timespec_of(int64_t ns)
{
	return (struct timespec){ .tv_sec = ns / 1000000000, .tv_nsec = ns % 1000000000 };
}

/* ns >= 0 as a struct timeval, to the microsecond below (hiredis's timeouts). */
static inline struct timeval tb__timeval_of(int64_t ns)
{
	return (struct timeval){ .tv_sec = ns / 1000000000, .tv_usec = (ns % 1000000000) / 1000 };
}

/* 1 if fd is readable or hung up, 0 if not, or a negative errno (-EBADF when closed). */
static inline int tb__cancel_requested(int fd)
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
 * A wait's cancel descriptor before it starts: 0 (none, or not readable),
 * -EBADF (not -1 and not open), or -ECANCELED (readable or hung up).
 */
static inline int tb__cancel_check(int fd)
{
	if (fd == -1)
		return 0;
	if (fd < 0 || fcntl(fd, F_GETFD) == -1)
		return -EBADF;
	int ready = tb__cancel_requested(fd);
	return ready < 0 ? ready : ready > 0 ? -ECANCELED : 0;
}

/*
 * The max_wait a wait's reservation takes for an absolute deadline, at now:
 * -1 for a deadline already past, and TOKENBUCKET_NEVER - 1 for none (a
 * reservation that would never be covered is refused, not slept on).
 */
static inline int64_t tb__max_wait_until(int64_t deadline, int64_t now)
{
	return deadline == INT64_MAX ? INT64_MAX - 1 : deadline < now ? -1 : deadline - now;
}

/*
 * Sleeps until target_ns on CLOCK_MONOTONIC: 0, or a negative errno
 * (-ECANCELED when cancel_fd becomes readable or hangs up, -EBADF when it is
 * closed, or what the sleep itself failed with).  cancel_fd < 0: none, and
 * clock_nanosleep with TIMER_ABSTIME.  With one, ppoll for the time left but
 * at most TB__CANCEL_SLICE_NS, recomputed from the absolute target after
 * every wake-up, so that neither signals nor slices shorten or lengthen the
 * sleep.  It never busy-waits.
 */
static inline int tb__sleep_until(int64_t target_ns, int cancel_fd)
{
	struct timespec target = tb__timespec_of(target_ns);
	for (;;) {
		if (cancel_fd < 0) {
			int err = clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &target, NULL);
			if (err == EINTR)
				continue;
			return -err;
		}
		struct timespec now;
		clock_gettime(CLOCK_MONOTONIC, &now);
		int64_t left = target_ns - ((int64_t)now.tv_sec * 1000000000 + now.tv_nsec);
		if (left <= 0)
			return 0;
		struct timespec slice = tb__timespec_of(left < TB__CANCEL_SLICE_NS ? left
										 : TB__CANCEL_SLICE_NS);
		struct pollfd pfd = { .fd = cancel_fd, .events = POLLIN };
		int ready = ppoll(&pfd, 1, &slice, NULL);
		if (ready == 0 || (ready < 0 && errno == EINTR))
			continue;
		if (ready < 0)
			return -errno;
		return (pfd.revents & POLLNVAL) ? -EBADF : -ECANCELED;
	}
}

#endif
