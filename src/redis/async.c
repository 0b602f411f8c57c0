/* SPDX-License-Identifier: MIT */
/*
 * The asynchronous client: calls pipelined on non-blocking hiredis
 * connections (up to `connections` per server: of a one-server client,
 * of each node of a cluster) that the caller's event loop drives through
 * struct tokenbucket_redis_loop (watch descriptors, arm one timer).
 *
 * A server's first connection is opened by its first call; another is
 * opened beside them only when a call finds every one ready and busy,
 * none being made, and goes on the ready one with the fewest calls in
 * flight.  On one connection the client and the server take turns (the
 * server idles while the client reads a frame of replies and writes the
 * next); on several their work overlaps.  A key's calls in flight
 * together stay on one connection (pins: a count per hash of the key), so
 * one key's calls are decided in the order they were started, as on one
 * connection.
 *
 * Every call started is an op in a list kept in start order; an op leaves
 * it only when its callback has run, so each callback runs exactly once.
 * An op not sent yet is also in a second list, of the waiting ops (in
 * start order too), until its connection is ready (connected, and set up
 * when it needs a SELECT first), or until a pause after CLUSTERDOWN or
 * TRYAGAIN ends; hiredis matches replies to the ops sent on a connection
 * in order.  Only the waiting ops are ever scanned, and a start outside
 * the library's frames tries its own op alone: a start costs the same
 * whatever is in flight.  Every op has the same timeout, so the list's
 * head has the earliest deadline, and the one timer is armed for it (or
 * for the end of the earliest pause).  When a sent op's deadline
 * passes, its connection is closed (a late reply must never be read as
 * another call's) and every op on it completes with -ETIME, as a blocking
 * call on a connection that timed out does.
 *
 * On a cluster an op goes to the primary of its key's slot, from the map
 * the blocking cluster client keeps (cluster.c); MOVED and ASK send it on,
 * CLUSTERDOWN, TRYAGAIN, LOADING and MASTERDOWN send it again after a
 * pause, a connection that could not be made is tried again, all within
 * the timeout, as tbr__cluster_exchange does.  A stale map is asked for
 * again (CLUSTER SLOTS) on a ready connection.
 *
 * A Sentinel client's one server has no fixed address: every connection
 * it opens goes where the sentinels say the primary is now.  The engine
 * asks them itself, without blocking: a round asks each sentinel in turn
 * (SENTINEL get-master-addr-by-name, on a connection of its own, within
 * the command timeout), starting with the one that answered last, while
 * the calls wait; the address found serves one connection, whose setup
 * checks with ROLE that it reached a primary.  A connection lost or timed
 * out, or one that answers READONLY (its server was demoted: the call did
 * not run and waits for the next connection, once), is followed by a new
 * round; rounds start at most every ASK_GAP_NS.  A round in which no
 * sentinel names a primary fails the calls that wait for it at once, with
 * the error the blocking client gives (-EHOSTUNREACH, or the last
 * sentinel's connection error), as does a primary named that cannot be
 * reached; a server named that is not a primary is asked about again
 * until the calls' timeout.  A primary demoted by SENTINEL FAILOVER may
 * go on taking writes, as a primary, until the sentinels reconfigure it,
 * and what it takes then is lost: so while calls flow, a round checks
 * every CHECK_NS that the sentinels still name the connection's server;
 * when they name another, the connection closes once the calls sent on it
 * are answered, and the next goes where they say.
 *
 * A several-limits decision (TOKENBUCKET_REDIS_ALLOW_ALL) is an op like
 * any other: its call is that of a struct tokenbucket_redis_call_all held
 * in the op, with the limits copied after it, so the codec, the routing
 * and the fallback treat it as the blocking allow_all's; only its
 * completion also copies the decision to the caller's res.
 *
 * Callbacks run from tokenbucket_redis_async_ready, _timeout and _close
 * only, never from _start.  They may start calls and close the client:
 * `depth` counts the library's frames on the stack, and a close asked for
 * within them is done when the outermost returns.
 *
 * Not thread-safe: one thread (the loop's) uses an async client.  What it
 * shares with the blocking client it was made from is safe to share: the
 * cluster map is atomic, the fallback has its own lock.
 *
 * This file has the interface, the sending of an op and the matching of
 * its reply; async_conn.c the connections and the sentinels; async_queue.c
 * the ops' lists, the loop's events and timer, and completion
 * (async_queue.h, async_conn.h).
 */
#include <errno.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "async.h"
#include "async_conn.h"
#include "slots.h"

#if HIREDIS_MAJOR < 1
/* Exported by hiredis 0.14 without a declaration in its headers (async.h has it from 1.0). */
void redisProcessCallbacks(redisAsyncContext *ac);
#endif

/* ---- Sending and replies -------------------------------------------------- */

static bool starts(const redisReply *rep, const char *prefix)
{
	size_t n = strlen(prefix);
	return rep->type == REDIS_REPLY_ERROR && rep->len >= n && memcmp(rep->str, prefix, n) == 0;
}

static void send_op(struct op *o, struct conn *c);

static int module_mode(const struct tokenbucket_redis_async *a)
{
	return a->module != NULL ? atomic_load_explicit(a->module, memory_order_relaxed)
				 : TOKENBUCKET_REDIS_MODULE_AUTO;
}

static void on_loaded(redisAsyncContext *ac, void *reply, void *privdata)
{
	struct conn *c = privdata;
	(void)ac;
	(void)reply; /* a load that failed leaves the calls to send the text themselves */
	c->loading = false;
}

/* A cluster's answer that says the call did not run here; true when o was sent on. */
static bool redirected(struct op *o, struct conn *c, const redisReply *rep)
{
	struct tokenbucket_redis_async *a = o->a;
	if (a->cluster == NULL || rep->type != REDIS_REPLY_ERROR)
		return false;
	struct tbr__node *to;
	bool ask;
	int r = tbr__cluster_redirect(a->cluster, c->node, rep, &to, &ask);
	if (r < 0 || (r == 0 && ++o->redirects > TBR__REDIRECTS_MAX)) {
		tbr__async_complete(o, r < 0 ? r : tbr__redirects_spent(o->unreached), NULL, NULL, 0);
		return true;
	}
	if (r == 0) {
		tbr__async_again(o, -ETIME, false);
		o->to = to;
		o->ask = ask;
		return true;
	}
	if (starts(rep, "TRYAGAIN") || starts(rep, "CLUSTERDOWN") || starts(rep, "LOADING") ||
	    starts(rep, "MASTERDOWN")) {
		/* Not run; the cluster is moving a slot, electing, or loading. */
		tbr__cluster_set_stale(a->cluster);
		if (starts(rep, "CLUSTERDOWN") && a->fallback != NULL &&
		    tbr__fallback_down_returns(a->fallback, &o->all.call))
			tbr__async_complete(o, -EAGAIN, NULL, NULL, 0); /* the fallback decides now */
		else
			tbr__async_again(o, -EAGAIN, true);
		return true;
	}
	return false;
}

/* o, answered that it did not run on c, sent on c again (after ASKING if it was). */
static void resend(struct op *o, struct conn *c)
{
	tbr__async_bind_op(o, NULL);
	if (o->asking && redisAsyncCommand(c->ac, NULL, NULL, "ASKING") != REDIS_OK)
		o->err = -ENOMEM;
	else
		send_op(o, c);
	if (o->conn == NULL)
		tbr__async_complete(o, o->err, NULL, NULL, 0);
}

static void on_reply(redisAsyncContext *ac, void *reply, void *privdata)
{
	struct op *o = privdata;
	struct conn *c = o->conn;
	if (reply == NULL) {
		/* hiredis is freeing the connection: every op on it ends the same way. */
		c->dying = true;
		if (c->drop_err == 0)
			atomic_store_explicit(&c->node->failed_at, tokenbucket_now(), memory_order_relaxed);
		if (c->unreached && c->drop_err == 0 && o->a->cluster != NULL) {
			/* Never written: the node refused; tried again after a pause. */
			tbr__cluster_set_stale(o->a->cluster);
			o->unreached = tbr__conn_errno(&ac->c);
			tbr__async_again(o, o->unreached, true);
			return;
		}
		tbr__async_complete(o, c->drop_err != 0 ? c->drop_err : tbr__conn_errno(&ac->c), NULL, NULL, 0);
		return;
	}
	struct tokenbucket_result res;
	struct tokenbucket_reservation rv;
	double tokens = 0;
	if (o->module && !c->dying && tbr__unknown_command(reply) &&
	    module_mode(o->a) == TOKENBUCKET_REDIS_MODULE_AUTO) {
		/* The module was unloaded: the call did not run; the script from now on. */
		c->module = false;
		resend(o, c);
		return;
	}
	if (o->function && !c->dying && tbr__function_found(reply) == 0) {
		/*
		 * FUNCTION FLUSH: the call did not run.  The library goes once
		 * more; meanwhile the calls go as the script, which decides alike.
		 */
		c->function = false;
		tbr__async_load_function(c);
		resend(o, c);
		return;
	}
	int err = tbr__decode(&o->all.call, reply, &res, &rv, &tokens);
	if (err == -ENOEXEC && !(o->all.call.flags & TOKENBUCKET_REDIS_EVAL) && !c->dying) {
		/*
		 * The server lost the script, and every call in flight will say
		 * so: the text goes once (SCRIPT LOAD), and they follow it by
		 * their SHA-1 again.  One that still finds no script sends the
		 * text itself.
		 */
		if (o->retried) {
			o->all.call.flags |= TOKENBUCKET_REDIS_EVAL;
		} else if (!c->loading &&
			   redisAsyncCommand(ac, on_loaded, c, "SCRIPT LOAD %s", tbr__script_text) ==
				   REDIS_OK) {
			c->loading = true;
		}
		o->retried = true;
		resend(o, c);
		return;
	}
	if (redirected(o, c, reply))
		return;
	if (err == -EROFS && o->a->sentinel != NULL && !o->demoted) {
		/*
		 * The primary was demoted (a failover): the call did not run.  It
		 * waits for the next connection, made where the sentinels say;
		 * this one closes once the calls sent on it are answered.
		 */
		o->demoted = true;
		tbr__async_again(o, -EROFS, false);
		if (!c->dying) {
			c->dying = true;
			redisAsyncDisconnect(ac);
		}
		return;
	}
	bool filled = err == 0 || err == -ETIMEDOUT || err == -E2BIG || err == -EOVERFLOW;
	tbr__async_complete(o, err, filled ? &res : NULL, filled ? &rv : NULL, tokens);
}

static void send_op(struct op *o, struct conn *c)
{
	struct tbr__args args;
	int mode = module_mode(o->a);
	o->module = tbr__use_module(mode, c->module);
	o->function = !o->module && c->function && mode != TOKENBUCKET_REDIS_MODULE_NEVER;
	int err = tbr__args(&o->all.call, &args,
			    o->module ? TBR__VIA_MODULE : o->function ? TBR__VIA_FUNCTION : TBR__VIA_SCRIPT);
	char buf[TBR__RESP_STACK], *heap = NULL;
	ssize_t n = err == 0 ? tbr__resp(&args, buf, sizeof(buf), &heap) : 0;
	if (n < 0)
		err = (int)n;
	if (err == 0 &&
	    redisAsyncFormattedCommand(c->ac, on_reply, o, heap ? heap : buf, (size_t)n) != REDIS_OK)
		err = -ENOMEM;
	free(heap);
	tbr__async_bind_op(o, err == 0 ? c : NULL);
	o->err = err;
}

/*
 * Sends every op that waits and may go, from `from` on (a->whead: all):
 * to its node's connection, opened if needed.  One that cannot be (no
 * memory, a connection refused on a one-server client) gets its error,
 * completed by settle().  A start outside the library's frames passes
 * its new op alone: the ops before it were tried by the last settle(),
 * and what lets them go (a connection ready, a map, an answer, a
 * sentinel's address) comes within frames, a pause's end from the timer.
 * On a Sentinel client the whole scan also finds whether any op still
 * waits for an address; the new op alone can only add that it does.
 */
static void send_waiting(struct tokenbucket_redis_async *a, struct op *from)
{
	int64_t now = tokenbucket_now();
	bool whole = from == a->whead;
	bool need = false;
	if (a->sentinel != NULL)
		tbr__async_sentinel_step(a, now);
	for (struct op *o = from, *next; o != NULL; o = next) {
		next = o->wnext; /* o leaves the list when sent */
		if (o->err != 0 || o->pause_until > now)
			continue;
		/* Its pause is over: it waits for its connection only (no timer, no scan at a start). */
		o->pause_until = 0;
		struct conn *c = tbr__async_conn_of(a, o, tbr__async_target(a, o));
		if (c == NULL) {
			o->err = -ENOMEM;
			continue;
		}
		if (c->ac == NULL && a->sentinel != NULL && a->primary_host == NULL) {
			need = true; /* waits for the sentinels' answer */
			continue;
		}
		if (c->ac == NULL) {
			int err = tbr__async_conn_open(c, false);
			if (err != 0 && a->cluster != NULL) {
				tbr__cluster_set_stale(a->cluster);
				o->to = NULL;
				o->unreached = err;
				tbr__async_again(o, err, true);
				continue;
			}
			if (err != 0) {
				o->err = err;
				continue;
			}
		}
		if (!c->ready || c->dying)
			continue;
		o->asking = o->to != NULL && o->ask;
		if (o->asking && redisAsyncCommand(c->ac, NULL, NULL, "ASKING") != REDIS_OK) {
			o->err = -ENOMEM;
			continue;
		}
		o->to = NULL;
		send_op(o, c);
	}
	if (a->sentinel != NULL) {
		if (whole) {
			/* An address nobody took may be stale by the next connection. */
			free(a->primary_host);
			a->primary_host = NULL;
			a->need_primary = need;
		} else {
			a->need_primary = a->need_primary || need;
		}
		tbr__async_sentinel_step(a, now);
	}
	tbr__async_refresh(a, now);
}

/* Tells the loop the write interest the frame ending has left (want_write). */
static void sync_all(struct tokenbucket_redis_async *a)
{
	for (size_t i = 0; i < a->nconns; i++)
		if (a->conns[i]->ac != NULL)
			tbr__async_sync_watch(a->conns[i]);
	if (a->asker.ac != NULL)
		tbr__async_sync_watch(&a->asker);
}

/*
 * After the library's work on the connections: completes the ops that
 * failed before they were sent, sends what waits, writes what may go, and
 * arms the timer.
 */

static void settle(struct tokenbucket_redis_async *a)
{
	unsigned long seen;
	do {
		/* A callback may start calls (appended, visited too) but ends none but its own. */
		for (struct op *o = a->whead, *next; o != NULL; o = next) {
			next = o->wnext;
			if (o->err != 0)
				tbr__async_complete(o, o->err, NULL, NULL, 0);
		}
		if (a->closing)
			return;
		send_waiting(a, a->whead);
		seen = a->completed;
		for (size_t i = 0; i < a->nconns; i++)
			tbr__async_conn_flush(a->conns[i]);
		/* A write that failed closed its connection and ran callbacks, which may start calls. */
	} while (a->completed != seen);
	sync_all(a);
	tbr__async_arm(a);
}

/* ---- The interface -------------------------------------------------------- */

int tbr__async_open(struct tokenbucket_redis_async **ap, const struct tbr__async_config *cfg,
		    const struct tokenbucket_redis_loop *loop)
{
	if (ap == NULL || cfg == NULL || loop == NULL || loop->watch == NULL || loop->timer == NULL)
		return -EINVAL;
	struct tokenbucket_redis_async *a = calloc(1, sizeof(*a));
	if (a == NULL)
		return -ENOMEM;
	if (cfg->prefixlen > 0) {
		a->prefix = malloc(cfg->prefixlen);
		if (a->prefix == NULL) {
			free(a);
			return -ENOMEM;
		}
		memcpy(a->prefix, cfg->prefix, cfg->prefixlen);
		a->prefixlen = cfg->prefixlen;
	}
	a->loop = *loop;
	a->node = cfg->node;
	a->cluster = cfg->cluster;
	a->timeout_ns = cfg->timeout_ns;
	a->fallback = cfg->fallback;
	a->module = cfg->module;
	a->connections = cfg->connections;
	a->timer_at = INT64_MAX;
	a->wait_at = a->pause_at = INT64_MAX;
	a->refreshed_at = INT64_MIN / 2;
	a->sentinel = cfg->cluster == NULL ? cfg->node->sentinel : NULL;
	a->asker.a = a;
	a->asker.fd = -1;
	*ap = a;
	return 0;
}

static void close_now(struct tokenbucket_redis_async *a)
{
	a->depth++;
	while (a->hooks != NULL) {
		struct tbr__async_hook *h = a->hooks;
		tbr__async_hook_remove(a, h);
		if (!a->forgetting)
			h->end(h);
	}
	for (size_t i = 0; i < a->nconns; i++)
		tbr__async_conn_drop(a->conns[i], -ECANCELED);
	a->ask_got = true; /* on_master ignores the drop */
	tbr__async_conn_drop(&a->asker, -ECANCELED);
	while (a->head != NULL)
		tbr__async_complete(a->head, -ECANCELED, NULL, NULL, 0);
	a->depth--;
	if (a->timer_at != INT64_MAX)
		a->loop.timer(a->loop.data, -1);
	if (a->loop.free != NULL)
		a->loop.free(a->loop.data);
	for (size_t i = 0; i < a->nconns; i++)
		free(a->conns[i]);
	free(a->conns);
	free(a->pins);
	free(a->primary_host);
	free(a->conn_host);
	free(a->found_host);
	free(a->prefix);
	free(a);
}

/* Leaves one of the library's frames; the last one out does a close asked for within. */
static void leave(struct tokenbucket_redis_async *a)
{
	if (--a->depth == 0 && a->closing)
		close_now(a);
}

void tokenbucket_redis_async_close(struct tokenbucket_redis_async *a)
{
	if (a == NULL)
		return;
	if (a->depth > 0) {
		a->closing = true;
		return;
	}
	close_now(a);
}

void tbr__async_forget(struct tokenbucket_redis_async *a)
{
	if (a == NULL)
		return;
	a->forgetting = true;
	close_now(a);
}

/* The pin of a key: FNV-1a, its low bits (the pins need spread, not secrecy). */
static uint32_t pin_of(const char *key, size_t len)
{
	uint32_t h = 2166136261u;
	for (size_t i = 0; i < len; i++)
		h = (h ^ (unsigned char)key[i]) * 16777619u;
	return (h ^ h >> 16) & (PINS - 1);
}

/*
 * Starts call (its limits and count for an allow_all, whose decision also
 * goes to set_to) with its completion; the checks of the public entry
 * point are done.
 */
static int start(struct tokenbucket_redis_async *a, const struct tokenbucket_redis_call *call,
		 const struct tokenbucket_limit *limits, size_t count,
		 struct tokenbucket_set_result *set_to, tokenbucket_redis_done_fn *done, void *arg)
{
	if (a->closing)
		return -ECANCELED;
	struct op *o = calloc(1, sizeof(*o) + count * sizeof(o->limits[0]));
	if (o == NULL)
		return -ENOMEM;
	size_t keylen;
	int err = tbr__key_join(a->prefix, a->prefixlen, call->key, call->keylen, &o->key, &keylen);
	if (err != 0) {
		free(o);
		return err;
	}
	o->a = a;
	o->all.call = (struct tokenbucket_redis_call){
		.op = call->op, .flags = call->flags, .key = o->key, .keylen = keylen,
		.limit = call->limit, .now = call->now, .n = call->n, .arg = call->arg,
	};
	if (count > 0)
		memcpy(o->limits, limits, count * sizeof(o->limits[0]));
	o->all.limits = o->limits;
	o->all.count = count;
	o->all.res = &o->set_res;
	struct tbr__args check;
	err = tbr__args(&o->all.call, &check, false);
	if (err != 0) {
		free(o->key);
		free(o);
		return err;
	}
	o->done = done;
	o->set_to = set_to;
	o->arg = arg;
	/* Its node's slot, for a cluster's routing only (CRC16 of the key). */
	o->slot = a->cluster != NULL ? tbr__slot(o->key, keylen) : 0;
	o->pin = pin_of(o->key, keylen);
	o->last_err = -ETIME;
	o->deadline = tokenbucket_now() + a->timeout_ns;
	o->seq = a->seq++;
	o->prev = a->tail;
	if (a->tail != NULL)
		a->tail->next = o;
	else
		a->head = o;
	a->tail = o;
	tbr__async_wait_link(a, o); /* the youngest: at the tail, at once */
	if (a->depth > 0)
		return 0; /* within a callback: settle() sends it on the way out */
	a->depth++;
	/*
	 * O(1) whatever is in flight: only o is tried (send_waiting), and
	 * only o is added to the timer's scan.  All are tried when an op
	 * before o may go now (its pause ended) or has failed, so one key's
	 * calls keep their order.  Errors are completed from the timer,
	 * never from here.
	 */
	bool all = a->whead != o && a->pause_at <= tokenbucket_now();
	send_waiting(a, all ? a->whead : o);
	sync_all(a);
	if (all)
		tbr__async_arm(a);
	else
		tbr__async_arm_from(a, o->conn == NULL ? o : NULL); /* o is the youngest: the last that waits */
	leave(a);
	return 0;
}

int tbr__async_start_call(struct tokenbucket_redis_async *a, const struct tokenbucket_redis_call *call,
			  tokenbucket_redis_done_fn *done, void *arg)
{
	if ((unsigned)call->op > TOKENBUCKET_REDIS_ALLOW_ALL)
		return -EINVAL;
	if (call->op != TOKENBUCKET_REDIS_ALLOW_ALL)
		return start(a, call, NULL, 0, NULL, done, arg);
	const struct tokenbucket_redis_call_all *all = tbr__call_all_of(call);
	if (all->limits == NULL || all->count == 0 || all->count > TOKENBUCKET_SET_MAX)
		return -EINVAL;
	return start(a, call, all->limits, all->count, all->res, done, arg);
}

/* A lease's own ops (TBR__LEASE) are the library's: refused from outside. */
int tokenbucket_redis_async_start(struct tokenbucket_redis_async *a,
				  const struct tokenbucket_redis_call *call,
				  tokenbucket_redis_done_fn *done, void *arg)
{
	if (a == NULL || call == NULL || done == NULL || (call->flags & TBR__LEASE))
		return -EINVAL;
	return tbr__async_start_call(a, call, done, arg);
}

/*
 * Reads what c's server sent, as redisAsyncHandleRead does, but hands
 * hiredis no reply it has no callback for: hiredis asserts on one (the
 * process aborts).  The bytes are parsed first by c's shadow reader,
 * which makes no objects, each reply paired with the next callback; the
 * replies that have one are delivered, then a reply nobody asked for
 * closes the connection, its calls failing with -EPROTO.  May free ac.
 */
static void conn_read(struct conn *c)
{
	redisAsyncContext *ac = c->ac;
	if (!(ac->c.flags & REDIS_CONNECTED)) {
		/* Completes the connection without reading (writing the setup). */
		tbr__async_conn_write(c);
		if (c->ac != ac || c->dying || !(ac->c.flags & REDIS_CONNECTED))
			return;
	}
	if (c->shadow == NULL) {
		tbr__async_conn_drop(c, -ENOMEM);
		return;
	}
	char buf[16 * 1024];
	ssize_t n = recv(ac->c.fd, buf, sizeof(buf), 0);
	if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
		return;
	if (n <= 0) {
		redisAsyncHandleRead(ac); /* reads the EOF or error again, and fails ac with it */
		return;
	}
	/* Past a bound, only what came before it is read; then the connection closes. */
	size_t good = tbr__bound_scan(&c->bound, buf, (size_t)n);
	size_t cut = good;
	bool unasked = c->bound.bad;
	const redisCallback *cb = ac->replies.head;
	redisReaderFeed(c->shadow, buf, good);
	size_t end = 0; /* where the last reply that has a callback ends in buf */
	for (;;) {
		void *r = NULL;
		if (redisReaderGetReply(c->shadow, &r) != REDIS_OK || r == NULL)
			break; /* hiredis finds a protocol error itself, at the same byte */
		if (cb == NULL) {
			unasked = true;
			cut = end;
			break;
		}
		cb = cb->next;
		end = good - (c->shadow->len - c->shadow->pos);
	}
	unsigned gen = c->gen;
	if (cut > 0 && redisReaderFeed(ac->c.reader, buf, cut) != REDIS_OK) {
		tbr__async_conn_drop(c, -ENOMEM);
		return;
	}
	tbr__async_want(c, TOKENBUCKET_REDIS_READ, 0);
	redisProcessCallbacks(ac);
	if (unasked && c->ac != NULL && c->gen == gen)
		tbr__async_conn_drop(c, -EPROTO);
}

void tokenbucket_redis_async_ready(struct tokenbucket_redis_async *a, int fd, unsigned events)
{
	if (a == NULL)
		return;
	struct conn *c = NULL;
	for (size_t i = 0; i < a->nconns && c == NULL; i++)
		if (a->conns[i]->ac != NULL && a->conns[i]->fd == fd)
			c = a->conns[i];
	if (c == NULL && a->asker.ac != NULL && a->asker.fd == fd)
		c = &a->asker;
	if (c == NULL)
		return;
	a->depth++;
	if (events & TOKENBUCKET_REDIS_READ)
		conn_read(c);
	if ((events & TOKENBUCKET_REDIS_WRITE) && c->ac != NULL && !c->dying)
		tbr__async_conn_write(c);
	settle(a);
	leave(a);
}

static void fire_hooks(struct tokenbucket_redis_async *a, int64_t now);

void tokenbucket_redis_async_timeout(struct tokenbucket_redis_async *a)
{
	if (a == NULL)
		return;
	a->depth++;
	a->timer_at = INT64_MAX; /* fired */
	int64_t now = tokenbucket_now();
	if (a->in_round && !a->ask_got && a->asker.ac != NULL && now >= a->ask_deadline) {
		/* The sentinel asked did not answer in time: the next one is asked. */
		a->ask_got = true;
		a->ask_result = -ETIME;
		tbr__async_conn_drop(&a->asker, -ETIME);
	}
	/* No reply in time: the connection goes, with every op on it. */
	while (a->head != NULL && a->head->deadline <= now) {
		struct op *o = a->head;
		if (o->conn != NULL)
			tbr__async_conn_drop(o->conn, -ETIME);
		if (a->head == o) /* not sent, or (never expected) not failed by the drop */
			tbr__async_complete(o, o->err != 0 ? o->err : o->conn != NULL ? -ETIME : o->last_err,
				 NULL, NULL, 0);
	}
	fire_hooks(a, now);
	settle(a);
	leave(a);
}

/* ---- Hooks ------------------------------------------------------------------ */

void tbr__async_hook_add(struct tokenbucket_redis_async *a, struct tbr__async_hook *h)
{
	h->due = INT64_MAX;
	h->pending = false;
	h->prev = NULL;
	h->next = a->hooks;
	if (a->hooks != NULL)
		a->hooks->prev = h;
	a->hooks = h;
}

void tbr__async_hook_remove(struct tokenbucket_redis_async *a, struct tbr__async_hook *h)
{
	if (h->prev != NULL)
		h->prev->next = h->next;
	else
		a->hooks = h->next;
	if (h->next != NULL)
		h->next->prev = h->prev;
	h->prev = h->next = NULL;
	h->pending = false;
}

void tbr__async_hook_due(struct tokenbucket_redis_async *a, struct tbr__async_hook *h,
			 int64_t due)
{
	h->due = due;
	if (a->depth == 0)
		tbr__async_arm_from(a, NULL); /* the ops' part as last scanned; within a frame, settle() arms on the way out */
}

/*
 * Fires the hooks due by now, each once: a hook's fire() may add, remove
 * or re-arm hooks (its own next time is for a later _timeout).
 */
static void fire_hooks(struct tokenbucket_redis_async *a, int64_t now)
{
	for (struct tbr__async_hook *h = a->hooks; h != NULL; h = h->next)
		h->pending = h->due <= now;
	for (;;) {
		struct tbr__async_hook *h = a->hooks;
		while (h != NULL && !h->pending)
			h = h->next;
		if (h == NULL || a->closing)
			return;
		h->pending = false;
		h->due = INT64_MAX;
		h->fire(h);
	}
}

void tbr__async_batch_begin(struct tokenbucket_redis_async *a)
{
	a->depth++;
}

void tbr__async_batch_end(struct tokenbucket_redis_async *a)
{
	settle(a);
	leave(a);
}

