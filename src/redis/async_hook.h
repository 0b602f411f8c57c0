/* SPDX-License-Identifier: MIT */
/*
 * A hook on an asynchronous engine's timer (async.h has its functions).
 * Apart from async.h so that the engine's lowest layer (async_queue.c),
 * which arms the timer for the hooks too, needs no more of it.
 */
#ifndef TOKENBUCKET_REDIS_ASYNC_HOOK_H
#define TOKENBUCKET_REDIS_ASYNC_HOOK_H

#include <stdbool.h>
#include <stdint.h>

/*
 * Something on an engine's loop with times of its own (a lease of the
 * asynchronous client, lease_async.c).  fire() runs from
 * tokenbucket_redis_async_timeout once tokenbucket_now() reaches due
 * (due is INT64_MAX again when it runs; it may set another, start calls
 * and add or remove hooks).  end() runs once, from the engine's close,
 * before the calls in flight are cancelled; the hook is removed then.
 * Loop thread only, like the engine.
 */
struct tbr__async_hook {
	int64_t due;
	void (*fire)(struct tbr__async_hook *h);
	void (*end)(struct tbr__async_hook *h);
	struct tbr__async_hook *prev, *next;
	bool pending; /* due in the _timeout running now */
};

#endif
