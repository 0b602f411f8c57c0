/* SPDX-License-Identifier: MIT */
/*
 * SIGPIPE and the library's writes, and its blocking reads by a deadline.
 * Below the pool, Sentinel and the asynchronous client, which all write
 * to servers that may have gone.
 */
#ifndef TBR_SIGPIPE_H
#define TBR_SIGPIPE_H

#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <hiredis/hiredis.h>

#include "internal.h"

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
/*
 * Reads one reply from blocking c by deadline (tokenbucket_now()'s
 * clock).  hiredis bounds each read() by the socket timeout, not the
 * reply, so a reply trickled a byte at a time would take as long as the
 * server likes: each read here gets at most the time left.  *timeout_ns is
 * the socket timeout set on c, lowered (and updated) only when the time
 * left is shorter by more than 1 ms, so a reply that comes at once costs
 * no system call.  0 with *rep, -ETIME past the deadline, or 1: c failed
 * (c->err, and errno as the failed read left it).
 */
int tbr__read_by(redisContext *c, struct tbr__bound *b, int64_t deadline, int64_t *timeout_ns,
		redisReply **rep);

#endif
