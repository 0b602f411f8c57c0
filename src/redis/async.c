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
 * A several-limits decision (tokenbucket_redis_async_allow_all) is an op
 * like any other: its call is that of a struct tbr__call_all held in the
 * op, with the limits copied after it, so the codec, the routing and the
 * fallback treat it as the blocking allow_all's; only its callback differs.
 *
 * Callbacks run from tokenbucket_redis_async_ready, _timeout and _close
 * only, never from _start.  They may start calls and close the client:
 * `depth` counts the library's frames on the stack, and a close asked for
 * within them is done when the outermost returns.
 *
 * Not thread-safe: one thread (the loop's) uses an async client.  What it
 * shares with the blocking client it was made from is safe to share: the
 * cluster map is atomic, the fallback has its own lock.
 */
#include <errno.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include <hiredis/async.h>

#include "async.h"
#include "slots.h"

#if HIREDIS_MAJOR < 1
/* Exported by hiredis 0.14 without a declaration in its headers (async.h has it from 1.0). */
void redisProcessCallbacks(redisAsyncContext *ac);
#endif

/* Pause before an op is sent again after CLUSTERDOWN, TRYAGAIN, or a refused connection. */
#define PAUSE_NS INT64_C(10000000)
/* The least time between two map requests. */
#define REFRESH_GAP_NS INT64_C(10000000)
/* A node whose connection failed this recently is not asked for the map. */
#define SUSPECT_NS INT64_C(1000000000)
/* Pins: a power of two, so that 5000 calls in flight leave most of them free. */
#define PINS 4096u
/* The least time between the starts of two rounds of questions to the sentinels. */
#define ASK_GAP_NS INT64_C(20000000)
/* While calls flow, how often a Sentinel client checks that its server is still the primary named. */
#define CHECK_NS INT64_C(1000000000)

struct tokenbucket_redis_async;

/* A connection to one node, made on first use, kept until close. */
struct conn {
	struct tokenbucket_redis_async *a;
	struct tbr__node *node;
	redisAsyncContext *ac; /* NULL while there is none */
	int fd;                /* ac's descriptor, as last told to watch */
	unsigned want;         /* the events asked for on fd */
	unsigned watched;      /* the events the loop was last told of (want, at a frame's end) */
	bool ready;            /* ac may carry calls (set up) */
	bool dying;            /* ac is being freed: send nothing more on it */
	bool unreached;        /* ac never connected: its ops were never written */
	bool loading;          /* a SCRIPT LOAD is on ac, its reply not read yet */
	bool module;           /* ac's server has the module (TOKENBUCKET.VERSION) */
	bool function;         /* ac's server has the function library */
	bool function_loading; /* a FUNCTION LOAD is on ac, its reply not read yet */
	int drop_err;          /* the error of the ops on an ac we free, or 0 */
	bool spare;            /* opened beside a ready one, not ready yet: no op is on it */
	uint32_t index;        /* in a->conns */
	size_t inflight;       /* ops bound to it (sent on ac, answers not yet read) */
	/* What ac's server sent, parsed again ahead of hiredis (conn_read); no objects. */
	redisReader *shadow;
	struct tbr__bound bound; /* and scanned against the bounds first */
	unsigned gen; /* counts the ac's c has had */
};

/* The connection the calls in flight of the keys hashed here are on. */
struct pin {
	uint32_t count; /* such calls */
	uint32_t conn;  /* its index in a->conns, while count > 0 */
};

struct op {
	struct tokenbucket_redis_async *a;
	struct op *prev, *next;   /* every op, in start order */
	struct op *wprev, *wnext; /* the ops not sent (conn NULL), in start order */
	uint64_t seq;             /* start order */
	/*
	 * all.call is the call, its key key; an allow_all's all.limits are
	 * limits and its decision goes to all.res, set_res.
	 */
	struct tbr__call_all all;
	char *key;
	tokenbucket_redis_done_fn *done;         /* or, for an allow_all: */
	tokenbucket_redis_set_done_fn *set_done;
	void *arg;
	struct tokenbucket_set_result set_res;
	int64_t deadline;   /* tokenbucket_now() */
	struct conn *conn;  /* while sent: its callback will come from there */
	bool retried;       /* sent again after NOSCRIPT */
	int err;            /* not sent: the error to complete it with, or 0 */
	int last_err;       /* not sent: what it gets if its time runs out */
	int64_t pause_until; /* not sent before this (0: no pause) */
	struct tbr__node *to; /* a node a redirection named: sent there once (after ASKING when ask) */
	bool ask;
	bool asking;        /* sent after ASKING (NOSCRIPT sends it again so) */
	bool module;        /* sent as TOKENBUCKET.CALL */
	bool function;      /* sent as FCALL */
	bool demoted;       /* answered READONLY once (a Sentinel client) */
	bool pinned;        /* counted in a->pins[pin] */
	int redirects;
	int unreached;      /* the last connection error of a node it was sent to, or 0 */
	unsigned slot;
	uint32_t pin;       /* the key's hash, modulo PINS */
	struct tokenbucket_redis_limit limits[]; /* an allow_all's, copied */
};

struct tokenbucket_redis_async {
	struct tokenbucket_redis_loop loop;
	struct tbr__cluster *cluster; /* or NULL: one server, node */
	struct tbr__node *node;
	int64_t timeout_ns;
	char *prefix;
	size_t prefixlen;
	struct tbr__fallback *fallback; /* or NULL */
	const _Atomic int *module;     /* TOKENBUCKET_REDIS_MODULE_*, or NULL: _AUTO */
	const _Atomic int *connections; /* per server, at most; or NULL: 1 */
	struct conn **conns;           /* every node's, in no order; freed at close only */
	size_t nconns;
	struct pin *pins;              /* PINS of them once more than one connection is allowed */
	int64_t spare_after;           /* no spare connection is opened before (one failed) */
	struct op *head, *tail;
	struct op *whead, *wtail; /* the ops not sent: only these are scanned */
	struct op *wback;         /* the op last sent back to them, while it waits (wait_link) */
	size_t nwaiting;       /* ops not sent (conn NULL) */
	uint64_t seq;          /* the next op's */
	int64_t wait_at;       /* the earliest pause (INT64_MIN: a failure) of the ops not sent, as last scanned */
	int64_t pause_at;      /* the earliest pause of the ops not sent, failed or not, as last scanned */
	int64_t timer_at;      /* when the timer was last armed to fire (INT64_MAX: disarmed) */
	bool refreshing;       /* a CLUSTER SLOTS is on its way */
	int64_t refreshed_at;
	int depth;
	bool closing;
	bool forgetting;         /* tbr__async_forget: ops end without their callbacks */
	unsigned long completed; /* callbacks run: settle() sees a write's failure by it */
	struct tbr__async_hook *hooks; /* tbr__async_hook_add's, in no order */
	/* A Sentinel client's questions (sentinel_step), on node only. */
	struct tbr__sentinel *sentinel; /* node's, or NULL */
	struct conn asker;     /* to the sentinel asked now (node NULL) */
	char *primary_host;    /* found by the last round, for the next connection (free()) */
	int primary_port;
	char *conn_host;       /* the address of the connection (free()), or NULL */
	int conn_port;
	bool checking;         /* the round checks the connection's address */
	int64_t check_after;   /* the next check starts no sooner */
	bool need_primary;     /* ops wait for a connection that needs an address */
	bool in_round;         /* sentinels are being asked */
	bool ask_got;          /* the sentinel asked now has answered or failed: ask_result */
	int ask_result;        /* 0 (found_*), 1 (names no primary) or -errno */
	char *found_host;
	int found_port;
	size_t ask_i, ask_tried;
	bool ask_named_none;   /* a sentinel of this round names no primary */
	int ask_last;          /* the last sentinel's connection error in this round */
	int64_t ask_deadline;  /* the sentinel asked now answers by then */
	int64_t ask_after;     /* the next round starts no sooner */
};

/*
 * o joins the ops not sent, in start order: a new op at once at the
 * tail, one sent back (a redirection, a refused node, READONLY after a
 * failover) before the younger ones that wait, so that one key's calls
 * still go in the order started.  The ops of a connection come back in
 * the order they were sent, so one sent back goes right after the one
 * sent back before it (a->wback): a failover that sends back every call
 * in flight costs one step a call, not the calls started meanwhile.
 */
static void wait_link(struct tokenbucket_redis_async *a, struct op *o)
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
static void bind_op(struct op *o, struct conn *c)
{
	struct tokenbucket_redis_async *a = o->a;
	if (o->conn == NULL && c != NULL)
		wait_unlink(a, o);
	else if (o->conn != NULL && c == NULL)
		wait_link(a, o);
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

static void sync_watch(struct conn *c)
{
	if (c->want != c->watched) {
		c->watched = c->want;
		c->a->loop.watch(c->a->loop.data, c->fd, c->want);
	}
}

static void want(struct conn *c, unsigned set, unsigned clear)
{
	c->want = (c->want | set) & ~clear;
	sync_watch(c);
}

/*
 * Within a frame the write interest is told to the loop at the frame's end
 * (settle): a call appended by a callback is written by the same frame
 * (conn_flush), so the interest would be added and dropped again for
 * nothing, two system calls each in most loops.
 */
static void want_write(struct conn *c, bool on)
{
	c->want = on ? c->want | TOKENBUCKET_REDIS_WRITE : c->want & ~TOKENBUCKET_REDIS_WRITE;
	if (c->a->depth == 0)
		sync_watch(c);
}

static void ev_add_read(void *p) { want(p, TOKENBUCKET_REDIS_READ, 0); }
static void ev_del_read(void *p) { want(p, 0, TOKENBUCKET_REDIS_READ); }
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
	want(c, 0, TOKENBUCKET_REDIS_READ | TOKENBUCKET_REDIS_WRITE);
	if (c->spare)
		c->a->spare_after = tokenbucket_now() + SUSPECT_NS;
	c->ac = NULL;
	c->ready = c->dying = c->loading = c->spare = false;
	redisReaderFree(c->shadow);
	c->shadow = NULL;
}

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

/*
 * Writes what hiredis has buffered for c's server, as
 * redisAsyncHandleWrite does but with send(MSG_NOSIGNAL): no SIGPIPE, so
 * no signal mask to set and restore in every frame.  A connection still
 * being made, and a write that failed (c's error is set, so hiredis
 * writes nothing and fails the connection with its calls), go through
 * hiredis's handler, SIGPIPE blocked around it.  May free ac (ev_cleanup).
 */
static void conn_write(struct conn *c)
{
	redisContext *ctx = &c->ac->c;
	if (ctx->flags & REDIS_CONNECTED) {
		int done = tbr__write_nosignal(ctx);
		if (done >= 0) {
			want_write(c, done == 1);
			want(c, TOKENBUCKET_REDIS_READ, 0);
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
static void conn_flush(struct conn *c)
{
	if (c->ac != NULL && !c->dying && (c->ac->c.flags & REDIS_CONNECTED) &&
	    (c->want & TOKENBUCKET_REDIS_WRITE))
		conn_write(c);
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
static void arm_from(struct tokenbucket_redis_async *a, const struct op *from)
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

static void arm(struct tokenbucket_redis_async *a)
{
	arm_from(a, a->whead);
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

/* o goes back to waiting, sent again after a pause (pause) or at once. */
static void again(struct op *o, int last_err, bool pause)
{
	bind_op(o, NULL);
	o->last_err = last_err;
	o->pause_until = pause ? tokenbucket_now() + PAUSE_NS : 0;
}

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

/* FUNCTION LOAD's reply: the calls go as FCALL again if it worked. */
static void on_function_loaded(redisAsyncContext *ac, void *reply, void *privdata)
{
	struct conn *c = privdata;
	(void)ac;
	c->function_loading = false;
	c->function = reply != NULL && tbr__function_loaded(reply);
}

static bool load_function(struct conn *c)
{
	if (c->function_loading)
		return true;
	if (redisAsyncCommandArgv(c->ac, on_function_loaded, c, 3, (const char **)tbr__function_load,
				  NULL) != REDIS_OK)
		return false;
	c->function_loading = true;
	return true;
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
		complete(o, r < 0 ? r : tbr__redirects_spent(o->unreached), NULL, NULL, 0);
		return true;
	}
	if (r == 0) {
		again(o, -ETIME, false);
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
			complete(o, -EAGAIN, NULL, NULL, 0); /* the fallback decides now */
		else
			again(o, -EAGAIN, true);
		return true;
	}
	return false;
}

/* o, answered that it did not run on c, sent on c again (after ASKING if it was). */
static void resend(struct op *o, struct conn *c)
{
	bind_op(o, NULL);
	if (o->asking && redisAsyncCommand(c->ac, NULL, NULL, "ASKING") != REDIS_OK)
		o->err = -ENOMEM;
	else
		send_op(o, c);
	if (o->conn == NULL)
		complete(o, o->err, NULL, NULL, 0);
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
			o->unreached = conn_error(ac);
			again(o, o->unreached, true);
			return;
		}
		complete(o, c->drop_err != 0 ? c->drop_err : conn_error(ac), NULL, NULL, 0);
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
		load_function(c);
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
		again(o, -EROFS, false);
		if (!c->dying) {
			c->dying = true;
			redisAsyncDisconnect(ac);
		}
		return;
	}
	bool filled = err == 0 || err == -ETIMEDOUT || err == -E2BIG || err == -EOVERFLOW;
	complete(o, err, filled ? &res : NULL, filled ? &rv : NULL, tokens);
}

/* ---- Connections ---------------------------------------------------------- */

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
	bind_op(o, err == 0 ? c : NULL);
	o->err = err;
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

static int conn_open(struct conn *c, bool spare);
static void conn_drop(struct conn *c, int err);

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
static struct conn *conn_of(struct tokenbucket_redis_async *a, const struct op *o,
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
			if (s != NULL && conn_open(s, true) != 0)
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
		load_function(c);
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
static struct tbr__node *target(struct tokenbucket_redis_async *a, const struct op *o)
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
		int err = conn_error(ac);
		atomic_store_explicit(&c->node->failed_at, tokenbucket_now(), memory_order_relaxed);
		for (struct op *o = a->whead; o != NULL; o = o->wnext) {
			if (o->err != 0 || target(a, o) != c->node)
				continue;
			if (a->cluster != NULL) {
				tbr__cluster_set_stale(a->cluster);
				again(o, err, true);
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

/* Makes ac (just opened) c's connection, its events the loop's. */
static void conn_attach(struct conn *c, redisAsyncContext *ac)
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

/*
 * Opens c's connection (non-blocking), its setup queued; 0 or a negative
 * errno.  A spare goes beside a ready one: a Sentinel client's to the
 * address of the connections it has.
 */
static int conn_open(struct conn *c, bool spare)
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
		int err = conn_error(ac);
		redisAsyncFree(ac);
		return err;
	}
	conn_attach(c, ac);
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
			conn_drop(c, -ENOMEM); /* no op is on it to drop it with a timeout */
		return -ENOMEM; /* ac stays: dropped with the ops' timeout */
	}
	/* Nothing is written before a command: watch for the connection to complete. */
	want(c, TOKENBUCKET_REDIS_WRITE, 0);
	return 0;
}

/* Closes c's connection now; its ops complete with err. */
static void conn_drop(struct conn *c, int err)
{
	if (c->ac == NULL)
		return;
	c->drop_err = err;
	c->dying = true;
	redisAsyncFree(c->ac);
	c->drop_err = 0;
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
static void refresh(struct tokenbucket_redis_async *a, int64_t now)
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
		a->ask_result = conn_error(ac);
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
		a->ask_result = conn_error(ac);
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
		a->ask_result = ac == NULL ? -ENOMEM : conn_error(ac);
		if (ac != NULL)
			redisAsyncFree(ac);
		return;
	}
	conn_attach(c, ac);
	redisAsyncSetConnectCallback(ac, on_asker_connect);
	const char *argv[] = { "SENTINEL", "get-master-addr-by-name", tbr__sentinel_name(a->sentinel) };
	if (redisAsyncCommandArgv(ac, on_master, a, 3, argv, NULL) != REDIS_OK) {
		a->ask_got = true;
		a->ask_result = -ENOMEM;
		conn_drop(c, -ENOMEM);
		return;
	}
	want(c, TOKENBUCKET_REDIS_WRITE, 0);
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
static void sentinel_step(struct tokenbucket_redis_async *a, int64_t now)
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
			sentinel_step(a, now); /* that one could not even be asked */
	}
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
		sentinel_step(a, now);
	for (struct op *o = from, *next; o != NULL; o = next) {
		next = o->wnext; /* o leaves the list when sent */
		if (o->err != 0 || o->pause_until > now)
			continue;
		/* Its pause is over: it waits for its connection only (no timer, no scan at a start). */
		o->pause_until = 0;
		struct conn *c = conn_of(a, o, target(a, o));
		if (c == NULL) {
			o->err = -ENOMEM;
			continue;
		}
		if (c->ac == NULL && a->sentinel != NULL && a->primary_host == NULL) {
			need = true; /* waits for the sentinels' answer */
			continue;
		}
		if (c->ac == NULL) {
			int err = conn_open(c, false);
			if (err != 0 && a->cluster != NULL) {
				tbr__cluster_set_stale(a->cluster);
				o->to = NULL;
				o->unreached = err;
				again(o, err, true);
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
		sentinel_step(a, now);
	}
	refresh(a, now);
}

/* Tells the loop the write interest the frame ending has left (want_write). */
static void sync_all(struct tokenbucket_redis_async *a)
{
	for (size_t i = 0; i < a->nconns; i++)
		if (a->conns[i]->ac != NULL)
			sync_watch(a->conns[i]);
	if (a->asker.ac != NULL)
		sync_watch(&a->asker);
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
				complete(o, o->err, NULL, NULL, 0);
		}
		if (a->closing)
			return;
		send_waiting(a, a->whead);
		seen = a->completed;
		for (size_t i = 0; i < a->nconns; i++)
			conn_flush(a->conns[i]);
		/* A write that failed closed its connection and ran callbacks, which may start calls. */
	} while (a->completed != seen);
	sync_all(a);
	arm(a);
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
		conn_drop(a->conns[i], -ECANCELED);
	a->ask_got = true; /* on_master ignores the drop */
	conn_drop(&a->asker, -ECANCELED);
	while (a->head != NULL)
		complete(a->head, -ECANCELED, NULL, NULL, 0);
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
 * Starts call (its limits and count for an allow_all) with its completion
 * (done, or set_done for an allow_all); the checks of the public entry
 * points are done.
 */
static int start(struct tokenbucket_redis_async *a, const struct tokenbucket_redis_call *call,
		 const struct tokenbucket_redis_limit *limits, size_t count,
		 tokenbucket_redis_done_fn *done, tokenbucket_redis_set_done_fn *set_done, void *arg)
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
	o->set_done = set_done;
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
	wait_link(a, o); /* the youngest: at the tail, at once */
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
		arm(a);
	else
		arm_from(a, o->conn == NULL ? o : NULL); /* o is the youngest: the last that waits */
	leave(a);
	return 0;
}

int tokenbucket_redis_async_start(struct tokenbucket_redis_async *a,
				  const struct tokenbucket_redis_call *call,
				  tokenbucket_redis_done_fn *done, void *arg)
{
	if (a == NULL || call == NULL || done == NULL || (unsigned)call->op > TOKENBUCKET_REDIS_REFUND)
		return -EINVAL;
	return start(a, call, NULL, 0, done, NULL, arg);
}

static int allow_all(struct tokenbucket_redis_async *a, const void *key, size_t keylen,
		     const struct tokenbucket_redis_limit *limits, size_t count, bool at,
		     int64_t now, uint64_t n, tokenbucket_redis_set_done_fn *done, void *arg)
{
	if (a == NULL || limits == NULL || count == 0 || count > TOKENBUCKET_SET_MAX || done == NULL)
		return -EINVAL;
	const struct tokenbucket_redis_call call = {
		.op = TBR__OP_ALLOW_ALL, .flags = at ? TOKENBUCKET_REDIS_AT : 0,
		.key = key, .keylen = keylen, .now = now, .n = n,
	};
	return start(a, &call, limits, count, NULL, done, arg);
}

int tokenbucket_redis_async_allow_all(struct tokenbucket_redis_async *a, const void *key,
				      size_t keylen, const struct tokenbucket_redis_limit *limits,
				      size_t count, uint64_t n, tokenbucket_redis_set_done_fn *done,
				      void *arg)
{
	return allow_all(a, key, keylen, limits, count, false, 0, n, done, arg);
}

int tokenbucket_redis_async_allow_all_at(struct tokenbucket_redis_async *a, const void *key,
					 size_t keylen,
					 const struct tokenbucket_redis_limit *limits, size_t count,
					 int64_t now, uint64_t n, tokenbucket_redis_set_done_fn *done,
					 void *arg)
{
	return allow_all(a, key, keylen, limits, count, true, now, n, done, arg);
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
		conn_write(c);
		if (c->ac != ac || c->dying || !(ac->c.flags & REDIS_CONNECTED))
			return;
	}
	if (c->shadow == NULL) {
		conn_drop(c, -ENOMEM);
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
		conn_drop(c, -ENOMEM);
		return;
	}
	want(c, TOKENBUCKET_REDIS_READ, 0);
	redisProcessCallbacks(ac);
	if (unasked && c->ac != NULL && c->gen == gen)
		conn_drop(c, -EPROTO);
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
		conn_write(c);
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
		conn_drop(&a->asker, -ETIME);
	}
	/* No reply in time: the connection goes, with every op on it. */
	while (a->head != NULL && a->head->deadline <= now) {
		struct op *o = a->head;
		if (o->conn != NULL)
			conn_drop(o->conn, -ETIME);
		if (a->head == o) /* not sent, or (never expected) not failed by the drop */
			complete(o, o->err != 0 ? o->err : o->conn != NULL ? -ETIME : o->last_err,
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
		arm_from(a, NULL); /* the ops' part as last scanned; within a frame, settle() arms on the way out */
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
