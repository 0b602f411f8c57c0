/* SPDX-License-Identifier: MIT */
/*
 * A fake Redis server on loopback for the tests: a thread accepts
 * connections on a port the kernel chose, reads their commands with
 * hiredis's reader and writes whatever reply() makes of each, protocol
 * bytes that need not be well-formed (NULs included).
 */
#ifndef FAKE_H
#define FAKE_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>

#include <hiredis/hiredis.h>

struct fake_server {
	int listen_fd, port;
	pthread_t thread;
	atomic_bool stop;
	atomic_int accepted; /* connections accepted */
	/* Sent to each connection as it is accepted (NULL: nothing). */
	const char *greeting;
	size_t greeting_len;
	/* Closes each connection at its first command, unanswered. */
	bool hang_up;
	/* When > 0, replies are written a byte at a time, this many ns apart. */
	long trickle_ns;
	/* The reply to cmd (an array of strings) into out; its length. */
	size_t (*reply)(struct fake_server *s, redisReply *cmd, char *out, size_t size);
};

/* Binds s to a port (s->port) without serving yet: set the fields, then fake_server_run. */
void fake_server_bind(struct fake_server *s,
		      size_t (*reply)(struct fake_server *, redisReply *, char *, size_t));
void fake_server_run(struct fake_server *s);
void fake_server_stop(struct fake_server *s);

#endif
