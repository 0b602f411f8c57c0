/* SPDX-License-Identifier: MIT */
/*
 * libtokenbucket-redis's asynchronous client on a libuv loop.  Header-only,
 * so that libtokenbucket-redis itself never needs libuv: a program that
 * includes this links libuv itself (pkg-config libuv).  Since
 * libtokenbucket-redis 1.2.
 *
 *	struct tokenbucket_redis_async *a;
 *	tokenbucket_redis_libuv_open(&a, r, uv_default_loop());
 *	tokenbucket_redis_async_start(a, &call, done, arg);
 *	uv_run(uv_default_loop(), UV_RUN_DEFAULT);
 *	tokenbucket_redis_async_close(a);
 *
 * Everything runs on the loop's thread.  The loop must outlive the client;
 * after tokenbucket_redis_async_close its handles close on the loop's next
 * turn (uv_close), so run the loop once more before uv_loop_close.
 */
#ifndef TOKENBUCKET_REDIS_LIBUV_H
#define TOKENBUCKET_REDIS_LIBUV_H

#include <stdlib.h>

#include <uv.h>

#include <tokenbucket-redis.h>

struct tokenbucket_redis_libuv {
	uv_loop_t *loop;
	struct tokenbucket_redis_async *a;
	uv_timer_t timer;    /* timer.data is this */
	uv_poll_t *poll;     /* the connection's descriptor, or NULL */
	int fd;
};

static void tokenbucket_redis_libuv_io(uv_poll_t *h, int status, int what)
{
	struct tokenbucket_redis_libuv *s = (struct tokenbucket_redis_libuv *)h->data;
	/* An error on the descriptor: let the library read it and find out. */
	unsigned events = status < 0 ? (TOKENBUCKET_REDIS_READ | TOKENBUCKET_REDIS_WRITE)
		: ((what & UV_READABLE) ? TOKENBUCKET_REDIS_READ : 0u) |
		  ((what & UV_WRITABLE) ? TOKENBUCKET_REDIS_WRITE : 0u);
	tokenbucket_redis_async_ready(s->a, s->fd, events);
}

static void tokenbucket_redis_libuv_fire(uv_timer_t *t)
{
	tokenbucket_redis_async_timeout(((struct tokenbucket_redis_libuv *)t->data)->a);
}

static void tokenbucket_redis_libuv_closed(uv_handle_t *h)
{
	free(h);
}

static void tokenbucket_redis_libuv_watch(void *p, int fd, unsigned events)
{
	struct tokenbucket_redis_libuv *s = (struct tokenbucket_redis_libuv *)p;
	if (s->poll != NULL && (events == 0 || fd != s->fd)) {
		/* Stopped before the library closes the descriptor, freed once libuv lets go. */
		uv_poll_stop(s->poll);
		uv_close((uv_handle_t *)s->poll, tokenbucket_redis_libuv_closed);
		s->poll = NULL;
	}
	if (events == 0)
		return;
	if (s->poll == NULL) {
		s->poll = (uv_poll_t *)calloc(1, sizeof(*s->poll));
		if (s->poll == NULL || uv_poll_init(s->loop, s->poll, fd) != 0) {
			/* Unwatched, the connection's calls end at the command timeout. */
			free(s->poll);
			s->poll = NULL;
			return;
		}
		s->poll->data = s;
		s->fd = fd;
	}
	int what = ((events & TOKENBUCKET_REDIS_READ) ? UV_READABLE : 0) |
		   ((events & TOKENBUCKET_REDIS_WRITE) ? UV_WRITABLE : 0);
	uv_poll_start(s->poll, what, tokenbucket_redis_libuv_io);
}

static void tokenbucket_redis_libuv_timer(void *p, int64_t ns)
{
	struct tokenbucket_redis_libuv *s = (struct tokenbucket_redis_libuv *)p;
	uv_timer_stop(&s->timer);
	if (ns < 0)
		return;
	/* libuv counts milliseconds: rounded up, never early. */
	uv_timer_start(&s->timer, tokenbucket_redis_libuv_fire, (uint64_t)((ns + 999999) / 1000000), 0);
}

static void tokenbucket_redis_libuv_timer_closed(uv_handle_t *h)
{
	free(h->data);
}

static void tokenbucket_redis_libuv_free(void *p)
{
	struct tokenbucket_redis_libuv *s = (struct tokenbucket_redis_libuv *)p;
	if (s->poll != NULL) {
		uv_poll_stop(s->poll);
		uv_close((uv_handle_t *)s->poll, tokenbucket_redis_libuv_closed);
		s->poll = NULL;
	}
	uv_close((uv_handle_t *)&s->timer, tokenbucket_redis_libuv_timer_closed);
}

/*
 * An asynchronous client of r (see tokenbucket_redis_async_open) whose
 * descriptor and timer are handles of loop.  0, -EINVAL, -EOPNOTSUPP,
 * -ENOMEM as tokenbucket_redis_async_open.
 */
static inline int tokenbucket_redis_libuv_open(struct tokenbucket_redis_async **ap,
					       struct tokenbucket_redis *r, uv_loop_t *loop)
{
	if (ap == NULL || loop == NULL)
		return -22; /* EINVAL, without <errno.h> in a header */
	struct tokenbucket_redis_libuv *s = (struct tokenbucket_redis_libuv *)calloc(1, sizeof(*s));
	if (s == NULL)
		return -12; /* ENOMEM */
	s->loop = loop;
	s->fd = -1;
	uv_timer_init(loop, &s->timer);
	s->timer.data = s;
	struct tokenbucket_redis_loop l = { s, tokenbucket_redis_libuv_watch,
					    tokenbucket_redis_libuv_timer,
					    tokenbucket_redis_libuv_free };
	int err = tokenbucket_redis_async_open(&s->a, r, &l);
	if (err != 0) {
		uv_close((uv_handle_t *)&s->timer, tokenbucket_redis_libuv_timer_closed);
		return err;
	}
	*ap = s->a;
	return 0;
}

#endif
