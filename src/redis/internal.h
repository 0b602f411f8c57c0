/* SPDX-License-Identifier: MIT */
/* libtokenbucket-redis's own pieces; nothing here is exported. */
#ifndef TOKENBUCKET_REDIS_INTERNAL_H
#define TOKENBUCKET_REDIS_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/time.h>

#include <hiredis/hiredis.h>

#include "tokenbucket-redis.h"

/* The script, embedded at build time from tokenbucket.lua (script.c). */
extern const char tbr__script_text[];
extern const char tbr__script_sha1[];

/* EVALSHA|EVAL sha|text 1 key op now tokens period burst n arg */
#define TBR__ARGC 11
struct tbr__args {
	const char *argv[TBR__ARGC];
	size_t len[TBR__ARGC];
	char num[6][24];
};

/* Checks call and points args at its fields; -EINVAL/-ERANGE on bad input. */
int tbr__args(const struct tokenbucket_redis_call *call, struct tbr__args *a);
/* An error reply's errno: -ENOEXEC for NOSCRIPT, -EBADMSG for a value that is not a bucket. */
int tbr__error(const char *str, size_t len);
/* A whole reply to call: 0 or a negative errno, with the outputs filled. */
int tbr__decode(const struct tokenbucket_redis_call *call, const redisReply *rep,
		struct tokenbucket_result *res, struct tokenbucket_reservation *rv,
		double *tokens);

/* ---- Connections (client.c), shared by the one-server and the cluster client ---- */

struct tbr__conn {
	redisContext *c;
	int64_t timeout_ns; /* the socket timeouts now set on c */
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
	_Atomic int64_t failed_at; /* tokenbucket_now() of its last failure (cluster nodes), or 0 */
};

/*
 * redis://host[:port][/db], unix:/path[?db=N], /path into n's address.
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
 * timeouts timeout_ns).  With check, an idle connection that has something
 * to read (the server closed it, or a stray reply) is closed and skipped.
 */
int tbr__conn_get(struct tbr__node *n, struct timeval connect_tv, int64_t timeout_ns,
		  bool check, struct tbr__conn **out);
void tbr__conn_put(struct tbr__node *n, struct tbr__conn *c);
void tbr__conn_drop(struct tbr__conn *c);
/* Sets c's socket timeouts to ns unless they are that already. */
int tbr__conn_timeout(struct tbr__conn *c, int64_t ns);
/* What a failed connection or round trip means, as a negative errno. */
int tbr__conn_error(const redisContext *c, int saved_errno);

/* ---- Redis Cluster (cluster.c) ---- */

struct tbr__cluster;

/* A cluster client knowing seeds (redis:// URLs, db 0); -EINVAL, -ENOMEM. */
int tbr__cluster_open(struct tbr__cluster **cp, const char *const *seeds, size_t nseeds,
		      struct timeval connect_tv, int64_t timeout_ns);
void tbr__cluster_close(struct tbr__cluster *cl);
/* call routed to the primary of its key's slot; the whole call within the timeout. */
int tbr__cluster_exchange(struct tbr__cluster *cl, struct tokenbucket_redis_call *call,
			  struct tokenbucket_result *res, struct tokenbucket_reservation *rv,
			  double *tokens);

#endif
