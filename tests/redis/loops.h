/* SPDX-License-Identifier: MIT */
/* The asynchronous suites' two event loops (libevent, libuv) behind one face. */
#ifndef LOOPS_H
#define LOOPS_H

#include <stdint.h>

#include <tokenbucket-redis.h>

enum loop_kind { LIBEVENT, LIBUV };

/* The loop of the running test: set by each suite's setup before loop_init. */
extern enum loop_kind kind;

/* Checked fixtures that set kind, added before a setup that needs it. */
void loop_kind_libevent(void);
void loop_kind_libuv(void);
void loop_init(void);
/* An asynchronous client of r on the loop (asserted to open). */
struct tokenbucket_redis_async *async_open(struct tokenbucket_redis *r);
/* One turn of the loop: waits for at least one event. */
void loop_once(void);
/* One turn of the loop that waits for nothing: what is ready runs. */
void loop_poll(void);
/* One turn of the loop that waits for an event at most ns (a server with nothing to do). */
void loop_wait(int64_t ns);
/* Frees the loop; its clients are closed first. */
void loop_fini(void);
/* Sanitizers and valgrind slow this process (not the servers) by up to this. */
int64_t multiplier(void);

#endif
