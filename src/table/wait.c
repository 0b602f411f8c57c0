/* SPDX-License-Identifier: MIT */
/*
 * 1.2: Go's WaitN on a key of a table, on the table's calls and the
 * sleeping path of tokenbucket_wait (sleep.h).  A reservation's
 * time_to_act is exact for the regime in force when it was made; a later
 * rate or burst change can make the tokens come later, and nothing wakes a
 * sleeper when it does, so after each sleep the ticket is checked again
 * (tbt_covered_at), as tokenbucket_wait does.
 */
#include <errno.h>

#include "core.h"
#include "sleep.h"
#include "table.h"

/*
 * A wait that fails takes nothing: the whole reservation goes back by the
 * refund rule, even when the failure is noticed after time_to_act (while
 * it sleeps on for tokens a rate change held back).
 */
static int give_back(struct tokenbucket_table *t, const void *key, size_t len,
		     struct tokenbucket_reservation *r, int err)
{
	(void)tokenbucket_table_refund(t, key, len, r->tokens);
	r->tokens = 0;
	return err;
}

/* Bounds of the pause between two checks of a reservation not yet covered. */
#define RECHECK_MIN_NS 1000000
#define RECHECK_MAX_NS 1000000000

int tokenbucket_table_wait(struct tokenbucket_table *t, const void *key, size_t len, uint64_t n,
			   int64_t deadline, int cancel_fd)
{
	if (t == NULL || (key == NULL && len != 0))
		return -EINVAL;
	int err = tb__cancel_check(cancel_fd);
	if (err)
		return err;
	int64_t now = tb__now();
	int64_t max_wait = tb__max_wait_until(deadline, now);
	struct tokenbucket_reservation r;
	err = tokenbucket_table_reserve_at(t, now, key, len, n, max_wait, &r);
	if (err)
		return err;
	for (;;) {
		/*
		 * time_to_act is on the key's clock, which calls with explicit
		 * times may have put ahead of CLOCK_MONOTONIC: past the
		 * deadline, the tokens are not there by it.
		 */
		if (r.time_to_act > deadline)
			return give_back(t, key, len, &r, -ETIMEDOUT);
		err = tb__sleep_until(r.time_to_act < 0 ? 0 : r.time_to_act, cancel_fd);
		now = tb__now();
		if (err) {
			/* Noticed once the tokens are there, a failure undoes nothing: they are taken. */
			if (now >= r.time_to_act && tbt_covered_at(t, now, key, len, r.ticket,
								   &(int64_t){0}) == 0)
				return 0;
			return give_back(t, key, len, &r, err);
		}
		int64_t pause = 0;
		int left = tbt_covered_at(t, now, key, len, r.ticket, &pause);
		if (left <= 0)
			return left; /* covered (0), or a corrupt table: the tokens stay taken */
		if (now >= deadline)
			return give_back(t, key, len, &r, -ETIMEDOUT);
		pause = pause < RECHECK_MIN_NS ? RECHECK_MIN_NS
			: pause > RECHECK_MAX_NS ? RECHECK_MAX_NS
						  : pause;
		r.time_to_act = pause >= deadline - now ? deadline : now + pause;
	}
}
