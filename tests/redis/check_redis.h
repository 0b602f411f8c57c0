/* SPDX-License-Identifier: MIT */
/* Shared helpers of the Redis suites; each test starts its own server. */
#ifndef CHECK_REDIS_H
#define CHECK_REDIS_H

#include <check.h>
#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include <tokenbucket-redis.h>

#include "../forked.h"
#include "server.h"

#define MS INT64_C(1000000)
#define SEC INT64_C(1000000000)

/* The server and a client of the running test (checked fixtures set them). */
extern struct server srv;
extern struct tokenbucket_redis *cli;

/* Starts srv and opens cli on its unix socket with a 500 ms command timeout. */
void redis_setup(void);
/* Starts srv loading the module at path, with more options (NULL-terminated, up to 13). */
int redis_start_module(const char *path, const char *const *more);
void redis_teardown(void);
/* Adds a test case named name to s: each test gets its own server (setup). */
void redis_tcase(Suite *s, const char *name, void (*setup)(void), int timeout,
		 const TTest *const *tests);
/* Sequences for the differential suite: TOKENBUCKET_REDIS_SEQUENCES or def. */
long redis_sequences(long def);

#define KEY(s) (s), strlen(s)
/* A client's options (tokenbucket_redis_configure), the fields not named 0. */
#define REDIS_OPTIONS(...) \
	(&(const struct tokenbucket_redis_options){ \
		.size = sizeof(struct tokenbucket_redis_options), __VA_ARGS__ })
/* A 1.2 struct tokenbucket_limit as the 1.0 and 1.1 functions take it. */
#define TBR_OLD(l) \
	(&(const struct tokenbucket_redis_limit){ (l)->tokens, (l)->period_ns, (l)->burst })

/* Arguments after the key that the script refuses with "ERR tokenbucket: bad ...". */
extern const char *const redis_bad_args[][7];
extern const size_t redis_bad_args_count;

/* Calls of command (tokenbucket.call, evalsha, eval, fcall) srv counted (INFO commandstats). */
long long redis_calls_of(const char *command);
/* The clients connected to srv (INFO clients), not counting c, which asks. */
long redis_clients_on(redisContext *c);
/* The same on a connection of its own, made for the question. */
long redis_clients(void);
/*
 * The asynchronous several-limits suites (test_redis_async_all.c): on one
 * server, or on a cluster, through libuv or libevent.
 */
Suite *redis_async_all_suite(const char *name, bool libuv, bool cluster);
/* Runs the suites (NULL-terminated); skips (77) or fails when !available. */
int redis_run(Suite *const *suites, bool available, const char *missing);
/*
 * One differential sequence from seed through client c on the key
 * "diff:<seed>:<index>", each answer asserted equal to the local library's;
 * the number of steps checked.
 */
int redis_sequence(struct tokenbucket_redis *c, uint64_t seed, int steps, long index);
/* The same for allow_all, on "set:<seed>:<index>", each result the local set's. */
int redis_set_sequence(struct tokenbucket_redis *c, uint64_t seed, int steps, long index);

Suite *redis_diff_suite(void);
Suite *redis_faults_suite(void);
Suite *redis_concurrency_suite(void);
Suite *redis_expiry_suite(void);
Suite *redis_badinput_suite(void);
Suite *redis_api_suite(void);
Suite *redis_lease_suite(void);
Suite *redis_lease_async_suite(void);
/* The leases' fleet test (test_redis_lease.c) on srv, or on a cluster's seeds. */
void lease_fleet(const char *const *seeds, size_t nseeds);
/* The same with a process SIGKILLed holding its lease a third into the run. */
void lease_fleet_kill(const char *const *seeds, size_t nseeds);
/* Each process's lease closed and reopened at a fifth of the rate a third into the run. */
void lease_fleet_rate_change(const char *const *seeds, size_t nseeds);
/* A 6 s run on a cluster; a third in, failover() kills the hot key's primary and waits till settled. */
void lease_fleet_failover(const char *const *seeds, size_t nseeds, void (*failover)(void));
Suite *redis_module_suite(void);

#endif
