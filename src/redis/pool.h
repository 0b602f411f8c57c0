/* SPDX-License-Identifier: MIT */
/*
 * Connections (pool.c): one server's address, its pool of idle blocking
 * hiredis connections, and one call's round trip on a connection.  Used by
 * the one-server client (client.c) and the cluster client (cluster.c);
 * needs only the codec below it.  Nothing here is exported.
 */
#ifndef TOKENBUCKET_REDIS_POOL_H
#define TOKENBUCKET_REDIS_POOL_H

#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/time.h>

#include "internal.h"
#include "sentinel.h"
#include "sigpipe.h"

/*
 * One connection, used by one thread at a time.  State that belongs to the
 * connection (what its server was found to support, say) goes here and is
 * set up once in pool.c's conn_setup.
 */
struct tbr__conn {
	redisContext *c;
	int64_t timeout_ns; /* the socket timeouts now set on c */
	int64_t deadline;   /* tokenbucket_now() by which its exchange ends: set by tbr__conn_get */
	struct tbr__bound bound; /* what its server sent so far, against the bounds */
	bool module;        /* its server has the module (until it answers otherwise) */
	bool function;      /* its server has the function library (the same) */
	uint64_t epoch;     /* a Sentinel client's: its node's epoch when it was made */
	struct tbr__conn *next;
};

/* One server's address and its pool of idle connections. */
struct tbr__node {
	pthread_mutex_t lock; /* idle and nidle */
	struct tbr__conn *idle;
	unsigned nidle;
	char *host; /* NULL for a unix socket */
	char *path;
	int port;
	int db;
	struct tbr__sentinel *sentinel; /* or NULL: the primary is asked for on every connection */
	_Atomic int64_t failed_at; /* tokenbucket_now() of its last failure (cluster nodes), or 0 */
	/*
	 * A Sentinel client's: the primary its connections go to, a count of
	 * its changes and the question that named it (under lock; a
	 * connection of an older epoch is closed, not pooled), the questions
	 * asked, and when the last began.
	 */
	char *primary_host;
	int primary_port;
	uint64_t epoch;
	uint64_t named_by;
	_Atomic uint64_t asks;
	_Atomic int64_t asked_at;
};

/*
 * redis://host[:port][/db], unix:/path[?db=N], /path, or
 * redis-sentinel://host[:port][,host[:port]...]/name[/db] into n's address.
 * -EINVAL, -ENOMEM (n's strings are then freed by tbr__node_fini).
 */
int tbr__node_parse(struct tbr__node *n, const char *url);
void tbr__node_init(struct tbr__node *n);
/* Closes n's idle connections and frees its address. */
void tbr__node_fini(struct tbr__node *n);
/* Closes n's idle connections: after a failure they may all be dead. */
void tbr__node_flush(struct tbr__node *n);

/*
 * An idle connection of n or a new one (connect within connect_tv, socket
 * timeouts timeout_ns).  An idle connection that has something to read
 * (its server closed it, or a reply nobody reads) is closed and skipped, so
 * one the server dropped while it sat in the pool is never handed out.
 * A Sentinel client's call asks the sentinel that answered last, at most
 * every TBR__CHECK_NS, where the primary is: when it names another, the
 * connections to the old one are closed as they come back.
 * *reused tells whether it came from the pool (may be NULL).
 */
int tbr__conn_get(struct tbr__node *n, struct timeval connect_tv, int64_t timeout_ns,
		  struct tbr__conn **out, bool *reused);
void tbr__conn_put(struct tbr__node *n, struct tbr__conn *c);
void tbr__conn_drop(struct tbr__conn *c);
/*
 * Sets c's socket timeouts to ns unless they are that already.  Its
 * exchange (setup, call, the replies read in full) ends by c->deadline,
 * tbr__conn_get's time plus its timeout: a reply trickled a byte at a
 * time fails with -ETIME then, whatever each read takes.
 */
int tbr__conn_timeout(struct tbr__conn *c, int64_t ns);

/*
 * Sends call on c (preceded by ASKING when asking; to the module or as the
 * script by mode, TOKENBUCKET_REDIS_MODULE_*, and what c found; an unknown
 * command under _AUTO sends it again as the script) and reads its reply into
 * *rep.  On failure, a negative errno, and *unsent is true when writing
 * failed: the server then never received the whole call, so it did not run
 * and may be sent again on another connection.  After a failure c cannot be
 * reused.
 */
int tbr__conn_call(struct tbr__conn *c, const struct tokenbucket_redis_call *call, bool asking,
		   int mode, redisReply **rep, bool *unsent);
/* One command of argc C strings (CLUSTER SLOTS, ...); its reply or a negative errno. */
int tbr__conn_command(struct tbr__conn *c, int argc, const char *const *argv, redisReply **rep);


#endif
