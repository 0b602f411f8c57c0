/* SPDX-License-Identifier: MIT */
/*
 * 1.2: Go's WaitN on a key of a table, on the table's public calls and the
 * sleeping path of tokenbucket_wait (sleep.h).  A table's rate never
 * changes, so a reservation's time_to_act is exact: one sleep suffices,
 * with no re-check of what a rate change could hold back.
 */
#include <errno.h>

#include "core.h"
#include "sleep.h"

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
	/*
	 * time_to_act is on the key's clock, which calls with explicit times
	 * may have put ahead of CLOCK_MONOTONIC: past the deadline, the
	 * tokens are not there by it.
	 */
	if (r.time_to_act > deadline) {
		tokenbucket_table_cancel_at(t, key, len, &r, now);
		return -ETIMEDOUT;
	}
	err = tb__sleep_until(r.time_to_act < 0 ? 0 : r.time_to_act, cancel_fd);
	if (err == 0)
		return 0;
	/* Noticed once the tokens are there, a failure undoes nothing: they are taken. */
	now = tb__now();
	if (now >= r.time_to_act)
		return 0;
	tokenbucket_table_cancel_at(t, key, len, &r, now);
	return err;
}
