/* SPDX-License-Identifier: MIT */
/*
 * The asynchronous engine's connections: which one an op goes on (opening
 * a spare beside busy ones), opening one and the replies to its setup
 * (the probes, SELECT, ROLE), the cluster's map asked for again, and a
 * Sentinel client's questions to the sentinels.  async.c's first comment
 * has the model.
 */
#include <errno.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "async_conn.h"

/* ---- Connections ---------------------------------------------------------- */

/*
 * c may carry calls: its setup is answered.  A spare waits for the last
 * of its setup's replies, so one its server closes at once never gets a
 * call.
 */
static void set_ready(struct conn *c)
{
	c->ready = true;
	c->spare = false;
}

/* FUNCTION LOAD's reply: the calls go as FCALL again if it worked. */
static void on_function_loaded(redisAsyncContext *ac, void *reply, void *privdata)
{
	struct conn *c = privdata;
	(void)ac;
	c->function_loading = false;
	c->function = reply != NULL && tbr__function_loaded(reply);
}

bool tbr__async_load_function(struct conn *c)
{
	if (c->function_loading)
		return true;
	if (redisAsyncCommandArgv(c->ac, on_function_loaded, c, 3, (const char **)tbr__function_load,
				  NULL) != REDIS_OK)
		return false;
	c->function_loading = true;
	return true;
}

/* A new connection to n, not open yet; NULL when out of memory. */
static struct conn *conn_new(struct tokenbucket_redis_async *a, struct tbr__node *n)
{
	if (a->nconns >= UINT32_MAX)
		return NULL;
	struct conn **more = realloc(a->conns, (a->nconns + 1) * sizeof(*more));
	if (more == NULL)
		return NULL;
	a->conns = more;
	struct conn *c = calloc(1, sizeof(*c));
	if (c == NULL)
		return NULL;
	c->a = a;
	c->node = n;
	c->fd = -1;
	c->index = (uint32_t)a->nconns;
	a->conns[a->nconns++] = c;
	return c;
}

/* How many connections per server the client may have now (1 to TOKENBUCKET_REDIS_CONNECTIONS_MAX). */
static unsigned connections(struct tokenbucket_redis_async *a)
{
	int k = a->connections != NULL ? atomic_load_explicit(a->connections, memory_order_relaxed) : 1;
	if (k <= 1)
		return 1;
	if (a->pins == NULL)
		a->pins = calloc(PINS, sizeof(*a->pins));
	return a->pins != NULL ? (unsigned)k : 1; /* no memory for pins: one, so order holds */
}

/*
 * The connection o goes on to reach n: the one its key's calls in flight
 * are on; else the ready one with the fewest calls in flight, a spare
 * opened beside it when every ready one is busy; else one being made or
 * closing (o waits for it), else a closed one (send_waiting opens it).
 * NULL when out of memory.
 */
struct conn *tbr__async_conn_of(struct tokenbucket_redis_async *a, const struct op *o,
			    struct tbr__node *n)
{
	unsigned k = connections(a);
	if (a->pins != NULL && a->pins[o->pin].count > 0) {
		struct conn *c = a->conns[a->pins[o->pin].conn];
		if (c->node == n && c->ac != NULL && !c->dying)
			return c;
	}
	struct conn *best = NULL, *making = NULL, *dying = NULL, *closed = NULL;
	unsigned live = 0;
	for (size_t i = 0; i < a->nconns; i++) {
		struct conn *c = a->conns[i];
		if (c->node != n)
			continue;
		if (c->ac == NULL) {
			closed = closed != NULL ? closed : c;
		} else if (c->dying) {
			dying = dying != NULL ? dying : c;
		} else {
			live++;
			if (!c->ready)
				making = making != NULL ? making : c;
			else if (best == NULL || c->inflight < best->inflight)
				best = c;
		}
	}
	if (best == NULL) {
		struct conn *c = making != NULL ? making : dying != NULL ? dying : closed;
		return c != NULL ? c : conn_new(a, n);
	}
	if (best->inflight > 0 && making == NULL && live < k) {
		int64_t now = tokenbucket_now();
		int64_t failed = atomic_load_explicit(&n->failed_at, memory_order_relaxed);
		if (now >= a->spare_after && (failed == 0 || now - failed >= SUSPECT_NS)) {
			struct conn *s = closed != NULL ? closed : conn_new(a, n);
			if (s != NULL && tbr__async_conn_open(s, true) != 0)
				a->spare_after = now + SUSPECT_NS;
		}
	}
	return best;
}

/*
 * Replies to the connection's setup.  Whether the server has the module
 * (any error means it has not): the calls sent before the answer go as
 * the script, which decides alike, rather than wait a round trip.
 */
static void on_probe(redisAsyncContext *ac, void *reply, void *privdata)
{
	struct conn *c = privdata;
	(void)ac;
	if (reply != NULL)
		c->module = tbr__module_speaks(reply);
}

/* The function library's probe (FCALL name 0): there, missing (loaded now), or no functions. */
static void on_function_probe(redisAsyncContext *ac, void *reply, void *privdata)
{
	struct conn *c = privdata;
	(void)ac;
	if (reply == NULL || c->dying)
		return;
	if (c->spare && c->node->db == 0 && c->a->sentinel == NULL)
		set_ready(c); /* the last of its setup */
	int found = tbr__function_found(reply);
	c->function = found == 1;
	if (found == 0 && !c->module) /* the module's reply came first */
		tbr__async_load_function(c);
}

/* SELECT, which the calls wait for. */

static void on_setup(redisAsyncContext *ac, void *reply, void *privdata)
{
	struct conn *c = privdata;
	if (reply == NULL)
		return; /* the connection is going: the waiting ops get a new one */
	const redisReply *rep = reply;
	if (rep->type == REDIS_REPLY_ERROR) {
		int err = tbr__error(rep->str, rep->len);
		for (struct op *o = c->a->whead; o != NULL; o = o->wnext)
			if (o->err == 0)
				o->err = err;
		c->dying = true;
		redisAsyncFree(ac); /* deferred by hiredis until this callback returns */
		return;
	}
	set_ready(c);
}

/*
 * ROLE, on a Sentinel client's connection: the server named may have been
 * demoted since.  A replica's connection closes, and the calls waiting
 * for it wait for the sentinels' next answer (-EROFS when none comes in
 * time); an error answer fails them as SELECT's does.
 */
static void on_role(redisAsyncContext *ac, void *reply, void *privdata)
{
	struct conn *c = privdata;
	if (reply == NULL)
		return;
	const redisReply *rep = reply;
	if (tbr__role_primary(rep)) {
		if (c->node->db == 0)
			set_ready(c); /* or when SELECT answers */
		return;
	}
	bool error = rep->type == REDIS_REPLY_ERROR;
	int err = error ? tbr__error(rep->str, rep->len) : -EROFS;
	for (struct op *o = c->a->whead; o != NULL; o = o->wnext) {
		if (o->err != 0)
			continue;
		if (error)
			o->err = err;
		else
			o->last_err = err;
	}
	c->dying = true;
	redisAsyncFree(ac); /* deferred by hiredis until this callback returns */
}

/* Where o goes now: an ASK target, its slot's primary, or the one server. */
struct tbr__node *tbr__async_target(struct tokenbucket_redis_async *a, const struct op *o)
{
	return o->to != NULL ? o->to
	       : a->cluster != NULL ? tbr__cluster_route(a->cluster, o->slot)
				    : a->node;
}

static void on_connect(const redisAsyncContext *ac, int status)
{
	struct conn *c = ac->data;
	if (status != REDIS_OK) {
		/* hiredis frees ac next, failing what was queued on it: none of it was written. */
		c->dying = true;
		c->unreached = true;
		struct tokenbucket_redis_async *a = c->a;
		if (c->spare)
			return; /* no call is on it; ev_cleanup holds the next spare back */
		/*
		 * The calls waiting for its setup were never queued on it: they
		 * fail as those queued would (a cluster's wait for a pause and a
		 * fresh map, a one-server client's fail now).
		 */
		int err = tbr__conn_errno(&ac->c);
		atomic_store_explicit(&c->node->failed_at, tokenbucket_now(), memory_order_relaxed);
		for (struct op *o = a->whead; o != NULL; o = o->wnext) {
			if (o->err != 0 || tbr__async_target(a, o) != c->node)
				continue;
			if (a->cluster != NULL) {
				tbr__cluster_set_stale(a->cluster);
				tbr__async_again(o, err, true);
			} else {
				o->err = err;
			}
		}
	}
}

static void on_disconnect(const redisAsyncContext *ac, int status)
{
	struct conn *c = ac->data;
	(void)status;
	c->dying = true;
}

/*
 * Opens c's connection (non-blocking), its setup queued; 0 or a negative
 * errno.  A spare goes beside a ready one: a Sentinel client's to the
 * address of the connections it has.
 */
int tbr__async_conn_open(struct conn *c, bool spare)
{
	const struct tbr__node *n = c->node;
	struct tokenbucket_redis_async *a = c->a;
	if (spare && a->sentinel != NULL && a->conn_host == NULL)
		return -EHOSTUNREACH;
	redisAsyncContext *ac = n->path != NULL ? redisAsyncConnectUnix(n->path)
				: a->sentinel != NULL && spare ? redisAsyncConnect(a->conn_host, a->conn_port)
				: a->sentinel != NULL ? redisAsyncConnect(a->primary_host, a->primary_port)
						      : redisAsyncConnect(n->host, n->port);
	if (a->sentinel != NULL && !spare) {
		/* An address serves one connection: the next one asks again. */
		free(a->conn_host);
		a->conn_host = a->primary_host;
		a->conn_port = a->primary_port;
		a->primary_host = NULL;
		a->check_after = tokenbucket_now() + CHECK_NS;
	}
	if (ac == NULL)
		return -ENOMEM;
	if (ac->err) {
		int err = tbr__conn_errno(&ac->c);
		redisAsyncFree(ac);
		return err;
	}
	tbr__async_conn_attach(c, ac);
	c->spare = spare;
	redisAsyncSetConnectCallback(ac, on_connect);
	redisAsyncSetDisconnectCallback(ac, on_disconnect);
	/* The replies to ROLE and SELECT come first (a spare's: all); meanwhile calls wait. */
	c->ready = n->db == 0 && a->sentinel == NULL && !spare;
	c->module = false;
	c->function = false;
	c->function_loading = false;
	if (redisAsyncCommandArgv(ac, on_probe, c, 1, (const char **)tbr__module_probe, NULL) != REDIS_OK ||
	    redisAsyncCommandArgv(ac, on_function_probe, c, 3, (const char **)tbr__function_probe, NULL) !=
		    REDIS_OK ||
	    (a->sentinel != NULL && redisAsyncCommand(ac, on_role, c, "ROLE") != REDIS_OK) ||
	    (n->db != 0 && redisAsyncCommand(ac, on_setup, c, "SELECT %d", n->db) != REDIS_OK)) {
		if (spare)
			tbr__async_conn_drop(c, -ENOMEM); /* no op is on it to drop it with a timeout */
		return -ENOMEM; /* ac stays: dropped with the ops' timeout */
	}
	/* Nothing is written before a command: watch for the connection to complete. */
	tbr__async_want(c, TOKENBUCKET_REDIS_WRITE, 0);
	return 0;
}

static void on_slots(redisAsyncContext *ac, void *reply, void *privdata)
{
	struct conn *c = privdata;
	(void)ac;
	c->a->refreshing = false;
	if (reply != NULL)
		tbr__cluster_map(c->a->cluster, c->node, reply); /* a bad map is not used */
}

/* Asks a ready node for the cluster's map when it is stale (at most every REFRESH_GAP_NS). */
void tbr__async_refresh(struct tokenbucket_redis_async *a, int64_t now)
{
	if (a->cluster == NULL || a->refreshing || !tbr__cluster_stale(a->cluster) ||
	    now - a->refreshed_at < REFRESH_GAP_NS)
		return;
	/*
	 * Only a connection that is up, to a node that has not failed in the
	 * last second: the map of a dead node's connection never comes.
	 */
	for (size_t i = 0; i < a->nconns; i++) {
		struct conn *c = a->conns[i];
		int64_t failed = atomic_load_explicit(&c->node->failed_at, memory_order_relaxed);
		if (c->ac != NULL && c->ready && !c->dying && (c->ac->c.flags & REDIS_CONNECTED) &&
		    (failed == 0 || now - failed >= SUSPECT_NS) &&
		    redisAsyncCommand(c->ac, on_slots, c, "CLUSTER SLOTS") == REDIS_OK) {
			a->refreshing = true;
			a->refreshed_at = now;
			return;
		}
	}
}

/* ---- Asking the sentinels ------------------------------------------------- */

static void on_master(redisAsyncContext *ac, void *reply, void *privdata)
{
	struct tokenbucket_redis_async *a = privdata;
	if (a->ask_got)
		return; /* timed out, or closing */
	a->ask_got = true;
	if (reply == NULL) {
		a->ask_result = tbr__conn_errno(&ac->c);
		return;
	}
	a->ask_result = tbr__sentinel_reply(reply, &a->found_host, &a->found_port);
	redisAsyncDisconnect(ac); /* done when this callback returns */
}

static void on_asker_connect(const redisAsyncContext *ac, int status)
{
	struct tokenbucket_redis_async *a = ((struct conn *)ac->data)->a;
	if (status != REDIS_OK && !a->ask_got) {
		a->ask_got = true;
		a->ask_result = tbr__conn_errno(&ac->c);
	}
}

/* Asks sentinel a->ask_i (non-blocking); a failure to start sets ask_result at once. */
static void ask_open(struct tokenbucket_redis_async *a, int64_t now)
{
	struct conn *c = &a->asker;
	const char *host;
	int port;
	tbr__sentinel_addr(a->sentinel, a->ask_i, &host, &port);
	a->ask_got = false;
	a->ask_deadline = now + a->timeout_ns;
	redisAsyncContext *ac = redisAsyncConnect(host, port);
	if (ac == NULL || ac->err) {
		a->ask_got = true;
		a->ask_result = tbr__conn_errno(ac != NULL ? &ac->c : NULL);
		if (ac != NULL)
			redisAsyncFree(ac);
		return;
	}
	tbr__async_conn_attach(c, ac);
	redisAsyncSetConnectCallback(ac, on_asker_connect);
	const char *argv[] = { "SENTINEL", "get-master-addr-by-name", tbr__sentinel_name(a->sentinel) };
	if (redisAsyncCommandArgv(ac, on_master, a, 3, argv, NULL) != REDIS_OK) {
		a->ask_got = true;
		a->ask_result = -ENOMEM;
		tbr__async_conn_drop(c, -ENOMEM);
		return;
	}
	tbr__async_want(c, TOKENBUCKET_REDIS_WRITE, 0);
}

/*
 * A check's answer (found_host): when the sentinels name another server
 * than the connections', they close once the calls sent on them are
 * answered, and the next one asks again.
 */
static void check_done(struct tokenbucket_redis_async *a)
{
	bool moved = a->conn_host == NULL || a->found_port != a->conn_port ||
		     strcmp(a->found_host, a->conn_host) != 0;
	free(a->found_host);
	a->found_host = NULL;
	for (size_t i = 0; moved && i < a->nconns; i++) {
		struct conn *c = a->conns[i];
		if (c->ac != NULL && !c->dying) {
			c->dying = true;
			redisAsyncDisconnect(c->ac); /* may free it now, when nothing is in flight */
		}
	}
}

/* A connection that carries calls now, or NULL. */
static const struct conn *any_ready(const struct tokenbucket_redis_async *a)
{
	for (size_t i = 0; i < a->nconns; i++)
		if (a->conns[i]->ac != NULL && a->conns[i]->ready && !a->conns[i]->dying)
			return a->conns[i];
	return NULL;
}

/*
 * Moves a round of questions on: takes the answer of the sentinel asked
 * (once its connection is gone), asks the next, ends the round with an
 * address or with the error of every op waiting; and starts a round when
 * ops wait for an address and the gap since the last has passed.
 */
void tbr__async_sentinel_step(struct tokenbucket_redis_async *a, int64_t now)
{
	size_t n = tbr__sentinel_count(a->sentinel);
	while (a->in_round && a->ask_got && a->asker.ac == NULL) {
		int r = a->ask_result;
		if (r == 0) {
			tbr__sentinel_answered(a->sentinel, a->ask_i);
			a->in_round = false;
			if (a->checking && !a->need_primary) {
				check_done(a);
				return;
			}
			free(a->primary_host);
			a->primary_host = a->found_host;
			a->primary_port = a->found_port;
			a->found_host = NULL;
			return;
		}
		if (r < 0)
			a->ask_last = r;
		else
			a->ask_named_none = true;
		if (++a->ask_tried == n) {
			/* A sentinel that answered without a primary says more than ones that did not answer. */
			int err = a->ask_named_none ? -EHOSTUNREACH : a->ask_last;
			/*
			 * Every op that waits fails: a pass over them, once a
			 * round, as each must be told.  Set from a start (every
			 * sentinel refused at once), the timer fires now for them.
			 */
			for (struct op *o = !a->checking ? a->whead : NULL; o != NULL; o = o->wnext)
				if (o->err == 0)
					o->err = err;
			if (!a->checking && a->whead != NULL)
				a->wait_at = INT64_MIN;
			a->in_round = false; /* a check that failed leaves the connection alone */
			return;
		}
		a->ask_i = (a->ask_i + 1) % n;
		ask_open(a, now);
	}
	bool check = !a->need_primary && any_ready(a) != NULL && a->head != NULL &&
		     now >= a->check_after;
	if (!a->in_round && (check || (a->need_primary && a->primary_host == NULL)) &&
	    now >= a->ask_after) {
		a->checking = check;
		if (check)
			a->check_after = now + CHECK_NS;
		a->in_round = true;
		a->ask_tried = 0;
		a->ask_named_none = false;
		a->ask_last = -EHOSTUNREACH;
		a->ask_i = tbr__sentinel_first(a->sentinel);
		a->ask_after = now + ASK_GAP_NS;
		ask_open(a, now);
		if (a->ask_got)
			tbr__async_sentinel_step(a, now); /* that one could not even be asked */
	}
}
