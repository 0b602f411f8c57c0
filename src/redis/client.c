/* SPDX-License-Identifier: MIT */
/*
 * Clients: one server (its pool, pool.c) or a cluster (cluster.c), the
 * round trip with its NOSCRIPT retry, the key prefix, and the local
 * fallback.  Any number of threads may call at once.
 */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>

#include "async.h"
#include "bridge.h"
#include "client.h"
#include "cluster.h"
#include "fallback.h"
#include "slots.h"
#include "sleep.h"


struct tokenbucket_redis {
	struct tbr__node node;        /* one server: its address and pool */
	struct tbr__cluster *cluster; /* or a cluster (tokenbucket_redis_open_cluster) */
	struct timeval connect_tv;
	int64_t command_ns;
	char *prefix;
	size_t prefixlen;
	struct tbr__fallback fallback;
	struct tbr__bridge *bridge; /* calls pipelined by an I/O thread, or NULL */
	_Atomic int module;         /* TOKENBUCKET_REDIS_MODULE_*, read by every call */
	_Atomic int connections;    /* per server, of the engines made from r; read by every call */
	_Atomic bool used;          /* a call or an asynchronous client was made: options are set */
	pthread_mutex_t deps_mu;    /* guards deps */
	struct tbr__dependent *deps; /* leases still open on this client */
};

static int64_t ns_or_default(int64_t ns)
{
	return ns <= 0 ? 1000000000 : ns;
}

/* A client with its timeouts and no server yet; NULL when out of memory. */
static struct tokenbucket_redis *client_new(int64_t connect_timeout_ns, int64_t command_timeout_ns)
{
	struct tokenbucket_redis *r = calloc(1, sizeof(*r));
	if (r == NULL)
		return NULL;
	tbr__node_init(&r->node);
	tbr__fallback_init(&r->fallback);
	pthread_mutex_init(&r->deps_mu, NULL);
	r->connect_tv = tb__timeval_of(ns_or_default(connect_timeout_ns));
	r->command_ns = ns_or_default(command_timeout_ns);
	atomic_init(&r->connections, TOKENBUCKET_REDIS_CONNECTIONS_DEFAULT);
	return r;
}

/* Hands r to the caller, or closes it when its server could not be set up. */
static int client_done(struct tokenbucket_redis **rp, struct tokenbucket_redis *r, int err)
{
	if (err != 0) {
		tokenbucket_redis_close(r);
		return err;
	}
	*rp = r;
	return 0;
}

int tokenbucket_redis_open(struct tokenbucket_redis **rp, const char *url,
			   int64_t connect_timeout_ns, int64_t command_timeout_ns)
{
	if (rp == NULL || url == NULL)
		return -EINVAL;
	struct tokenbucket_redis *r = client_new(connect_timeout_ns, command_timeout_ns);
	if (r == NULL)
		return -ENOMEM;
	return client_done(rp, r, tbr__node_parse(&r->node, url));
}

int tokenbucket_redis_open_cluster(struct tokenbucket_redis **rp, const char *const *seeds,
				   size_t nseeds, int64_t connect_timeout_ns,
				   int64_t command_timeout_ns)
{
	if (rp == NULL || seeds == NULL || nseeds == 0)
		return -EINVAL;
	struct tokenbucket_redis *r = client_new(connect_timeout_ns, command_timeout_ns);
	if (r == NULL)
		return -ENOMEM;
	int err = tbr__cluster_open(&r->cluster, seeds, nseeds, r->connect_tv, r->command_ns);
	if (err == 0)
		tbr__cluster_set_module(r->cluster, &r->module);
	return client_done(rp, r, err);
}

void tokenbucket_redis_close(struct tokenbucket_redis *r)
{
	if (r == NULL)
		return;
	/* Leases still open end first: their give-backs need the client. */
	pthread_mutex_lock(&r->deps_mu);
	while (r->deps != NULL) {
		struct tbr__dependent *d = r->deps;
		r->deps = d->next;
		d->prev = d->next = NULL;
		d->end(d);
	}
	pthread_mutex_unlock(&r->deps_mu);
	pthread_mutex_destroy(&r->deps_mu);
	tbr__bridge_close(r->bridge);
	tbr__node_fini(&r->node);
	tbr__cluster_close(r->cluster);
	tbr__fallback_fini(&r->fallback);
	free(r->prefix);
	free(r);
}

void tbr__client_attach(struct tokenbucket_redis *r, struct tbr__dependent *d)
{
	pthread_mutex_lock(&r->deps_mu);
	d->prev = NULL;
	d->next = r->deps;
	if (r->deps != NULL)
		r->deps->prev = d;
	r->deps = d;
	pthread_mutex_unlock(&r->deps_mu);
}

void tbr__client_detach(struct tokenbucket_redis *r, struct tbr__dependent *d)
{
	pthread_mutex_lock(&r->deps_mu);
	if (d->prev != NULL)
		d->prev->next = d->next;
	else if (r->deps == d)
		r->deps = d->next;
	if (d->next != NULL)
		d->next->prev = d->prev;
	d->prev = d->next = NULL;
	pthread_mutex_unlock(&r->deps_mu);
}

int tokenbucket_redis_set_prefix(struct tokenbucket_redis *r, const void *prefix, size_t len)
{
	if (r == NULL || (prefix == NULL && len > 0))
		return -EINVAL;
	char *copy = NULL;
	if (len > 0) {
		copy = malloc(len);
		if (copy == NULL)
			return -ENOMEM;
		memcpy(copy, prefix, len);
	}
	free(r->prefix);
	r->prefix = copy;
	r->prefixlen = len;
	return 0;
}

int tokenbucket_redis_set_fallback(struct tokenbucket_redis *r, double share)
{
	if (r == NULL || isnan(share) || share < 0 || share > 1)
		return -EINVAL;
	r->fallback.share = share;
	return 0;
}

/*
 * One round trip; a lost script cache is refilled by sending the text once.
 * A call that could not be written to a pooled connection never ran: it is
 * sent again on a new one.
 */
static int exchange(struct tokenbucket_redis *r, struct tokenbucket_redis_call *call,
		    struct tokenbucket_result *res, struct tokenbucket_reservation *rv,
		    double *tokens)
{
	bool demoted = false;
	for (;;) {
		struct tbr__conn *c = NULL;
		bool reused;
		int err = tbr__conn_get(&r->node, r->connect_tv, r->command_ns, &c, &reused);
		if (err != 0)
			return err;
		redisReply *rep;
		bool unsent;
		err = tbr__conn_call(c, call, false,
				     atomic_load_explicit(&r->module, memory_order_relaxed), &rep, &unsent);
		if (err != 0) {
			/* The reply may still come: the connection cannot be reused. */
			tbr__conn_drop(c);
			if (unsent && reused) {
				tbr__node_flush(&r->node); /* its siblings are likely gone too */
				continue;
			}
			return err;
		}
		tbr__conn_put(&r->node, c);
		err = tbr__decode(call, rep, res, rv, tokens);
		freeReplyObject(rep);
		if (err == -EROFS && r->node.sentinel != NULL && !demoted) {
			/*
			 * A primary demoted after a failover (READONLY: the call did
			 * not run): its pooled connections go, and a new one goes
			 * where the sentinels say the primary is now.
			 */
			demoted = true;
			tbr__node_flush(&r->node);
			continue;
		}
		if (err != -ENOEXEC || (call->flags & TOKENBUCKET_REDIS_EVAL))
			return err;
		call->flags |= TOKENBUCKET_REDIS_EVAL;
	}
}

/*
 * One decision on the server or the cluster.  Its writes raise no SIGPIPE
 * (tbr__write_nosignal; setup commands within tbr__sigpipe_block).
 */
static int round_trip(struct tokenbucket_redis *r, struct tokenbucket_redis_call *call,
		      struct tokenbucket_result *res, struct tokenbucket_reservation *rv,
		      double *tokens)
{
	/* A cluster that is down is unavailable at once to allow and reserve with a fallback. */
	bool down_returns = tbr__fallback_down_returns(&r->fallback, call);
	/* In a fork()ed child the I/O thread is gone: calls take the pool again. */
	int err = r->bridge != NULL && tbr__bridge_here(r->bridge)
		? tbr__bridge_call(r->bridge, call, res, rv, tokens)
		  : r->cluster != NULL
		? tbr__cluster_exchange(r->cluster, call, res, rv, tokens, down_returns)
		: exchange(r, call, res, rv, tokens);
	return err;
}


/* ---- The calls ----------------------------------------------------------- */

/* Runs call on prefix + key; the fallback answers allow and reserve if Redis cannot. */
static int run(struct tokenbucket_redis *r, struct tokenbucket_redis_call *call,
	       struct tokenbucket_result *res, struct tokenbucket_reservation *rv, double *tokens)
{
	if (r == NULL || (call->key == NULL && call->keylen > 0))
		return -EINVAL;
	/* Read first: a store from every call would share the line between threads. */
	if (!atomic_load_explicit(&r->used, memory_order_relaxed))
		atomic_store_explicit(&r->used, true, memory_order_relaxed);
	char stack[256];
	char *full = stack;
	size_t len = r->prefixlen + call->keylen;
	if (len < call->keylen)
		return -EINVAL;
	if (len > sizeof(stack)) {
		full = malloc(len);
		if (full == NULL)
			return -ENOMEM;
	}
	if (r->prefixlen > 0)
		memcpy(full, r->prefix, r->prefixlen);
	if (call->keylen > 0)
		memcpy(full + r->prefixlen, call->key, call->keylen);
	call->key = full;
	call->keylen = len;
	int err = tbr__fallback_apply(&r->fallback, call, round_trip(r, call, res, rv, tokens), res, rv);
	if (full != stack)
		free(full);
	return err;
}

int tbr__lease_call(struct tokenbucket_redis *r, const void *key, size_t keylen,
		    const struct tokenbucket_redis_limit *lim, enum tokenbucket_redis_op op, uint64_t n,
		    int64_t arg, struct tokenbucket_result *res)
{
	struct tokenbucket_redis_call call = { .op = op, .flags = TBR__LEASE, .key = key,
					       .keylen = keylen, .limit = *lim, .n = n, .arg = arg };
	return run(r, &call, res, NULL, NULL);
}

#define CALL(op_, at_, now_, n_, arg_) \
	{ .op = (op_), .flags = (at_) ? TOKENBUCKET_REDIS_AT : 0, .key = key, .keylen = keylen, \
	  .limit = *lim, .now = (now_), .n = (n_), .arg = (arg_) }

int tokenbucket_redis_allow_at(struct tokenbucket_redis *r, const void *key, size_t keylen,
			       const struct tokenbucket_redis_limit *lim, int64_t now, uint64_t n,
			       struct tokenbucket_result *res)
{
	if (lim == NULL)
		return -EINVAL;
	struct tokenbucket_redis_call call = CALL(TOKENBUCKET_REDIS_ALLOW, true, now, n, 0);
	return run(r, &call, res, NULL, NULL);
}

int tokenbucket_redis_allow(struct tokenbucket_redis *r, const void *key, size_t keylen,
			    const struct tokenbucket_redis_limit *lim, uint64_t n,
			    struct tokenbucket_result *res)
{
	if (lim == NULL)
		return -EINVAL;
	struct tokenbucket_redis_call call = CALL(TOKENBUCKET_REDIS_ALLOW, false, 0, n, 0);
	return run(r, &call, res, NULL, NULL);
}

static int reserve(struct tokenbucket_redis *r, const void *key, size_t keylen,
		   const struct tokenbucket_redis_limit *lim, bool at, int64_t now, uint64_t n,
		   int64_t max_wait, struct tokenbucket_reservation *rv,
		   struct tokenbucket_result *res)
{
	if (lim == NULL || rv == NULL)
		return -EINVAL;
	struct tokenbucket_redis_call call = CALL(TOKENBUCKET_REDIS_RESERVE, at, now, n, max_wait);
	return run(r, &call, res, rv, NULL);
}

int tokenbucket_redis_reserve_at(struct tokenbucket_redis *r, const void *key, size_t keylen,
				 const struct tokenbucket_redis_limit *lim, int64_t now, uint64_t n,
				 int64_t max_wait, struct tokenbucket_reservation *rv,
				 struct tokenbucket_result *res)
{
	return reserve(r, key, keylen, lim, true, now, n, max_wait, rv, res);
}

int tokenbucket_redis_reserve(struct tokenbucket_redis *r, const void *key, size_t keylen,
			      const struct tokenbucket_redis_limit *lim, uint64_t n,
			      int64_t max_wait, struct tokenbucket_reservation *rv,
			      struct tokenbucket_result *res)
{
	return reserve(r, key, keylen, lim, false, 0, n, max_wait, rv, res);
}

static int cancel(struct tokenbucket_redis *r, const void *key, size_t keylen,
		  const struct tokenbucket_redis_limit *lim, struct tokenbucket_reservation *rv,
		  bool at, int64_t now)
{
	if (r == NULL || lim == NULL || rv == NULL)
		return -EINVAL;
	if (rv->reserved == 1) {
		/* A reservation the local fallback made goes back to its bucket. */
		char *full;
		size_t len;
		int err = tbr__key_join(r->prefix, r->prefixlen, key, keylen, &full, &len);
		if (err != 0)
			return err;
		tbr__fallback_cancel(&r->fallback, full, len, rv);
		free(full);
		return 0;
	}
	struct tokenbucket_redis_call call =
		CALL(TOKENBUCKET_REDIS_CANCEL, at, now, rv->tokens, rv->time_to_act);
	int err = run(r, &call, NULL, NULL, NULL);
	if (err == 0)
		rv->tokens = 0;
	return err;
}

int tokenbucket_redis_cancel_at(struct tokenbucket_redis *r, const void *key, size_t keylen,
				const struct tokenbucket_redis_limit *lim,
				struct tokenbucket_reservation *rv, int64_t now)
{
	return cancel(r, key, keylen, lim, rv, true, now);
}

int tokenbucket_redis_cancel(struct tokenbucket_redis *r, const void *key, size_t keylen,
			     const struct tokenbucket_redis_limit *lim,
			     struct tokenbucket_reservation *rv)
{
	return cancel(r, key, keylen, lim, rv, false, 0);
}

static int refund(struct tokenbucket_redis *r, const void *key, size_t keylen,
		  const struct tokenbucket_limit *limit, bool at, int64_t now, uint64_t n)
{
	if (limit == NULL)
		return -EINVAL;
	const struct tokenbucket_redis_limit one = tbr__limit(limit), *lim = &one;
	struct tokenbucket_redis_call call = CALL(TOKENBUCKET_REDIS_REFUND, at, now, n, 0);
	return run(r, &call, NULL, NULL, NULL);
}

int tokenbucket_redis_refund_at(struct tokenbucket_redis *r, const void *key, size_t keylen,
				const struct tokenbucket_limit *lim, int64_t now, uint64_t n)
{
	return refund(r, key, keylen, lim, true, now, n);
}

int tokenbucket_redis_refund(struct tokenbucket_redis *r, const void *key, size_t keylen,
			     const struct tokenbucket_limit *lim, uint64_t n)
{
	return refund(r, key, keylen, lim, false, 0, n);
}

int tokenbucket_redis_tokens_at(struct tokenbucket_redis *r, const void *key, size_t keylen,
				const struct tokenbucket_redis_limit *lim, int64_t now,
				double *tokens, struct tokenbucket_result *res)
{
	if (lim == NULL)
		return -EINVAL;
	struct tokenbucket_redis_call call = CALL(TOKENBUCKET_REDIS_TOKENS, true, now, 0, 0);
	return run(r, &call, res, NULL, tokens);
}

int tokenbucket_redis_tokens(struct tokenbucket_redis *r, const void *key, size_t keylen,
			     const struct tokenbucket_redis_limit *lim, double *tokens,
			     struct tokenbucket_result *res)
{
	if (lim == NULL)
		return -EINVAL;
	struct tokenbucket_redis_call call = CALL(TOKENBUCKET_REDIS_TOKENS, false, 0, 0, 0);
	return run(r, &call, res, NULL, tokens);
}

int tokenbucket_redis_reset_at(struct tokenbucket_redis *r, const void *key, size_t keylen,
			       const struct tokenbucket_redis_limit *lim, int64_t now,
			       uint64_t tokens)
{
	if (lim == NULL)
		return -EINVAL;
	struct tokenbucket_redis_call call = CALL(TOKENBUCKET_REDIS_RESET, true, now, tokens, 0);
	return run(r, &call, NULL, NULL, NULL);
}

int tokenbucket_redis_reset(struct tokenbucket_redis *r, const void *key, size_t keylen,
			    const struct tokenbucket_redis_limit *lim, uint64_t tokens)
{
	if (lim == NULL)
		return -EINVAL;
	struct tokenbucket_redis_call call = CALL(TOKENBUCKET_REDIS_RESET, false, 0, tokens, 0);
	return run(r, &call, NULL, NULL, NULL);
}

static int allow_all(struct tokenbucket_redis *r, const void *key, size_t keylen,
		     const struct tokenbucket_limit *limits, size_t count, bool at,
		     int64_t now, uint64_t n, struct tokenbucket_set_result *res)
{
	if (limits == NULL || count == 0 || count > TOKENBUCKET_SET_MAX || res == NULL)
		return -EINVAL;
	struct tokenbucket_redis_call_all all = {
		.call = { .op = TOKENBUCKET_REDIS_ALLOW_ALL, .flags = at ? TOKENBUCKET_REDIS_AT : 0,
			  .key = key, .keylen = keylen, .now = now, .n = n },
		.limits = limits,
		.count = count,
		.res = res,
	};
	return run(r, &all.call, NULL, NULL, NULL);
}

int tokenbucket_redis_allow_all_at(struct tokenbucket_redis *r, const void *key, size_t keylen,
				   const struct tokenbucket_limit *limits, size_t count,
				   int64_t now, uint64_t n, struct tokenbucket_set_result *res)
{
	return allow_all(r, key, keylen, limits, count, true, now, n, res);
}

int tokenbucket_redis_allow_all(struct tokenbucket_redis *r, const void *key, size_t keylen,
				const struct tokenbucket_limit *limits, size_t count, uint64_t n,
				struct tokenbucket_set_result *res)
{
	return allow_all(r, key, keylen, limits, count, false, 0, n, res);
}

/* An engine on r's server or cluster, with r's timeout and fallback, and prefix if with_prefix. */
static struct tbr__async_config engine_config(struct tokenbucket_redis *r, bool with_prefix)
{
	return (struct tbr__async_config){
		.node = r->cluster != NULL ? NULL : &r->node,
		.cluster = r->cluster,
		.timeout_ns = r->command_ns,
		.prefix = with_prefix ? r->prefix : NULL,
		.prefixlen = with_prefix ? r->prefixlen : 0,
		.fallback = &r->fallback,
		.module = &r->module,
		.connections = &r->connections,
	};
}

int tokenbucket_redis_async_open(struct tokenbucket_redis_async **ap, struct tokenbucket_redis *r,
				 const struct tokenbucket_redis_loop *loop)
{
	if (r == NULL)
		return -EINVAL;
	const struct tbr__async_config cfg = engine_config(r, true);
	int err = tbr__async_open(ap, &cfg, loop);
	if (err == 0)
		atomic_store_explicit(&r->used, true, memory_order_relaxed);
	return err;
}

/* The options of opts that this library knows; -EINVAL or -E2BIG as tokenbucket_redis_configure. */
static int options_read(const struct tokenbucket_redis_options *opts,
			struct tokenbucket_redis_options *o)
{
	const size_t known = sizeof(*o);
	/* The first struct (1.2) is the smallest a caller can hold; no struct grows past 4 KiB. */
	if (opts->size < known || opts->size > 4096)
		return -EINVAL;
	/* A newer caller's fields past ours must hold their defaults (zero). */
	for (size_t i = known; i < opts->size; i++)
		if (((const unsigned char *)opts)[i] != 0)
			return -E2BIG;
	memcpy(o, opts, known);
	if (o->pipelining != 0 && o->pipelining != 1)
		return -EINVAL;
	if (o->module < TOKENBUCKET_REDIS_MODULE_AUTO || o->module > TOKENBUCKET_REDIS_MODULE_ALWAYS)
		return -EINVAL;
	if (o->connections == 0)
		o->connections = TOKENBUCKET_REDIS_CONNECTIONS_DEFAULT;
	if (o->connections < 1 || o->connections > TOKENBUCKET_REDIS_CONNECTIONS_MAX)
		return -EINVAL;
	return 0;
}

int tokenbucket_redis_configure(struct tokenbucket_redis *r,
				const struct tokenbucket_redis_options *opts)
{
	if (r == NULL || opts == NULL)
		return -EINVAL;
	struct tokenbucket_redis_options o;
	int err = options_read(opts, &o);
	if (err != 0)
		return err;
	if (atomic_load_explicit(&r->used, memory_order_relaxed))
		return -EBUSY;
	atomic_store_explicit(&r->module, o.module, memory_order_relaxed);
	atomic_store_explicit(&r->connections, o.connections, memory_order_relaxed);
	if (!o.pipelining) {
		tbr__bridge_close(r->bridge);
		r->bridge = NULL;
		return 0;
	}
	if (r->bridge != NULL)
		return 0;
	/* run() puts the prefix on each key before the engine sees it. */
	const struct tbr__async_config cfg = engine_config(r, false);
	return tbr__bridge_open(&r->bridge, &cfg);
}

int tokenbucket_redis_slot(const struct tokenbucket_redis *r, const void *key, size_t keylen)
{
	if (key == NULL && keylen > 0)
		return -EINVAL;
	if (r == NULL || r->prefixlen == 0)
		return (int)tbr__slot(key, keylen);
	size_t len = r->prefixlen + keylen;
	if (len < keylen)
		return -EINVAL;
	char *full = malloc(len);
	if (full == NULL)
		return -ENOMEM;
	memcpy(full, r->prefix, r->prefixlen);
	if (keylen > 0)
		memcpy(full + r->prefixlen, key, keylen);
	int slot = (int)tbr__slot(full, len);
	free(full);
	return slot;
}

const char *tokenbucket_redis_script(const char **sha1)
{
	if (sha1 != NULL)
		*sha1 = tbr__script_sha1;
	return tbr__script_text;
}
