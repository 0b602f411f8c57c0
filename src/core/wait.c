/* SPDX-License-Identifier: MIT */
/*
 * The clock and the sleeping path.  tokenbucket_wait sleeps on
 * CLOCK_MONOTONIC towards an absolute time, resumes after signals, and
 * watches the cancel descriptor while it sleeps; it never busy-waits.
 */
#include <errno.h>

#include "rovers.h"
#include "sleep.h"

int64_t tokenbucket_now(void)
{
	return tb__now();
}

/* A wait that fails takes nothing: the whole reservation goes back, even
 * when the failure is noticed after time_to_act (while it sleeps on for
 * tokens that a rate change or ceil held back). */
static int give_back(struct tokenbucket *tb, struct tokenbucket_reservation *r, int err)
{
	struct tb__view v;
	int64_t at;
	if (tb__view_at_clock(tb, &v, &at))
		tb__give_back(tb, &v, at, r->tokens);
	r->tokens = 0;
	return err;
}

/* Bounds of the pause between two checks of a reservation not yet covered. */
#define RECHECK_MIN_NS 1000000
#define RECHECK_MAX_NS 1000000000

/*
 * Sleeps until the reservation is covered.  time_to_act is exact for the
 * rate in force when the tokens were reserved, but a later set_rate, or
 * ceil under TOKENBUCKET_CAPPED_RELEASE, can make the tokens come later, and
 * nothing wakes a sleeper when they do.  So after each sleep the ticket's
 * deficiency is checked, and while tokens are missing the wait sleeps again
 * for the time the rate needs for them (within RECHECK_MIN_NS and
 * RECHECK_MAX_NS), until the deadline.  A reservation not covered by then
 * is given back whole.
 */
static int sleep_until_covered(struct tokenbucket *tb, struct tokenbucket_reservation *r,
			       int64_t deadline, int cancel_fd)
{
	for (;;) {
		/*
		 * Never past the deadline: time_to_act is on the bucket's clock,
		 * which calls with explicit times (or a shared bucket's words)
		 * may have put ahead of CLOCK_MONOTONIC.  A target before 0 (a
		 * deadline long past) is 0, a time CLOCK_MONOTONIC has passed.
		 */
		int64_t target = r->time_to_act < deadline ? r->time_to_act : deadline;
		int err = tb__sleep_until(target < 0 ? 0 : target, cancel_fd);
		if (err)
			return give_back(tb, r, err);
		struct tb__view v;
		int64_t now;
		if (!tb__enter(tb, tb__now(), &v, &now, true))
			return give_back(tb, r, -EBADMSG);
		uint64_t missing = tokenbucket_deficiency(tb, r->ticket);
		if (missing == 0)
			return 0;
		if (now >= deadline)
			return give_back(tb, r, -ETIMEDOUT);
		int64_t pause = tokenbucket_duration_for(tb, missing);
		pause = pause < RECHECK_MIN_NS ? RECHECK_MIN_NS
			: pause > RECHECK_MAX_NS ? RECHECK_MAX_NS
						  : pause;
		r->time_to_act = pause >= deadline - now ? deadline : now + pause;
	}
}

int tokenbucket_wait(struct tokenbucket *tb, uint64_t n, int64_t deadline, int cancel_fd)
{
	if (tb == NULL)
		return -EINVAL;
	if (n > tokenbucket_burst(tb) && !tb__unlimited(tb))
		return -E2BIG;
	int cancel = tb__cancel_check(cancel_fd);
	if (cancel != 0)
		return cancel;
	int64_t now = tb__now();
	int64_t max_wait = tb__max_wait_until(deadline, now);
	struct tokenbucket_reservation r;
	int err = tokenbucket_reserve_at(tb, now, n, max_wait, &r);
	if (err)
		return err;
	return sleep_until_covered(tb, &r, deadline, cancel_fd);
}
