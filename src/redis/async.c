/* SPDX-License-Identifier: MIT */
/*
 * The asynchronous client: calls pipelined on one non-blocking hiredis
 * connection that the caller's event loop drives through
 * struct tokenbucket_redis_loop (watch a descriptor, arm one timer).
 *
 * Every call started is an op in a list kept in start order; an op leaves
 * it only when its callback has run, so each callback runs exactly once.
 * Ops are sent once the connection is ready (connected, and set up when it
 * needs a SELECT first); hiredis matches replies to them in order.
 * Since every op has the same timeout, the list's head has the earliest
 * deadline: the one timer is armed for it.  When it passes, the connection
 * is closed (a late reply must never be read as another call's) and every
 * op on it completes with -ETIME, as a blocking call on a connection that
 * timed out does.
 *
 * Callbacks run from tokenbucket_redis_async_ready, _timeout and _close
 * only, never from _start.  They may start calls and close the client:
 * `depth` counts the library's frames on the stack, and a close asked for
 * within them is done when the outermost returns.
 *
 * Not thread-safe: one thread (the loop's) uses an async client.  The
 * blocking client it was made from is shared safely (the fallback has its
 * own lock).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include <hiredis/async.h>

#include "client.h"

struct op {
	struct tokenbucket_redis_async *a;
	struct op *prev, *next;
	struct tokenbucket_redis_call call; /* call.key is key */
	char *key;
	tokenbucket_redis_done_fn *done;
	void *arg;
	int64_t deadline; /* tokenbucket_now() */
	bool sent;        /* handed to hiredis: its callback will come */
	bool retried;     /* sent again after NOSCRIPT */
	int err;          /* not sent: the error to complete it with, or 0 */
};

struct tokenbucket_redis_async {
	struct tokenbucket_redis *r;
	struct tokenbucket_redis_loop loop;
	const struct tbr__node *node;
	int64_t timeout_ns;
	redisAsyncContext *ac; /* NULL while there is no connection */
	int fd;                /* ac's descriptor, as last told to watch */
	unsigned want;         /* the events asked for on fd */
	bool ready;            /* ac may carry calls (set up) */
	bool dying;            /* ac is being freed: send nothing more on it */
	bool loading;          /* a SCRIPT LOAD is on ac, its reply not read yet */
	int drop_err;          /* the error of the ops on an ac we free, or 0 */
	struct op *head, *tail;
	int64_t timer_ns;      /* the timer as last armed (-1: disarmed) */
	int depth;
	bool closing;
};

/* ---- The event loop ------------------------------------------------------- */

static void want(struct tokenbucket_redis_async *a, unsigned set, unsigned clear)
{
	unsigned w = (a->want | set) & ~clear;
	if (w != a->want) {
		a->want = w;
		a->loop.watch(a->loop.data, a->fd, w);
	}
}

static void ev_add_read(void *p) { want(p, TOKENBUCKET_REDIS_READ, 0); }
static void ev_del_read(void *p) { want(p, 0, TOKENBUCKET_REDIS_READ); }
static void ev_add_write(void *p) { want(p, TOKENBUCKET_REDIS_WRITE, 0); }
static void ev_del_write(void *p) { want(p, 0, TOKENBUCKET_REDIS_WRITE); }

/* hiredis frees the connection (after failing its callbacks): nothing is watched any more. */
static void ev_cleanup(void *p)
{
	struct tokenbucket_redis_async *a = p;
	if (a->want != 0) {
		a->want = 0;
		a->loop.watch(a->loop.data, a->fd, 0);
	}
	a->ac = NULL;
	a->ready = false;
	a->dying = false;
	a->loading = false;
}

/* Arms the timer for the earliest deadline, or at once when unsent ops have failed. */
static void arm(struct tokenbucket_redis_async *a)
{
	int64_t ns = -1;
	for (struct op *o = a->head; o != NULL; o = o->next)
		if (!o->sent && o->err != 0) {
			ns = 0;
			break;
		}
	if (ns < 0 && a->head != NULL) {
		int64_t left = a->head->deadline - tokenbucket_now();
		ns = left > 0 ? left : 0;
	}
	if (ns >= 0 || a->timer_ns >= 0)
		a->loop.timer(a->loop.data, ns);
	a->timer_ns = ns;
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
static void complete(struct op *o, int err, struct tokenbucket_result *res,
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
	err = tbr__client_fallback(a->r, &o->call, err, res, rv);
	unlink_op(a, o);
	bool granted = err == 0 && o->call.op == TOKENBUCKET_REDIS_RESERVE;
	o->done(o->arg, err, res, granted ? rv : NULL, tokens);
	free(o->key);
	free(o);
}

/* The error of a connection hiredis gave up, as the blocking client reports it. */
static int conn_error(const redisAsyncContext *ac)
{
	if (ac->c.err == REDIS_ERR_EOF)
		return -ECONNRESET;
	if (ac->c.err == REDIS_ERR_OOM)
		return -ENOMEM;
	if (ac->c.err == REDIS_ERR_PROTOCOL)
		return -EPROTO;
	/* hiredis keeps errno's text only. */
	static const struct { const char *text; int err; } known[] = {
		{ "refused", ECONNREFUSED }, { "No such file", ENOENT },
		{ "Broken pipe", EPIPE },    { "timed out", ETIME },
		{ "unreachable", EHOSTUNREACH },
	};
	for (size_t i = 0; i < sizeof(known) / sizeof(known[0]); i++)
		if (strstr(ac->c.errstr, known[i].text) != NULL)
			return -known[i].err;
	return -ECONNRESET;
}

static void send_op(struct tokenbucket_redis_async *a, struct op *o);

static void on_loaded(redisAsyncContext *ac, void *reply, void *privdata)
{
	struct tokenbucket_redis_async *a = privdata;
	(void)ac;
	(void)reply; /* a load that failed leaves the calls to send the text themselves */
	a->loading = false;
}

static void on_reply(redisAsyncContext *ac, void *reply, void *privdata)
{
	struct op *o = privdata;
	struct tokenbucket_redis_async *a = o->a;
	if (reply == NULL) {
		/* hiredis is freeing the connection: every op on it ends the same way. */
		a->dying = true;
		complete(o, a->drop_err != 0 ? a->drop_err : conn_error(ac), NULL, NULL, 0);
		return;
	}
	struct tokenbucket_result res;
	struct tokenbucket_reservation rv;
	double tokens = 0;
	int err = tbr__decode(&o->call, reply, &res, &rv, &tokens);
	if (err == -ENOEXEC && !(o->call.flags & TOKENBUCKET_REDIS_EVAL) && !a->dying) {
		/*
		 * The server lost the script, and every call in flight will say
		 * so: the text goes once (SCRIPT LOAD), and they follow it by
		 * their SHA-1 again.  One that still finds no script sends the
		 * text itself.
		 */
		if (o->retried) {
			o->call.flags |= TOKENBUCKET_REDIS_EVAL;
		} else if (!a->loading &&
			   redisAsyncCommand(ac, on_loaded, a, "SCRIPT LOAD %s", tbr__script_text) ==
				   REDIS_OK) {
			a->loading = true;
		}
		o->retried = true;
		send_op(a, o);
		if (!o->sent)
			complete(o, o->err, NULL, NULL, 0);
		return;
	}
	bool filled = err == 0 || err == -ETIMEDOUT || err == -E2BIG || err == -EOVERFLOW;
	complete(o, err, filled ? &res : NULL, filled ? &rv : NULL, tokens);
}

/* ---- Connections ---------------------------------------------------------- */

static void send_op(struct tokenbucket_redis_async *a, struct op *o)
{
	struct tbr__args args;
	int err = tbr__args(&o->call, &args);
	if (err == 0 && redisAsyncCommandArgv(a->ac, on_reply, o, TBR__ARGC, args.argv, args.len) !=
				REDIS_OK)
		err = -ENOMEM;
	o->sent = err == 0;
	o->err = err;
}

static void send_waiting(struct tokenbucket_redis_async *a)
{
	for (struct op *o = a->head; o != NULL && a->ac != NULL && a->ready && !a->dying; o = o->next)
		if (!o->sent && o->err == 0)
			send_op(a, o);
}

/* Every op not sent yet fails with err (completed from the timer). */
static void fail_waiting(struct tokenbucket_redis_async *a, int err)
{
	for (struct op *o = a->head; o != NULL; o = o->next)
		if (!o->sent && o->err == 0)
			o->err = err;
}

/*
 * Replies to the connection's setup.  SELECT is all there is today; what a
 * connection learns about its server once (a capability, say) is asked for
 * here too, and the calls wait until the answers are in.
 */
static void on_setup(redisAsyncContext *ac, void *reply, void *privdata)
{
	struct tokenbucket_redis_async *a = privdata;
	(void)ac;
	if (reply == NULL)
		return; /* the connection is going: the waiting ops get a new one */
	const redisReply *rep = reply;
	if (rep->type == REDIS_REPLY_ERROR) {
		fail_waiting(a, tbr__error(rep->str, rep->len));
		a->dying = true;
		redisAsyncFree(a->ac); /* deferred by hiredis until this callback returns */
		return;
	}
	a->ready = true;
	send_waiting(a);
}

static void on_connect(const redisAsyncContext *ac, int status)
{
	struct tokenbucket_redis_async *a = ac->data;
	if (status != REDIS_OK) {
		/* hiredis frees ac next; the waiting ops fail with its error. */
		a->dying = true;
		fail_waiting(a, conn_error(ac));
	}
}

static void on_disconnect(const redisAsyncContext *ac, int status)
{
	struct tokenbucket_redis_async *a = ac->data;
	(void)status;
	a->dying = true;
}

/* Opens the connection (non-blocking), its setup queued; 0 or a negative errno. */
static int connect_node(struct tokenbucket_redis_async *a)
{
	const struct tbr__node *n = a->node;
	redisAsyncContext *ac = n->path != NULL ? redisAsyncConnectUnix(n->path)
						: redisAsyncConnect(n->host, n->port);
	if (ac == NULL)
		return -ENOMEM;
	if (ac->err) {
		int err = conn_error(ac);
		redisAsyncFree(ac);
		return err;
	}
	a->ac = ac;
	a->fd = ac->c.fd;
	a->want = 0;
	a->dying = false;
	ac->data = a;
	ac->ev.data = a;
	ac->ev.addRead = ev_add_read;
	ac->ev.delRead = ev_del_read;
	ac->ev.addWrite = ev_add_write;
	ac->ev.delWrite = ev_del_write;
	ac->ev.cleanup = ev_cleanup;
	redisAsyncSetConnectCallback(ac, on_connect);
	redisAsyncSetDisconnectCallback(ac, on_disconnect);
	/* The reply to SELECT comes first; meanwhile calls wait. */
	a->ready = n->db == 0;
	if (!a->ready && redisAsyncCommand(ac, on_setup, a, "SELECT %d", n->db) != REDIS_OK)
		return -ENOMEM; /* ac stays: dropped with the ops' timeout */
	/* Nothing is written before a command: watch for the connection to complete. */
	want(a, TOKENBUCKET_REDIS_WRITE, 0);
	return 0;
}

/* Closes the connection now; its ops complete with err. */
static void drop(struct tokenbucket_redis_async *a, int err)
{
	if (a->ac == NULL)
		return;
	a->drop_err = err;
	a->dying = true;
	redisAsyncFree(a->ac);
	a->drop_err = 0;
}

/*
 * After the library's work on the connection: completes the ops that
 * failed before they were sent, opens a connection for waiting ops,
 * sends them, and arms the timer.
 */
static void settle(struct tokenbucket_redis_async *a)
{
	for (struct op *o = a->head, *next; o != NULL; o = next) {
		next = o->next;
		if (!o->sent && o->err != 0)
			complete(o, o->err, NULL, NULL, 0);
	}
	if (a->closing)
		return;
	bool waiting = false;
	for (struct op *o = a->head; o != NULL && !waiting; o = o->next)
		waiting = !o->sent;
	if (waiting && a->ac == NULL) {
		int err = connect_node(a);
		if (err != 0)
			fail_waiting(a, err);
	}
	send_waiting(a);
	arm(a);
}

/* ---- The interface -------------------------------------------------------- */

int tokenbucket_redis_async_open(struct tokenbucket_redis_async **ap, struct tokenbucket_redis *r,
				 const struct tokenbucket_redis_loop *loop)
{
	if (ap == NULL || r == NULL || loop == NULL || loop->watch == NULL || loop->timer == NULL)
		return -EINVAL;
	const struct tbr__node *n = tbr__client_node(r);
	if (n == NULL)
		return -EOPNOTSUPP;
	struct tokenbucket_redis_async *a = calloc(1, sizeof(*a));
	if (a == NULL)
		return -ENOMEM;
	a->r = r;
	a->loop = *loop;
	a->node = n;
	a->timeout_ns = tbr__client_timeout(r);
	a->fd = -1;
	a->timer_ns = -1;
	*ap = a;
	return 0;
}

static void close_now(struct tokenbucket_redis_async *a)
{
	a->depth++;
	drop(a, -ECANCELED);
	a->drop_err = -ECANCELED;
	while (a->head != NULL)
		complete(a->head, -ECANCELED, NULL, NULL, 0);
	a->depth--;
	if (a->timer_ns >= 0)
		a->loop.timer(a->loop.data, -1);
	if (a->loop.free != NULL)
		a->loop.free(a->loop.data);
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

int tokenbucket_redis_async_start(struct tokenbucket_redis_async *a,
				  const struct tokenbucket_redis_call *call,
				  tokenbucket_redis_done_fn *done, void *arg)
{
	if (a == NULL || call == NULL || done == NULL)
		return -EINVAL;
	if (a->closing)
		return -ECANCELED;
	struct op *o = calloc(1, sizeof(*o));
	if (o == NULL)
		return -ENOMEM;
	size_t keylen;
	int err = tbr__client_key(a->r, call->key, call->keylen, &o->key, &keylen);
	if (err != 0) {
		free(o);
		return err;
	}
	o->a = a;
	o->call = (struct tokenbucket_redis_call){
		.op = call->op, .flags = call->flags, .key = o->key, .keylen = keylen,
		.limit = call->limit, .now = call->now, .n = call->n, .arg = call->arg,
	};
	struct tbr__args check;
	err = tbr__args(&o->call, &check);
	if (err != 0) {
		free(o->key);
		free(o);
		return err;
	}
	o->done = done;
	o->arg = arg;
	o->deadline = tokenbucket_now() + a->timeout_ns;
	o->prev = a->tail;
	if (a->tail != NULL)
		a->tail->next = o;
	else
		a->head = o;
	a->tail = o;
	if (a->depth > 0)
		return 0; /* within a callback: settle() sends it on the way out */
	a->depth++;
	if (a->ac == NULL) {
		err = connect_node(a);
		if (err != 0)
			fail_waiting(a, err); /* completed from the timer, never from here */
	}
	send_waiting(a);
	arm(a);
	leave(a);
	return 0;
}

void tokenbucket_redis_async_ready(struct tokenbucket_redis_async *a, int fd, unsigned events)
{
	if (a == NULL || a->ac == NULL || fd != a->fd)
		return;
	struct tbr__sigpipe sp;
	tbr__sigpipe_block(&sp);
	a->depth++;
	if (events & TOKENBUCKET_REDIS_READ)
		redisAsyncHandleRead(a->ac);
	if ((events & TOKENBUCKET_REDIS_WRITE) && a->ac != NULL && !a->dying)
		redisAsyncHandleWrite(a->ac);
	settle(a);
	tbr__sigpipe_restore(&sp);
	leave(a);
}

void tokenbucket_redis_async_timeout(struct tokenbucket_redis_async *a)
{
	if (a == NULL)
		return;
	a->depth++;
	a->timer_ns = -1;
	int64_t now = tokenbucket_now();
	if (a->head != NULL && a->head->deadline <= now) {
		/* No reply in time: the connection goes, with every op on it. */
		drop(a, -ETIME);
		for (struct op *o = a->head; o != NULL; o = o->next)
			if (!o->sent && o->err == 0 && o->deadline <= now)
				o->err = -ETIME;
	}
	settle(a);
	leave(a);
}
