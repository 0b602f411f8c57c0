/* SPDX-License-Identifier: MIT */
/*
 * Routing over a Redis Cluster: the slot map learned from CLUSTER SLOTS,
 * a pool per node, and the redirections (MOVED, ASK, TRYAGAIN,
 * CLUSTERDOWN) followed within the call's time.
 *
 * A call is repeated only when it certainly did not run: its connection
 * could not be made, writing it failed, or the node answered with an error
 * that says it did not run the script (a redirection, NOSCRIPT, TRYAGAIN,
 * CLUSTERDOWN, LOADING, MASTERDOWN).  A call whose reply was lost (reset, timeout) may
 * have taken tokens and is never sent again: it returns that error.
 *
 * Concurrency: the map is an array of atomic node indices, read without a
 * lock; nodes are appended under a mutex and never removed until close, so
 * an index once read stays valid.  One thread at a time refreshes the map
 * (a try-lock: the others carry on with the map as it is).
 */
#include <errno.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cluster.h"
#include "slots.h"

/* Nodes a client remembers (seeds and every address a map or redirect named). */
#define TBR__NODES_MAX 1024
#define TBR__NONE UINT16_MAX
/* Pause before trying again a node that refused or a cluster that is not ready. */
#define TBR__PAUSE_NS INT64_C(10000000)
/* The least time between two map refreshes that a failure asks for. */
#define TBR__REFRESH_GAP_NS INT64_C(10000000)
/* How far a first attempt's socket timeout may reach past the call's deadline. */
#define TBR__SLACK_NS INT64_C(1000000)
/* A node that failed this recently is asked for the map only when the others do not answer. */
#define TBR__SUSPECT_NS INT64_C(1000000000)

struct tbr__cluster {
	struct timeval connect_tv;
	int64_t timeout_ns; /* a whole call, redirections included */
	pthread_mutex_t nodes_lock; /* appending to node */
	struct tbr__node *node[TBR__NODES_MAX];
	_Atomic unsigned nnodes;
	_Atomic uint16_t owner[TBR__SLOTS]; /* index of the slot's primary in node, or TBR__NONE */
	pthread_mutex_t refresh_lock;
	_Atomic bool stale;              /* the map may be wrong: refresh before the next call */
	_Atomic int64_t refreshed_at;    /* tokenbucket_now() of the last refresh */
	_Atomic unsigned turn;           /* rotates the node asked for the map */
	const _Atomic int *module;       /* TOKENBUCKET_REDIS_MODULE_*, or NULL: _AUTO */
};

void tbr__cluster_set_module(struct tbr__cluster *cl, const _Atomic int *mode)
{
	cl->module = mode;
}

/* -ENOSPC when the node table is full, -ENOMEM otherwise: why intern() gave NULL. */
static int intern_error(struct tbr__cluster *cl)
{
	return atomic_load_explicit(&cl->nnodes, memory_order_relaxed) >= TBR__NODES_MAX ? -ENOSPC
											  : -ENOMEM;
}

/* The node at host:port, added if new; NULL when the table is full or on ENOMEM. */
static struct tbr__node *intern(struct tbr__cluster *cl, const char *host, size_t hostlen, int port,
				uint16_t *index)
{
	unsigned n = atomic_load_explicit(&cl->nnodes, memory_order_acquire);
	for (unsigned i = 0; i < n; i++) {
		const struct tbr__node *x = cl->node[i];
		if (x->port == port && strlen(x->host) == hostlen && memcmp(x->host, host, hostlen) == 0) {
			*index = (uint16_t)i;
			return cl->node[i];
		}
	}
	pthread_mutex_lock(&cl->nodes_lock);
	unsigned m = atomic_load_explicit(&cl->nnodes, memory_order_relaxed);
	struct tbr__node *found = NULL;
	for (unsigned i = n; i < m && found == NULL; i++) {
		struct tbr__node *x = cl->node[i];
		if (x->port == port && strlen(x->host) == hostlen && memcmp(x->host, host, hostlen) == 0) {
			*index = (uint16_t)i;
			found = x;
		}
	}
	if (found == NULL && m < TBR__NODES_MAX && (found = malloc(sizeof(*found))) != NULL) {
		tbr__node_init(found);
		found->port = port;
		found->host = strndup(host, hostlen);
		if (found->host == NULL) {
			tbr__node_fini(found);
			free(found);
			found = NULL;
		} else {
			cl->node[m] = found;
			*index = (uint16_t)m;
			/* Release: a reader that sees the count sees the node. */
			atomic_store_explicit(&cl->nnodes, m + 1, memory_order_release);
		}
	}
	pthread_mutex_unlock(&cl->nodes_lock);
	return found;
}

int tbr__cluster_open(struct tbr__cluster **cp, const char *const *seeds, size_t nseeds,
		      struct timeval connect_tv, int64_t timeout_ns)
{
	struct tbr__cluster *cl = calloc(1, sizeof(*cl));
	if (cl == NULL)
		return -ENOMEM;
	pthread_mutex_init(&cl->nodes_lock, NULL);
	pthread_mutex_init(&cl->refresh_lock, NULL);
	cl->connect_tv = connect_tv;
	cl->timeout_ns = timeout_ns;
	for (unsigned s = 0; s < TBR__SLOTS; s++)
		atomic_init(&cl->owner[s], TBR__NONE);
	atomic_init(&cl->stale, true);
	int err = nseeds > TBR__NODES_MAX ? -EINVAL : 0;
	for (size_t i = 0; err == 0 && i < nseeds; i++) {
		struct tbr__node seed;
		tbr__node_init(&seed);
		err = seeds[i] == NULL ? -EINVAL : tbr__node_parse(&seed, seeds[i]);
		/* A cluster has database 0 only, and nodes name each other by host and port. */
		if (err == 0 && (seed.host == NULL || seed.db != 0))
			err = -EINVAL;
		uint16_t index;
		if (err == 0 && intern(cl, seed.host, strlen(seed.host), seed.port, &index) == NULL)
			err = -ENOMEM;
		tbr__node_fini(&seed);
	}
	if (err != 0) {
		tbr__cluster_close(cl);
		return err;
	}
	*cp = cl;
	return 0;
}

void tbr__cluster_close(struct tbr__cluster *cl)
{
	if (cl == NULL)
		return;
	unsigned n = atomic_load_explicit(&cl->nnodes, memory_order_acquire);
	for (unsigned i = 0; i < n; i++) {
		tbr__node_fini(cl->node[i]);
		free(cl->node[i]);
	}
	pthread_mutex_destroy(&cl->nodes_lock);
	pthread_mutex_destroy(&cl->refresh_lock);
	free(cl);
}

static void pause_until(int64_t deadline)
{
	int64_t left = deadline - tokenbucket_now();
	int64_t ns = left < TBR__PAUSE_NS ? left : TBR__PAUSE_NS;
	if (ns > 0)
		nanosleep(&(struct timespec){ .tv_sec = ns / 1000000000, .tv_nsec = ns % 1000000000 }, NULL);
}

static int64_t min64(int64_t a, int64_t b)
{
	return a < b ? a : b;
}

static struct timeval connect_within(const struct tbr__cluster *cl, int64_t left)
{
	int64_t ns = (int64_t)cl->connect_tv.tv_sec * 1000000000 + cl->connect_tv.tv_usec * 1000;
	ns = min64(ns, left);
	return (struct timeval){ .tv_sec = ns / 1000000000, .tv_usec = (ns % 1000000000) / 1000 };
}

/* A connection to n for at most left ns of I/O. */
static int get(struct tbr__cluster *cl, struct tbr__node *n, int64_t left, struct tbr__conn **c)
{
	/* Under a microsecond of socket timeout would mean none at all to the kernel. */
	if (left < 1000)
		return -ETIME;
	/* A first attempt keeps the full timeout set on its socket: no system call. */
	int64_t io = left >= cl->timeout_ns - TBR__SLACK_NS ? cl->timeout_ns : left;
	return tbr__conn_get(n, connect_within(cl, left), io, c, NULL);
}

/* Replaces the map with what node n (index self) says; 0 or a negative errno. */
static int ask_map(struct tbr__cluster *cl, struct tbr__node *n, int64_t deadline)
{
	struct tbr__conn *c;
	int err = get(cl, n, deadline - tokenbucket_now(), &c);
	if (err != 0)
		return err;
	static const char *const slots[] = { "CLUSTER", "SLOTS" };
	redisReply *rep;
	err = tbr__conn_command(c, 2, slots, &rep);
	if (err != 0) {
		tbr__conn_drop(c);
		return err;
	}
	tbr__conn_put(n, c);
	err = tbr__cluster_map(cl, n, rep);
	freeReplyObject(rep);
	return err;
}

int tbr__cluster_map(struct tbr__cluster *cl, const struct tbr__node *n, const redisReply *rep)
{
	struct tbr__range *g = NULL;
	size_t count = 0;
	int err = rep->type == REDIS_REPLY_ERROR ? tbr__error(rep->str, rep->len)
						 : tbr__slots_parse(rep, &g, &count);
	uint16_t *owner = err == 0 ? malloc(TBR__SLOTS * sizeof(*owner)) : NULL;
	if (err == 0 && owner == NULL)
		err = -ENOMEM;
	if (err == 0) {
		for (unsigned s = 0; s < TBR__SLOTS; s++)
			owner[s] = TBR__NONE;
		for (size_t i = 0; i < count && err == 0; i++) {
			uint16_t index;
			/* An empty host: the node that answered. */
			const char *host = g[i].hostlen > 0 ? g[i].host : n->host;
			size_t hostlen = g[i].hostlen > 0 ? g[i].hostlen : strlen(n->host);
			if (intern(cl, host, hostlen, g[i].port, &index) == NULL)
				err = intern_error(cl);
			for (unsigned s = g[i].start; err == 0 && s <= g[i].end; s++)
				owner[s] = index;
		}
	}
	if (err == 0) {
		for (unsigned s = 0; s < TBR__SLOTS; s++)
			atomic_store_explicit(&cl->owner[s], owner[s], memory_order_relaxed);
		atomic_store_explicit(&cl->stale, false, memory_order_relaxed);
	}
	free(owner);
	free(g);
	return err;
}

static void failed(struct tbr__node *n)
{
	atomic_store_explicit(&n->failed_at, tokenbucket_now(), memory_order_relaxed);
}

/*
 * Refreshes a stale map from the first node that answers, unless another
 * thread is at it.  Nodes that failed in the last second are asked last:
 * a paused one would spend the caller's time.
 */
static void refresh(struct tbr__cluster *cl, int64_t deadline)
{
	if (!atomic_load_explicit(&cl->stale, memory_order_relaxed) ||
	    pthread_mutex_trylock(&cl->refresh_lock) != 0)
		return;
	int64_t now = tokenbucket_now();
	if (atomic_load_explicit(&cl->stale, memory_order_relaxed) &&
	    now - atomic_load_explicit(&cl->refreshed_at, memory_order_relaxed) >= TBR__REFRESH_GAP_NS) {
		unsigned n = atomic_load_explicit(&cl->nnodes, memory_order_acquire);
		unsigned first = atomic_fetch_add_explicit(&cl->turn, 1, memory_order_relaxed);
		bool done = false;
		for (int pass = 0; pass < 2 && !done; pass++) {
			for (unsigned i = 0; i < n && !done && tokenbucket_now() < deadline; i++) {
				struct tbr__node *x = cl->node[(first + i) % n];
				int64_t f = atomic_load_explicit(&x->failed_at, memory_order_relaxed);
				bool recent = f != 0 && now - f < TBR__SUSPECT_NS;
				if (recent != (pass == 1))
					continue;
				done = ask_map(cl, x, deadline) == 0;
				if (!done)
					failed(x);
			}
		}
		if (done)
			atomic_store_explicit(&cl->stale, false, memory_order_relaxed);
		atomic_store_explicit(&cl->refreshed_at, tokenbucket_now(), memory_order_relaxed);
	}
	pthread_mutex_unlock(&cl->refresh_lock);
}

struct tbr__node *tbr__cluster_route(struct tbr__cluster *cl, unsigned slot)
{
	uint16_t i = atomic_load_explicit(&cl->owner[slot], memory_order_relaxed);
	unsigned n = atomic_load_explicit(&cl->nnodes, memory_order_acquire);
	if (i == TBR__NONE || i >= n)
		i = (uint16_t)(atomic_fetch_add_explicit(&cl->turn, 1, memory_order_relaxed) % n);
	return cl->node[i];
}

static bool starts(const redisReply *rep, const char *prefix)
{
	size_t n = strlen(prefix);
	return rep->len >= n && memcmp(rep->str, prefix, n) == 0;
}

int tbr__cluster_redirect(struct tbr__cluster *cl, const struct tbr__node *from,
			  const redisReply *rep, struct tbr__node **to, bool *ask)
{
	struct tbr__redirect rd;
	if (!(starts(rep, "MOVED ") || starts(rep, "ASK ")) ||
	    tbr__redirect_parse(rep->str, rep->len, &rd) != 0)
		return 1;
	/* An empty host: the host of the node that answered (Redis 7). */
	uint16_t index;
	*to = rd.hostlen > 0 ? intern(cl, rd.host, rd.hostlen, rd.port, &index)
			     : intern(cl, from->host, strlen(from->host), rd.port, &index);
	*ask = rd.ask;
	if (*to != NULL && !rd.ask) {
		/* This slot at once; the rest of the map on the next call. */
		atomic_store_explicit(&cl->owner[rd.slot], index, memory_order_relaxed);
		atomic_store_explicit(&cl->stale, true, memory_order_relaxed);
	}
	return *to == NULL ? intern_error(cl) : 0;
}

bool tbr__cluster_stale(struct tbr__cluster *cl)
{
	return atomic_load_explicit(&cl->stale, memory_order_relaxed);
}

void tbr__cluster_set_stale(struct tbr__cluster *cl)
{
	atomic_store_explicit(&cl->stale, true, memory_order_relaxed);
}

int64_t tbr__cluster_timeout(const struct tbr__cluster *cl)
{
	return cl->timeout_ns;
}

int tbr__cluster_exchange(struct tbr__cluster *cl, struct tokenbucket_redis_call *call,
			  struct tokenbucket_result *res, struct tokenbucket_reservation *rv,
			  double *tokens, bool down_returns)
{
	struct tbr__args check;
	int err = tbr__args(call, &check, false);
	if (err != 0)
		return err;
	const int64_t deadline = tokenbucket_now() + cl->timeout_ns;
	const unsigned slot = tbr__slot(call->key, call->keylen);
	/*
	 * The node a redirection named, for the next attempt (before the map
	 * is asked again, which may still name the node that redirected), and
	 * whether it goes after ASKING.
	 */
	struct tbr__node *next = NULL;
	bool ask = false;
	int redirects = 0;
	int unreached = 0; /* the last connection error since the call began */
	int64_t rtt = 0;   /* ns from send to answer of the last attempt answered */
	err = -ETIME;
	for (;;) {
		if (next == NULL)
			refresh(cl, deadline);
		int64_t left = deadline - tokenbucket_now();
		if (left <= 0)
			return err;
		/*
		 * After a not-ready answer the call is known not to have run; a retry
		 * that cannot be answered before the deadline would turn that into
		 * -ETIME (outcome unknown), so it is not sent.
		 */
		if (err == -EAGAIN && left < 2 * rtt + TBR__PAUSE_NS / 10)
			return err;
		struct tbr__node *n = next != NULL ? next : tbr__cluster_route(cl, slot);
		bool asking = next != NULL && ask;
		next = NULL;
		struct tbr__conn *c;
		int got = get(cl, n, left, &c);
		if (got != 0) {
			/* Nothing was sent: try again (the map may have moved on) until the time is up. */
			if (got == -ETIME && err == -EAGAIN)
				return err; /* no time left to connect: the last answer stands */
			err = got;
			unreached = got;
			failed(n);
			tbr__node_flush(n);
			atomic_store_explicit(&cl->stale, true, memory_order_relaxed);
			pause_until(deadline);
			continue;
		}
		redisReply *rep;
		bool unsent;
		int mode = cl->module != NULL ? atomic_load_explicit(cl->module, memory_order_relaxed)
					      : TOKENBUCKET_REDIS_MODULE_AUTO;
		int64_t sent = tokenbucket_now();
		err = tbr__conn_call(c, call, asking, mode, &rep, &unsent);
		rtt = tokenbucket_now() - sent;
		if (err != 0) {
			/* Its siblings may be dead too. */
			tbr__conn_drop(c);
			failed(n);
			tbr__node_flush(n);
			atomic_store_explicit(&cl->stale, true, memory_order_relaxed);
			if (!unsent)
				return err; /* the call may have run: it is not sent again */
			continue;
		}
		tbr__conn_put(n, c);
		if (rep->type != REDIS_REPLY_ERROR) {
			err = tbr__decode(call, rep, res, rv, tokens);
			freeReplyObject(rep);
			return err;
		}
		struct tbr__node *to;
		bool rd_ask;
		if (starts(rep, "NOSCRIPT") && !(call->flags & TOKENBUCKET_REDIS_EVAL)) {
			/* This node has not seen the script: the text, to the same node. */
			call->flags |= TOKENBUCKET_REDIS_EVAL;
			next = asking ? n : NULL;
			ask = asking;
			err = -ETIME;
		} else if (tbr__cluster_redirect(cl, n, rep, &to, &rd_ask) != 1) {
			err = to == NULL ? intern_error(cl) : tbr__redirects_spent(unreached);
			next = to;
			ask = rd_ask;
			if (to == NULL || ++redirects > TBR__REDIRECTS_MAX) {
				freeReplyObject(rep);
				return err;
			}
			err = -ETIME;
		} else if (starts(rep, "TRYAGAIN") || starts(rep, "CLUSTERDOWN") ||
			   starts(rep, "LOADING") || starts(rep, "MASTERDOWN")) {
			/* Not run; the cluster is moving a slot, electing, or loading. */
			err = -EAGAIN;
			atomic_store_explicit(&cl->stale, true, memory_order_relaxed);
			if (down_returns && starts(rep, "CLUSTERDOWN")) {
				/* The caller has a fallback: it decides now, not after the timeout. */
				freeReplyObject(rep);
				return err;
			}
			pause_until(deadline);
		} else {
			err = tbr__decode(call, rep, res, rv, tokens);
			freeReplyObject(rep);
			return err;
		}
		freeReplyObject(rep);
	}
}
