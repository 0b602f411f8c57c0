/* SPDX-License-Identifier: MIT */
/*
 * A rate-limit server on one libevent loop: every line a client sends
 * names a key, and the answer line is "allow", "deny" or "error N",
 * decided in Redis by the asynchronous client.  No thread waits for Redis:
 * thousands of requests can be in flight on one thread.
 *
 * usage: redis-gate [PORT [URL]]   (default 7070, redis://127.0.0.1:6379)
 *
 *	$ redis-gate 7070 &
 *	$ printf 'alice\nalice\nbob\n' | nc -q1 127.0.0.1 7070
 *
 * Each key may pass 5 times a second, 10 at once.  Listens on loopback.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/listener.h>

#include <tokenbucket-redis-libevent.h>

static const struct tokenbucket_redis_limit limit = {
	.tokens = 5, .period_ns = 1000000000, .burst = 10,
};

static struct tokenbucket_redis_async *gate;

/*
 * A connection: alive while its bufferevent is, or while answers are
 * owed.  Answers go out in the order the lines came, since the client
 * completes calls in the order they were started.
 */
struct conn {
	struct bufferevent *bev; /* NULL once the peer has gone */
	int owed;                /* calls started, not yet completed */
};

static void conn_release(struct conn *c)
{
	if (c->bev == NULL && c->owed == 0)
		free(c);
}

static void answered(void *arg, int err, const struct tokenbucket_result *res,
		     const struct tokenbucket_reservation *rv, double tokens)
{
	struct conn *c = arg;
	(void)rv;
	(void)tokens;
	c->owed--;
	if (c->bev != NULL) {
		if (err != 0)
			evbuffer_add_printf(bufferevent_get_output(c->bev), "error %d\n", -err);
		else
			evbuffer_add_printf(bufferevent_get_output(c->bev), "%s\n",
					    res->allowed ? "allow" : "deny");
	}
	conn_release(c);
}

/*
 * Every line starts a call.  Nothing to flush: the calls started in this
 * turn of the loop, from every connection's lines, go to Redis together
 * on the next.
 */
static void on_read(struct bufferevent *bev, void *arg)
{
	struct conn *c = arg;
	char *line;
	size_t len;
	while ((line = evbuffer_readln(bufferevent_get_input(bev), &len, EVBUFFER_EOL_CRLF)) != NULL) {
		struct tokenbucket_redis_call call = {
			.op = TOKENBUCKET_REDIS_ALLOW, .key = line, .keylen = len,
			.limit = limit, .n = 1,
		};
		int err = tokenbucket_redis_async_start(gate, &call, answered, c);
		if (err == 0)
			c->owed++;
		else
			evbuffer_add_printf(bufferevent_get_output(bev), "error %d\n", -err);
		free(line); /* the call copied the key */
	}
}

static void on_event(struct bufferevent *bev, short what, void *arg)
{
	struct conn *c = arg;
	if (what & (BEV_EVENT_EOF | BEV_EVENT_ERROR)) {
		bufferevent_free(bev);
		c->bev = NULL;
		conn_release(c);
	}
}

static void on_accept(struct evconnlistener *l, evutil_socket_t fd, struct sockaddr *sa, int len,
		      void *arg)
{
	(void)sa;
	(void)len;
	(void)arg;
	struct conn *c = calloc(1, sizeof(*c));
	struct bufferevent *bev = bufferevent_socket_new(evconnlistener_get_base(l), fd,
							 BEV_OPT_CLOSE_ON_FREE);
	if (c == NULL || bev == NULL) {
		free(c);
		if (bev != NULL)
			bufferevent_free(bev);
		else
			evutil_closesocket(fd);
		return;
	}
	c->bev = bev;
	bufferevent_setcb(bev, on_read, NULL, on_event, c);
	bufferevent_enable(bev, EV_READ | EV_WRITE);
}

static void on_signal(evutil_socket_t sig, short what, void *arg)
{
	(void)sig;
	(void)what;
	event_base_loopexit(arg, NULL);
}

int main(int argc, char **argv)
{
	int port = argc > 1 ? atoi(argv[1]) : 7070;
	const char *url = argc > 2 ? argv[2] : "redis://127.0.0.1:6379";
	if (port <= 0 || port > 65535) {
		fprintf(stderr, "usage: redis-gate [PORT [URL]]\n");
		return 2;
	}
	signal(SIGPIPE, SIG_IGN);
	struct event_base *base = event_base_new();
	struct tokenbucket_redis *r;
	int err = base == NULL ? -ENOMEM : tokenbucket_redis_open(&r, url, 0, 0);
	if (err == 0) {
		err = tokenbucket_redis_libevent_open(&gate, r, base);
		if (err != 0)
			tokenbucket_redis_close(r);
	}
	if (err != 0) {
		fprintf(stderr, "redis-gate: %s: %s\n", url, strerror(-err));
		return 1;
	}
	struct sockaddr_in sin = { .sin_family = AF_INET, .sin_port = htons((uint16_t)port),
				   .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	struct evconnlistener *l = evconnlistener_new_bind(
		base, on_accept, NULL, LEV_OPT_CLOSE_ON_FREE | LEV_OPT_REUSEABLE, -1,
		(struct sockaddr *)&sin, sizeof(sin));
	if (l == NULL) {
		fprintf(stderr, "redis-gate: port %d: %s\n", port, strerror(errno));
		return 1;
	}
	struct event *stop = evsignal_new(base, SIGINT, on_signal, base);
	struct event *term = evsignal_new(base, SIGTERM, on_signal, base);
	event_add(stop, NULL);
	event_add(term, NULL);
	event_base_dispatch(base);
	/* Answers still owed complete with ECANCELED; open connections are dropped. */
	evconnlistener_free(l);
	event_free(stop);
	event_free(term);
	tokenbucket_redis_async_close(gate);
	tokenbucket_redis_close(r);
	event_base_free(base);
	return 0;
}
