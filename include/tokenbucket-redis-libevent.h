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

struct tokenbucket_redis_libevent {
	struct event_base *base;
	struct tokenbucket_redis_async *a;
	struct event io; /* the connection's descriptor, while io_on */
	struct event timer;
	int io_on;
	int fd;
};

static void tokenbucket_redis_libevent_io(evutil_socket_t fd, short what, void *p)
{
	struct tokenbucket_redis_libevent *s = (struct tokenbucket_redis_libevent *)p;
	unsigned events = ((what & EV_READ) ? TOKENBUCKET_REDIS_READ : 0u) |
			  ((what & EV_WRITE) ? TOKENBUCKET_REDIS_WRITE : 0u);
	tokenbucket_redis_async_ready(s->a, (int)fd, events);
}

static void tokenbucket_redis_libevent_fire(evutil_socket_t fd, short what, void *p)
{
	(void)fd;
	(void)what;
	tokenbucket_redis_async_timeout(((struct tokenbucket_redis_libevent *)p)->a);
}

static void tokenbucket_redis_libevent_watch(void *p, int fd, unsigned events)
{
	struct tokenbucket_redis_libevent *s = (struct tokenbucket_redis_libevent *)p;
	if (s->io_on) {
		event_del(&s->io);
		s->io_on = 0;
	}
	if (events == 0)
		return;
	short what = (short)(EV_PERSIST | ((events & TOKENBUCKET_REDIS_READ) ? EV_READ : 0) |
			     ((events & TOKENBUCKET_REDIS_WRITE) ? EV_WRITE : 0));
	event_assign(&s->io, s->base, fd, what, tokenbucket_redis_libevent_io, s);
	event_add(&s->io, NULL);
	s->io_on = 1;
	s->fd = fd;
}

static void tokenbucket_redis_libevent_timer(void *p, int64_t ns)
{
	struct tokenbucket_redis_libevent *s = (struct tokenbucket_redis_libevent *)p;
	evtimer_del(&s->timer);
	if (ns < 0)
		return;
	struct timeval tv = { (time_t)(ns / 1000000000), (suseconds_t)(ns % 1000000000 / 1000) };
	evtimer_add(&s->timer, &tv);
}

static void tokenbucket_redis_libevent_free(void *p)
{
	struct tokenbucket_redis_libevent *s = (struct tokenbucket_redis_libevent *)p;
	if (s->io_on)
		event_del(&s->io);
	evtimer_del(&s->timer);
	free(s);
}

/*
 * An asynchronous client of r (see tokenbucket_redis_async_open) whose
 * descriptor and timer are events of base.  0, -EINVAL, -EOPNOTSUPP,
 * -ENOMEM as tokenbucket_redis_async_open.
 */
static inline int tokenbucket_redis_libevent_open(struct tokenbucket_redis_async **ap,
						  struct tokenbucket_redis *r,
						  struct event_base *base)
{
	if (ap == NULL || base == NULL)
		return -22; /* EINVAL, without <errno.h> in a header */
	struct tokenbucket_redis_libevent *s =
		(struct tokenbucket_redis_libevent *)calloc(1, sizeof(*s));
	if (s == NULL)
		return -12; /* ENOMEM */
	s->base = base;
	s->fd = -1;
	evtimer_assign(&s->timer, base, tokenbucket_redis_libevent_fire, s);
	struct tokenbucket_redis_loop loop = { s, tokenbucket_redis_libevent_watch,
					       tokenbucket_redis_libevent_timer,
					       tokenbucket_redis_libevent_free };
	int err = tokenbucket_redis_async_open(&s->a, r, &loop);
	if (err != 0) {
		free(s);
		return err;
	}
	*ap = s->a;
	return 0;
}

#endif
