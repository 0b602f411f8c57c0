/* SPDX-License-Identifier: MIT */
#ifndef TB_TEST_FORKED_H
#define TB_TEST_FORKED_H

#include <check.h>
#include <errno.h>
#include <string.h>

/*
 * The check of a fork()'s result.  A check that passes writes a mark to
 * Check's message file, which a child shares with its test: a child
 * SIGKILLed in that write (a kill can cut a write short) leaves the file
 * unreadable to the runner.  This one writes only when fork() failed.
 */
#define TBT_FORKED(pid)                                     \
	do {                                                \
		if ((pid) < 0)                              \
			ck_abort_msg("fork: %s", strerror(errno)); \
	} while (0)

#endif
