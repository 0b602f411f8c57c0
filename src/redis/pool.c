/* SPDX-License-Identifier: MIT */
/*
 * Connections: a server's address from its URL, a pool of idle blocking
 * hiredis connections per server, and one call's round trip.
 *
 * Thread safety: a caller takes an idle connection from the pool (or opens
 * one), uses it alone, and puts it back; the pool's mutex is held only to
 * pop and push.  So N threads use up to N connections at once and never
 * wait for each other's round trips.
 */
#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>

#include <hiredis/sds.h>

#include "pool.h"
#include "sleep.h"

/* Idle connections kept beyond this (per server) are closed. */
#define TBR__IDLE_MAX 64
/* While calls flow, how often a Sentinel client checks that its connections go to the primary named. */
#define TBR__CHECK_NS INT64_C(1000000000)

static int parse_db(const char *s, int *db)
{
	char *end;
	errno = 0;
	long v = strtol(s, &end, 10);
	if (errno != 0 || end == s || *end != '\0' || v < 0 || v > INT_MAX)
		return -EINVAL;
	*db = (int)v;
	return 0;
}

int tbr__node_parse(struct tbr__node *r, const char *url)
{
	r->port = 6379;
	if (strncmp(url, "redis-sentinel://", 17) == 0)
		return tbr__sentinel_parse(&r->sentinel, url + 17, &r->db);
	if (url[0] == '/' || strncmp(url, "unix:", 5) == 0) {
		const char *p = url[0] == '/' ? url : url + 5;
		while (p[0] == '/' && p[1] == '/')
			p++; /* unix:///path */
		if (p[0] != '/')
			return -EINVAL;
		r->path = strdup(p);
		if (r->path == NULL)
			return -ENOMEM;
		char *q = strstr(r->path, "?db=");
		if (q != NULL) {
			*q = '\0';
			return parse_db(q + 4, &r->db);
		}
		return 0;
	}
	if (strncmp(url, "redis://", 8) != 0)
		return -EINVAL;
	const char *h = url + 8;
	size_t hl = strcspn(h, ":/");
	if (hl == 0)
		return -EINVAL;
	r->host = strndup(h, hl);
	if (r->host == NULL)
		return -ENOMEM;
	const char *p = h + hl;
	if (*p == ':') {
		char *end;
		errno = 0;
		long port = strtol(p + 1, &end, 10);
		if (errno != 0 || end == p + 1 || port <= 0 || port > 65535 || (*end != '\0' && *end != '/'))
			return -EINVAL;
		r->port = (int)port;
		p = end;
	}
	if (*p == '/' && p[1] != '\0')
		return parse_db(p + 1, &r->db);
	return *p == '\0' || (p[0] == '/' && p[1] == '\0') ? 0 : -EINVAL;
}

void tbr__node_init(struct tbr__node *n)
{
	memset(n, 0, sizeof(*n));
	pthread_mutex_init(&n->lock, NULL);
}

static void conns_drop(struct tbr__conn *c)
{
	while (c != NULL) {
		struct tbr__conn *next = c->next;
		tbr__conn_drop(c);
		c = next;
	}
}

void tbr__node_flush(struct tbr__node *n)
{
	pthread_mutex_lock(&n->lock);
	struct tbr__conn *c = n->idle;
	n->idle = NULL;
	n->nidle = 0;
	pthread_mutex_unlock(&n->lock);
	conns_drop(c);
}

void tbr__node_fini(struct tbr__node *n)
{
	tbr__node_flush(n);
	pthread_mutex_destroy(&n->lock);
	free(n->host);
	free(n->path);
	free(n->primary_host);
	tbr__sentinel_free(n->sentinel);
	n->host = n->path = n->primary_host = NULL;
	n->sentinel = NULL;
}

/* ---- Connections --------------------------------------------------------- */

void tbr__conn_drop(struct tbr__conn *c)
{
	if (c == NULL)
		return;
	redisFree(c->c);
	free(c);
}

int tbr__conn_timeout(struct tbr__conn *c, int64_t ns)
{
	if (c->timeout_ns == ns)
		return 0;
	if (redisSetTimeout(c->c, tb__timeval_of(ns)) != REDIS_OK)
		return tbr__conn_errno(c->c);
	c->timeout_ns = ns;
	return 0;
}

/*
 * Bytes the reader holds past the last reply (hiredis reads what the socket
 * has, so a reply nobody asked for may arrive with the one that was), or
 * a reply begun: the next call would take them as its answer.
 */
static bool conn_unread(const struct tbr__conn *c)
{
	const redisReader *rd = c->c->reader;
	return rd == NULL || rd->pos < rd->len || rd->ridx >= 0 || c->bound.bad;
}

/* An idle connection with bytes or EOF waiting: its server closed it, or a reply nobody reads. */
static bool conn_spoiled(const struct tbr__conn *c)
{
	struct pollfd p = { .fd = c->c->fd, .events = POLLIN };
	return conn_unread(c) || poll(&p, 1, 0) != 0;
}

/*
 * Everything a new connection needs before its first call: the database
 * (SELECT).  Per-connection knowledge of the server, found once when the
 * connection is made, belongs here too, kept in struct tbr__conn.
 */
static int conn_setup(const struct tbr__node *n, struct tbr__conn *c)
{
	redisReply *rep = NULL;
	/* Any error (unknown command, no permission) means no module here. */
	int err = tbr__conn_command(c, 1, tbr__module_probe, &rep);
	if (err != 0)
		return err;
	c->module = tbr__module_speaks(rep);
	freeReplyObject(rep);
	c->function = false;
	if (!c->module) {
		/* The function library, loaded here if the server has functions but not it. */
		err = tbr__conn_command(c, 3, tbr__function_probe, &rep);
		if (err != 0)
			return err;
		int found = tbr__function_found(rep);
		freeReplyObject(rep);
		if (found == 0) {
			err = tbr__conn_command(c, 3, tbr__function_load, &rep);
			if (err != 0)
				return err;
			found = tbr__function_loaded(rep);
			freeReplyObject(rep);
		}
		c->function = found == 1;
	}
	if (n->sentinel != NULL) {
		/* What a sentinel named may have been demoted since: a replica refuses writes. */
		static const char *const role[] = { "ROLE" };
		err = tbr__conn_command(c, 1, role, &rep);
		if (err == 0) {
			err = rep->type == REDIS_REPLY_ERROR ? tbr__error(rep->str, rep->len)
			      : tbr__role_primary(rep) ? 0 : -EROFS;
			freeReplyObject(rep);
		}
	}
	if (err != 0 || n->db == 0)
		return err;
	char db[16];
	snprintf(db, sizeof(db), "%d", n->db);
	const char *const select[] = { "SELECT", db };
	err = tbr__conn_command(c, 2, select, &rep);
	if (err != 0)
		return err;
	err = rep->type == REDIS_REPLY_ERROR ? tbr__error(rep->str, rep->len) : 0;
	freeReplyObject(rep);
	return err;
}

/*
 * A Sentinel client's primary as the sentinels named it in answer to
 * question ask (from n->asks): a new one starts an epoch, and the idle
 * connections of the old one are closed (those in use are closed when they
 * come back).  An answer to a question older than the one that named the
 * primary changes nothing: its connection serves one call and is closed.
 * Returns the epoch of a connection made to host.
 */
static uint64_t primary_named(struct tbr__node *n, const char *host, int port, uint64_t ask)
{
	struct tbr__conn *old = NULL;
	char *copy = NULL;
	pthread_mutex_lock(&n->lock);
	bool same = n->primary_host != NULL && port == n->primary_port &&
		    strcmp(host, n->primary_host) == 0;
	if (!same && ask < n->named_by) {
		uint64_t stale = n->epoch - 1;
		pthread_mutex_unlock(&n->lock);
		return stale;
	}
	if (ask > n->named_by)
		n->named_by = ask;
	if (!same) {
		copy = strdup(host);
		if (copy != NULL) {
			/* Without memory for the name, every connection stays in this epoch. */
			free(n->primary_host);
			n->primary_host = copy;
			n->primary_port = port;
			n->epoch++;
			old = n->idle;
			n->idle = NULL;
			n->nidle = 0;
		}
	}
	uint64_t epoch = n->epoch;
	pthread_mutex_unlock(&n->lock);
	conns_drop(old);
	return epoch;
}

/*
 * While calls flow, at most every TBR__CHECK_NS, one call of a Sentinel
 * client asks the sentinel that answered last where the primary is (within
 * the connect and command timeouts): a primary demoted by SENTINEL
 * FAILOVER may go on taking writes, which the failover then discards,
 * until the sentinels reconfigure it.  A question that fails changes
 * nothing.
 */
static void sentinel_check(struct tbr__node *n, struct timeval connect_tv, int64_t timeout_ns)
{
	int64_t now = tokenbucket_now();
	int64_t last = atomic_load_explicit(&n->asked_at, memory_order_relaxed);
	if (now - last < TBR__CHECK_NS ||
	    !atomic_compare_exchange_strong_explicit(&n->asked_at, &last, now, memory_order_relaxed,
						     memory_order_relaxed))
		return;
	char *host = NULL;
	int port;
	uint64_t ask = atomic_fetch_add_explicit(&n->asks, 1, memory_order_relaxed) + 1;
	if (tbr__sentinel_ask_first(n->sentinel, connect_tv, timeout_ns, &host, &port) == 0)
		primary_named(n, host, port, ask);
	free(host);
}

/* A new connection to n, set up; 0 or a negative errno. */
static int conn_open(struct tbr__node *n, struct timeval connect_tv, int64_t timeout_ns,
		     int64_t deadline, struct tbr__conn **out)
{
	struct tbr__conn *c = calloc(1, sizeof(*c));
	if (c == NULL)
		return -ENOMEM;
	c->deadline = deadline;
	char *found = NULL;
	int port = n->port;
	if (n->sentinel != NULL) {
		/* Every new connection goes where the sentinels say the primary is now. */
		uint64_t ask = atomic_fetch_add_explicit(&n->asks, 1, memory_order_relaxed) + 1;
		atomic_store_explicit(&n->asked_at, tokenbucket_now(), memory_order_relaxed);
		int err = tbr__sentinel_primary(n->sentinel, connect_tv, timeout_ns, &found, &port);
		if (err != 0) {
			free(c);
			return err;
		}
		c->epoch = primary_named(n, found, port, ask);
	}
	/* The call's one deadline covers its connection attempt too. */
	int64_t left = deadline - tokenbucket_now();
	int64_t connect_ns = (int64_t)connect_tv.tv_sec * 1000000000 + (int64_t)connect_tv.tv_usec * 1000;
	if (left < connect_ns)
		connect_tv = tb__timeval_of(left > 1000 ? left : 1000);
	if (n->path != NULL)
		c->c = redisConnectUnixWithTimeout(n->path, connect_tv);
	else
		c->c = redisConnectWithTimeout(found != NULL ? found : n->host, port, connect_tv);
	free(found);
	int err = c->c == NULL || c->c->err ? tbr__conn_errno(c->c) : 0;
	if (err == 0)
		err = tbr__conn_timeout(c, timeout_ns);
	if (err == 0)
		err = conn_setup(n, c);
	if (err != 0) {
		tbr__conn_drop(c);
		return err;
	}
	*out = c;
	return 0;
}

int tbr__conn_get(struct tbr__node *n, struct timeval connect_tv, int64_t timeout_ns,
		  struct tbr__conn **out, bool *reused)
{
	int64_t deadline = tokenbucket_now() + timeout_ns;
	if (n->sentinel != NULL)
		sentinel_check(n, connect_tv, timeout_ns);
	for (;;) {
		pthread_mutex_lock(&n->lock);
		struct tbr__conn *c = n->idle;
		if (c != NULL) {
			n->idle = c->next;
			n->nidle--;
		}
		pthread_mutex_unlock(&n->lock);
		if (c == NULL)
			break;
		if (conn_spoiled(c)) {
			tbr__conn_drop(c);
			continue;
		}
		int err = tbr__conn_timeout(c, timeout_ns);
		if (err != 0) {
			tbr__conn_drop(c);
			return err;
		}
		if (reused != NULL)
			*reused = true;
		c->deadline = deadline;
		*out = c;
		return 0;
	}
	if (reused != NULL)
		*reused = false;
	return conn_open(n, connect_tv, timeout_ns, deadline, out);
}

void tbr__conn_put(struct tbr__node *n, struct tbr__conn *c)
{
	if (conn_unread(c)) {
		tbr__conn_drop(c);
		return;
	}
	pthread_mutex_lock(&n->lock);
	if (n->nidle < TBR__IDLE_MAX && c->epoch == n->epoch) {
		c->next = n->idle;
		n->idle = c;
		n->nidle++;
		c = NULL;
	}
	pthread_mutex_unlock(&n->lock);
	tbr__conn_drop(c);
}


/* Writes what c has buffered; 0, or the error of a write that failed. */
static int conn_flush(struct tbr__conn *c)
{
	int err = tbr__write_nosignal(c->c);
	return err < 0 ? tbr__conn_errno(c->c) : 0;
}


/* Reads one reply from c by c->deadline; 0 or the error of a read that failed. */
static int conn_read(struct tbr__conn *c, redisReply **rep)
{
	int r = tbr__read_by(c->c, &c->bound, c->deadline, &c->timeout_ns, rep);
	return r == 1 ? tbr__conn_errno(c->c) : r;
}

int tbr__conn_call(struct tbr__conn *c, const struct tokenbucket_redis_call *call, bool asking,
		   int mode, redisReply **rep, bool *unsent)
{
	struct tbr__args a;
	*unsent = false;
	bool module = tbr__use_module(mode, c->module);
	bool function = !module && c->function && mode != TOKENBUCKET_REDIS_MODULE_NEVER;
	int err = tbr__args(call, &a, module ? TBR__VIA_MODULE : function ? TBR__VIA_FUNCTION : TBR__VIA_SCRIPT);
	if (err != 0)
		return err;
	*rep = NULL;
	char buf[TBR__RESP_STACK], *heap;
	ssize_t n = tbr__resp(&a, buf, sizeof(buf), &heap);
	if (n < 0)
		return (int)n;
	bool appended = (!asking || redisAppendCommand(c->c, "ASKING") == REDIS_OK) &&
			redisAppendFormattedCommand(c->c, heap ? heap : buf, (size_t)n) == REDIS_OK;
	free(heap);
	if (!appended)
		return -ENOMEM;
	/* A write that fails leaves the call incomplete at the server: it did not run. */
	err = conn_flush(c);
	if (err != 0) {
		*unsent = true;
		return err;
	}
	if (asking) {
		redisReply *ok = NULL;
		err = conn_read(c, &ok);
		if (err != 0)
			return err;
		freeReplyObject(ok); /* +OK; an error here shows in the call's own reply */
	}
	err = conn_read(c, rep);
	if (err == 0 && module && mode == TOKENBUCKET_REDIS_MODULE_AUTO && tbr__unknown_command(*rep)) {
		/* The module was unloaded: it did not run; the script from now on. */
		freeReplyObject(*rep);
		*rep = NULL;
		c->module = false;
		return tbr__conn_call(c, call, asking, mode, rep, unsent);
	}
	if (err == 0 && function && tbr__function_found(*rep) == 0) {
		/*
		 * FUNCTION FLUSH, or a server without it: the call did not run.
		 * The library is loaded again for the next calls, and this one
		 * goes as the script, which decides alike.
		 */
		freeReplyObject(*rep);
		*rep = NULL;
		redisReply *r = NULL;
		err = tbr__conn_command(c, 3, tbr__function_load, &r);
		if (err != 0)
			return err;
		bool loaded = tbr__function_loaded(r);
		freeReplyObject(r);
		c->function = false;
		err = tbr__conn_call(c, call, asking, mode, rep, unsent);
		c->function = loaded;
	}
	return err;
}

int tbr__conn_command(struct tbr__conn *c, int argc, const char *const *argv, redisReply **rep)
{
	if (redisAppendCommandArgv(c->c, argc, (const char **)argv, NULL) != REDIS_OK)
		return -ENOMEM;
	redisReply *r = NULL;
	int err = conn_flush(c);
	if (err == 0)
		err = conn_read(c, &r);
	if (err != 0)
		return err;
	if (conn_unread(c)) {
		/* Two replies to one command: which is the answer is unknowable. */
		freeReplyObject(r);
		return -EPROTO;
	}
	*rep = r;
	return 0;
}
