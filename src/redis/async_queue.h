/* SPDX-License-Identifier: MIT */
/*
 * The asynchronous engine's lowest layer (async_queue.c) and what its
 * files share: an engine, its connections and its ops (async.c's first
 * comment has the model).  The files stand in layers, each calling only
 * those below: async.c (the interface, sending, replies) on async_conn.c
 * (which connection, opening and setting one up, the cluster map, the
 * sentinels) on async_queue.c (the ops' lists, the loop's events and
 * timer, completion).  Not exported.
 */
#ifndef TOKENBUCKET_REDIS_ASYNC_QUEUE_H
#define TOKENBUCKET_REDIS_ASYNC_QUEUE_H

#include <stdbool.h>
#include <stdint.h>

#include <hiredis/async.h>

#include "async_hook.h"
#include "cluster.h"
#include "fallback.h"

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
	struct op *wback;         /* the op last sent back to them, while it waits (tbr__async_wait_link) */
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
	/* A Sentinel client's questions (tbr__async_sentinel_step), on node only. */
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

/* async_queue.c */
void tbr__async_wait_link(struct tokenbucket_redis_async *a, struct op *o);
void tbr__async_bind_op(struct op *o, struct conn *c);
void tbr__async_sync_watch(struct conn *c);
void tbr__async_want(struct conn *c, unsigned set, unsigned clear);
void tbr__async_conn_write(struct conn *c);
void tbr__async_conn_flush(struct conn *c);
void tbr__async_arm_from(struct tokenbucket_redis_async *a, const struct op *from);
void tbr__async_arm(struct tokenbucket_redis_async *a);
void tbr__async_complete(struct op *o, int err, struct tokenbucket_result *res,
			 struct tokenbucket_reservation *rv, double tokens);
void tbr__async_again(struct op *o, int last_err, bool pause);
void tbr__async_conn_attach(struct conn *c, redisAsyncContext *ac);
void tbr__async_conn_drop(struct conn *c, int err);

#endif
