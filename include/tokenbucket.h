/* SPDX-License-Identifier: MIT */
/*
 * libtokenbucket: an exact, lock-free token bucket with two faces.
 *
 * One opaque bucket holds the rovers of a shared token bucket (tail, head,
 * ceil).  The Seastar face (grab, replenish, release, deficiency) and the Go
 * face (allow, reserve, cancel, wait) work on the same state and may be mixed.
 *
 * Conventions shared by every function:
 *  - Time is int64_t nanoseconds.  Functions ending in _at take the caller's
 *    "now" on any monotonic time base; the others read tokenbucket_now().
 *    INT64_MIN and INT64_MAX (TOKENBUCKET_NEVER) are reserved: a "now" of
 *    INT64_MIN is read as INT64_MIN + 1, one of INT64_MAX as INT64_MAX - 1.
 *  - Time never runs backwards inside a bucket: a "now" earlier than the
 *    latest time the bucket has seen is treated as that latest time.
 *  - Where "now" goes (since 1.2.0, followed by every function added since):
 *    a call that acts at a time comes as name(), which reads
 *    tokenbucket_now(), and name_at(), which takes now as its second
 *    argument, right after the bucket or table it acts on; a call that
 *    sleeps takes an absolute deadline instead and has no _at form.  The
 *    1.0 and 1.1 cancel_at functions, which take now last, stay as shipped.
 *  - A rate and burst are said exactly by struct tokenbucket_limit (since
 *    1.2.0): tokens every period_ns.  The double rates of 1.0 are converted
 *    once to such a ratio (tokenbucket_limit_from_rate shows which).
 *  - Production is exact: a rate of p tokens per q ns yields exactly
 *    floor(T * p / q) whole tokens in T ns, fractions carried.
 *  - Functions returning int return 0 or a negative errno value; a NULL
 *    pointer's -EINVAL comes before any other error, and -EINVAL before
 *    -ERANGE.  Output parameters are left untouched on failure.
 *  - Every function except tokenbucket_set_* and tokenbucket_reset* is
 *    lock-free and may be called from any number of threads at once.  The
 *    set_* and reset functions serialise among themselves with a lock and
 *    are safe to call concurrently with everything else.  One exception, at
 *    extreme rates: once the rate in force has produced 2^61 tokens since it
 *    was set, reset or last normalized (at 1e15 tokens/s every 38 minutes;
 *    above about 2^61 tokens per ns at every call that moves the clock), the
 *    next call that passes a time, or grab, normalizes the bucket under that
 *    lock and may wait for it.  A reservation belongs to one thread at a
 *    time; tokenbucket_free must not race anything.
 *
 * See tokenbucket(7) and docs/core.md for the model.
 */
#ifndef TOKENBUCKET_H
#define TOKENBUCKET_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The version, defined here once; the build system reads it from this file. */
#define TOKENBUCKET_VERSION_MAJOR 1
#define TOKENBUCKET_VERSION_MINOR 2
#define TOKENBUCKET_VERSION_PATCH 0
#define TOKENBUCKET_VERSION_NUMBER \
	(TOKENBUCKET_VERSION_MAJOR * 10000 + TOKENBUCKET_VERSION_MINOR * 100 + \
	 TOKENBUCKET_VERSION_PATCH)
#define TOKENBUCKET__STR(x) #x
#define TOKENBUCKET__XSTR(x) TOKENBUCKET__STR(x)
#define TOKENBUCKET_VERSION_STRING                       \
	TOKENBUCKET__XSTR(TOKENBUCKET_VERSION_MAJOR) "." \
	TOKENBUCKET__XSTR(TOKENBUCKET_VERSION_MINOR) "." \
	TOKENBUCKET__XSTR(TOKENBUCKET_VERSION_PATCH)

#if defined(_WIN32)
#define TOKENBUCKET_API
#else
#define TOKENBUCKET_API __attribute__((visibility("default")))
#endif

/* A rate with no limit: positive infinity.  Any rate >= DBL_MAX is the same. */
#define TOKENBUCKET_INF (__builtin_inf())
/* A time or a duration that never comes. */
#define TOKENBUCKET_NEVER INT64_MAX
/* Flag for create: head may not pass ceil; tokenbucket_release() advances ceil. */
#define TOKENBUCKET_CAPPED_RELEASE (1u << 0)

/* The largest burst a bucket accepts (2^62 tokens); larger gives -ERANGE. */
#define TOKENBUCKET_BURST_MAX (UINT64_C(1) << 62)
/* The most a bucket can owe (tail ahead of head), in tokens: 2^62 - 1. */
#define TOKENBUCKET_DEBT_MAX ((UINT64_C(1) << 62) - 1)

struct tokenbucket;

/* ---- Time and version ---------------------------------------------------- */

/* CLOCK_MONOTONIC in nanoseconds. */
TOKENBUCKET_API int64_t tokenbucket_now(void);
/* Go's Every: 1e9 / interval_ns tokens per second; TOKENBUCKET_INF if interval_ns <= 0. */
TOKENBUCKET_API double tokenbucket_every(int64_t interval_ns);
/* TOKENBUCKET_VERSION_NUMBER of the library actually loaded. */
TOKENBUCKET_API unsigned tokenbucket_version_number(void);
/* TOKENBUCKET_VERSION_STRING of the library actually loaded, e.g. "1.0.0". */
TOKENBUCKET_API const char *tokenbucket_version_string(void);

/* ---- Life cycle ---------------------------------------------------------- */

/*
 * Creates a full bucket (burst tokens) that has seen no time yet, producing
 * rate tokens per second (TOKENBUCKET_INF: unlimited; 0: never refills).
 * A finite rate is converted once to an exact ratio of tokens per period.
 * -EINVAL: tbp NULL, rate NaN or negative, unknown flag bits.
 * -ERANGE: burst > TOKENBUCKET_BURST_MAX.  -ENOMEM.
 */
TOKENBUCKET_API int tokenbucket_create(struct tokenbucket **tbp, double rate,
				       uint64_t burst, unsigned flags);
/*
 * As tokenbucket_create, producing exactly tokens per period_ns (tokens == 0:
 * rate 0).  -EINVAL also when period_ns <= 0 with tokens > 0.
 */
TOKENBUCKET_API int tokenbucket_create_every(struct tokenbucket **tbp, uint64_t tokens,
					     int64_t period_ns, uint64_t burst,
					     unsigned flags);
/* Frees a bucket; accepts NULL.  No other call on tb may be running. */
TOKENBUCKET_API void tokenbucket_free(struct tokenbucket *tb);
/*
 * The bucket's clock becomes now (even if earlier) and it holds tokens;
 * debt and outstanding tickets are forgotten (all are covered).  With
 * TOKENBUCKET_CAPPED_RELEASE, the room for replenishment becomes
 * burst - tokens.  At rate TOKENBUCKET_INF the bucket stays full.
 * -EINVAL: tb NULL, tokens > burst.
 */
TOKENBUCKET_API int tokenbucket_reset_at(struct tokenbucket *tb, int64_t now, uint64_t tokens);
/* tokenbucket_reset_at at tokenbucket_now().  Since 1.2.0. */
TOKENBUCKET_API int tokenbucket_reset(struct tokenbucket *tb, uint64_t tokens);

/* ---- The Seastar face ---------------------------------------------------- */

/*
 * Takes n tokens unconditionally (the tail may pass the head) and returns the
 * ticket: the tail rover after the grab.  The debt is bounded by
 * TOKENBUCKET_DEBT_MAX; a grab beyond it takes only up to that bound.
 * With rate TOKENBUCKET_INF nothing is taken.  tb NULL returns 0.
 */
TOKENBUCKET_API uint64_t tokenbucket_grab(struct tokenbucket *tb, uint64_t n);
/*
 * Credits the whole tokens produced since the last credit, once they reach
 * the threshold (default 1).  Tokens beyond burst, or that would push head
 * past ceil, are lost.  A replenish that comes before threshold tokens are
 * produced changes nothing (except that it fixes the clock of a bucket that
 * has seen no time).
 */
TOKENBUCKET_API void tokenbucket_replenish(struct tokenbucket *tb, int64_t now);
/*
 * With TOKENBUCKET_CAPPED_RELEASE, advances ceil by n (completed work feeds
 * the bucket back); ceil never runs more than burst ahead of the tail.
 * -ENOTSUP without the flag; -EINVAL: tb NULL, n > burst.
 */
TOKENBUCKET_API int tokenbucket_release(struct tokenbucket *tb, uint64_t n);
/*
 * Gives back n tokens that were grabbed and not used; the bucket still never
 * holds more than burst.  In capped-release mode the refunded tokens also stop
 * counting as in flight.  tb NULL is ignored.
 */
TOKENBUCKET_API void tokenbucket_refund(struct tokenbucket *tb, uint64_t n);
/*
 * Whole tokens still missing before the grab that returned ticket is covered;
 * 0 means go.  Grabs are covered in ticket order.  tb NULL returns 0.
 */
TOKENBUCKET_API uint64_t tokenbucket_deficiency(const struct tokenbucket *tb, uint64_t ticket);
/*
 * Nanoseconds the rate needs to produce tokens, rounded up; 0 for 0 tokens or
 * rate TOKENBUCKET_INF; TOKENBUCKET_NEVER for rate 0 or a duration beyond
 * INT64_MAX - 1 ns, and for tb NULL whatever tokens is.
 */
TOKENBUCKET_API int64_t tokenbucket_duration_for(const struct tokenbucket *tb, uint64_t tokens);
/* Sets the replenish threshold: 1 to burst, else -EINVAL (also tb NULL). */
TOKENBUCKET_API int tokenbucket_set_threshold(struct tokenbucket *tb, uint64_t threshold);

/* ---- The Go face --------------------------------------------------------- */

/*
 * Go's AllowN(now, n): true and n tokens taken if the bucket holds at least n
 * at now; false and nothing taken otherwise.  n > burst is false at once;
 * any other call leaves the bucket having seen now.  With rate
 * TOKENBUCKET_INF always true.  tb NULL is false.
 */
TOKENBUCKET_API bool tokenbucket_allow(struct tokenbucket *tb, uint64_t n);
TOKENBUCKET_API bool tokenbucket_allow_at(struct tokenbucket *tb, int64_t now, uint64_t n);

struct tokenbucket_reservation {
	int64_t time_to_act; /* when the tokens are there; TOKENBUCKET_NEVER if never */
	uint64_t tokens;     /* how many were reserved */
	uint64_t ticket;     /* the tail rover after this reservation */
	uint64_t reserved;   /* zero; for the library's use */
};

/*
 * Go's reserveN: takes n tokens at now, possibly into debt, and fills *r.
 * time_to_act is when they are covered (never earlier than the latest time
 * the bucket has seen).  max_wait bounds time_to_act - now
 * (TOKENBUCKET_NEVER: no limit).  On error nothing is taken and *r is
 * untouched (after -ETIMEDOUT or -EOVERFLOW the bucket has seen now).
 * -EINVAL: tb or r NULL.  -E2BIG: n > burst (finite rate).
 * -ETIMEDOUT: the wait would exceed max_wait.
 * -EOVERFLOW: the debt would exceed TOKENBUCKET_DEBT_MAX.
 * With rate TOKENBUCKET_INF: time_to_act is now (on the bucket's clock) and
 * nothing is taken.  time_to_act is exact for the rate in force; a later
 * rate change, or ceil under TOKENBUCKET_CAPPED_RELEASE, may delay the tokens.
 */
TOKENBUCKET_API int tokenbucket_reserve(struct tokenbucket *tb, uint64_t n, int64_t max_wait,
					struct tokenbucket_reservation *r);
TOKENBUCKET_API int tokenbucket_reserve_at(struct tokenbucket *tb, int64_t now, uint64_t n,
					   int64_t max_wait,
					   struct tokenbucket_reservation *r);
/* Go's DelayFrom: max(0, r->time_to_act - now); TOKENBUCKET_NEVER for r NULL. */
TOKENBUCKET_API int64_t tokenbucket_reservation_delay(const struct tokenbucket_reservation *r,
						      int64_t now);
/*
 * Go's CancelAt, made exact: gives back all r->tokens (tickets still waiting
 * are covered that much sooner) and sets r->tokens to 0.  Gives back nothing if
 * now is past r->time_to_act, if r->tokens is 0 or if the rate is
 * TOKENBUCKET_INF.  The bucket never holds more than burst.  NULLs are ignored.
 */
TOKENBUCKET_API void tokenbucket_cancel(struct tokenbucket *tb, struct tokenbucket_reservation *r);
TOKENBUCKET_API void tokenbucket_cancel_at(struct tokenbucket *tb,
					   struct tokenbucket_reservation *r, int64_t now);

/*
 * Go's WaitN: reserves n tokens, then sleeps on CLOCK_MONOTONIC until they are
 * there.  deadline is absolute on tokenbucket_now()'s clock
 * (TOKENBUCKET_NEVER: none); cancel_fd becomes readable (or hangs up) to
 * cancel, or is -1.  Signals do not end the wait.  A wait that fails takes
 * nothing: a reservation it made is given back whole.
 * 0: the tokens are taken.  -EINVAL: tb NULL.  -E2BIG: n > burst (finite
 * rate).  -EBADF: cancel_fd is not an open descriptor, on entry or while
 * sleeping: the call sleeps in slices of at most 50 ms, so a cancel_fd
 * closed while it sleeps is noticed within one slice (unless the tokens are
 * there first), and the reservation is given back.  A descriptor number
 * that another open() reuses meanwhile cannot be told apart: the call
 * watches the new file instead.  -ECANCELED: cancel_fd readable or hung up,
 * on entry or while sleeping.  -ETIMEDOUT: the tokens would not be
 * there by the deadline (never, with rate 0); nothing is taken.  -EOVERFLOW:
 * as for tokenbucket_reserve.  Other negative errno values from poll(2).
 * The wait lasts until the tokens are really there: if a rate change, or ceil
 * under TOKENBUCKET_CAPPED_RELEASE, holds them back past time_to_act, it
 * checks again each time the rate could have produced what is missing
 * (between 1 ms and 1 s apart) until the deadline, then gives -ETIMEDOUT.
 */
TOKENBUCKET_API int tokenbucket_wait(struct tokenbucket *tb, uint64_t n, int64_t deadline,
				     int cancel_fd);

/* The rate in tokens per second: TOKENBUCKET_INF, 0, or the exact ratio's value. NaN for NULL. */
TOKENBUCKET_API double tokenbucket_rate(const struct tokenbucket *tb);
/* The burst in tokens; 0 for NULL. */
TOKENBUCKET_API uint64_t tokenbucket_burst(const struct tokenbucket *tb);
/*
 * Go's TokensAt: the tokens at now, negative in debt, fractional where the
 * rate makes them so; never above burst.  NaN for tb NULL.
 */
TOKENBUCKET_API double tokenbucket_tokens(struct tokenbucket *tb);
TOKENBUCKET_API double tokenbucket_tokens_at(struct tokenbucket *tb, int64_t now);
/*
 * Go's SetLimitAt: tokens produced up to now are credited at the old rate
 * (the fraction of a token carries over, rounded down to a nanosecond of the
 * new rate, and no further back than INT64_MIN + 1), then the new rate applies.  -EINVAL: tb NULL, rate NaN or
 * negative; for set_rate_every_at, period_ns <= 0 with tokens > 0.
 */
TOKENBUCKET_API int tokenbucket_set_rate(struct tokenbucket *tb, double rate);
TOKENBUCKET_API int tokenbucket_set_rate_at(struct tokenbucket *tb, int64_t now, double rate);
TOKENBUCKET_API int tokenbucket_set_rate_every_at(struct tokenbucket *tb, int64_t now,
						  uint64_t tokens, int64_t period_ns);
/* tokenbucket_set_rate_every_at at tokenbucket_now().  Since 1.2.0. */
TOKENBUCKET_API int tokenbucket_set_rate_every(struct tokenbucket *tb, uint64_t tokens,
					       int64_t period_ns);
/*
 * Go's SetBurstAt: tokens produced up to now are credited first; lowering
 * burst drops the tokens above it (and lowers the threshold to it).
 * -EINVAL: tb NULL.  -ERANGE: burst > TOKENBUCKET_BURST_MAX.
 */
TOKENBUCKET_API int tokenbucket_set_burst(struct tokenbucket *tb, uint64_t burst);
TOKENBUCKET_API int tokenbucket_set_burst_at(struct tokenbucket *tb, int64_t now, uint64_t burst);

/* ---- A decision, as a server reports it ----------------------------------- */

/*
 * One rate-limiting decision in the terms of RateLimit and Retry-After
 * headers.  tokenbucket_allow_result and tokenbucket_table_allow_result
 * fill it, and so does libtokenbucket-redis.
 */
struct tokenbucket_result {
	bool allowed;            /* the request was granted */
	unsigned flags;          /* TOKENBUCKET_RESULT_* */
	uint64_t limit;          /* the burst */
	uint64_t remaining;      /* whole tokens left after the decision; 0 in debt */
	/* Nanoseconds until the tokens asked for are (or were) there: 0 if now,
	 * TOKENBUCKET_NEVER if never. */
	int64_t retry_after_ns;
	/* Nanoseconds until the bucket is full again; TOKENBUCKET_NEVER if never. */
	int64_t reset_after_ns;
	uint64_t reserved[2];    /* zero */
};
/* The decision was made by a local fallback bucket, not by the shared one. */
#define TOKENBUCKET_RESULT_LOCAL (1u << 0)
/* A table had no bucket for the key (it was full): the table's policy decided. */
#define TOKENBUCKET_RESULT_NO_BUCKET (1u << 1)

/*
 * Go's AllowN, as tokenbucket_allow_at, reporting the decision in *res:
 * limit is the burst; remaining the whole tokens left at the bucket's
 * clock just after the decision (under concurrent calls, theirs count
 * too); retry_after_ns 0 if allowed, else how long until n tokens are
 * there (TOKENBUCKET_NEVER: never, or n > burst); reset_after_ns how long
 * until the bucket is full.  Unlike allow, a refusal of n > burst also
 * leaves the bucket having seen now, so that the report is about now.
 * -EINVAL: tb or res NULL (*res untouched).
 * Since 1.1.0.
 */
TOKENBUCKET_API int tokenbucket_allow_result(struct tokenbucket *tb, uint64_t n,
					     struct tokenbucket_result *res);
TOKENBUCKET_API int tokenbucket_allow_result_at(struct tokenbucket *tb, int64_t now, uint64_t n,
						struct tokenbucket_result *res);

/* ---- 1.1: buckets shared between processes ------------------------------- */

/*
 * A bucket may live in memory shared between processes: memory the caller
 * maps (shm_open, memfd, a file, an arena) or a named bucket this library
 * maps.  Every function above works on such a bucket from any number of
 * processes and threads at once, lock-free as before; the writers serialise
 * on a process-shared robust mutex, so a process killed at any instant
 * (SIGKILL included) never leaves the bucket blocked or inconsistent
 * (docs/shm.md, "Crashes"): the next writer, or the next call that
 * passes a time, takes over the lock of a writer that died (trying it,
 * never waiting for it) and rolls back what it left half done.
 * tokenbucket_free must never be called on a shared bucket.  Since 1.1.0.
 *
 * Errors of the shared placement, in addition to those of tokenbucket_create:
 *  -ENOTSUP   8-byte atomics are not lock-free (or not address-free) here, or
 *             the system has no process-shared robust mutexes;
 *  -EBADMSG   the memory or object is not a bucket: no magic, too small
 *             (truncated), not a regular file, a state no bucket can be in,
 *             or a bucket marked corrupt (below);
 *  -EPROTO    a bucket of another layout: another layout version, state
 *             size or alignment, or library major version;
 *  -EAGAIN    a bucket whose initialisation has not finished (or died).
 * Shared memory is input (since 1.2.0): whatever bytes it holds, every call
 * returns, with no signal and no write outside the bucket; a corrupt bucket
 * may answer wrongly.  A call that finds words no bucket can hold (a loop
 * that cannot make progress, a writer mutex that fails to lock) marks the
 * bucket corrupt: its writers then return -EBADMSG, calls that cannot take
 * their fast path fail (false, NaN, -EBADMSG, a grab that takes nothing),
 * and attach refuses it.  Writers wait for the writer lock at most 2 s,
 * then return -EDEADLK (its holder is stopped, or its lock word was
 * overwritten).
 */

/* Bytes a shared bucket needs (a header and the state). */
TOKENBUCKET_API size_t tokenbucket_shared_size(void);
/* The alignment, in bytes, the memory of a shared bucket needs. */
TOKENBUCKET_API size_t tokenbucket_shared_align(void);
/*
 * Initialises a full bucket, as tokenbucket_create would, in the size bytes
 * at mem (aligned to tokenbucket_shared_align(), size at least
 * tokenbucket_shared_size()), and stores in *tbp the bucket it holds.  No
 * other process may use the memory until this returns; attaching before
 * then gives -EAGAIN.  -EINVAL also: mem NULL or misaligned, size too small.
 */
TOKENBUCKET_API int tokenbucket_init_shared(struct tokenbucket **tbp, void *mem, size_t size,
					    double rate, uint64_t burst, unsigned flags);
/*
 * Stores in *tbp the bucket that another process (or this one) initialised
 * in the size bytes at mem, after checking its header and state.
 * -EINVAL: tbp or mem NULL, mem misaligned.  -EBADMSG, -EPROTO, -EAGAIN,
 * -ENOTSUP: see above.
 */
TOKENBUCKET_API int tokenbucket_attach_shared(struct tokenbucket **tbp, void *mem, size_t size);

/* The longest name of a named bucket, in bytes after its leading '/'. */
#define TOKENBUCKET_NAME_MAX 200
/* *status after tokenbucket_open: this call created the bucket. */
#define TOKENBUCKET_OPEN_CREATED (1u << 0)
/* *status after tokenbucket_open: the bucket existed with another rate, burst or flags. */
#define TOKENBUCKET_OPEN_DIFFERS (1u << 1)

/*
 * Opens the named bucket name ("/" then 1 to TOKENBUCKET_NAME_MAX bytes,
 * none of them '/'), as sem_open(3) opens a named semaphore.  If it does
 * not exist, creates it with rate, burst and flags (as tokenbucket_create)
 * and permissions mode (exactly, umask aside; 0 means 0600); the bucket is
 * initialised completely before its name appears, so of processes creating
 * one name at once exactly one creates it and the others attach to it.  If
 * it exists, attaches to it as it is: its rate, burst and flags stand, and
 * TOKENBUCKET_OPEN_DIFFERS in *status says they are not the ones asked
 * for.  status may be NULL.  The bucket lives in /dev/shm until
 * tokenbucket_unlink; tokenbucket_close unmaps it.
 * -EINVAL: tbp NULL, a bad name, rate or flags; mode beyond 0777.
 * -ENAMETOOLONG.  -EACCES: the bucket exists and mode bits forbid reading
 * and writing it.  -EBADMSG, -EPROTO, -ENOTSUP: see above; other negative
 * errno values of open(2), ftruncate(2) and mmap(2).
 */
TOKENBUCKET_API int tokenbucket_open(struct tokenbucket **tbp, const char *name, double rate,
				     uint64_t burst, unsigned flags, unsigned mode,
				     unsigned *status);
/*
 * Unmaps a bucket that tokenbucket_open returned; accepts NULL.  The bucket
 * and its name stay for other processes.  No other call on tb in this
 * process may be running.
 */
TOKENBUCKET_API void tokenbucket_close(struct tokenbucket *tb);
/*
 * Removes the name of a named bucket; processes that have it open keep using
 * it until they close it.  -EINVAL, -ENAMETOOLONG: as tokenbucket_open.
 * -ENOENT: no such bucket.  -EACCES, -EPERM: not allowed.
 */
TOKENBUCKET_API int tokenbucket_unlink(const char *name);

/* ---- 1.1: per-key tables -------------------------------------------------- */

/*
 * A table of buckets: one bucket per key (bytes and a length), all with one
 * rate and burst, in a fixed number of slots chosen at creation.  Each key
 * behaves exactly as a single bucket whose origin is the table's first
 * time; a key never seen, or whose slot was given to another key while its
 * bucket was full, is a new full bucket.  Lookups and takes are lock-free;
 * a table may live in memory shared between processes.  See
 * tokenbucket_table_create(3) for the sizing rule and the policies, and
 * docs/table.md for the protocol.  Since 1.1.0.
 */
struct tokenbucket_table;

/* Policy when a new key finds no free slot (default: refuse it, fail closed). */
#define TOKENBUCKET_TABLE_FAIL_OPEN (1u << 0) /* allow it, without a bucket */
#define TOKENBUCKET_TABLE_EVICT (1u << 1)     /* evict the fullest bucket it could use */

/* The largest burst of a table (2^40 tokens), and the most a key may owe. */
#define TOKENBUCKET_TABLE_BURST_MAX (UINT64_C(1) << 40)
#define TOKENBUCKET_TABLE_DEBT_MAX (UINT64_C(1) << 40)
/* The most slots a table may have. */
#define TOKENBUCKET_TABLE_CAPACITY_MAX (UINT64_C(1) << 32)
/* The alignment, in bytes, of a table's memory. */
#define TOKENBUCKET_TABLE_ALIGN 128

/*
 * Bytes a table of capacity slots needs: 512 + 32 * capacity rounded up to
 * a multiple of 4; 0 if capacity is 0 or above the maximum.
 */
TOKENBUCKET_API size_t tokenbucket_table_size(uint64_t capacity);
/*
 * Creates a table of capacity slots whose buckets produce tokens every
 * period_ns (tokens 0: never refill) and hold burst.  flags: 0 (fail
 * closed), TOKENBUCKET_TABLE_FAIL_OPEN or TOKENBUCKET_TABLE_EVICT.
 * -EINVAL: tp NULL, capacity 0, period_ns <= 0 with tokens > 0, unknown or
 * conflicting flags.  -ERANGE: burst > TOKENBUCKET_TABLE_BURST_MAX,
 * capacity > TOKENBUCKET_TABLE_CAPACITY_MAX, a rate above 16 tokens per
 * ns.  -ENOMEM.  Negative errno values of getrandom(2).
 */
TOKENBUCKET_API int tokenbucket_table_create(struct tokenbucket_table **tp, uint64_t tokens,
					     int64_t period_ns, uint64_t burst, uint64_t capacity,
					     unsigned flags);
/*
 * As tokenbucket_table_create, in the size bytes at mem (aligned to
 * TOKENBUCKET_TABLE_ALIGN, at least tokenbucket_table_size(capacity)).
 * *tp is a handle of this process, released by tokenbucket_table_free.
 * -EINVAL also: mem NULL or misaligned, size too small.  -ENOTSUP: as
 * tokenbucket_init_shared.
 */
TOKENBUCKET_API int tokenbucket_table_init_shared(struct tokenbucket_table **tp, void *mem,
						  size_t size, uint64_t tokens, int64_t period_ns,
						  uint64_t burst, uint64_t capacity, unsigned flags);
/*
 * A handle on the table another process (or this one) initialised in the
 * size bytes at mem, after checking its header.  -EINVAL: tp or mem NULL,
 * mem misaligned.  -EBADMSG, -EPROTO, -EAGAIN, -ENOTSUP: as
 * tokenbucket_attach_shared.  -ENOMEM.
 */
TOKENBUCKET_API int tokenbucket_table_attach_shared(struct tokenbucket_table **tp, void *mem,
						    size_t size);
/*
 * Opens the named table name as tokenbucket_open opens a named bucket
 * (same names and namespace; tokenbucket_unlink removes it), creating it
 * with the arguments of tokenbucket_table_create and mode if it does not
 * exist.  TOKENBUCKET_OPEN_DIFFERS: it exists with another rate, burst,
 * capacity or flags, which stand.  Errors: those of tokenbucket_open and
 * tokenbucket_table_create.
 */
TOKENBUCKET_API int tokenbucket_table_open(struct tokenbucket_table **tp, const char *name,
					   uint64_t tokens, int64_t period_ns, uint64_t burst,
					   uint64_t capacity, unsigned flags, unsigned mode,
					   unsigned *status);
/*
 * Releases a handle: frees a table from tokenbucket_table_create, unmaps
 * one from tokenbucket_table_open, leaves caller memory alone.  Accepts
 * NULL.  No other call on t in this process may be running.
 */
TOKENBUCKET_API void tokenbucket_table_free(struct tokenbucket_table *t);

/*
 * The Go face per key, as tokenbucket_allow_at and friends on the key's
 * bucket.  key may be NULL only with len 0.  When a new key finds no slot,
 * the policy decides: fail closed refuses (false; reserve -EBUSY), fail
 * open allows without taking anything (true; reserve succeeds with
 * tokens 0).  A table has no horizon (since 1.2.0): every 2^53 tokens of
 * production the call that would write first re-anchors it, a pass over
 * its slots under the mutex of tokenbucket_table_set_limit (waiting at
 * most 2 s for another change: then false, -EDEADLK).  allow with key NULL
 * and len > 0, or t NULL, or a corrupt table (-EBADMSG), is false.
 */
TOKENBUCKET_API bool tokenbucket_table_allow(struct tokenbucket_table *t, const void *key,
					     size_t len, uint64_t n);
TOKENBUCKET_API bool tokenbucket_table_allow_at(struct tokenbucket_table *t, int64_t now,
						const void *key, size_t len, uint64_t n);
/*
 * As tokenbucket_table_allow_at, filling *res as tokenbucket_allow_result
 * does; TOKENBUCKET_RESULT_NO_BUCKET says the policy decided.  -EINVAL: t
 * or res NULL, key NULL with len > 0.  -EDEADLK: a re-anchor waited 2 s
 * for another change (above).  -EBADMSG: a corrupt table.
 */
TOKENBUCKET_API int tokenbucket_table_allow_result(struct tokenbucket_table *t, const void *key,
						   size_t len, uint64_t n,
						   struct tokenbucket_result *res);
TOKENBUCKET_API int tokenbucket_table_allow_result_at(struct tokenbucket_table *t, int64_t now,
						      const void *key, size_t len, uint64_t n,
						      struct tokenbucket_result *res);
/*
 * The decision of tokenbucket_table_allow_result_at, reporting only what a
 * RateLimit header shows, for less work: 1 allowed, 0 refused, or its
 * errors (-EINVAL also for remaining or reset_s NULL).  *remaining is
 * res.remaining; *reset_s is res.reset_after_ns in whole seconds rounded
 * up (0 when the key is full, TOKENBUCKET_NEVER never), exactly.  Since
 * 1.2.0.
 */
TOKENBUCKET_API int tokenbucket_table_allow_reset(struct tokenbucket_table *t, const void *key,
						  size_t len, uint64_t n, uint64_t *remaining,
						  int64_t *reset_s);
TOKENBUCKET_API int tokenbucket_table_allow_reset_at(struct tokenbucket_table *t, int64_t now,
						     const void *key, size_t len, uint64_t n,
						     uint64_t *remaining, int64_t *reset_s);
/*
 * As tokenbucket_reserve_at on the key's bucket.  -EINVAL: t or r NULL, key
 * NULL with len > 0.  -E2BIG, -ETIMEDOUT as tokenbucket_reserve_at.
 * -EOVERFLOW: the key would owe more than TOKENBUCKET_TABLE_DEBT_MAX.
 * -EBUSY: no slot for a new key (fail closed).  -EDEADLK, -EBADMSG as
 * tokenbucket_table_allow_result_at.
 */
TOKENBUCKET_API int tokenbucket_table_reserve(struct tokenbucket_table *t, const void *key,
					      size_t len, uint64_t n, int64_t max_wait,
					      struct tokenbucket_reservation *r);
TOKENBUCKET_API int tokenbucket_table_reserve_at(struct tokenbucket_table *t, int64_t now,
						 const void *key, size_t len, uint64_t n,
						 int64_t max_wait,
						 struct tokenbucket_reservation *r);
/*
 * As tokenbucket_cancel_at on the key's bucket (Go's cancel): gives back
 * r->tokens as tokenbucket_table_refund does, unless the key's time is
 * past r->time_to_act; sets r->tokens to 0.  NULLs are ignored.
 */
TOKENBUCKET_API void tokenbucket_table_cancel(struct tokenbucket_table *t, const void *key,
					      size_t len, struct tokenbucket_reservation *r);
TOKENBUCKET_API void tokenbucket_table_cancel_at(struct tokenbucket_table *t, const void *key,
						 size_t len, struct tokenbucket_reservation *r,
						 int64_t now);
/*
 * As tokenbucket_refund on the key's bucket: gives back n tokens taken and
 * not used, whatever the time and whatever other calls did since, except
 * what would lift the key above its burst (docs/core.md, "Giving back").
 * A key with no bucket, or whose slot went to another key since the take,
 * is full and gets nothing.  0; -EINVAL: t NULL, key NULL with len > 0;
 * -EBADMSG: a corrupt table.  Since 1.2.0.
 */
TOKENBUCKET_API int tokenbucket_table_refund(struct tokenbucket_table *t, const void *key,
					     size_t len, uint64_t n);
TOKENBUCKET_API int tokenbucket_table_refund_at(struct tokenbucket_table *t, int64_t now,
						const void *key, size_t len, uint64_t n);
/*
 * As tokenbucket_tokens_at on the key's bucket (burst for a key with no
 * bucket; none is made).  NaN: t NULL, key NULL with len > 0, a corrupt
 * table.
 */
TOKENBUCKET_API double tokenbucket_table_tokens(struct tokenbucket_table *t, const void *key,
						size_t len);
TOKENBUCKET_API double tokenbucket_table_tokens_at(struct tokenbucket_table *t, int64_t now,
						   const void *key, size_t len);

/* A live key, as tokenbucket_table_next reports it. */
struct tokenbucket_table_entry {
	uint64_t fingerprint; /* the key's 56-bit keyed fingerprint */
	int64_t clock;        /* the latest time the key has seen */
	double tokens;        /* its tokens at max(now, clock), as tokens_at (never recorded) */
	uint64_t reserved[2]; /* zero */
};

/*
 * Iterates over the keys that hold a slot: start with *cursor 0; each call
 * fills *e with the next one and advances *cursor.  Keys that move while
 * iterating may be missed or seen twice.  0: *e filled.  -ENOENT: no more.
 * -EINVAL: a NULL argument.
 */
TOKENBUCKET_API int tokenbucket_table_next(struct tokenbucket_table *t, uint64_t *cursor,
					   int64_t now, struct tokenbucket_table_entry *e);

/* The table's counters (statistics: a process killed mid-insert can leave them off by one). */
struct tokenbucket_table_stats {
	uint64_t capacity; /* slots */
	uint64_t in_use;   /* slots holding a key */
	uint64_t lossless; /* slots of full keys given to new keys */
	uint64_t lossy;    /* keys evicted before their bucket was full (TOKENBUCKET_TABLE_EVICT) */
	uint64_t refused;  /* new keys that found no slot (failed closed or passed open) */
	uint64_t reserved[3];
};

/* Fills *s.  -EINVAL: a NULL argument. */
TOKENBUCKET_API int tokenbucket_table_stats(struct tokenbucket_table *t,
					    struct tokenbucket_table_stats *s);

/* ---- 1.2: exact limits ----------------------------------------------------- */

/*
 * A rate and a burst, exactly: tokens every period_ns nanoseconds, and at
 * most burst tokens held.  Since 1.2.0.
 *  - tokens 0: rate 0, the bucket never refills (period_ns any value >= 0);
 *  - period_ns 0 with tokens > 0: unlimited, the rate TOKENBUCKET_INF
 *    (tables have none: -ERANGE);
 *  - otherwise tokens >= 1 every period_ns >= 1, reduced to lowest terms
 *    (2 every 6 ns is 1 every 3 ns): after T ns exactly
 *    floor(T * tokens / period_ns) tokens have been produced.
 * period_ns < 0 is -EINVAL everywhere.  burst is checked by the function
 * that takes the limit: at most TOKENBUCKET_BURST_MAX for a bucket,
 * TOKENBUCKET_TABLE_BURST_MAX for a table, else -ERANGE.
 */
struct tokenbucket_limit {
	uint64_t tokens;
	int64_t period_ns;
	uint64_t burst;
};

/*
 * The exact limit tokenbucket_create and the other functions that take a
 * double make of rate (tokens per second) and burst: the simplest ratio
 * p/q tokens per ns that reads back as rate (0.1 is 1 every 1e10 ns),
 * {0, 1, burst} for 0 and {1, 0, burst} for TOKENBUCKET_INF (any rate >=
 * DBL_MAX).  A bucket made from *lim behaves bit for bit as one made from
 * rate.  -EINVAL: lim NULL, rate NaN or negative (*lim untouched).  Pure:
 * any thread, any time.
 */
TOKENBUCKET_API int tokenbucket_limit_from_rate(struct tokenbucket_limit *lim, double rate,
						uint64_t burst);

/* *flags of tokenbucket_limit_parse: in, what the text is; out, what it named. */
#define TOKENBUCKET_PARSE_BURST 0x1u /* in: a burst, into lim->burst alone */
#define TOKENBUCKET_PARSE_BYTES 0x2u /* out: a byte or bit unit was named */
#define TOKENBUCKET_PARSE_PERIOD 0x4u /* in: a duration, into lim->period_ns alone */

/*
 * Reads a rate ("10r/s", "7/3s", "5MB/s", "1GB/h", "unlimited") or, with
 * TOKENBUCKET_PARSE_BURST in *flags, a burst ("20", "4MB", "64Ki") or,
 * with TOKENBUCKET_PARSE_PERIOD, a duration ("1.5", "500ms", "2min"; bare:
 * seconds) exactly, with no double; the grammar is in
 * tokenbucket_limit_parse(3).  A rate sets tokens and period_ns in lowest
 * terms and burst to the amount written, the most a quota ("1000r/h")
 * holds, within [1, TOKENBUCKET_BURST_MAX]; "unlimited" is {1, 0,
 * TOKENBUCKET_BURST_MAX}.  A burst sets burst alone, a duration period_ns
 * alone.  flags may be NULL: a rate, nothing said back.  end, if not NULL,
 * gets the text's end on success; on failure the first character outside
 * the grammar (-EINVAL), else text.  -EINVAL: lim or text NULL, unknown
 * bits in *flags or both BURST and PERIOD, text outside the grammar.
 * -EDOM: a zero rate, burst or duration, a burst not a whole number of
 * tokens, a duration not a whole number of ns.  -ERANGE: a number beyond
 * 128 bits, a rate whose lowest terms exceed 64 bits (tokens) or 63 (ns),
 * a burst above TOKENBUCKET_BURST_MAX, a duration above INT64_MAX ns.
 * *lim and *flags untouched on failure.  Pure, no locale: any thread, any
 * time.
 */
TOKENBUCKET_API int tokenbucket_limit_parse(struct tokenbucket_limit *lim, const char *text,
					    unsigned *flags, const char **end);
/*
 * Fills *lim with the bucket's rate in force, in lowest terms ({0, 1} for
 * rate 0, {1, 0} for unlimited), and its burst; each is read as it stands,
 * so a racing rate and burst change may be seen half done.  Lock-free.
 * -EINVAL: tb or lim NULL.  -EBADMSG: a shared bucket whose words hold no
 * rate a bucket can have.
 */
TOKENBUCKET_API int tokenbucket_get_limit(const struct tokenbucket *tb,
					  struct tokenbucket_limit *lim);
/*
 * As tokenbucket_create (and tokenbucket_create_every) with the exact rate
 * and burst of *lim.  -EINVAL: tbp or lim NULL, period_ns < 0, unknown
 * flag bits.  -ERANGE: burst > TOKENBUCKET_BURST_MAX.  -ENOMEM.
 */
TOKENBUCKET_API int tokenbucket_create_limit(struct tokenbucket **tbp,
					     const struct tokenbucket_limit *lim, unsigned flags);
/*
 * As tokenbucket_init_shared with the exact rate and burst of *lim.  Errors:
 * those of tokenbucket_init_shared; -EINVAL also for lim NULL or
 * period_ns < 0.
 */
TOKENBUCKET_API int tokenbucket_init_shared_limit(struct tokenbucket **tbp, void *mem,
						  size_t size,
						  const struct tokenbucket_limit *lim,
						  unsigned flags);
/*
 * As tokenbucket_open with the exact rate and burst of *lim: a bucket it
 * creates has that rate from its first instant, and TOKENBUCKET_OPEN_DIFFERS
 * compares the rate in force with *lim's ratio in lowest terms, exactly
 * (and burst and flags).  Errors: those of tokenbucket_open; -EINVAL also
 * for lim NULL or period_ns < 0.
 */
TOKENBUCKET_API int tokenbucket_open_limit(struct tokenbucket **tbp, const char *name,
					   const struct tokenbucket_limit *lim, unsigned flags,
					   unsigned mode, unsigned *status);
/*
 * Changes rate and burst together at now: as tokenbucket_set_rate_every_at
 * then tokenbucket_set_burst_at at the same now, under one hold of the
 * writer lock, so no other writer comes between them (lock-free calls may
 * see the new rate with the old burst for that moment; a writer killed
 * between the two leaves that state, which is consistent).  -EINVAL: tb or
 * lim NULL, period_ns < 0.  -ERANGE: burst > TOKENBUCKET_BURST_MAX.
 * -EBADMSG, -EDEADLK: as tokenbucket_set_rate_at (after -EBADMSG the rate
 * may have changed without the burst).  Nothing changes on another error.
 * Serialised with the other writers; safe beside every call but free.
 */
TOKENBUCKET_API int tokenbucket_set_limit(struct tokenbucket *tb,
					  const struct tokenbucket_limit *lim);
TOKENBUCKET_API int tokenbucket_set_limit_at(struct tokenbucket *tb, int64_t now,
					     const struct tokenbucket_limit *lim);

/*
 * The table functions with the exact rate and burst of *lim, as
 * tokenbucket_table_create, tokenbucket_table_init_shared and
 * tokenbucket_table_open with lim->tokens and lim->period_ns (and the same
 * TOKENBUCKET_OPEN_DIFFERS).  Errors: theirs; -EINVAL also for lim NULL or
 * period_ns < 0; -ERANGE also for an unlimited limit (period_ns 0 with
 * tokens > 0), after every -EINVAL.
 */
TOKENBUCKET_API int tokenbucket_table_create_limit(struct tokenbucket_table **tp,
						   const struct tokenbucket_limit *lim,
						   uint64_t capacity, unsigned flags);
TOKENBUCKET_API int tokenbucket_table_init_shared_limit(struct tokenbucket_table **tp, void *mem,
							size_t size,
							const struct tokenbucket_limit *lim,
							uint64_t capacity, unsigned flags);
TOKENBUCKET_API int tokenbucket_table_open_limit(struct tokenbucket_table **tp, const char *name,
						 const struct tokenbucket_limit *lim,
						 uint64_t capacity, unsigned flags, unsigned mode,
						 unsigned *status);

/*
 * Go's WaitN on the key's bucket: reserves n tokens as
 * tokenbucket_table_reserve_at at tokenbucket_now(), then sleeps on
 * CLOCK_MONOTONIC until they are there.  deadline and cancel_fd as for
 * tokenbucket_wait (sleeping in slices of at most 50 ms when cancel_fd is
 * not -1; signals do not end the wait).  A rate or burst change may make
 * the tokens come later than the reservation's time_to_act: after each
 * sleep the wait checks them and sleeps again until they are there or the
 * deadline passes (then -ETIMEDOUT, the reservation given back).
 * 0: the tokens are taken (also when a cancel or a closed cancel_fd is
 * noticed only once they are there).  -EINVAL: t NULL, key NULL with
 * len > 0.  -EBADF, -ECANCELED: cancel_fd closed or readable, on entry
 * (nothing taken) or while sleeping (the reservation is given back as
 * tokenbucket_table_cancel_at does, whole unless the key's bucket was
 * given to another key meanwhile).  Then the errors of
 * tokenbucket_table_reserve_at: -E2BIG (n > burst), -ETIMEDOUT (not there
 * by the deadline; never, with rate 0: nothing is taken), -EOVERFLOW,
 * -EBUSY, -EDEADLK, -EBADMSG.  Other negative errno values from poll(2).  Thread-safe
 * and lock-free as the table's other calls (apart from sleeping).
 */
TOKENBUCKET_API int tokenbucket_table_wait(struct tokenbucket_table *t, const void *key,
					   size_t len, uint64_t n, int64_t deadline,
					   int cancel_fd);

/*
 * 1.2: changes a table's rate and burst to *lim for every key at once, at
 * the latest time any key has seen, at least now (and the table's origin):
 * each key's level carries over exactly, as a single bucket's across
 * tokenbucket_set_limit_at at that time; a lower burst drops what lies
 * above it, a higher one brings back nothing the old one dropped (keys
 * with no bucket are full, at the new burst).  Takes stay lock-free while
 * it runs; changes serialise on a process-shared robust mutex in the
 * table, and a change cut short by the death of its process is finished
 * by the next change or by the next call that finds it (a scan of every
 * slot, as the change makes).  Errors: -EINVAL (t or lim NULL, period_ns
 * < 0); -ERANGE (an unlimited limit, burst above
 * TOKENBUCKET_TABLE_BURST_MAX, a rate above 16 tokens per ns); -EDEADLK
 * (another change holds the mutex for more than 2 s); -EBADMSG (a
 * corrupt table).
 */
TOKENBUCKET_API int tokenbucket_table_set_limit_at(struct tokenbucket_table *t, int64_t now,
						   const struct tokenbucket_limit *lim);
/* tokenbucket_table_set_limit_at at tokenbucket_now(). */
TOKENBUCKET_API int tokenbucket_table_set_limit(struct tokenbucket_table *t,
						const struct tokenbucket_limit *lim);
/*
 * 1.2: fills *lim with the table's rate and burst in force, the rate in
 * lowest terms ({0, 1, burst} for rate 0).  -EINVAL: t or lim NULL.
 * -EBADMSG: a corrupt table.
 */
TOKENBUCKET_API int tokenbucket_table_get_limit(struct tokenbucket_table *t,
						struct tokenbucket_limit *lim);

/* ---- 1.2: several limits in one decision ---------------------------------- */

/*
 * A set is an array of count distinct buckets (1 to TOKENBUCKET_SET_MAX),
 * private or shared between processes (tokenbucket_init_shared,
 * tokenbucket_attach_shared, tokenbucket_open), each with its own rate and
 * burst: "10 a second and 1000 an hour" is a set of two.  The calls below
 * take n tokens from every bucket of the set or from none.  The set (array
 * and count) is what they act on, so an _at twin takes now right after
 * count.  Since 1.2.0; docs/sets.md has the model.
 *
 * How: the buckets after the first are checked, then n is taken from each
 * in order with that bucket's own lock-free take; when one refuses, what
 * was taken from the earlier ones is given back before the call returns,
 * as tokenbucket_refund gives back: all n, except what would lift the
 * bucket above its burst, whatever other calls did in between
 * (docs/core.md, "Giving back").  So a refused set takes nothing, under
 * any concurrency.
 *
 * The transient under-grant: from the take from bucket i until the call
 * refuses and gives it back (or returns), bucket i holds n fewer tokens,
 * so a call on it alone may be refused that would otherwise be allowed.
 * It is at most n tokens per bucket per set call in progress and lasts
 * for that call only (its takes and give-backs, which never wait for
 * another thread).  A set refused by the check before the takes causes
 * none.
 *
 * Every call fails with -EINVAL for: set NULL, count 0 or above
 * TOKENBUCKET_SET_MAX, a NULL bucket, the same bucket twice (by address: a
 * shared bucket mapped at two addresses cannot be recognised and is taken
 * from twice), a NULL output.  -E2BIG: n above some bucket's burst (finite
 * rate), nothing taken.  -EBADMSG: a shared bucket whose words no bucket
 * can hold, found by a take's general path (docs/shm.md), nothing taken.
 * Lock-free and thread-safe as the single-bucket calls.
 */

/* The most buckets a set may hold. */
#define TOKENBUCKET_SET_MAX 16

/*
 * A decision on a set, as struct tokenbucket_result reports one on a
 * bucket.  Durations are counted from each bucket's own clock.
 */
struct tokenbucket_set_result {
	bool allowed;            /* n was taken from every bucket */
	unsigned flags;          /* zero */
	/* The bucket reported: the one that refused; if allowed, the one with
	 * the fewest whole tokens left (the first of those). */
	size_t index;
	uint64_t limit;          /* the burst of set[index] */
	uint64_t remaining;      /* whole tokens set[index] holds after the decision; 0 in debt */
	/* 0 if allowed; else nanoseconds until every bucket holds n (the
	 * latest of the buckets), TOKENBUCKET_NEVER if never. */
	int64_t retry_after_ns;
	/* Nanoseconds until every bucket is full; TOKENBUCKET_NEVER if never. */
	int64_t reset_after_ns;
	uint64_t reserved[2];    /* zero */
};

/*
 * Takes n tokens from every bucket of the set at now, or none (as
 * tokenbucket_allow_at on each, all or nothing), and reports the decision
 * in *res.  Refused, nothing is taken and index is the first bucket found
 * short.  Every bucket examined has seen now.  0, or the errors above
 * (*res untouched).
 */
TOKENBUCKET_API int tokenbucket_allow_all(struct tokenbucket *const *set, size_t count, uint64_t n,
					  struct tokenbucket_set_result *res);
TOKENBUCKET_API int tokenbucket_allow_all_at(struct tokenbucket *const *set, size_t count,
					     int64_t now, uint64_t n,
					     struct tokenbucket_set_result *res);
/*
 * Reserves n tokens from every bucket of the set at now (as
 * tokenbucket_reserve_at on each, all or nothing), filling r[0] to
 * r[count - 1], one per bucket.  Each r[i].time_to_act is the set's: the
 * latest of the buckets' times, when all n are there in every bucket.
 * max_wait bounds each bucket's wait from its own time of the call.  On
 * error nothing is taken and r is untouched.  Errors above, and those of
 * tokenbucket_reserve_at: -ETIMEDOUT, -EOVERFLOW.
 */
TOKENBUCKET_API int tokenbucket_reserve_all(struct tokenbucket *const *set, size_t count,
					    uint64_t n, int64_t max_wait,
					    struct tokenbucket_reservation *r);
TOKENBUCKET_API int tokenbucket_reserve_all_at(struct tokenbucket *const *set, size_t count,
					       int64_t now, uint64_t n, int64_t max_wait,
					       struct tokenbucket_reservation *r);
/*
 * Gives back a set's reservation (r as tokenbucket_reserve_all filled it,
 * for the same set in the same order): unless now is past
 * r[i].time_to_act, every bucket gets back all it took, as described
 * above (not capped by the bucket's own time_to_act: the set acts at the
 * latest).  Sets each r[i].tokens to 0.  -EINVAL as above (nothing given
 * back).
 */
TOKENBUCKET_API int tokenbucket_cancel_all(struct tokenbucket *const *set, size_t count,
					   struct tokenbucket_reservation *r);
TOKENBUCKET_API int tokenbucket_cancel_all_at(struct tokenbucket *const *set, size_t count,
					      int64_t now, struct tokenbucket_reservation *r);
/*
 * Go's WaitN on a set: reserves n tokens from every bucket at
 * tokenbucket_now(), then sleeps until they are there in all of them,
 * with deadline and cancel_fd as tokenbucket_wait (sleeping in slices of
 * at most 50 ms when cancel_fd is not -1; signals do not end the wait; a
 * rate change that delays the tokens is checked again until the
 * deadline).  A wait that fails takes nothing: every reservation is given
 * back.  0: the tokens are taken from every bucket.  Errors above, then
 * -EBADF, -ECANCELED, -ETIMEDOUT, -EOVERFLOW as tokenbucket_wait.
 */
TOKENBUCKET_API int tokenbucket_wait_all(struct tokenbucket *const *set, size_t count, uint64_t n,
					 int64_t deadline, int cancel_fd);

/*
 * Several limits per key: tables[0] to tables[count - 1] (1 to
 * TOKENBUCKET_SET_MAX distinct tables, each one limit with its own rate,
 * burst, capacity and policy: "10 a second and 1000 an hour per API key"
 * is two tables) decide key together, taking n from the key's bucket in
 * every table or from none, as tokenbucket_allow_all does for buckets
 * (the tables after the first are checked, then each is taken from in
 * order; on a refusal the earlier ones get back what they gave before the
 * call returns, as tokenbucket_table_refund gives back, so a refused set
 * takes nothing).  A key uses a slot (32 bytes) in every
 * table that holds a bucket for it.  Refused by a table's policy (no slot
 * for a new key, fail closed), the set is refused there; passed open, that
 * table takes nothing.  *res as
 * tokenbucket_allow_all fills it, index naming a table; flags zero.
 * -EINVAL: res or tables NULL, count 0 or above TOKENBUCKET_SET_MAX, a
 * NULL table or two handles on one table, key NULL with len > 0.
 * -E2BIG: n above a table's burst.  -EDEADLK: a re-anchor waited 2 s for
 * another change (tokenbucket_table_allow).  -EBADMSG: a corrupt table.
 * On every error nothing is taken and *res is untouched.  Lock-free and
 * thread-safe as the tables' other calls; tables may be shared between
 * processes.  Since 1.2.0.
 */
TOKENBUCKET_API int tokenbucket_table_allow_all(struct tokenbucket_table *const *tables,
						size_t count, const void *key, size_t len,
						uint64_t n, struct tokenbucket_set_result *res);
TOKENBUCKET_API int tokenbucket_table_allow_all_at(struct tokenbucket_table *const *tables,
						   size_t count, int64_t now, const void *key,
						   size_t len, uint64_t n,
						   struct tokenbucket_set_result *res);

#ifdef __cplusplus
}
#endif

#endif /* TOKENBUCKET_H */
