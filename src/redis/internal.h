/* SPDX-License-Identifier: MIT */
/*
 * libtokenbucket-redis's codec: the script, a call's arguments and its
 * reply, and the bounds a server's bytes are held to.  The lowest layer
 * (pool.h and cluster.h build on it); nothing here is exported.
 */
#ifndef TOKENBUCKET_REDIS_INTERNAL_H
#define TOKENBUCKET_REDIS_INTERNAL_H

#include <errno.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/types.h>

#include <hiredis/hiredis.h>

#include "tokenbucket-redis.h"

/*
 * struct tokenbucket_redis_limit (1.0, 1.1) and struct tokenbucket_limit
 * (1.2) are one configuration under two names: same fields, same layout.
 */
_Static_assert(sizeof(struct tokenbucket_redis_limit) == sizeof(struct tokenbucket_limit) &&
		       offsetof(struct tokenbucket_redis_limit, tokens) ==
			       offsetof(struct tokenbucket_limit, tokens) &&
		       offsetof(struct tokenbucket_redis_limit, period_ns) ==
			       offsetof(struct tokenbucket_limit, period_ns) &&
		       offsetof(struct tokenbucket_redis_limit, burst) ==
			       offsetof(struct tokenbucket_limit, burst),
	       "struct tokenbucket_redis_limit is struct tokenbucket_limit");
/* A 1.2 limit as the 1.0 call struct carries it. */
static inline struct tokenbucket_redis_limit tbr__limit(const struct tokenbucket_limit *lim)
{
	return (struct tokenbucket_redis_limit){ lim->tokens, lim->period_ns, lim->burst };
}

/* The script, embedded at build time: tokenbucket.lua, joined from script-*.lua (script.c). */
extern const char tbr__script_text[];
extern const char tbr__script_sha1[];
/* The Redis 7 function library (tokenbucket-function.lua) and its function's name. */
extern const char tbr__function_text[];
extern const char tbr__function_name[];

/*
 * EVALSHA|EVAL sha|text (or FCALL name) 1 key op now tokens period burst n arg, and for an
 * allow a last word "1" asking for the compact reply (4 integers), or for
 * the native module (tokenbucket-redis-module(7)) from argv[2] on:
 * TOKENBUCKET.CALL key op now tokens period burst n arg, with the 7-element
 * reply.  The command is argc words from argv + first.
 */
#define TBR__ARGC 12
/* allow_all's words: 7, three per limit (struct tokenbucket_redis_call_all) and the reply form. */
#define TBR__ARGC_ALL (8 + 3 * TOKENBUCKET_SET_MAX)
struct tbr__args {
	const char *argv[TBR__ARGC_ALL];
	size_t len[TBR__ARGC_ALL];
	char num[2 + 3 * TOKENBUCKET_SET_MAX][24];
	int first, argc;
};

/* The struct tokenbucket_redis_call_all whose call is call (op TOKENBUCKET_REDIS_ALLOW_ALL). */
static inline struct tokenbucket_redis_call_all *
tbr__call_all_of(const struct tokenbucket_redis_call *call)
{
	return (struct tokenbucket_redis_call_all *)((char *)call -
						     offsetof(struct tokenbucket_redis_call_all, call));
}
/* What a several-limits decision says in the terms of a single one (its index aside). */
static inline struct tokenbucket_result tbr__result_of_set(const struct tokenbucket_set_result *s)
{
	return (struct tokenbucket_result){ .allowed = s->allowed, .flags = s->flags,
					    .limit = s->limit, .remaining = s->remaining,
					    .retry_after_ns = s->retry_after_ns,
					    .reset_after_ns = s->reset_after_ns };
}

/*
 * A lease's own calls (docs/leases.md, "Safety"), never a caller's: with
 * this flag, ALLOW goes as the script's op "lease" (arg: the window in
 * ns) and REFUND as "giveback" (arg: the group's expiry, as the lease was
 * told).  A granted lease's result then says its group in the fields a
 * grant does not use: retry_after_ns the group's expiry on the server's
 * clock, reset_after_ns the time from the decision to it.  The public
 * entry points that take a call from the caller refuse the flag.
 */
#define TBR__LEASE (1u << 30)

/*
 * How a call goes: EVALSHA (or EVAL) of the script, TOKENBUCKET.CALL of the
 * module, or FCALL of the function library's function (from argv[0], as
 * the script's: FCALL name 1 key op ...).
 */
enum { TBR__VIA_SCRIPT = 0, TBR__VIA_MODULE = 1, TBR__VIA_FUNCTION = 2 };
/* Checks call and points args at its fields (via: TBR__VIA_*); -EINVAL/-ERANGE on bad input. */
int tbr__args(const struct tokenbucket_redis_call *call, struct tbr__args *a, int via);
/*
 * The arguments a->argv[first ..] as one RESP command, the bytes hiredis's
 * redisFormatCommandArgv makes, without printf or sds, NUL-terminated as
 * its are: into buf when they fit its size, else into *heap (malloc'd; the
 * caller frees it, NULL when unused).  The command's length (the NUL not
 * counted), or -ENOMEM.
 */
#define TBR__RESP_STACK 1024 /* a call with a key of up to ~600 bytes fits on the stack */
ssize_t tbr__resp(const struct tbr__args *a, char *buf, size_t size, char **heap);
/*
 * The function library, found once per connection where the server has no
 * module: tbr__function_probe (FCALL name 0) replies the script's "bad
 * argument count" where the function is there (tbr__function_found 1),
 * "Function not found" where it is not (0: tbr__function_load loads it,
 * and tbr__function_loaded says whether that worked), anything else (-1)
 * where there are no functions (Redis 5 and 6) or no permission: the script.
 */
extern const char *const tbr__function_probe[3];
extern const char *const tbr__function_load[3];
int tbr__function_found(const redisReply *rep);
bool tbr__function_loaded(const redisReply *rep);

/*
 * Whether the server has the module, from its reply to TOKENBUCKET.VERSION
 * (a version this client speaks), asked once per connection.
 */
extern const char *const tbr__module_probe[1];
bool tbr__module_speaks(const redisReply *rep);
/* A reply to ROLE saying the server is a primary. */
bool tbr__role_primary(const redisReply *rep);
/* An error reply saying the server has no such command (the module was unloaded). */
bool tbr__unknown_command(const redisReply *rep);
/* Whether a call goes to the module: mode (TOKENBUCKET_REDIS_MODULE_*) and what the connection found. */
static inline bool tbr__use_module(int mode, bool found)
{
	return mode == TOKENBUCKET_REDIS_MODULE_ALWAYS || (mode == TOKENBUCKET_REDIS_MODULE_AUTO && found);
}
/* An error reply's errno: -ENOEXEC for NOSCRIPT, -EBADMSG for a value that is not a bucket. */
int tbr__error(const char *str, size_t len);
/*
 * The errno of a connection hiredis failed (c, NULL when hiredis could not
 * allocate one), the same for the blocking client, the asynchronous
 * engine and the sentinels' questions; docs/redis.md's fault table lists
 * the set.  hiredis keeps no errno, only its text: every errno it or
 * sigpipe.c records ends errstr ("[what: ]strerror(errno)"), so the text
 * is matched against the errnos a connection can fail with.  A wait that
 * ran out is -ETIME; what no errno names is -ECONNRESET for I/O on a
 * connection made, else (a name not resolved) -ECONNREFUSED.
 */
static inline int tbr__conn_errno(const redisContext *c)
{
	static const int known[] = { ECONNREFUSED, ENOENT, EACCES, ECONNRESET, ECONNABORTED, EPIPE,
				     ENOTCONN, ENETUNREACH, EHOSTUNREACH, ETIMEDOUT, EAGAIN, EINPROGRESS };
	if (c == NULL || c->err == REDIS_ERR_OOM)
		return -ENOMEM;
	if (c->err == REDIS_ERR_EOF)
		return -ECONNRESET;
	if (c->err == REDIS_ERR_PROTOCOL)
		return -EPROTO;
	size_t len = strnlen(c->errstr, sizeof(c->errstr));
	for (size_t i = 0; i < sizeof(known) / sizeof(known[0]); i++) {
		const char *text = strerror(known[i]);
		size_t n = strlen(text);
		if (n <= len && memcmp(c->errstr + len - n, text, n) == 0)
			return known[i] == ETIMEDOUT || known[i] == EAGAIN || known[i] == EINPROGRESS
				       ? -ETIME
				       : -known[i];
	}
	return c->err == REDIS_ERR_IO ? -ECONNRESET : -ECONNREFUSED;
}
/* A whole reply to call: 0 or a negative errno, with the outputs filled. */
int tbr__decode(const struct tokenbucket_redis_call *call, const redisReply *rep,
		struct tokenbucket_result *res, struct tokenbucket_reservation *rv,
		double *tokens);

/*
 * Bounds on what a server may send, checked on the bytes before hiredis
 * reads them (bounds.c): hiredis 0.14 allocates a multi-bulk's elements
 * when its count comes (2^31 - 1 of them: 16 GiB) and buffers a bulk
 * string or a line until it ends.  Counted over a whole reply, as each
 * element costs an allocation however few bytes it takes.  No reply of
 * the library's calls comes near these: the largest, CLUSTER SLOTS, has
 * at most 16384 ranges of a few short fields each.
 */
#define TBR__REPLY_COUNT_MAX (1u << 18)  /* elements of one reply, its multi-bulks' together */
#define TBR__REPLY_STRING_MAX 65536      /* bytes of one bulk string or line */
#define TBR__REPLY_BYTES_MAX (8u << 20)  /* bytes of one whole reply */
/* A connection's scan of the replies it read so far: zero it with the connection. */
struct tbr__bound {
	uint64_t skip;    /* bytes of a bulk string's body still to come (its CRLF included) */
	uint64_t pending; /* items the reply begun still needs (0: between replies) */
	uint64_t bytes;   /* bytes of the reply begun so far */
	uint64_t elements; /* and elements */
	uint64_t line;    /* bytes of the line begun so far */
	char head[24];    /* its first bytes: the type and a count or length */
	bool cr;          /* the last byte of the line was CR */
	bool bad;         /* a bound was passed: nothing after it is read */
};
/*
 * Scans len more bytes of a connection's stream: len when they stay
 * within the bounds, else how many of them come before the line that
 * passed one (b->bad is then set, and stays).
 */
size_t tbr__bound_scan(struct tbr__bound *b, const char *buf, size_t len);

#endif
