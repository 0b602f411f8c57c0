/* SPDX-License-Identifier: MIT */
/*
 * The tokenbucket Redis module: the script's calls as native commands, on
 * the same stored value (tokenbucket-redis-module(7)).
 *
 *   TOKENBUCKET.CALL key op now tokens period burst n arg
 *   TOKENBUCKET.VERSION
 *
 * A write is replicated as the SET it made, with an absolute PXAT expiry,
 * so that replicas and the AOF replay the result, never the server's clock.
 * A call that writes nothing leaves the key as the script's GET would:
 * nothing propagated, no event, no WATCH broken, the encoding kept.
 */
#include <stdbool.h>
#include <string.h>
#include <time.h>

#include "bucket.h"
#include "redismodule-api.h"

#define TB_EXPORT __attribute__((visibility("default")))

/* The server's clock in ns, whole microseconds as TIME gives them. */
static int64_t server_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec / 1000 * 1000;
}

static int tb_call(RedisModuleCtx *ctx, RedisModuleString **argv, int argc)
{
	/* allow_all takes 3 + 3 * limits arguments after the key, the rest 7. */
	struct tbm_str arg[3 + 3 * TBM_SET_MAX];
	size_t nargs = argc > 2 ? (size_t)argc - 2 : 0;
	if (argc >= 3) {
		arg[0].p = RedisModule_StringPtrLen(argv[2], &arg[0].n);
		if (!(arg[0].n == 9 && memcmp(arg[0].p, "allow_all", 9) == 0)) {
			if (argc != 9)
				nargs = 0;
		} else if (nargs < 6 || nargs > 3 + 3 * TBM_SET_MAX || nargs % 3 != 0) {
			nargs = 0;
		}
	}
	if (nargs == 0)
		return RedisModule_ReplyWithError(ctx, "ERR tokenbucket: bad argument count");
	for (size_t i = 1; i < nargs; i++)
		arg[i].p = RedisModule_StringPtrLen(argv[i + 2], &arg[i].n);
	bool several = nargs != 7;
	int64_t ns = server_ns();

	/* Read as the script does, with GET: a key opened for writing is
	 * signalled modified when closed (a WATCH on it fails), and reading a
	 * string through StringDMA re-encodes a short or numeric one, so a
	 * call that writes nothing must not touch the key any other way. */
	RedisModuleCallReply *got = RedisModule_Call(ctx, "GET", "s", argv[1]);
	if (got == NULL)
		return RedisModule_ReplyWithError(ctx, "ERR tokenbucket: the value could not be read");
	struct tbm_str stored, *sp = NULL;
	int type = RedisModule_CallReplyType(got);
	if (type == REDISMODULE_REPLY_STRING) {
		stored.p = RedisModule_CallReplyStringPtr(got, &stored.n);
		sp = &stored;
	} else if (type == REDISMODULE_REPLY_ERROR) {
		/* The one error GET gives: a key of another type. */
		RedisModule_FreeCallReply(got);
		return RedisModule_ReplyWithError(ctx, REDISMODULE_ERRORMSG_WRONGTYPE);
	}
	struct tbm_out out;
	if (several)
		tbm_call_all(arg, nargs, sp, ns, &out);
	else
		tbm_call(arg, sp, ns, &out);
	RedisModule_FreeCallReply(got);
	if (out.error)
		return RedisModule_ReplyWithError(ctx, out.error);
	if (out.write) {
		/* Where the script SETs, and only there: in place, the string
		 * resized (or made, for a new key) and written through its
		 * pointer, which keeps any expiry; the expiry is then set or
		 * removed, and the events raised, as a SET would. */
		RedisModuleKey *key = RedisModule_OpenKey(ctx, argv[1], REDISMODULE_READ | REDISMODULE_WRITE);
		size_t len;
		char *dst = NULL;
		if (RedisModule_StringTruncate(key, out.value_len) == REDISMODULE_OK)
			dst = RedisModule_StringDMA(key, &len, REDISMODULE_WRITE);
		/* Only a key that is not a string fails here, checked above. */
		if (dst == NULL || len != out.value_len) {
			RedisModule_CloseKey(key);
			return RedisModule_ReplyWithError(ctx, "ERR tokenbucket: the value could not be written");
		}
		memcpy(dst, out.value, len);
		if (out.expire) {
			long long at = ns / 1000000 + out.expire_ms;
			RedisModule_SetAbsExpire(key, at);
			RedisModule_Replicate(ctx, "SET", "sbcl", argv[1], out.value, out.value_len,
					      "PXAT", at);
		} else {
			RedisModule_SetExpire(key, REDISMODULE_NO_EXPIRE);
			RedisModule_Replicate(ctx, "SET", "sb", argv[1], out.value, out.value_len);
		}
		RedisModule_CloseKey(key);
		RedisModule_NotifyKeyspaceEvent(ctx, REDISMODULE_NOTIFY_STRING, "set", argv[1]);
		if (out.expire)
			RedisModule_NotifyKeyspaceEvent(ctx, REDISMODULE_NOTIFY_GENERIC, "expire", argv[1]);
	}
	if (out.several) {
		static const int fields[4] = { 0, 1, 4, 5 }; /* clock, level, act, full */
		RedisModule_ReplyWithArray(ctx, 6);
		RedisModule_ReplyWithLongLong(ctx, out.code);
		RedisModule_ReplyWithLongLong(ctx, out.index);
		for (int i = 0; i < 4; i++)
			RedisModule_ReplyWithStringBuffer(ctx, out.field[fields[i]], out.field_len[fields[i]]);
		return REDISMODULE_OK;
	}
	int nf = out.lease ? 7 : 6;
	RedisModule_ReplyWithArray(ctx, nf + 1);
	RedisModule_ReplyWithLongLong(ctx, out.code);
	for (int i = 0; i < nf; i++)
		RedisModule_ReplyWithStringBuffer(ctx, out.field[i], out.field_len[i]);
	return REDISMODULE_OK;
}

static int tb_version(RedisModuleCtx *ctx, RedisModuleString **argv, int argc)
{
	(void)argv;
	if (argc != 1)
		return RedisModule_ReplyWithError(ctx, "ERR tokenbucket: bad argument count");
	return RedisModule_ReplyWithStringBuffer(ctx, TOKENBUCKET_MODULE_VERSION,
						 sizeof(TOKENBUCKET_MODULE_VERSION) - 1);
}

TB_EXPORT int RedisModule_OnLoad(RedisModuleCtx *ctx, RedisModuleString **argv, int argc);

int RedisModule_OnLoad(RedisModuleCtx *ctx, RedisModuleString **argv, int argc)
{
	(void)argv;
	(void)argc;
	if (tb_api_init(ctx, "tokenbucket", TOKENBUCKET_MODULE_VERNUM) != REDISMODULE_OK)
		return REDISMODULE_ERR;
	if (RedisModule_CreateCommand(ctx, "tokenbucket.call", tb_call, "write deny-oom fast", 1, 1,
				      1) != REDISMODULE_OK
	    || RedisModule_CreateCommand(ctx, "tokenbucket.version", tb_version, "readonly fast", 0,
					 0, 0) != REDISMODULE_OK)
		return REDISMODULE_ERR;
	return REDISMODULE_OK;
}
