/* SPDX-License-Identifier: MIT */
/*
 * libtokenbucket-redis: libtokenbucket's bucket kept in Redis and shared by
 * every process that names the same key.
 *
 * Each decision is one round trip, one command that computes exactly what a
 * local bucket computes: TOKENBUCKET.CALL where the server has the native
 * module, else FCALL of the client's function library where it has
 * functions (Redis 7), else EVALSHA of the Lua script (installed as
 * tokenbucket.lua); each connection finds out which once, when it is made
 * (tokenbucket_redis_configure, tokenbucket-redis(7)).  A script cache
 * lost to a restart, a failover or SCRIPT FLUSH is refilled with EVAL on
 * the same call.  A client of a Redis Cluster
 * (tokenbucket_redis_open_cluster, since 1.1) routes each call to the
 * primary of its key's hash slot.
 *
 * Conventions:
 *  - Every call names a key (any bytes; prefixed with the client's prefix)
 *    and carries the key's configuration.  A stored bucket whose
 *    configuration differs is reconfigured at that instant, as
 *    tokenbucket_set_rate_every_at() and then tokenbucket_set_burst_at()
 *    would do.
 *  - Time comes from the Redis server (TIME, nanoseconds since the epoch);
 *    the _at functions take the caller's time instead, on any time base
 *    that every user of the key shares, as now right after the key and
 *    its limit(s) (docs/limits.md, "Where now goes").  Time never runs backwards per key.
 *    A key written at the server's time expires a second after its bucket
 *    is full again (a missing key is a full bucket); one written by an _at
 *    call does not expire, since its time need not be the server's.
 *  - Functions return 0 or a negative errno value; see tokenbucket-redis(7)
 *    for the table.  -ETIME means no reply within the command timeout.
 *  - One client may be used from any number of threads at once: each call
 *    takes a connection from the client's pool (opening one when none is
 *    idle), so calls run in parallel.  The set_* functions and
 *    tokenbucket_redis_configure must not run concurrently with calls.
 */
#ifndef TOKENBUCKET_REDIS_H
#define TOKENBUCKET_REDIS_H

#include <stddef.h>
#include <stdint.h>

#include <tokenbucket.h>

#ifdef __cplusplus
extern "C" {
#endif

struct tokenbucket_redis;

/*
 * A key's configuration as the 1.0 and 1.1 functions take it: tokens per
 * period_ns (tokens 0: rate 0), and burst.  Its layout is that of struct
 * tokenbucket_limit, which every function since 1.2 takes (the library
 * asserts that the two match).
 */
struct tokenbucket_redis_limit {
	uint64_t tokens;
	int64_t period_ns;
	uint64_t burst;
};

/* ---- Clients ------------------------------------------------------------- */

/*
 * Creates a client for url: "redis://host[:port][/db]", "unix:/path[?db=N]",
 * a socket path starting with "/", or (since 1.2)
 * "redis-sentinel://host[:port][,host[:port]...]/name[/db]": the primary of
 * master name as the Redis Sentinels there (port 26379 by default) say,
 * asked on every new connection, so a failover is followed.  Connections open on first use and
 * reopen on the call after a failure.  command_timeout_ns (<= 0: 1
 * second) is one deadline for a call's whole exchange, from its
 * connection attempt to the reply's last byte, not one per read;
 * connect_timeout_ns bounds each connection attempt within it.
 * -EINVAL: rp or url NULL, url malformed.  -ENOMEM.
 */
TOKENBUCKET_API int tokenbucket_redis_open(struct tokenbucket_redis **rp, const char *url,
					   int64_t connect_timeout_ns,
					   int64_t command_timeout_ns);
/*
 * Since 1.1.  Creates a client for a Redis Cluster known by nseeds seed
 * nodes, each "redis://host[:port]" (database 0; any node will do: the
 * client learns the rest from CLUSTER SLOTS on first use).  Each call goes
 * to the primary of its key's hash slot, follows MOVED and ASK, and loads
 * the script on nodes that lack it.  The call's whole time, redirections
 * and retries included, is bounded by command_timeout_ns (<= 0: 1 second);
 * connect_timeout_ns bounds each connection attempt within it.  Every
 * other function takes the cluster client as it takes a one-server client.
 * -EINVAL: rp or seeds NULL, nseeds 0 or above 1024, a seed NULL,
 * malformed, a unix socket or a database other than 0.  -ENOMEM.
 * Calls on a cluster client may also return -ELOOP (more than 16
 * redirections in one call), -EAGAIN (the cluster stayed down or kept
 * moving the slot for the whole timeout) and -ENOSPC (more than 1024
 * distinct node addresses seen).
 */
TOKENBUCKET_API int tokenbucket_redis_open_cluster(struct tokenbucket_redis **rp,
						   const char *const *seeds, size_t nseeds,
						   int64_t connect_timeout_ns,
						   int64_t command_timeout_ns);
/*
 * Since 1.1.  The Redis Cluster hash slot (0 to 16383) of key as a call on
 * r sends it: r's prefix and then key (r NULL: key alone), hashed whole or,
 * if it holds a "{tag}" (the first '{' and the first '}' after it, with at
 * least one byte between), the tag alone.  Keys with the same tag share a
 * slot, and so a node.  -EINVAL: key NULL with keylen > 0.  -ENOMEM.
 */
TOKENBUCKET_API int tokenbucket_redis_slot(const struct tokenbucket_redis *r, const void *key,
					   size_t keylen);
/* Closes every connection and frees the client; accepts NULL. */
TOKENBUCKET_API void tokenbucket_redis_close(struct tokenbucket_redis *r);
/*
 * Prepends prefix (len bytes, may hold a Cluster hash tag "{...}") to every
 * key.  -EINVAL: r NULL, prefix NULL with len > 0.  -ENOMEM.
 */
TOKENBUCKET_API int tokenbucket_redis_set_prefix(struct tokenbucket_redis *r,
						 const void *prefix, size_t len);
/*
 * When Redis cannot answer (connection, timeout, OOM, READONLY, BUSY,
 * LOADING, a cluster that is down), allow and reserve decide with a local
 * bucket per key holding share (0 < share <= 1) of the rate and of the
 * burst, and say so with TOKENBUCKET_RESULT_LOCAL.  A cluster node's
 * CLUSTERDOWN is taken at once, without waiting for the timeout.  share 0
 * turns the fallback off (the default).
 * -EINVAL: r NULL, share NaN, negative or above 1.
 */
TOKENBUCKET_API int tokenbucket_redis_set_fallback(struct tokenbucket_redis *r, double share);

/*
 * Since 1.2.  A client's options, all given at once by
 * tokenbucket_redis_configure.  size is sizeof(struct
 * tokenbucket_redis_options) as the caller was compiled: later versions
 * add fields at the end, and a field the library does not know must be 0.
 * Every field 0 is the default.
 *  - pipelining 1: the blocking calls of every thread share a few
 *    connections per server, written together and answered in order by an
 *    I/O thread of the client's (auto-pipelining), so threads no longer
 *    need a connection each; a call's errors, timeout, fallback and
 *    redirections are those of tokenbucket_redis_async_start.  0: each
 *    call in flight has a pooled connection of its own.  The I/O thread
 *    does not survive fork(): in a child the calls take pooled
 *    connections.
 *  - module: which command decides.  Every connection asks its server
 *    once, when it is made, whether the native module is loaded
 *    (TOKENBUCKET.VERSION, a version this library speaks); with _AUTO its
 *    calls then go as TOKENBUCKET.CALL, otherwise as FCALL of the function
 *    library where the server has functions, else as the script, and a
 *    server that unloads the module makes the connection go back to the
 *    script.  All decide alike on the same stored value.  _NEVER always
 *    sends the script; _ALWAYS always sends TOKENBUCKET.CALL (a server
 *    without the module answers -EPROTO), for tests and benchmarks.
 *  - connections: how many connections per server the asynchronous
 *    clients made from r and its pipelining may use, 1 to
 *    TOKENBUCKET_REDIS_CONNECTIONS_MAX (0: _DEFAULT).  A server's first
 *    connection opens with its first call; another opens only while every
 *    one is busy, so a quiet client keeps one.  A call goes on the
 *    connection with the fewest calls in flight, except that the calls of
 *    one key in flight together share one, so a key's calls are decided in
 *    the order they were started.
 */
#define TOKENBUCKET_REDIS_MODULE_AUTO 0
#define TOKENBUCKET_REDIS_MODULE_NEVER 1
#define TOKENBUCKET_REDIS_MODULE_ALWAYS 2
#define TOKENBUCKET_REDIS_CONNECTIONS_DEFAULT 4
#define TOKENBUCKET_REDIS_CONNECTIONS_MAX 64
struct tokenbucket_redis_options {
	size_t size;     /* sizeof(struct tokenbucket_redis_options) */
	int pipelining;  /* 0 or 1 */
	int module;      /* TOKENBUCKET_REDIS_MODULE_* */
	int connections; /* per server; 0: TOKENBUCKET_REDIS_CONNECTIONS_DEFAULT */
};

/*
 * Since 1.2.  Sets r's options (copied) after tokenbucket_redis_open or
 * _open_cluster and before r's first call or asynchronous client, as
 * libuv's uv_loop_configure comes before uv_run: one function serves every
 * kind of client (a URL, a Sentinel, a cluster's seeds), where options
 * given to the open functions would need an open of each kind, and a
 * client's calls never see its options change.  May be called again
 * until then; the last call counts.  0, or -EINVAL: r or opts NULL,
 * opts->size below this struct's, a field out of range.  -E2BIG: a field
 * past those this library knows is not 0.  -EBUSY: r already made a call
 * or an asynchronous client (nothing changes).  With pipelining: -ENOMEM,
 * -EAGAIN (no thread), -EMFILE.
 */
TOKENBUCKET_API int tokenbucket_redis_configure(struct tokenbucket_redis *r,
						const struct tokenbucket_redis_options *opts);

/* ---- Decisions ----------------------------------------------------------- */

/*
 * Go's AllowN on the shared bucket: takes n tokens if they are there.
 * 0 and *res filled (res->allowed says whether; n > burst is refused with
 * retry_after_ns TOKENBUCKET_NEVER).  res may be NULL.
 */
TOKENBUCKET_API int tokenbucket_redis_allow(struct tokenbucket_redis *r, const void *key,
					    size_t keylen,
					    const struct tokenbucket_redis_limit *lim, uint64_t n,
					    struct tokenbucket_result *res);
TOKENBUCKET_API int tokenbucket_redis_allow_at(struct tokenbucket_redis *r, const void *key,
					       size_t keylen,
					       const struct tokenbucket_redis_limit *lim,
					       int64_t now, uint64_t n,
					       struct tokenbucket_result *res);
/*
 * Go's reserveN: takes n tokens, possibly into debt, if they are there within
 * max_wait ns (TOKENBUCKET_NEVER: no limit); rv->time_to_act is on the
 * server's clock (or the caller's, for _at).  -E2BIG: n > burst.
 * -ETIMEDOUT: the wait would exceed max_wait (*res still filled).
 * -EOVERFLOW: the debt would exceed TOKENBUCKET_DEBT_MAX.  res may be NULL.
 */
TOKENBUCKET_API int tokenbucket_redis_reserve(struct tokenbucket_redis *r, const void *key,
					      size_t keylen,
					      const struct tokenbucket_redis_limit *lim, uint64_t n,
					      int64_t max_wait, struct tokenbucket_reservation *rv,
					      struct tokenbucket_result *res);
TOKENBUCKET_API int tokenbucket_redis_reserve_at(struct tokenbucket_redis *r, const void *key,
						 size_t keylen,
						 const struct tokenbucket_redis_limit *lim,
						 int64_t now, uint64_t n, int64_t max_wait,
						 struct tokenbucket_reservation *rv,
						 struct tokenbucket_result *res);
/*
 * Go's CancelAt, exact: gives back all rv->tokens unless now is past
 * rv->time_to_act, within burst, and sets rv->tokens to 0.
 */
TOKENBUCKET_API int tokenbucket_redis_cancel(struct tokenbucket_redis *r, const void *key,
					     size_t keylen,
					     const struct tokenbucket_redis_limit *lim,
					     struct tokenbucket_reservation *rv);
TOKENBUCKET_API int tokenbucket_redis_cancel_at(struct tokenbucket_redis *r, const void *key,
						size_t keylen,
						const struct tokenbucket_redis_limit *lim,
						struct tokenbucket_reservation *rv, int64_t now);
/*
 * Since 1.2.  Gives n tokens taken earlier (by allow or reserve) back to the
 * shared bucket at the call's time, as tokenbucket_refund() does to a local
 * one: debt is paid first, and nothing lifts the bucket above its burst.
 * The server cannot tell whose tokens they are: give back only what was
 * taken and not used.  -E2BIG: n > burst (nothing changes).
 */
TOKENBUCKET_API int tokenbucket_redis_refund(struct tokenbucket_redis *r, const void *key,
					     size_t keylen,
					     const struct tokenbucket_limit *lim, uint64_t n);
TOKENBUCKET_API int tokenbucket_redis_refund_at(struct tokenbucket_redis *r, const void *key,
						size_t keylen,
						const struct tokenbucket_limit *lim,
						int64_t now, uint64_t n);
/*
 * Go's TokensAt: *tokens is the level (negative in debt, fractional where
 * the rate makes it so).  tokens and res may be NULL.
 */
TOKENBUCKET_API int tokenbucket_redis_tokens(struct tokenbucket_redis *r, const void *key,
					     size_t keylen,
					     const struct tokenbucket_redis_limit *lim,
					     double *tokens, struct tokenbucket_result *res);
TOKENBUCKET_API int tokenbucket_redis_tokens_at(struct tokenbucket_redis *r, const void *key,
						size_t keylen,
						const struct tokenbucket_redis_limit *lim,
						int64_t now, double *tokens,
						struct tokenbucket_result *res);
/*
 * The bucket's clock becomes now (even if earlier) and it holds tokens.
 * -EINVAL also when tokens > burst.
 */
TOKENBUCKET_API int tokenbucket_redis_reset(struct tokenbucket_redis *r, const void *key,
					    size_t keylen,
					    const struct tokenbucket_redis_limit *lim,
					    uint64_t tokens);
TOKENBUCKET_API int tokenbucket_redis_reset_at(struct tokenbucket_redis *r, const void *key,
					       size_t keylen,
					       const struct tokenbucket_redis_limit *lim,
					       int64_t now, uint64_t tokens);
/*
 * Go's WaitN on the shared bucket: reserves n tokens, then sleeps until
 * they are there.  deadline is absolute on tokenbucket_now()'s clock
 * (TOKENBUCKET_NEVER: none); cancel_fd becomes readable to cancel, or is -1.
 * -ETIMEDOUT: not there by the deadline (nothing taken).  -ECANCELED: the
 * reservation is given back.  -EBADF: cancel_fd is not open.
 */
TOKENBUCKET_API int tokenbucket_redis_wait(struct tokenbucket_redis *r, const void *key,
					   size_t keylen,
					   const struct tokenbucket_redis_limit *lim, uint64_t n,
					   int64_t deadline, int cancel_fd);

/*
 * Since 1.2.  Several limits in one key ("10 a second and 1000 an hour"),
 * decided in one round trip: takes n tokens from every limit or from none,
 * as tokenbucket_allow_all_at does on local buckets, and reports the
 * decision in *res (index: the lowest limit short of n if refused, the one
 * with the fewest whole tokens left if taken).  limits[0] to
 * limits[count - 1] (1 to TOKENBUCKET_SET_MAX) are the key's configuration,
 * carried by every call as a single limit's is: a limit whose
 * configuration differs is reconfigured at that instant, one not stored
 * yet starts full, and the key keeps no limit past count.  The key holds
 * all its limits in one value of its own kind ("tbs1", tokenbucket-redis(7)):
 * the single-limit calls refuse it, and this call refuses a single
 * limit's value, with -EBADMSG, changing nothing.  Time and expiry as for
 * the other calls; the key expires a second after every limit is full.
 * Pipelined with the other calls when pipelining is on.  When Redis
 * cannot answer, the local fallback decides with a local bucket per limit
 * (res->flags TOKENBUCKET_RESULT_LOCAL), as for allow.  0, or -EINVAL:
 * limits or res NULL, count 0 or above TOKENBUCKET_SET_MAX, a bad rate;
 * -ERANGE: a burst above TOKENBUCKET_BURST_MAX; -E2BIG: n above some
 * limit's burst (nothing changes); -EBADMSG; the errors of every call
 * (*res untouched then).
 */
TOKENBUCKET_API int tokenbucket_redis_allow_all(struct tokenbucket_redis *r, const void *key,
						size_t keylen,
						const struct tokenbucket_limit *limits,
						size_t count, uint64_t n,
						struct tokenbucket_set_result *res);
TOKENBUCKET_API int tokenbucket_redis_allow_all_at(struct tokenbucket_redis *r, const void *key,
						   size_t keylen,
						   const struct tokenbucket_limit *limits,
						   size_t count, int64_t now, uint64_t n,
						   struct tokenbucket_set_result *res);

/* ---- Leases: a hot key decided locally ----------------------------------- */

struct tokenbucket_redis_lease;

/*
 * Since 1.2.  Opts key in to leases on client r (docs/leases.md): a thread
 * of the lease's takes the key's tokens from the shared bucket a chunk per
 * round trip (with allow, on the server's clock), and
 * tokenbucket_redis_lease_allow spends them locally, without a round trip.
 * A chunk is at most cap = min(share * burst, the tokens the rate makes
 * in window_ns) (rate 0: share * burst), starts at cap / 64 (at least 1),
 * doubles when a chunk lasts less than window_ns or a caller was refused,
 * halves when one lasts more than two windows, and goes back to the start
 * when the key is quiet; the next chunk is asked for when fewer than half
 * a chunk are left, so that callers rarely find none.  While other clients
 * drain the shared bucket, a lease takes what is there every window_ns / 4
 * on average (each turn drawn from 1/8 to 3/8 of window_ns); after a
 * failed round trip it tries again window_ns / 8 later.  The lease holds at most 2 * cap tokens.  Tokens not used go back to the
 * shared bucket (TOKENBUCKET_REDIS_REFUND) when a whole window passes
 * without a call, and at tokenbucket_redis_lease_close.  A grant of the
 * client's local fallback is never taken as a lease.  Other processes and
 * keys without a lease share the same bucket call by call.  A lease still
 * open at tokenbucket_redis_close gives everything back then and refuses
 * every later call with -ESHUTDOWN; tokenbucket_redis_lease_close still
 * frees it.  -EINVAL: lp, r or lim NULL, key NULL with keylen > 0, share
 * NaN or not in (0, 1], window_ns <= 0, a bad rate, or cap 0 (share *
 * burst or the window's tokens below 1).  -ERANGE: burst above
 * TOKENBUCKET_BURST_MAX, window_ns above an hour, or the rate making a
 * burst or more in 3/8 of window_ns (a contended lease's turns may be
 * that far apart; the bucket would drop what it makes meanwhile).  -ENOMEM,
 * -EAGAIN (no thread).
 */
TOKENBUCKET_API int tokenbucket_redis_lease_open(struct tokenbucket_redis_lease **lp,
						 struct tokenbucket_redis *r, const void *key,
						 size_t keylen,
						 const struct tokenbucket_limit *lim,
						 double share, int64_t window_ns);
/*
 * Since 1.2.  Go's AllowN on the lease's key, decided locally from the
 * tokens leased: never a round trip, never a wait, any number of threads
 * at once.  When the tokens held are not enough (used up, and the next
 * chunk still in flight or not there in the shared bucket), the call is
 * refused at once: res->allowed false, res->retry_after_ns an estimate of
 * when the next chunk lands (the last round trip's time, or the wait for
 * the lease's next turn at a shared bucket that other clients drain).  n above cap goes to Redis call by call
 * (tokenbucket_redis_allow).  res->remaining is the tokens held locally.
 * res may be NULL.  0, or -EINVAL (l NULL), or for n above cap what
 * tokenbucket_redis_allow returns (-ESHUTDOWN after the client closed).
 */
TOKENBUCKET_API int tokenbucket_redis_lease_allow(struct tokenbucket_redis_lease *l, uint64_t n,
						  struct tokenbucket_result *res);
/*
 * Since 1.2.  *tokens: the whole tokens the lease holds now, unused.
 * Returns 0, or the error of the latest round trip while it stands
 * (callers are refused until Redis answers again), -ESHUTDOWN once the
 * client closed; -EINVAL: a NULL argument.
 */
TOKENBUCKET_API int tokenbucket_redis_lease_tokens(struct tokenbucket_redis_lease *l,
						   uint64_t *tokens);
/*
 * Since 1.2.  Stops the lease's thread, gives its unused tokens back to the
 * shared bucket (with those of reservations still queued, which end) and
 * frees l (NULL: nothing, 0).  No other call on l may be running, nor
 * tokenbucket_redis_close on its client.  0, or the give-back's error (the
 * tokens are then lost to every client until the rate makes them again;
 * the limit is kept).  After the client closed: frees l, 0.
 */
TOKENBUCKET_API int tokenbucket_redis_lease_close(struct tokenbucket_redis_lease *l);
/*
 * Since 1.2.  Go's ReserveN on a lease: n tokens from those it holds, or
 * queued for the lease's next refills (first come, first covered).  The
 * tokens are the caller's only once covered: when *rv comes back with
 * rv->ticket 0 (covered at once), or once tokenbucket_redis_lease_deficiency
 * says 0.  rv->time_to_act (tokenbucket_now()'s clock) is then an
 * estimate, never a promise: what the key's full rate needs to make the
 * tokens queued up to this reservation, after a round trip; contention or
 * a server fault make it later, a full shared bucket earlier.  max_wait
 * bounds that estimate.  On error nothing is taken.  -EINVAL: l or rv
 * NULL.  -E2BIG: n above the lease's cap (reserve through
 * tokenbucket_redis_reserve instead).  -ETIMEDOUT: the estimate exceeds
 * max_wait (always with max_wait < 0; with rate 0, unless the tokens are
 * held).  -ENOMEM.  -ESHUTDOWN: the client was closed.
 */
TOKENBUCKET_API int tokenbucket_redis_lease_reserve(struct tokenbucket_redis_lease *l,
						    uint64_t n, int64_t max_wait,
						    struct tokenbucket_reservation *rv);
/*
 * Since 1.2.  *deficiency: the tokens reservation rv of lease l still
 * lacks, as tokenbucket_deficiency() says of a bucket's ticket; 0 means
 * go.  -EINVAL: a NULL argument, or rv not made by l.  -ESHUTDOWN: the
 * client was closed (a reservation queued then is never covered:
 * *deficiency stays above 0).
 */
TOKENBUCKET_API int tokenbucket_redis_lease_deficiency(struct tokenbucket_redis_lease *l,
						       const struct tokenbucket_reservation *rv,
						       uint64_t *deficiency);
/*
 * Since 1.2.  Gives back exactly the tokens reservation rv took, covered or
 * not, whatever the time (unlike tokenbucket_cancel: time_to_act is only an
 * estimate here): the part its refills gave it goes to the reservations
 * queued after it, then to the lease, and what the lease has no room for
 * to the shared bucket at its next give-back.  rv->tokens becomes 0, so a
 * second cancel gives nothing; the caller must not have used the tokens
 * (a copy of rv cancelled twice gives twice, as with the core).  After the
 * client closed, nothing is given (all went back then).  -EINVAL: l or rv
 * NULL, or rv not made by l.
 */
TOKENBUCKET_API int tokenbucket_redis_lease_cancel(struct tokenbucket_redis_lease *l,
						   struct tokenbucket_reservation *rv);
/*
 * Since 1.2.  Go's WaitN on a lease: reserves n tokens as
 * tokenbucket_redis_lease_reserve does, then sleeps (never spinning) until
 * the lease's refills cover them.  deadline is absolute on
 * tokenbucket_now()'s clock (TOKENBUCKET_NEVER: none); cancel_fd becomes
 * readable (or hangs up) to cancel, or is -1.  A wait that fails takes
 * nothing: its reservation is cancelled.  0: the tokens are taken.
 * -EINVAL: l NULL.  -ETIMEDOUT: the estimate is past the deadline (nothing
 * reserved), or the deadline came first.  -ECANCELED: cancel_fd readable
 * or hung up, on entry or while sleeping.  -EBADF: cancel_fd not open, on
 * entry or while sleeping (noticed within 50 ms).  n above cap: what
 * tokenbucket_redis_wait returns on the lease's key.  -ENOMEM,
 * -ESHUTDOWN as for tokenbucket_redis_lease_reserve; -EMFILE, -ENFILE (no
 * eventfd to sleep on).
 */
TOKENBUCKET_API int tokenbucket_redis_lease_wait(struct tokenbucket_redis_lease *l, uint64_t n,
						 int64_t deadline, int cancel_fd);

/* ---- Without blocking: build the command, parse the reply ---------------- */

enum tokenbucket_redis_op {
	TOKENBUCKET_REDIS_ALLOW,
	TOKENBUCKET_REDIS_RESERVE,
	TOKENBUCKET_REDIS_CANCEL,
	TOKENBUCKET_REDIS_TOKENS,
	TOKENBUCKET_REDIS_RESET,
	/*
	 * Since 1.2: gives n tokens taken earlier back to the bucket at now,
	 * paying any debt first, within burst (the core's tokenbucket_refund);
	 * n > burst changes nothing and returns -E2BIG.  Leases use it for the
	 * tokens they did not use.
	 */
	TOKENBUCKET_REDIS_REFUND,
	/*
	 * Since 1.2: tokenbucket_redis_allow_all, in the call of a struct
	 * tokenbucket_redis_call_all (below), never in a call of its own.
	 */
	TOKENBUCKET_REDIS_ALLOW_ALL
};
/* Flags of struct tokenbucket_redis_call. */
#define TOKENBUCKET_REDIS_AT (1u << 0)   /* use now, not the server's clock */
#define TOKENBUCKET_REDIS_EVAL (1u << 1) /* send the script's text (after -ENOEXEC) */

/* One call, as the blocking functions above make it. */
struct tokenbucket_redis_call {
	enum tokenbucket_redis_op op;
	unsigned flags;                       /* TOKENBUCKET_REDIS_* */
	const void *key;                      /* the whole key: no prefix is added */
	size_t keylen;
	struct tokenbucket_redis_limit limit;
	int64_t now;                          /* with TOKENBUCKET_REDIS_AT */
	uint64_t n;                           /* tokens; for RESET the level */
	int64_t arg;                          /* RESERVE: max_wait; CANCEL: time_to_act */
};

/*
 * Since 1.2.  Several limits in one key (tokenbucket_redis_allow_all) as a
 * call: format, parse and async_start take &call_all.call, with call.op
 * TOKENBUCKET_REDIS_ALLOW_ALL (call.limit unused), and read limits[0] to
 * limits[count - 1] from here; the call struct of 1.0 cannot grow, so it
 * is embedded.  res (may be NULL) receives the decision: from parse, and
 * from async_start before done runs (it must then stay valid until done).
 */
struct tokenbucket_redis_call_all {
	struct tokenbucket_redis_call call;
	const struct tokenbucket_limit *limits;
	size_t count;
	struct tokenbucket_set_result *res;
};

/*
 * Writes the command for call in Redis's protocol to a new buffer *cmd of
 * *len bytes (free it with free()), to be sent on any connection.
 * -EINVAL: a NULL pointer, a bad op, flag or configuration.  -ENOMEM.
 */
TOKENBUCKET_API int tokenbucket_redis_format(const struct tokenbucket_redis_call *call,
					     char **cmd, size_t *len);
/*
 * Parses the reply to call at the start of buf (len bytes read so far):
 * 0 and *used bytes consumed once a whole reply is there, -EAGAIN while it
 * is not; -ENOEXEC when the script is not loaded (send the call again with
 * TOKENBUCKET_REDIS_EVAL); otherwise what the blocking call returns, with
 * *used set too.  res, rv (RESERVE) and tokens (TOKENS) may be NULL.  For
 * TOKENBUCKET_REDIS_ALLOW_ALL the decision goes to the call_all's res, and
 * to res in a single limit's terms (the limit at its index).
 */
TOKENBUCKET_API int tokenbucket_redis_parse(const struct tokenbucket_redis_call *call,
					    const char *buf, size_t len, size_t *used,
					    struct tokenbucket_result *res,
					    struct tokenbucket_reservation *rv, double *tokens);
/* The Lua script's text (NUL-terminated) and, if sha1 is not NULL, its SHA-1 in hex. */
TOKENBUCKET_API const char *tokenbucket_redis_script(const char **sha1);

/* ---- The asynchronous client: an event loop drives it -------------------- */

struct tokenbucket_redis_async;

/* Events of tokenbucket_redis_loop.watch and tokenbucket_redis_async_ready. */
#define TOKENBUCKET_REDIS_READ (1u << 0)
#define TOKENBUCKET_REDIS_WRITE (1u << 1)

/*
 * What the library asks of an event loop, as libcurl's multi interface and
 * c-ares do.  The library calls these from within its own functions only:
 *  - watch: from now on, tell tokenbucket_redis_async_ready when fd is ready
 *    for events (TOKENBUCKET_REDIS_READ | _WRITE); 0: stop watching fd (it
 *    may be closed right after).  _WRITE is asked for when calls wait to
 *    be written, and dropped once they are: a level-triggered loop
 *    (poll, epoll, libevent, libuv) reports it on its next turn, which is
 *    when the calls started since go out together.
 *  - timer: call tokenbucket_redis_async_timeout once, ns nanoseconds from
 *    now (0: as soon as the loop can, never from within this call); a
 *    negative ns disarms it.  Each call replaces the previous timer.
 *  - free: the async client is being closed; data is no longer used.  May
 *    be NULL.
 */
struct tokenbucket_redis_loop {
	void *data;
	void (*watch)(void *data, int fd, unsigned events);
	void (*timer)(void *data, int64_t ns);
	void (*free)(void *data);
};

/*
 * A call's completion: err and the outputs the blocking call would give
 * (res for every op; rv for a reservation granted; tokens for TOKENS, 0
 * otherwise).  The pointers are valid during the callback only.
 */
typedef void tokenbucket_redis_done_fn(void *arg, int err, const struct tokenbucket_result *res,
				       const struct tokenbucket_reservation *rv, double tokens);

/*
 * Since 1.2.  An asynchronous client on r's server or cluster: same
 * address (or seeds and slot map), timeouts, key prefix and local fallback
 * as r, with connections of its own (up to r's options' connections per
 * server, tokenbucket_redis_configure) driven by loop (copied).  r must
 * outlive it; r's blocking calls go on working beside it.  The async client belongs to the loop's thread: its functions must
 * not run concurrently with each other.  Made from a Sentinel client, it
 * asks the sentinels itself, without blocking, while its calls wait.
 * -EINVAL: a NULL argument, loop without watch or timer.  -ENOMEM.
 */
TOKENBUCKET_API int tokenbucket_redis_async_open(struct tokenbucket_redis_async **ap,
						 struct tokenbucket_redis *r,
						 const struct tokenbucket_redis_loop *loop);
/*
 * Since 1.2.  Completes every call still in flight with -ECANCELED, stops
 * watching, calls loop->free and frees a (NULL: nothing).  May be called
 * from a completion callback.
 */
TOKENBUCKET_API void tokenbucket_redis_async_close(struct tokenbucket_redis_async *a);
/*
 * Since 1.2.  Starts call (TOKENBUCKET_REDIS_AT in its flags for the _at
 * form; the client's prefix is added to its key) and returns at once:
 * done(arg, ...) is called exactly once, later, from
 * tokenbucket_redis_async_ready, _timeout or _close, with what the
 * blocking call would return: the result of the script, -ETIME past the
 * command timeout, a connection's error, a decision of the local fallback
 * for ALLOW and RESERVE; on a cluster MOVED, ASK, CLUSTERDOWN and TRYAGAIN
 * are followed as by the blocking call.  Calls are pipelined on a
 * few connections per server (tokenbucket_redis_configure); calls
 * of one key in flight together share one and are decided in the order
 * started; a connection that times out or fails takes every call on it
 * with it, as the blocking call's connection would.  A
 * TOKENBUCKET_REDIS_ALLOW_ALL (struct tokenbucket_redis_call_all, limits
 * copied) completes with its decision in res in a single limit's terms
 * (the limit at its index) and whole in the call_all's res, written
 * before done runs; -EBADMSG and -EPROTOTYPE as the blocking call.  A CANCEL of a
 * reservation the fallback made goes to tokenbucket_redis_cancel instead.
 * Nothing is written from here: the calls started before the loop's next
 * turn (from the program's own events, a timer, a loop over requests)
 * are batched and go out together when the loop reports the connection
 * writable, as hiredis's asynchronous commands do; the ones started from
 * a callback go out before the library returns to the loop.  No flush or
 * cork is needed, and a start costs the same, and asks nothing of the
 * loop after the first, whatever is in flight.  0, or before anything
 * starts (done is then not called): -EINVAL (a NULL pointer, a bad call),
 * -ERANGE, -ENOMEM.
 */
TOKENBUCKET_API int tokenbucket_redis_async_start(struct tokenbucket_redis_async *a,
						  const struct tokenbucket_redis_call *call,
						  tokenbucket_redis_done_fn *done, void *arg);
/* Since 1.2.  fd, which the library asked to watch, is ready for events. */
TOKENBUCKET_API void tokenbucket_redis_async_ready(struct tokenbucket_redis_async *a, int fd,
						   unsigned events);
/* Since 1.2.  The timer the library armed has fired. */
TOKENBUCKET_API void tokenbucket_redis_async_timeout(struct tokenbucket_redis_async *a);
/*
 * Since 1.2.  A lease (tokenbucket_redis_lease_open) whose round trips are
 * calls of the asynchronous client a, on a's loop: no thread, and nothing
 * blocks.  A refill starts when a caller finds the tokens low (or queues a
 * reservation) and from a's timer (a contended lease's next turn, the
 * look for a quiet window), and lands from a's callbacks.  The lease
 * belongs to a's loop thread: every call on it runs there, never
 * concurrently with a's functions.  The lease functions work on it as on
 * a blocking client's lease, except: tokenbucket_redis_lease_allow with n
 * above cap returns -E2BIG (start that call on a instead);
 * tokenbucket_redis_lease_wait returns -EDEADLK (its refills need the
 * loop it would block: reserve, then ask tokenbucket_redis_lease_deficiency);
 * tokenbucket_redis_lease_close starts the give-back on a and returns (0,
 * or the error of starting it).  Close the lease before a: a lease still
 * open at tokenbucket_redis_async_close drops what it holds (granted to no
 * one until the rate makes it again) and refuses every later call with
 * -ESHUTDOWN; tokenbucket_redis_lease_close still frees it.  Errors as
 * tokenbucket_redis_lease_open's (a NULL a is -EINVAL), never -EAGAIN.
 */
TOKENBUCKET_API int tokenbucket_redis_async_lease_open(struct tokenbucket_redis_lease **lp,
						       struct tokenbucket_redis_async *a,
						       const void *key, size_t keylen,
						       const struct tokenbucket_limit *lim,
						       double share, int64_t window_ns);

#ifdef __cplusplus
}
#endif

#endif /* TOKENBUCKET_REDIS_H */
