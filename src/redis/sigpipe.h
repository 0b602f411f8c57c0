/* SPDX-License-Identifier: MIT */
/*
 * SIGPIPE and the library's writes.  Below the pool, Sentinel and the
 * asynchronous client, which all write to servers that may have gone.
 */
#ifndef TBR_SIGPIPE_H
#define TBR_SIGPIPE_H

#include <signal.h>
#include <stdbool.h>

#include <hiredis/hiredis.h>

/*
 * hiredis writes with write(2): a peer that went away would raise SIGPIPE
 * and kill the process.  The library blocks it in the calling thread around
 * its own I/O and discards one it caused, leaving the process's handlers
 * alone.
 */
struct tbr__sigpipe {
	sigset_t old;
	bool pending_before;
};

void tbr__sigpipe_block(struct tbr__sigpipe *s);
void tbr__sigpipe_restore(struct tbr__sigpipe *s);
/*
 * Writes c's buffered commands with send(MSG_NOSIGNAL), which raises no
 * SIGPIPE and so needs no signal mask set and restored around it (four
 * system calls a decision): the calls' hot path uses this, hiredis's own
 * writes (commands that write and read in one, at setup) stay within
 * tbr__sigpipe_block.  0 all written, 1 the rest would block (a
 * non-blocking c: it stays buffered), or -errno with c's error set as
 * hiredis sets it.
 */
int tbr__write_nosignal(redisContext *c);

#endif
