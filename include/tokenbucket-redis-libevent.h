/* SPDX-License-Identifier: MIT */
/*
 * libtokenbucket-redis's asynchronous client on a libevent 2 event_base.
 * Header-only, so that libtokenbucket-redis itself never needs libevent:
 * a program that includes this links libevent itself (pkg-config
 * libevent).  Since libtokenbucket-redis 1.2.
 *
 *	struct tokenbucket_redis_async *a;
 *	tokenbucket_redis_libevent_open(&a, r, base);
 *	tokenbucket_redis_async_start(a, &call, done, arg);
 *	event_base_dispatch(base);
 *	tokenbucket_redis_async_close(a);
 *
 * Everything runs on the base's thread.  The base must outlive the client.
 */
#ifndef TOKENBUCKET_REDIS_LIBEVENT_H
#define TOKENBUCKET_REDIS_LIBEVENT_H

#include <stdlib.h>

#include <event2/event.h>
#include <event2/event_struct.h>

#include <tokenbucket-redis.h>

/* The adapter's own state and callbacks (tbr__libevent*): not part of the API. */

/* One descriptor the client watches (one per server it talks to). */
struct tbr__libevent_fd {
	struct tbr__libevent *s;
	struct event ev;
	int fd;
	int on;
};

struct tbr__libevent {
	struct event_base *base;
	struct tokenbucket_redis_async *a;
	struct event timer;
	struct tbr__libevent_fd **fds; /* each allocated once: libevent holds &ev */
	size_t nfds;
};

static void tbr__libevent_io(evutil_socket_t fd, short what, void *p)
{
	struct tbr__libevent_fd *f = (struct tbr__libevent_fd *)p;
	unsigned events = ((what & EV_READ) ? TOKENBUCKET_REDIS_READ : 0u) |
			  ((what & EV_WRITE) ? TOKENBUCKET_REDIS_WRITE : 0u);
	tokenbucket_redis_async_ready(f->s->a, (int)fd, events);
}

static void tbr__libevent_fire(evutil_socket_t fd, short what, void *p)
{
	(void)fd;
	(void)what;
	tokenbucket_redis_async_timeout(((struct tbr__libevent *)p)->a);
}

static void tbr__libevent_watch(void *p, int fd, unsigned events)
{
	struct tbr__libevent *s = (struct tbr__libevent *)p;
	struct tbr__libevent_fd *f = NULL, *idle = NULL;
	for (size_t i = 0; i < s->nfds && f == NULL; i++) {
		if (s->fds[i]->on && s->fds[i]->fd == fd)
			f = s->fds[i];
		else if (!s->fds[i]->on && idle == NULL)
			idle = s->fds[i];
	}
	if (f != NULL) {
		event_del(&f->ev);
		f->on = 0;
	}
	if (events == 0)
		return;
	if (f == NULL)
		f = idle;
	if (f == NULL) {
		struct tbr__libevent_fd **more =
			(struct tbr__libevent_fd **)realloc(s->fds, (s->nfds + 1) * sizeof(*more));
		if (more == NULL)
			return; /* unwatched, its calls end at the command timeout */
		s->fds = more;
		f = (struct tbr__libevent_fd *)calloc(1, sizeof(*f));
		if (f == NULL)
			return;
		f->s = s;
		s->fds[s->nfds++] = f;
	}
	short what = (short)(EV_PERSIST | ((events & TOKENBUCKET_REDIS_READ) ? EV_READ : 0) |
			     ((events & TOKENBUCKET_REDIS_WRITE) ? EV_WRITE : 0));
	event_assign(&f->ev, s->base, fd, what, tbr__libevent_io, f);
	event_add(&f->ev, NULL);
	f->on = 1;
	f->fd = fd;
}

static void tbr__libevent_timer(void *p, int64_t ns)
{
	struct tbr__libevent *s = (struct tbr__libevent *)p;
	evtimer_del(&s->timer);
	if (ns < 0)
		return;
	struct timeval tv = { (time_t)(ns / 1000000000), (suseconds_t)(ns % 1000000000 / 1000) };
	evtimer_add(&s->timer, &tv);
}

static void tbr__libevent_free(void *p)
{
	struct tbr__libevent *s = (struct tbr__libevent *)p;
	for (size_t i = 0; i < s->nfds; i++) {
		if (s->fds[i]->on)
			event_del(&s->fds[i]->ev);
		free(s->fds[i]);
	}
	free(s->fds);
	evtimer_del(&s->timer);
	free(s);
}

/*
 * An asynchronous client of r (see tokenbucket_redis_async_open) whose
 * descriptor and timer are events of base.  0, -EINVAL, -ENOMEM as
 * tokenbucket_redis_async_open.
 */
static inline int tokenbucket_redis_libevent_open(struct tokenbucket_redis_async **ap,
						  struct tokenbucket_redis *r,
						  struct event_base *base)
{
	if (ap == NULL || base == NULL)
		return -22; /* EINVAL, without <errno.h> in a header */
	struct tbr__libevent *s =
		(struct tbr__libevent *)calloc(1, sizeof(*s));
	if (s == NULL)
		return -12; /* ENOMEM */
	s->base = base;
	evtimer_assign(&s->timer, base, tbr__libevent_fire, s);
	struct tokenbucket_redis_loop loop = { s, tbr__libevent_watch,
					       tbr__libevent_timer,
					       tbr__libevent_free };
	int err = tokenbucket_redis_async_open(&s->a, r, &loop);
	if (err != 0) {
		free(s);
		return err;
	}
	*ap = s->a;
	return 0;
}

#endif
