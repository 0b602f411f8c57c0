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
 * Calls started between two turns of the loop (from a uv_read_cb, a timer,
 * anywhere) are batched: the connection's poll handle is asked for
 * UV_WRITABLE once, and they go out together on the next turn.
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

/* The adapter's own state and callbacks (tbr__libuv*): not part of the API. */

/* One descriptor the client watches (one per connection it has). */
struct tbr__libuv_fd {
	uv_poll_t poll; /* first: the handle's address is this struct's */
	struct tbr__libuv *s;
	int fd;
};

struct tbr__libuv {
	uv_loop_t *loop;
	struct tokenbucket_redis_async *a;
	uv_timer_t timer; /* timer.data is this */
	struct tbr__libuv_fd **fds;
	size_t nfds;
};

static void tbr__libuv_io(uv_poll_t *h, int status, int what)
{
	struct tbr__libuv_fd *f = (struct tbr__libuv_fd *)h->data;
	/* An error on the descriptor: let the library read it and find out. */
	unsigned events = status < 0 ? (TOKENBUCKET_REDIS_READ | TOKENBUCKET_REDIS_WRITE)
		: ((what & UV_READABLE) ? TOKENBUCKET_REDIS_READ : 0u) |
		  ((what & UV_WRITABLE) ? TOKENBUCKET_REDIS_WRITE : 0u);
	tokenbucket_redis_async_ready(f->s->a, f->fd, events);
}

static void tbr__libuv_fire(uv_timer_t *t)
{
	tokenbucket_redis_async_timeout(((struct tbr__libuv *)t->data)->a);
}

static void tbr__libuv_closed(uv_handle_t *h)
{
	free(h->data);
}

/* Stops watching f (before the library closes its descriptor); freed once libuv lets go. */
static void tbr__libuv_release(struct tbr__libuv_fd *f)
{
	uv_poll_stop(&f->poll);
	uv_close((uv_handle_t *)&f->poll, tbr__libuv_closed);
}

static void tbr__libuv_watch(void *p, int fd, unsigned events)
{
	struct tbr__libuv *s = (struct tbr__libuv *)p;
	size_t i = 0;
	while (i < s->nfds && s->fds[i]->fd != fd)
		i++;
	if (events == 0) {
		if (i < s->nfds) {
			tbr__libuv_release(s->fds[i]);
			s->fds[i] = s->fds[--s->nfds];
		}
		return;
	}
	if (i == s->nfds) {
		struct tbr__libuv_fd **more =
			(struct tbr__libuv_fd **)realloc(s->fds, (s->nfds + 1) * sizeof(*more));
		if (more == NULL)
			return; /* unwatched, its calls end at the command timeout */
		s->fds = more;
		struct tbr__libuv_fd *f =
			(struct tbr__libuv_fd *)calloc(1, sizeof(*f));
		if (f == NULL)
			return;
		if (uv_poll_init(s->loop, &f->poll, fd) != 0) {
			free(f);
			return;
		}
		f->poll.data = f;
		f->s = s;
		f->fd = fd;
		s->fds[s->nfds++] = f;
	}
	int what = ((events & TOKENBUCKET_REDIS_READ) ? UV_READABLE : 0) |
		   ((events & TOKENBUCKET_REDIS_WRITE) ? UV_WRITABLE : 0);
	uv_poll_start(&s->fds[i]->poll, what, tbr__libuv_io);
}

static void tbr__libuv_timer(void *p, int64_t ns)
{
	struct tbr__libuv *s = (struct tbr__libuv *)p;
	uv_timer_stop(&s->timer);
	if (ns < 0)
		return;
	/* libuv counts milliseconds: rounded up, never early. */
	uv_timer_start(&s->timer, tbr__libuv_fire, (uint64_t)((ns + 999999) / 1000000), 0);
}

static void tbr__libuv_timer_closed(uv_handle_t *h)
{
	free(h->data);
}

static void tbr__libuv_free(void *p)
{
	struct tbr__libuv *s = (struct tbr__libuv *)p;
	for (size_t i = 0; i < s->nfds; i++)
		tbr__libuv_release(s->fds[i]);
	free(s->fds);
	uv_close((uv_handle_t *)&s->timer, tbr__libuv_timer_closed);
}

/*
 * An asynchronous client of r (see tokenbucket_redis_async_open) whose
 * descriptor and timer are handles of loop.  0, -EINVAL, -ENOMEM as
 * tokenbucket_redis_async_open.
 */
static inline int tokenbucket_redis_libuv_open(struct tokenbucket_redis_async **ap,
					       struct tokenbucket_redis *r, uv_loop_t *loop)
{
	if (ap == NULL || loop == NULL)
		return -22; /* EINVAL, without <errno.h> in a header */
	struct tbr__libuv *s = (struct tbr__libuv *)calloc(1, sizeof(*s));
	if (s == NULL)
		return -12; /* ENOMEM */
	s->loop = loop;
	uv_timer_init(loop, &s->timer);
	s->timer.data = s;
	struct tokenbucket_redis_loop l = { s, tbr__libuv_watch,
					    tbr__libuv_timer,
					    tbr__libuv_free };
	int err = tokenbucket_redis_async_open(&s->a, r, &l);
	if (err != 0) {
		uv_close((uv_handle_t *)&s->timer, tbr__libuv_timer_closed);
		return err;
	}
	*ap = s->a;
	return 0;
}

#endif
