/* SPDX-License-Identifier: MIT */
/*
 * The part of Redis's module API that the tokenbucket module uses, declared
 * here from the API's documentation (API version 1, Redis 7.0 and later).
 * Redis hands a module its functions by name: the first word of the context
 * passed to RedisModule_OnLoad is the lookup function, and tb_api_init()
 * fetches each pointer below through it before anything else is called.
 * Only these names are declared; nothing here is a copy of Redis's header.
 */
#ifndef TOKENBUCKET_REDISMODULE_API_H
#define TOKENBUCKET_REDISMODULE_API_H

#include <stddef.h>

#define REDISMODULE_OK 0
#define REDISMODULE_ERR 1
#define REDISMODULE_APIVER_1 1

/* OpenKey modes. */
#define REDISMODULE_READ (1 << 0)
#define REDISMODULE_WRITE (1 << 1)

/* SetExpire: no expiry. */
#define REDISMODULE_NO_EXPIRE -1

/* CallReplyType results: the ones GET gives (a nil is neither). */
#define REDISMODULE_REPLY_STRING 0
#define REDISMODULE_REPLY_ERROR 1

/* NotifyKeyspaceEvent classes: the ones SET raises. */
#define REDISMODULE_NOTIFY_GENERIC (1 << 2)
#define REDISMODULE_NOTIFY_STRING (1 << 3)

#define REDISMODULE_ERRORMSG_WRONGTYPE \
	"WRONGTYPE Operation against a key holding the wrong kind of value"

typedef long long mstime_t;
typedef struct RedisModuleCtx RedisModuleCtx;
typedef struct RedisModuleKey RedisModuleKey;
typedef struct RedisModuleString RedisModuleString;
typedef struct RedisModuleCallReply RedisModuleCallReply;
typedef int (*RedisModuleCmdFunc)(RedisModuleCtx *ctx, RedisModuleString **argv, int argc);

/* Each entry: X(return type, name, parameters). */
#define TB_REDISMODULE_API(X)                                                                  \
	X(void, SetModuleAttribs, (RedisModuleCtx *, const char *, int, int))                  \
	X(int, IsModuleNameBusy, (const char *))                                               \
	X(int, CreateCommand,                                                                  \
	  (RedisModuleCtx *, const char *, RedisModuleCmdFunc, const char *, int, int, int))  \
	X(void *, OpenKey, (RedisModuleCtx *, RedisModuleString *, int))                       \
	X(void, CloseKey, (RedisModuleKey *))                                                  \
	X(char *, StringDMA, (RedisModuleKey *, size_t *, int))                                \
	X(int, StringTruncate, (RedisModuleKey *, size_t))                                     \
	X(int, SetExpire, (RedisModuleKey *, mstime_t))                                        \
	X(int, SetAbsExpire, (RedisModuleKey *, mstime_t))                                     \
	X(const char *, StringPtrLen, (const RedisModuleString *, size_t *))                  \
	X(int, Replicate, (RedisModuleCtx *, const char *, const char *, ...))                 \
	X(int, NotifyKeyspaceEvent, (RedisModuleCtx *, int, const char *, RedisModuleString *)) \
	X(RedisModuleCallReply *, Call, (RedisModuleCtx *, const char *, const char *, ...))  \
	X(int, CallReplyType, (RedisModuleCallReply *))                                        \
	X(const char *, CallReplyStringPtr, (RedisModuleCallReply *, size_t *))                \
	X(void, FreeCallReply, (RedisModuleCallReply *))                                       \
	X(int, ReplyWithArray, (RedisModuleCtx *, long))                                       \
	X(int, ReplyWithLongLong, (RedisModuleCtx *, long long))                               \
	X(int, ReplyWithStringBuffer, (RedisModuleCtx *, const char *, size_t))                \
	X(int, ReplyWithSimpleString, (RedisModuleCtx *, const char *))                        \
	X(int, ReplyWithError, (RedisModuleCtx *, const char *))

#define TB_DECLARE(ret, name, params) extern ret(*RedisModule_##name) params;
TB_REDISMODULE_API(TB_DECLARE)
#undef TB_DECLARE

/* Fetches every pointer above and registers the module as name, version
 * ver; REDISMODULE_OK, or REDISMODULE_ERR when one is missing (a server
 * older than 7.0) or the name is taken. */
int tb_api_init(RedisModuleCtx *ctx, const char *name, int ver);

#endif
