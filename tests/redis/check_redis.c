/* SPDX-License-Identifier: MIT */
/*
 * The Redis suites' fixtures and runner: CK_RUN_SUITE=<name> runs one (each
 * ctest entry does).  Without redis-server they skip (77), or fail where
 * TOKENBUCKET_NO_SKIP is set, as tests/skip.sh does for the shell tests.
 */
#include <stdio.h>
#include <stdlib.h>

#include "check_redis.h"

struct server srv;
struct tokenbucket_redis *cli;

int redis_start_module(const char *path, const char *const *more)
{
	const char *extra[16] = { "--loadmodule", path };
	for (int i = 0; more != NULL && more[i] != NULL && i < 13; i++)
		extra[2 + i] = more[i];
	/* A sanitizer's runtime for an instrumented module in an uninstrumented
	 * server (.ci/sanitize asan sets it); only the server gets it. */
	const char *preload = getenv("TOKENBUCKET_MODULE_PRELOAD");
	if (preload != NULL && *preload != '\0' && setenv("LD_PRELOAD", preload, 1) != 0)
		return -1;
	int started = server_start(&srv, extra);
	if (preload != NULL && *preload != '\0')
		unsetenv("LD_PRELOAD");
	return started;
}

void redis_setup(void)
{
	/* The same suites on a server with the native module, which the client then uses. */
	const char *module = getenv("TOKENBUCKET_REDIS_MODULE");
	ck_assert_int_eq(module != NULL ? redis_start_module(module, NULL) : server_start(&srv, NULL), 0);
	ck_assert_int_eq(tokenbucket_redis_open(&cli, srv.url, SEC, 500 * MS), 0);
	/* The same suites with every thread's calls pipelined on one connection. */
	if (getenv("TOKENBUCKET_REDIS_PIPELINING") != NULL)
		ck_assert_int_eq(tokenbucket_redis_configure(cli, REDIS_OPTIONS(.pipelining = 1)), 0);
}

void redis_teardown(void)
{
	tokenbucket_redis_close(cli);
	cli = NULL;
	server_stop(&srv, false);
}

void redis_tcase(Suite *s, const char *name, void (*setup)(void), int timeout,
		 const TTest *const *tests)
{
	TCase *tc = tcase_create(name);
	tcase_add_checked_fixture(tc, setup, redis_teardown);
	tcase_set_timeout(tc, timeout);
	for (int i = 0; tests[i] != NULL; i++)
		tcase_add_test(tc, tests[i]);
	suite_add_tcase(s, tc);
}

long redis_sequences(long def)
{
	const char *s = getenv("TOKENBUCKET_REDIS_SEQUENCES");
	return s != NULL && atol(s) > 0 ? atol(s) : def;
}

int redis_run(Suite *const *suites, bool available, const char *missing)
{
	if (!available) {
		printf("SKIP: %s is not installed\n", missing);
		if (getenv("TOKENBUCKET_NO_SKIP") != NULL && *getenv("TOKENBUCKET_NO_SKIP") != '\0') {
			fprintf(stderr, "(TOKENBUCKET_NO_SKIP is set: failing instead)\n");
			return EXIT_FAILURE;
		}
		return 77;
	}
	SRunner *sr = srunner_create(suites[0]);
	for (int i = 1; suites[i] != NULL; i++)
		srunner_add_suite(sr, suites[i]);
	srunner_run_all(sr, CK_NORMAL);
	int failed = srunner_ntests_failed(sr);
	int run = srunner_ntests_run(sr);
	srunner_free(sr);
	return failed == 0 && run > 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}

const char *const redis_bad_args[][7] = {
	{ "fly", "", "1", "1", "1", "1", "0" },
	{ "Allow", "", "1", "1", "1", "1", "0" },
	{ "allow", "abc", "1", "1", "1", "1", "0" },
	{ "allow", "-", "1", "1", "1", "1", "0" },
	{ "allow", "9223372036854775808", "1", "1", "1", "1", "0" },
	{ "allow", "-9223372036854775809", "1", "1", "1", "1", "0" },
	{ "allow", "", "18446744073709551616", "1", "1", "1", "0" },
	{ "allow", "", "1", "0", "1", "1", "0" },
	{ "allow", "", "", "1", "1", "1", "0" },
	{ "allow", "", "1", "9223372036854775808", "1", "1", "0" },
	{ "allow", "", "1", "1", "4611686018427387905", "1", "0" },
	{ "allow", "", "1", "1", "-1", "1", "0" },
	{ "allow", "", "1", "1", "1", "123456789012345678901234567890", "0" },
	{ "reserve", "", "1", "1", "1", "1", "x" },
	{ "reserve", "", "1", "1", "1", "1", "9223372036854775808" },
	{ "cancel", "", "1", "1", "1", "1", "" },
	{ "reset", "", "1", "1", "1", "2", "0" },
	{ "refund", "", "1", "1", "1", "-1", "0" },
	{ "refund", "", "1", "1", "1", "18446744073709551616", "0" },
	{ "Refund", "", "1", "1", "1", "1", "0" },
	{ "allow", "", " 1", "1", "1", "1", "0" },
	{ "allow", "", "1.5", "1", "1", "1", "0" },
};
const size_t redis_bad_args_count = sizeof(redis_bad_args) / sizeof(redis_bad_args[0]);

long redis_clients_on(redisContext *c)
{
	redisReply *r = redisCommand(c, "INFO clients");
	ck_assert(r != NULL && r->type == REDIS_REPLY_STRING);
	const char *at = strstr(r->str, "connected_clients:");
	ck_assert_ptr_nonnull(at);
	long n = atol(at + strlen("connected_clients:"));
	freeReplyObject(r);
	return n - 1;
}

long redis_clients(void)
{
	redisContext *c = server_admin(&srv);
	ck_assert_ptr_nonnull(c);
	long n = redis_clients_on(c);
	redisFree(c);
	return n;
}

long long redis_calls_of(const char *command)
{
	redisContext *c = redisConnect("127.0.0.1", srv.port);
	ck_assert(c != NULL && !c->err);
	redisReply *r = redisCommand(c, "INFO commandstats");
	ck_assert(r != NULL && r->type == REDIS_REPLY_STRING);
	char name[64];
	snprintf(name, sizeof(name), "cmdstat_%s:calls=", command);
	const char *at = strstr(r->str, name);
	long long n = at != NULL ? atoll(at + strlen(name)) : 0;
	freeReplyObject(r);
	redisFree(c);
	return n;
}
