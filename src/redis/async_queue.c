/* SPDX-License-Identifier: MIT */
/*
 * The asynchronous engine's lowest layer: the ops' lists (every op in
 * start order, the waiting ones beside), the loop's events and its one
 * timer, completion, and a connection's hiredis context attached to the
 * loop and dropped.  async.c's first comment has the model.
 */
#include <errno.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "async_queue.h"

/* ---- The ops' lists ------------------------------------------------------- */

/*
 * o joins the ops not sent, in start order: a new op at once at the
 * tail, one sent back (a redirection, a refused node, READONLY after a
 * failover) before the younger ones that wait, so that one key's calls
 * still go in the order started.  The ops of a connection come back in
 * the order they were sent, so one sent back goes right after the one
 * sent back before it (a->wback): a failover that sends back every call
 * in flight costs one step a call, not the calls started meanwhile.
 */
void tbr__async_wait_link(struct tokenbucket_redis_async *a, struct op *o)
{
	struct op *p = a->wtail;
	if (p != NULL && p->seq > o->seq && a->wback != NULL && a->wback->seq < o->seq) {
		p = a->wback;
		while (p->wnext != NULL && p->wnext->seq < o->seq)
			p = p->wnext;
	} else {
		while (p != NULL && p->seq > o->seq)
			p = p->wprev;
	}
	if (p != a->wtail || o->seq + 1 != a->seq) /* sent back, not new */
		a->wback = o;
	o->wprev = p;
	o->wnext = p != NULL ? p->wnext : a->whead;
	if (o->wnext != NULL)
		o->wnext->wprev = o;
	else
		a->wtail = o;
	if (p != NULL)
		p->wnext = o;
	else
		a->whead = o;
	a->nwaiting++;
}

static void wait_unlink(struct tokenbucket_redis_async *a, struct op *o)
{
	if (a->wback == o)
		a->wback = NULL;
	if (o->wprev != NULL)
		o->wprev->wnext = o->wnext;
	else
		a->whead = o->wnext;
	if (o->wnext != NULL)
		o->wnext->wprev = o->wprev;
	else
		a->wtail = o->wprev;
	o->wprev = o->wnext = NULL;
	a->nwaiting--;
}

/* o, sent, is no longer on its connection (nor waiting). */
static void unbind_op(struct op *o)
{
	o->conn->inflight--;
	if (o->pinned)
		o->a->pins[o->pin].count--;
	o->pinned = false;
	o->conn = NULL;
}

/*
 * Binds o to connection c (NULL: waiting again), keeping the list of
 * waiting ops, each connection's count in flight and the pins.
 */
void tbr__async_bind_op(struct op *o, struct conn *c)
{
	struct tokenbucket_redis_async *a = o->a;
	if (o->conn == NULL && c != NULL)
		wait_unlink(a, o);
	else if (o->conn != NULL && c == NULL)
		tbr__async_wait_link(a, o);
	if (o->conn != NULL)
		unbind_op(o);
	if (c != NULL) {
		c->inflight++;
		struct pin *p = a->pins != NULL ? &a->pins[o->pin] : NULL;
		if (p != NULL && p->count == 0)
			p->conn = c->index;
		if (p != NULL && p->conn == c->index) {
			p->count++;
			o->pinned = true;
		}
	}
	o->conn = c;
}

/* ---- The event loop ------------------------------------------------------- */

void tbr__async_sync_watch(struct conn *c)
{
	if (c->want != c->watched) {
		c->watched = c->want;
		c->a->loop.watch(c->a->loop.data, c->fd, c->want);
	}
}

void tbr__async_want(struct conn *c, unsigned set, unsigned clear)
{
	c->want = (c->want | set) & ~clear;
	tbr__async_sync_watch(c);
}

/*
 * Within a frame the write interest is told to the loop at the frame's end
 * (settle): a call appended by a callback is written by the same frame
 * (tbr__async_conn_flush), so the interest would be added and dropped again for
 * nothing, two system calls each in most loops.
 */
static void want_write(struct conn *c, bool on)
{
	c->want = on ? c->want | TOKENBUCKET_REDIS_WRITE : c->want & ~TOKENBUCKET_REDIS_WRITE;
	if (c->a->depth == 0)
		tbr__async_sync_watch(c);
}

static void ev_add_read(void *p) { tbr__async_want(p, TOKENBUCKET_REDIS_READ, 0); }
static void ev_del_read(void *p) { tbr__async_want(p, 0, TOKENBUCKET_REDIS_READ); }
static void ev_add_write(void *p) { want_write(p, true); }
static void ev_del_write(void *p) { want_write(p, false); }

/*
 * hiredis frees the connection (after failing its callbacks): nothing is
 * watched any more.  A spare that never became ready (refused, or closed
 * by a server at its maxclients) holds the next spare back a while.
 */
static void ev_cleanup(void *p)
{
	struct conn *c = p;
	tbr__async_want(c, 0, TOKENBUCKET_REDIS_READ | TOKENBUCKET_REDIS_WRITE);
	if (c->spare)
		c->a->spare_after = tokenbucket_now() + SUSPECT_NS;
	c->ac = NULL;
	c->ready = c->dying = c->loading = c->spare = false;
	redisReaderFree(c->shadow);
	c->shadow = NULL;
}

/*
 * Writes what hiredis has buffered for c's server, as
 * redisAsyncHandleWrite does but with send(MSG_NOSIGNAL): no SIGPIPE, so
 * no signal mask to set and restore in every frame.  A connection still
 * being made, and a write that failed (c's error is set, so hiredis
 * writes nothing and fails the connection with its calls), go through
 * hiredis's handler, SIGPIPE blocked around it.  May free ac (ev_cleanup).
 */
void tbr__async_conn_write(struct conn *c)
{
	redisContext *ctx = &c->ac->c;
	if (ctx->flags & REDIS_CONNECTED) {
		int done = tbr__write_nosignal(ctx);
		if (done >= 0) {
			want_write(c, done == 1);
			tbr__async_want(c, TOKENBUCKET_REDIS_READ, 0);
			return;
		}
	}
	struct tbr__sigpipe sp;
	tbr__sigpipe_block(&sp);
	redisAsyncHandleWrite(c->ac);
	tbr__sigpipe_restore(&sp);
}

/*
 * Writes what hiredis has buffered for c's server (every call appended
 * since the last write) in the frame that appended it, rather than on the
 * loop's next turn.  What would block waits for the loop.
 */
void tbr__async_conn_flush(struct conn *c)
{
	if (c->ac != NULL && !c->dying && (c->ac->c.flags & REDIS_CONNECTED) &&
	    (c->want & TOKENBUCKET_REDIS_WRITE))
		tbr__async_conn_write(c);
}

/*
 * Arms the timer for the earliest deadline or pause, or at once when ops
 * have failed.  Every op has the same timeout, so the earliest deadline
 * is the head's; the pauses and failures are those of the waiting ops
 * from `from` on, and of the ones before as last scanned (a->wait_at).
 * Only what runs outside the library's frames may pass a `from` other
 * than a->whead, and only when no op before it changed since settle():
 * the ops' pauses and errors change within frames, which end with a full
 * scan.  from NULL: the last scan's.
 */
void tbr__async_arm_from(struct tokenbucket_redis_async *a, const struct op *from)
{
	bool whole = from == a->whead;
	bool failed = !whole && a->wait_at == INT64_MIN;
	int64_t pause = whole ? INT64_MAX : a->pause_at;
	for (const struct op *o = from; o != NULL; o = o->wnext) {
		failed = failed || o->err != 0;
		if (o->pause_until != 0 && o->pause_until < pause)
			pause = o->pause_until;
	}
	a->pause_at = pause;
	int64_t at = a->wait_at = failed ? INT64_MIN : pause;
	if (a->head != NULL && a->head->deadline < at)
		at = a->head->deadline;
	if (a->in_round && a->ask_deadline < at)
		at = a->ask_deadline;
	else if (!a->in_round && a->need_primary && a->ask_after < at)
		at = a->ask_after;
	for (const struct tbr__async_hook *h = a->hooks; h != NULL; h = h->next)
		at = h->due < at ? h->due : at;
	/*
	 * Unchanged (a start adds a later deadline than the head's): the
	 * loop is not told again, so starts between two turns of the loop
	 * cost it nothing.
	 */
	if (at == a->timer_at)
		return;
	int64_t ns = -1;
	if (at != INT64_MAX) {
		int64_t now = tokenbucket_now();
		ns = at <= now ? 0 : at - now;
	}
	a->loop.timer(a->loop.data, ns);
	a->timer_at = at;
}

void tbr__async_arm(struct tokenbucket_redis_async *a)
{
	tbr__async_arm_from(a, a->whead);
}

/* ---- Completion ----------------------------------------------------------- */

static void unlink_op(struct tokenbucket_redis_async *a, struct op *o)
{
	if (o->prev != NULL)
		o->prev->next = o->next;
	else
		a->head = o->next;
	if (o->next != NULL)
		o->next->prev = o->prev;
	else
		a->tail = o->prev;
}

/* Runs o's callback with err (or the fallback's decision) and frees o. */
void tbr__async_complete(struct op *o, int err, struct tokenbucket_result *res,
		     struct tokenbucket_reservation *rv, double tokens)
{
	struct tokenbucket_redis_async *a = o->a;
	struct tokenbucket_result r0;
	struct tokenbucket_reservation v0;
	if (res == NULL) {
		memset(&r0, 0, sizeof(r0));
		res = &r0;
	}
	if (rv == NULL) {
		memset(&v0, 0, sizeof(v0));
		rv = &v0;
	}
	if (a->fallback != NULL && !a->forgetting)
		err = tbr__fallback_apply(a->fallback, &o->all.call, err, res, rv);
	if (o->conn != NULL) /* o leaves the lists */
		unbind_op(o);
	else
		wait_unlink(a, o);
	a->completed++;
	unlink_op(a, o);
	bool granted = err == 0 && o->all.call.op == TOKENBUCKET_REDIS_RESERVE;
	if (!a->forgetting && o->set_done != NULL) {
		if (err != 0) /* decode and the fallback fill it on success only */
			memset(&o->set_res, 0, sizeof(o->set_res));
		o->set_done(o->arg, err, &o->set_res);
	} else if (!a->forgetting) {
		o->done(o->arg, err, res, granted ? rv : NULL, tokens);
	}
	free(o->key);
	free(o);
}

/* o goes back to waiting, sent again after a pause (pause) or at once. */
void tbr__async_again(struct op *o, int last_err, bool pause)
{
	tbr__async_bind_op(o, NULL);
	o->last_err = last_err;
	o->pause_until = pause ? tokenbucket_now() + PAUSE_NS : 0;
}

/* ---- A connection's hiredis context --------------------------------------- */

/* Makes ac (just opened) c's connection, its events the loop's. */
void tbr__async_conn_attach(struct conn *c, redisAsyncContext *ac)
{
	c->ac = ac;
	c->gen++;
	c->fd = ac->c.fd;
	c->want = c->watched = 0;
	redisReaderFree(c->shadow);
	c->shadow = redisReaderCreateWithFunctions(NULL); /* NULL: conn_read drops c */
	c->bound = (struct tbr__bound){ 0 };
	c->dying = c->unreached = c->loading = false;
	ac->data = c;
	ac->ev.data = c;
	ac->ev.addRead = ev_add_read;
	ac->ev.delRead = ev_del_read;
	ac->ev.addWrite = ev_add_write;
	ac->ev.delWrite = ev_del_write;
	ac->ev.cleanup = ev_cleanup;
}

/* Closes c's connection now; its ops complete with err. */
void tbr__async_conn_drop(struct conn *c, int err)
{
	if (c->ac == NULL)
		return;
	c->drop_err = err;
	c->dying = true;
	redisAsyncFree(c->ac);
	c->drop_err = 0;
}
