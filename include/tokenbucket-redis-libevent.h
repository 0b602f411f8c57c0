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
 * Calls started between two turns of the loop (from a bufferevent's read
 * callback, a timer, anywhere) are batched: the connection's write event
 * is added once, and they go out together on the next turn.
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

/*
 * One descriptor the client watches (one per connection it has).  Reading
 * and writing are two events: the write interest comes and goes with every
 * batch of calls, and so costs one epoll_ctl each way, not a delete and an
 * add of the descriptor.
 */
struct tbr__libevent_fd {
	struct tbr__libevent *s;
	struct event rd, wr;
	int fd;
	unsigned on; /* TOKENBUCKET_REDIS_READ and _WRITE: the events added */
	int bound;   /* rd and wr are assigned to fd; 0: free for another */
};

struct tbr__libevent {
	struct event_base *base;
	struct tokenbucket_redis_async *a;
	struct event timer;
	struct tbr__libevent_fd **fds; /* each allocated once: libevent holds &rd, &wr */
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

/* Adds or deletes ev as want says, on what tells whether it is added. */
static void tbr__libevent_set(struct event *ev, unsigned want, unsigned *on, unsigned bit)
{
	if ((want & bit) && !(*on & bit)) {
		if (event_add(ev, NULL) == 0)
			*on |= bit;
	} else if (!(want & bit) && (*on & bit)) {
		event_del(ev);
		*on &= ~bit;
	}
}

static void tbr__libevent_watch(void *p, int fd, unsigned events)
{
	struct tbr__libevent *s = (struct tbr__libevent *)p;
	struct tbr__libevent_fd *f = NULL, *idle = NULL;
	for (size_t i = 0; i < s->nfds && f == NULL; i++) {
		if (s->fds[i]->bound && s->fds[i]->fd == fd)
			f = s->fds[i];
		else if (!s->fds[i]->bound && idle == NULL)
			idle = s->fds[i];
	}
	if (f == NULL && events == 0)
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
	if (!f->bound) {
		event_assign(&f->rd, s->base, fd, EV_READ | EV_PERSIST, tbr__libevent_io, f);
		event_assign(&f->wr, s->base, fd, EV_WRITE | EV_PERSIST, tbr__libevent_io, f);
		f->fd = fd;
		f->on = 0;
		f->bound = 1;
	}
	tbr__libevent_set(&f->rd, events, &f->on, TOKENBUCKET_REDIS_READ);
	tbr__libevent_set(&f->wr, events, &f->on, TOKENBUCKET_REDIS_WRITE);
	/* Nothing watched: the client is done with fd, which may come back as another. */
	if (events == 0)
		f->bound = 0;
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
		if (s->fds[i]->on & TOKENBUCKET_REDIS_READ)
			event_del(&s->fds[i]->rd);
		if (s->fds[i]->on & TOKENBUCKET_REDIS_WRITE)
			event_del(&s->fds[i]->wr);
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
