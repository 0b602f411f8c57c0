/* SPDX-License-Identifier: MIT */
/*
 * The module API's function pointers, fetched by name at load time.
 */
#include "redismodule-api.h"

#define TB_DEFINE(ret, name, params) ret(*RedisModule_##name) params;
TB_REDISMODULE_API(TB_DEFINE)
#undef TB_DEFINE

int tb_api_init(RedisModuleCtx *ctx, const char *name, int ver)
{
	/* The documented entry point: the context's first word is the server's
	 * int (*)(const char *name, void *where) that stores a function's
	 * address and returns REDISMODULE_ERR for a name it does not have. */
	int (*get_api)(const char *, void *) = *(int (**)(const char *, void *))ctx;
#define TB_FETCH(ret, fname, params)                                          \
	if (get_api("RedisModule_" #fname, (void *)&RedisModule_##fname) != REDISMODULE_OK) \
		return REDISMODULE_ERR;
	TB_REDISMODULE_API(TB_FETCH)
#undef TB_FETCH
	if (RedisModule_IsModuleNameBusy(name))
		return REDISMODULE_ERR;
	RedisModule_SetModuleAttribs(ctx, name, ver, REDISMODULE_APIVER_1);
	return REDISMODULE_OK;
}
