/* SPDX-License-Identifier: MIT */
/* The asynchronous suites' two event loops: each adapter header's own entry point. */
#include <event2/event.h>
#include <stdlib.h>
#include <uv.h>

#include <tokenbucket-redis-libevent.h>
#include <tokenbucket-redis-libuv.h>

#include "check_redis.h"
#include "loops.h"

enum loop_kind kind;

void loop_kind_libevent(void)
{
	kind = LIBEVENT;
}

void loop_kind_libuv(void)
{
	kind = LIBUV;
}
static struct event_base *base;
static uv_loop_t uvloop;

void loop_init(void)
{
	if (kind == LIBEVENT) {
		base = event_base_new();
		ck_assert_ptr_nonnull(base);
	} else {
		ck_assert_int_eq(uv_loop_init(&uvloop), 0);
	}
}

struct tokenbucket_redis_async *async_open(struct tokenbucket_redis *r)
{
	struct tokenbucket_redis_async *a = NULL;
	int err = kind == LIBEVENT ? tokenbucket_redis_libevent_open(&a, r, base)
				   : tokenbucket_redis_libuv_open(&a, r, &uvloop);
	ck_assert_int_eq(err, 0);
	return a;
}

void loop_once(void)
{
	if (kind == LIBEVENT)
		event_base_loop(base, EVLOOP_ONCE);
	else
		uv_run(&uvloop, UV_RUN_ONCE);
}

void loop_poll(void)
{
	if (kind == LIBEVENT)
		event_base_loop(base, EVLOOP_NONBLOCK);
	else
		uv_run(&uvloop, UV_RUN_NOWAIT);
}

static void no_op(uv_timer_t *t)
{
	(void)t;
}

void loop_wait(int64_t ns)
{
	if (kind == LIBEVENT) {
		struct timeval tv = { .tv_sec = ns / 1000000000, .tv_usec = ns % 1000000000 / 1000 };
		event_base_loopexit(base, &tv);
		event_base_loop(base, EVLOOP_ONCE);
	} else {
		/* libuv's timers count whole milliseconds. */
		uv_timer_t t;
		ck_assert_int_eq(uv_timer_init(&uvloop, &t), 0);
		uv_timer_start(&t, no_op, (uint64_t)(ns + 999999) / 1000000, 0);
		uv_run(&uvloop, UV_RUN_ONCE);
		uv_close((uv_handle_t *)&t, NULL);
		uv_run(&uvloop, UV_RUN_NOWAIT);
	}
}

void loop_fini(void)
{
	if (kind == LIBEVENT) {
		event_base_free(base);
		base = NULL;
	} else {
		/* The adapter's handles close on the loop's next turn. */
		uv_run(&uvloop, UV_RUN_DEFAULT);
		ck_assert_int_eq(uv_loop_close(&uvloop), 0);
	}
}

int64_t multiplier(void)
{
	const char *s = getenv("CK_TIMEOUT_MULTIPLIER");
	return s != NULL && atoi(s) >= 1 ? atoi(s) : 1;
}
