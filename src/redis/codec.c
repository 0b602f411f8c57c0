/* SPDX-License-Identifier: MIT */
/*
 * The script call as bytes: its arguments, the meaning of its reply and of
 * Redis's error replies.  Shared by the blocking calls and by
 * tokenbucket_redis_format/parse.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "decimal.h"
#include "internal.h"

static const char *const op_names[] = { "allow", "reserve", "cancel", "tokens", "reset", "refund" };

static void put(struct tbr__args *a, int i, const char *s, size_t len)
{
	a->argv[i] = s;
	a->len[i] = len;
}

static void put_num(struct tbr__args *a, int i, int slot, bool is_signed, uint64_t v)
{
	char *s = a->num[slot];
	put(a, i, s, is_signed ? put_i64(s, (int64_t)v) : put_u64(s, v));
}

ssize_t tbr__resp(const struct tbr__args *a, char *buf, size_t size, char **heap)
{
	/* "*argc\r\n", then "$len\r\n" arg "\r\n" each: at most 26 bytes of framing each;
	 * and a NUL after the command, as hiredis's formatter leaves one. */
	size_t need = 27;
	for (int i = a->first; i < a->first + a->argc; i++) {
		if (a->len[i] > SIZE_MAX / 2 - need)
			return -ENOMEM;
		need += 26 + a->len[i];
	}
	char *out = buf;
	*heap = NULL;
	if (need > size) {
		out = *heap = malloc(need);
		if (out == NULL)
			return -ENOMEM;
	}
	char *o = out;
	*o++ = '*';
	o += put_u64(o, (uint64_t)a->argc);
	*o++ = '\r';
	*o++ = '\n';
	for (int i = a->first; i < a->first + a->argc; i++) {
		*o++ = '$';
		o += put_u64(o, a->len[i]);
		*o++ = '\r';
		*o++ = '\n';
		if (a->len[i] > 0)
			memcpy(o, a->argv[i], a->len[i]);
		o += a->len[i];
		*o++ = '\r';
		*o++ = '\n';
	}
	*o = '\0';
	return o - out;
}

/* A configuration the script takes: -EINVAL or -ERANGE otherwise. */
static int check_limit(const struct tokenbucket_redis_limit *lim)
{
	if (lim->tokens > 0 && lim->period_ns <= 0)
		return -EINVAL;
	if (lim->burst > TOKENBUCKET_BURST_MAX)
		return -ERANGE;
	return 0;
}

/* Rate 0 goes as 0 per 1 ns whatever the period says. */
static void put_limit(struct tbr__args *a, int i, int slot, const struct tokenbucket_redis_limit *lim)
{
	put_num(a, i, slot, false, lim->tokens);
	put_num(a, i + 1, slot + 1, true, lim->tokens > 0 ? (uint64_t)lim->period_ns : 1);
	put_num(a, i + 2, slot + 2, false, lim->burst);
}

/* The words every call starts with: the command, the key, op and now (words 0 to 5). */
static void put_head(const struct tokenbucket_redis_call *call, struct tbr__args *a, int via,
		     const char *op)
{
	a->first = 0;
	if (via == TBR__VIA_MODULE) {
		/* The module takes the script's arguments after the key count. */
		a->first = 2;
		put(a, 2, "TOKENBUCKET.CALL", 16);
	} else if (via == TBR__VIA_FUNCTION) {
		put(a, 0, "FCALL", 5);
		put(a, 1, tbr__function_name, strlen(tbr__function_name));
	} else if (call->flags & TOKENBUCKET_REDIS_EVAL) {
		put(a, 0, "EVAL", 4);
		put(a, 1, tbr__script_text, strlen(tbr__script_text));
	} else {
		put(a, 0, "EVALSHA", 7);
		put(a, 1, tbr__script_sha1, 40);
	}
	if (via != TBR__VIA_MODULE)
		put(a, 2, "1", 1);
	put(a, 3, call->keylen > 0 ? call->key : "", call->keylen);
	put(a, 4, op, strlen(op));
	if (call->flags & TOKENBUCKET_REDIS_AT)
		put_num(a, 5, 0, true, (uint64_t)call->now);
	else
		put(a, 5, "", 0);
}

/* allow_all: ... now n, then tokens period burst of each limit, and for the script the reply form "1". */
static int args_all(const struct tokenbucket_redis_call *call, struct tbr__args *a, int via)
{
	const struct tokenbucket_redis_call_all *all = tbr__call_all_of(call);
	if (all->limits == NULL || all->count == 0 || all->count > TOKENBUCKET_SET_MAX)
		return -EINVAL;
	for (size_t i = 0; i < all->count; i++) {
		struct tokenbucket_redis_limit lim = tbr__limit(&all->limits[i]);
		int err = check_limit(&lim);
		if (err != 0)
			return err;
	}
	put_head(call, a, via, "allow_all");
	put_num(a, 6, 1, false, call->n);
	for (size_t i = 0; i < all->count; i++) {
		struct tokenbucket_redis_limit lim = tbr__limit(&all->limits[i]);
		put_limit(a, 7 + 3 * (int)i, 2 + 3 * (int)i, &lim);
	}
	a->argc = 7 + 3 * (int)all->count - a->first;
	/* No decimal times needed here either: the script may reply in integers. */
	if (via != TBR__VIA_MODULE)
		put(a, a->first + a->argc++, "1", 1);
	return 0;
}

int tbr__args(const struct tokenbucket_redis_call *call, struct tbr__args *a, int via)
{
	if (call == NULL || a == NULL || (call->key == NULL && call->keylen > 0))
		return -EINVAL;
	if (call->flags & ~(TOKENBUCKET_REDIS_AT | TOKENBUCKET_REDIS_EVAL | TBR__LEASE))
		return -EINVAL;
	if (call->op == TOKENBUCKET_REDIS_ALLOW_ALL)
		return args_all(call, a, via);
	if ((unsigned)call->op > TOKENBUCKET_REDIS_REFUND)
		return -EINVAL;
	const struct tokenbucket_redis_limit *lim = &call->limit;
	int err = check_limit(lim);
	if (err != 0)
		return err;
	if (call->op == TOKENBUCKET_REDIS_RESET && call->n > lim->burst)
		return -EINVAL;
	bool lease = call->flags & TBR__LEASE;
	if (lease && call->op != TOKENBUCKET_REDIS_ALLOW && call->op != TOKENBUCKET_REDIS_REFUND)
		return -EINVAL;
	put_head(call, a, via, !lease ? op_names[call->op]
			       : call->op == TOKENBUCKET_REDIS_ALLOW ? "lease" : "giveback");
	a->argc = TBR__ARGC - 1 - a->first;
	put_limit(a, 6, 1, lim);
	put_num(a, 9, 4, false, call->n);
	bool has_arg = call->op == TOKENBUCKET_REDIS_RESERVE || call->op == TOKENBUCKET_REDIS_CANCEL ||
		       lease;
	put_num(a, 10, 5, true, has_arg ? (uint64_t)call->arg : 0);
	/* An allow needs no decimal times: the script may reply in integers. */
	if (via != TBR__VIA_MODULE && call->op == TOKENBUCKET_REDIS_ALLOW && !lease) {
		put(a, 11, "1", 1);
		a->argc++;
	}
	return 0;
}

static bool starts(const char *s, size_t len, const char *prefix)
{
	size_t n = strlen(prefix);
	return len >= n && memcmp(s, prefix, n) == 0;
}

const char *const tbr__module_probe[1] = { "TOKENBUCKET.VERSION" };

bool tbr__module_speaks(const redisReply *rep)
{
	/* Version 1.x: TOKENBUCKET.CALL as tokenbucket-redis-module(7) describes it. */
	return rep != NULL && rep->type == REDIS_REPLY_STRING && starts(rep->str, rep->len, "1.");
}

/* FCALL of the function with no key: the script's argument check answers. */
const char *const tbr__function_probe[3] = { "FCALL", tbr__function_name, "0" };
const char *const tbr__function_load[3] = { "FUNCTION", "LOAD", tbr__function_text };

int tbr__function_found(const redisReply *rep)
{
	if (rep == NULL || rep->type != REDIS_REPLY_ERROR)
		return -1;
	if (starts(rep->str, rep->len, "ERR tokenbucket: bad argument count"))
		return 1;
	if (starts(rep->str, rep->len, "ERR Function not found"))
		return 0;
	return -1;
}

bool tbr__function_loaded(const redisReply *rep)
{
	/* The library's name, or another client loaded it first. */
	return rep != NULL &&
	       ((rep->type == REDIS_REPLY_STRING && strcmp(rep->str, tbr__function_name) == 0) ||
		(rep->type == REDIS_REPLY_ERROR && strstr(rep->str, "already exists") != NULL));
}

bool tbr__role_primary(const redisReply *rep)
{
	/* The whole word, by length: "master\0x" is not it. */
	const redisReply *e = rep != NULL && rep->type == REDIS_REPLY_ARRAY && rep->elements > 0
				      ? rep->element[0] : NULL;
	return e != NULL && e->type == REDIS_REPLY_STRING && e->len == 6 &&
	       memcmp(e->str, "master", 6) == 0;
}

bool tbr__unknown_command(const redisReply *rep)
{
	return rep != NULL && rep->type == REDIS_REPLY_ERROR &&
	       starts(rep->str, rep->len, "ERR unknown command");
}

int tbr__error(const char *s, size_t len)
{
	static const struct {
		const char *prefix;
		int err;
	} table[] = {
		{ "NOSCRIPT", ENOEXEC },
		{ "TBCORRUPT", EBADMSG },
		{ "WRONGTYPE", EPROTOTYPE },
		{ "OOM", ENOMEM },
		{ "READONLY", EROFS },
		{ "BUSY", EBUSY },
		{ "LOADING", EAGAIN },
		{ "MASTERDOWN", EAGAIN },
		{ "TRYAGAIN", EAGAIN },
		{ "CLUSTERDOWN", EAGAIN },
		{ "MOVED", EREMOTE },
		{ "ASK", EREMOTE },
		{ "CROSSSLOT", EREMOTE },
		{ "NOAUTH", EACCES },
		{ "NOPERM", EACCES },
		{ "ERR tokenbucket: bad", EINVAL },
	};
	if (s == NULL)
		return -EPROTO;
	for (size_t i = 0; i < sizeof(table) / sizeof(table[0]); i++)
		if (starts(s, len, table[i].prefix))
			return -table[i].err;
	return -EPROTO;
}

/* A decimal int64 with nothing around it. */
static bool read_int(const redisReply *e, int64_t lo, int64_t *out)
{
	if (e == NULL || e->type != REDIS_REPLY_STRING || e->len == 0 || e->len > 20)
		return false;
	char buf[24];
	memcpy(buf, e->str, e->len);
	buf[e->len] = '\0';
	if (buf[0] != '-' && (buf[0] < '0' || buf[0] > '9'))
		return false;
	char *end;
	errno = 0;
	long long v = strtoll(buf, &end, 10);
	/* end, not *end: a NUL inside the string ends strtoll early. */
	if (errno != 0 || end != buf + e->len || v < lo)
		return false;
	*out = v;
	return true;
}

/*
 * The compact reply to an allow: { code, level, wait, full } in integers,
 * the waits in ns from the bucket's time (-1: never), as the script gives
 * it when its common case decides.
 */
static int decode_compact(const struct tokenbucket_redis_call *call, const redisReply *rep,
			  struct tokenbucket_result *res)
{
	for (size_t i = 0; i < 4; i++)
		if (rep->element[i]->type != REDIS_REPLY_INTEGER)
			return -EPROTO;
	long long code = rep->element[0]->integer, level = rep->element[1]->integer;
	long long wait = rep->element[2]->integer, full = rep->element[3]->integer;
	if (call->op != TOKENBUCKET_REDIS_ALLOW || code < 0 || code > 1 ||
	    level < -(long long)TOKENBUCKET_DEBT_MAX || level > (long long)call->limit.burst ||
	    wait < -1 || full < -1)
		return -EPROTO;
	if (res != NULL) {
		*res = (struct tokenbucket_result){
			.allowed = code == 1,
			.limit = call->limit.burst,
			.remaining = level > 0 ? (uint64_t)level : 0,
			.retry_after_ns = wait < 0 ? TOKENBUCKET_NEVER : wait,
			.reset_after_ns = full < 0 ? TOKENBUCKET_NEVER : full,
		};
	}
	return 0;
}

/*
 * t - now, at least 0; TOKENBUCKET_NEVER for a time that never comes, and
 * for a span that no int64_t holds (explicit times far apart).
 */
static int64_t until(int64_t t, int64_t now)
{
	if (t == TOKENBUCKET_NEVER || t <= now)
		return t == TOKENBUCKET_NEVER ? TOKENBUCKET_NEVER : 0;
	uint64_t d = (uint64_t)t - (uint64_t)now;
	return d >= (uint64_t)TOKENBUCKET_NEVER ? TOKENBUCKET_NEVER : (int64_t)d;
}

/*
 * The reply to allow_all: { code, index, clock, level, act, full }, code 1
 * taken, 0 refused, 2 n above limit index's burst (-E2BIG, *res untouched).
 */
static int decode_all(const struct tokenbucket_redis_call *call, const redisReply *rep)
{
	const struct tokenbucket_redis_call_all *all = tbr__call_all_of(call);
	if (rep->type != REDIS_REPLY_ARRAY || (rep->elements != 5 && rep->elements != 6))
		return -EPROTO;
	bool compact = rep->elements == 5;
	for (size_t i = 0; i < (compact ? 5u : 2u); i++)
		if (rep->element[i]->type != REDIS_REPLY_INTEGER)
			return -EPROTO;
	long long code = rep->element[0]->integer, index = rep->element[1]->integer;
	if (code < 0 || code > 2 || index < 0 || (unsigned long long)index >= all->count)
		return -EPROTO;
	if (code == 2)
		return -E2BIG;
	uint64_t burst = all->limits[index].burst;
	int64_t level, retry, reset;
	if (compact) {
		/* { code, index, level, wait, full_wait }: waits in ns from the key's clock, -1 never. */
		level = rep->element[2]->integer;
		retry = rep->element[3]->integer;
		reset = rep->element[4]->integer;
		if (retry < -1 || reset < -1)
			return -EPROTO;
		retry = retry < 0 ? TOKENBUCKET_NEVER : retry;
		reset = reset < 0 ? TOKENBUCKET_NEVER : reset;
	} else {
		int64_t now, act, full;
		if (!read_int(rep->element[2], INT64_MIN, &now) || !read_int(rep->element[3], 0, &level) ||
		    !read_int(rep->element[4], INT64_MIN, &act) ||
		    !read_int(rep->element[5], INT64_MIN, &full))
			return -EPROTO;
		retry = until(act, now);
		reset = until(full, now);
	}
	if (level < 0 || (uint64_t)level > burst)
		return -EPROTO;
	if (all->res != NULL) {
		*all->res = (struct tokenbucket_set_result){
			.allowed = code == 1,
			.index = (size_t)index,
			.limit = burst,
			.remaining = (uint64_t)level,
			.retry_after_ns = code == 1 ? 0 : retry,
			.reset_after_ns = reset,
		};
	}
	return 0;
}

int tbr__decode(const struct tokenbucket_redis_call *call, const redisReply *rep,
		struct tokenbucket_result *res, struct tokenbucket_reservation *rv,
		double *tokens)
{
	if (rep == NULL)
		return -EPROTO;
	if (rep->type == REDIS_REPLY_ERROR)
		return tbr__error(rep->str, rep->len);
	if (call->op == TOKENBUCKET_REDIS_ALLOW_ALL)
		return decode_all(call, rep);
	bool lease = (call->flags & TBR__LEASE) && call->op == TOKENBUCKET_REDIS_ALLOW;
	if (rep->type == REDIS_REPLY_ARRAY && rep->elements == 4 && !lease)
		return decode_compact(call, rep, res);
	if (rep->type != REDIS_REPLY_ARRAY || rep->elements != (lease ? 8u : 7u) ||
	    rep->element[0]->type != REDIS_REPLY_INTEGER)
		return -EPROTO;
	long long code = rep->element[0]->integer;
	int64_t now, level, rem, q, act, full;
	if (code < 0 || code > 3 || !read_int(rep->element[1], INT64_MIN, &now) ||
	    !read_int(rep->element[2], -(int64_t)TOKENBUCKET_DEBT_MAX, &level) ||
	    !read_int(rep->element[3], 0, &rem) || !read_int(rep->element[4], 1, &q) ||
	    rem >= q || !read_int(rep->element[5], INT64_MIN, &act) ||
	    !read_int(rep->element[6], INT64_MIN, &full))
		return -EPROTO;
	uint64_t burst = call->limit.burst;
	/* A bucket never holds more than its burst (the compact decoders check alike). */
	if (level > 0 && (uint64_t)level > burst)
		return -EPROTO;
	bool decides = call->op == TOKENBUCKET_REDIS_ALLOW || call->op == TOKENBUCKET_REDIS_RESERVE;
	int64_t group = 0;
	/* A lease's group expires after the decision, if at all (INT64_MAX - 1 at most). */
	if (lease && (!read_int(rep->element[7], INT64_MIN, &group) || group < now ||
		      (code == 1 && call->n > 0 && group == now)))
		return -EPROTO;
	if (res != NULL) {
		*res = (struct tokenbucket_result){
			.allowed = decides ? code == 1 : level >= 1,
			.limit = burst,
			.remaining = level > 0 ? (uint64_t)level : 0,
			.retry_after_ns = until(act, now),
			.reset_after_ns = until(full, now),
		};
		if (lease && code == 1) {
			res->retry_after_ns = group;
			res->reset_after_ns = until(group, now);
		}
	}
	int err = 0;
	switch (call->op) {
	case TOKENBUCKET_REDIS_RESERVE:
		/*
		 * A grant past max_wait (arg; INT64_MAX: no limit) is one the
		 * script never makes: a caller would sleep past its deadline.
		 */
		if (code == 1 && call->arg != INT64_MAX &&
		    (call->arg < 0 || act == TOKENBUCKET_NEVER || until(act, now) > call->arg))
			return -EPROTO;
		err = code == 1 ? 0 : code == 0 ? -ETIMEDOUT : code == 2 ? -E2BIG : -EOVERFLOW;
		if (err == 0 && rv != NULL)
			*rv = (struct tokenbucket_reservation){ .time_to_act = act, .tokens = call->n };
		break;
	case TOKENBUCKET_REDIS_REFUND:
		err = code == 2 ? -E2BIG : 0;
		break;
	case TOKENBUCKET_REDIS_TOKENS:
		if (tokens != NULL) {
			/* The expression tokenbucket_tokens_at evaluates, so the same bits:
			 * level + rem/q in long double, rounded to double once. */
			double v = (double)((long double)level + (long double)rem / (long double)q);
			*tokens = v > (double)burst ? (double)burst : v;
		}
		break;
	default:
		break;
	}
	return err;
}

int tokenbucket_redis_format(const struct tokenbucket_redis_call *call, char **cmd, size_t *len)
{
	struct tbr__args a;
	if (cmd == NULL || len == NULL ||
	    (call != NULL && ((unsigned)call->op > TOKENBUCKET_REDIS_ALLOW_ALL || (call->flags & TBR__LEASE))))
		return -EINVAL;
	int err = tbr__args(call, &a, false);
	if (err != 0)
		return err;
	char *out;
	ssize_t n = tbr__resp(&a, NULL, 0, &out); /* always in malloc'd memory: free() takes it */
	if (n < 0)
		return (int)n;
	*cmd = out;
	*len = (size_t)n;
	return 0;
}

int tokenbucket_redis_parse(const struct tokenbucket_redis_call *call, const char *buf,
			    size_t len, size_t *used, struct tokenbucket_result *res,
			    struct tokenbucket_reservation *rv, double *tokens)
{
	if (call == NULL || (buf == NULL && len > 0) || used == NULL ||
	    (unsigned)call->op > TOKENBUCKET_REDIS_ALLOW_ALL || (call->flags & TBR__LEASE))
		return -EINVAL;
	/* A several-limits decision is decoded here, then handed to the caller's res. */
	struct tokenbucket_redis_call_all all;
	struct tokenbucket_set_result set;
	struct tokenbucket_set_result *set_to = NULL;
	if (call->op == TOKENBUCKET_REDIS_ALLOW_ALL) {
		all = *tbr__call_all_of(call);
		set_to = all.res;
		all.res = &set;
		call = &all.call;
	}
	redisReader *rd = redisReaderCreate();
	if (rd == NULL)
		return -ENOMEM;
	void *rep = NULL;
	int err = 0;
	/* hiredis sees only what lies within the bounds: a reply past them is malformed, not awaited. */
	struct tbr__bound b = { 0 };
	size_t good = len > 0 ? tbr__bound_scan(&b, buf, len) : 0;
	if (good > 0 && redisReaderFeed(rd, buf, good) != REDIS_OK)
		err = -ENOMEM;
	else if (redisReaderGetReply(rd, &rep) != REDIS_OK)
		err = rd->err == REDIS_ERR_OOM ? -ENOMEM : -EPROTO;
	else if (rep == NULL)
		err = b.bad ? -EPROTO : -EAGAIN;
	if (err == 0) {
		/* What the reader has not consumed is still in its buffer. */
		*used = good - (rd->len - rd->pos);
		struct tokenbucket_result r;
		struct tokenbucket_reservation v;
		double t;
		err = tbr__decode(call, rep, &r, &v, &t);
		if (err == 0 && call->op == TOKENBUCKET_REDIS_ALLOW_ALL) {
			if (set_to != NULL)
				*set_to = set;
			if (res != NULL)
				*res = tbr__result_of_set(&set);
		} else if (err == 0 || err == -ETIMEDOUT || err == -E2BIG || err == -EOVERFLOW) {
			if (res != NULL)
				*res = r;
			if (err == 0 && rv != NULL && call->op == TOKENBUCKET_REDIS_RESERVE)
				*rv = v;
			if (err == 0 && tokens != NULL && call->op == TOKENBUCKET_REDIS_TOKENS)
				*tokens = t;
		}
	}
	if (rep != NULL)
		freeReplyObject(rep);
	redisReaderFree(rd);
	return err;
}
