/* SPDX-License-Identifier: MIT */
/*
 * The rest of the surface: the result a server reports, wait with its
 * deadline and cancel descriptor, the non-blocking format/parse pair on a
 * socket of the test's own, key prefixes with hash tags, TCP and database
 * URLs.
 */
#include <hiredis/hiredis.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check_redis.h"

/* 1 token per 100 ms, burst 5. */
static const struct tokenbucket_redis_limit lim = { .tokens = 1, .period_ns = 100 * MS, .burst = 5 };

START_TEST(test_result)
{
	struct tokenbucket_result res;
	ck_assert_int_eq(tokenbucket_redis_allow_at(cli, KEY("r"), &lim, 0, 3, &res), 0);
	ck_assert(res.allowed);
	ck_assert_uint_eq(res.limit, 5);
	ck_assert_uint_eq(res.remaining, 2);
	ck_assert_int_eq(res.retry_after_ns, 0);
	ck_assert_int_eq(res.reset_after_ns, 300 * MS);
	ck_assert_uint_eq(res.flags, 0);
	/* 4 more at 50 ms: 2 there, 2 missing, the first of them at 100 ms. */
	ck_assert_int_eq(tokenbucket_redis_allow_at(cli, KEY("r"), &lim, 50 * MS, 4, &res), 0);
	ck_assert(!res.allowed);
	ck_assert_uint_eq(res.remaining, 2);
	ck_assert_int_eq(res.retry_after_ns, 150 * MS);
	ck_assert_int_eq(res.reset_after_ns, 250 * MS);
	/* A reservation in debt: retry_after is its delay. */
	struct tokenbucket_reservation rv;
	ck_assert_int_eq(tokenbucket_redis_reserve_at(cli, KEY("r"), &lim, 50 * MS, 4, TOKENBUCKET_NEVER, &rv, &res), 0);
	ck_assert_int_eq(rv.time_to_act, 200 * MS);
	ck_assert_uint_eq(rv.tokens, 4);
	ck_assert_uint_eq(res.remaining, 0);
	ck_assert_int_eq(res.retry_after_ns, 150 * MS);
	ck_assert_int_eq(res.reset_after_ns, 650 * MS);
	ck_assert_int_eq(tokenbucket_redis_reserve_at(cli, KEY("r"), &lim, 50 * MS, 1, 100 * MS, &rv, &res), -ETIMEDOUT);
	ck_assert(!res.allowed);
	ck_assert_int_eq(res.retry_after_ns, 250 * MS);
	double tokens;
	ck_assert_int_eq(tokenbucket_redis_tokens_at(cli, KEY("r"), &lim, 75 * MS, &tokens, &res), 0);
	ck_assert(tokens == -1.25); /* -2 whole, and three quarters of the next */
}
END_TEST

START_TEST(test_wait)
{
	/* 5 in the new bucket; the 6th comes 100 ms after its first call. */
	int64_t t0 = tokenbucket_now();
	ck_assert_int_eq(tokenbucket_redis_wait(cli, KEY("w"), &lim, 5, TOKENBUCKET_NEVER, -1), 0);
	ck_assert_int_eq(tokenbucket_redis_wait(cli, KEY("w"), &lim, 1, TOKENBUCKET_NEVER, -1), 0);
	int64_t took = tokenbucket_now() - t0;
	ck_assert_msg(took >= 95 * MS && took < 1000 * MS, "took %lld", (long long)took);
	/* 3 more need 300 ms; not there by a deadline 200 ms away: at once, nothing taken. */
	t0 = tokenbucket_now();
	ck_assert_int_eq(tokenbucket_redis_wait(cli, KEY("w"), &lim, 3, t0 + 200 * MS, -1), -ETIMEDOUT);
	ck_assert_int_lt(tokenbucket_now() - t0, 200 * MS);
	ck_assert_int_eq(tokenbucket_redis_wait(cli, KEY("w"), &lim, 6, TOKENBUCKET_NEVER, -1), -E2BIG);
	ck_assert_int_eq(tokenbucket_redis_wait(cli, KEY("w"), &lim, 1, TOKENBUCKET_NEVER, 12345), -EBADF);
	/* Cancelled while sleeping: the reservation is given back. */
	int fd = eventfd(0, EFD_CLOEXEC);
	ck_assert_int_ge(fd, 0);
	ck_assert_int_eq(tokenbucket_redis_reset(cli, KEY("c"), &lim, 0), 0);
	pid_t child = fork();
	if (child == 0) {
		tokenbucket_redis_close(cli); /* the parent's */
		usleep(100000);
		uint64_t one = 1;
		_exit(write(fd, &one, sizeof(one)) == sizeof(one) ? 0 : 1);
	}
	ck_assert_int_eq(tokenbucket_redis_wait(cli, KEY("c"), &lim, 5, TOKENBUCKET_NEVER, fd), -ECANCELED);
	double tokens;
	ck_assert_int_eq(tokenbucket_redis_tokens(cli, KEY("c"), &lim, &tokens, NULL), 0);
	/* About 1 produced while waiting; without the give-back it would be -4 or less. */
	ck_assert_msg(tokens >= 0.9 && tokens < 4.9, "tokens %g", tokens);
	ck_assert_int_eq(tokenbucket_redis_wait(cli, KEY("c"), &lim, 1, TOKENBUCKET_NEVER, fd), -ECANCELED);
	close(fd);
}
END_TEST

static int unix_socket(const char *path)
{
	int fd = socket(AF_UNIX, SOCK_STREAM, 0);
	struct sockaddr_un a = { .sun_family = AF_UNIX };
	strncpy(a.sun_path, path, sizeof(a.sun_path) - 1);
	ck_assert_int_eq(connect(fd, (struct sockaddr *)&a, sizeof(a)), 0);
	return fd;
}

/* Sends call on fd and parses the reply as it arrives, one byte at a time. */
static int exchange(int fd, const struct tokenbucket_redis_call *call, struct tokenbucket_result *res,
		    struct tokenbucket_reservation *rv, double *tokens)
{
	char *cmd;
	size_t len;
	ck_assert_int_eq(tokenbucket_redis_format(call, &cmd, &len), 0);
	ck_assert_int_eq(write(fd, cmd, len), (ssize_t)len);
	free(cmd);
	char buf[4096];
	size_t have = 0, used = 0;
	for (;;) {
		ck_assert_int_eq(read(fd, buf + have, 1), 1);
		have++;
		int err = tokenbucket_redis_parse(call, buf, have, &used, res, rv, tokens);
		if (err != -EAGAIN) {
			ck_assert_uint_eq(used, have);
			return err;
		}
	}
}

/*
 * tokenbucket_redis_format, the blocking calls and the asynchronous ones
 * write the same bytes: the library's own RESP writer against hiredis's,
 * for every operation, extreme numbers, and keys empty, binary and longer
 * than the writer's stack buffer.
 */
START_TEST(test_format_bytes)
{
	static char longkey[3000];
	memset(longkey, 'k', sizeof(longkey));
	const struct {
		const char *key;
		size_t keylen;
	} keys[] = { { "", 0 }, { "a", 1 }, { "a\0b\r\n", 5 }, { longkey, sizeof(longkey) } };
	const int64_t nows[] = { 0, 1, -1, INT64_MIN, INT64_MAX, 1000000000 };
	const struct tokenbucket_redis_limit lims[] = {
		{ 0, 1, 0 }, { 1, 1, 1 }, { UINT64_MAX, INT64_MAX, TOKENBUCKET_BURST_MAX },
	};
	int checked = 0;
	for (int op = TOKENBUCKET_REDIS_ALLOW; op <= TOKENBUCKET_REDIS_REFUND; op++)
		for (size_t k = 0; k < sizeof(keys) / sizeof(keys[0]); k++)
			for (size_t t = 0; t < sizeof(nows) / sizeof(nows[0]); t++)
				for (size_t l = 0; l < sizeof(lims) / sizeof(lims[0]); l++) {
					struct tokenbucket_redis_call call = {
						.op = op, .flags = t > 0 ? TOKENBUCKET_REDIS_AT : 0,
						.key = keys[k].key, .keylen = keys[k].keylen,
						.limit = lims[l], .now = nows[t],
						.n = op == TOKENBUCKET_REDIS_RESET ? 0 : UINT64_MAX - t,
						.arg = nows[t],
					};
					char *cmd;
					size_t len;
					ck_assert_int_eq(tokenbucket_redis_format(&call, &cmd, &len), 0);
					/* NUL-terminated, as hiredis's formatter leaves it. */
					ck_assert(cmd[len] == '\0');
					/* Parse it back: its argv, then hiredis's bytes of that argv. */
					ck_assert(len > 4 && cmd[0] == '*');
					int argc = atoi(cmd + 1);
					ck_assert(argc >= 11 && argc <= 12);
					const char *argv[12];
					size_t argl[12];
					const char *p = strchr(cmd, '\n') + 1;
					for (int i = 0; i < argc; i++) {
						ck_assert(*p == '$');
						argl[i] = strtoull(p + 1, NULL, 10);
						p = strchr(p, '\n') + 1;
						argv[i] = p;
						p += argl[i] + 2;
					}
					ck_assert(p == cmd + len);
					char *want = NULL;
					int wlen = redisFormatCommandArgv(&want, argc, argv, argl);
					ck_assert_int_eq(wlen, (int)len);
					ck_assert(memcmp(want, cmd, len) == 0);
					ck_assert(argl[3] == keys[k].keylen &&
						  memcmp(argv[3], keys[k].key, keys[k].keylen) == 0);
					/* The numbers, as printf writes them. */
					char num[32];
					snprintf(num, sizeof(num), "%" PRId64, nows[t]);
					ck_assert(t == 0 ? argl[5] == 0
							 : argl[5] == strlen(num) && memcmp(argv[5], num, argl[5]) == 0);
					snprintf(num, sizeof(num), "%" PRIu64, call.n);
					ck_assert(argl[9] == strlen(num) && memcmp(argv[9], num, argl[9]) == 0);
					snprintf(num, sizeof(num), "%" PRIu64, lims[l].tokens);
					ck_assert(argl[6] == strlen(num) && memcmp(argv[6], num, argl[6]) == 0);
					redisFreeCommand(want);
					free(cmd);
					checked++;
				}
	ck_assert_int_eq(checked, 6 * 4 * 6 * 3);
}
END_TEST

START_TEST(test_format_and_parse)
{
	int fd = unix_socket(srv.sock);
	struct tokenbucket_redis_call call = { .op = TOKENBUCKET_REDIS_ALLOW, .flags = TOKENBUCKET_REDIS_AT,
					       .key = "a", .keylen = 1, .limit = lim, .now = 0, .n = 2 };
	struct tokenbucket_result res;
	/* The script is not cached yet: EVALSHA says so, EVAL loads it. */
	ck_assert_int_eq(exchange(fd, &call, &res, NULL, NULL), -ENOEXEC);
	call.flags |= TOKENBUCKET_REDIS_EVAL;
	ck_assert_int_eq(exchange(fd, &call, &res, NULL, NULL), 0);
	ck_assert(res.allowed);
	ck_assert_uint_eq(res.remaining, 3);
	call.flags = TOKENBUCKET_REDIS_AT;
	call.op = TOKENBUCKET_REDIS_RESERVE;
	call.n = 5;
	call.arg = TOKENBUCKET_NEVER;
	struct tokenbucket_reservation rv;
	ck_assert_int_eq(exchange(fd, &call, &res, &rv, NULL), 0);
	ck_assert_int_eq(rv.time_to_act, 200 * MS);
	call.op = TOKENBUCKET_REDIS_TOKENS;
	double tokens;
	ck_assert_int_eq(exchange(fd, &call, &res, NULL, &tokens), 0);
	ck_assert(tokens == -2);
	/* Errors come back as errno values too. */
	call.op = TOKENBUCKET_REDIS_RESERVE;
	call.n = 6;
	ck_assert_int_eq(exchange(fd, &call, &res, &rv, NULL), -E2BIG);
	ck_assert_int_eq(server_cmd(&srv, "SET bad %s", "x"), REDIS_REPLY_STATUS);
	call.key = "bad";
	call.keylen = 3;
	ck_assert_int_eq(exchange(fd, &call, &res, &rv, NULL), -EBADMSG);
	close(fd);
	/* Bad calls are refused before anything is built. */
	char *cmd;
	size_t len;
	call.op = 99;
	ck_assert_int_eq(tokenbucket_redis_format(&call, &cmd, &len), -EINVAL);
	call.op = TOKENBUCKET_REDIS_ALLOW;
	call.flags = 1u << 7;
	ck_assert_int_eq(tokenbucket_redis_format(&call, &cmd, &len), -EINVAL);
	ck_assert_int_eq(tokenbucket_redis_format(NULL, &cmd, &len), -EINVAL);
	size_t used;
	ck_assert_int_eq(tokenbucket_redis_parse(&call, "+OK\r\n", 5, &used, &res, NULL, NULL), -EPROTO);
	ck_assert_int_eq(tokenbucket_redis_parse(&call, "*7\r\n:1\r\n", 8, &used, &res, NULL, NULL), -EAGAIN);
	ck_assert_int_eq(tokenbucket_redis_parse(&call, "?garbage\r\n", 10, &used, &res, NULL, NULL), -EPROTO);
	ck_assert_int_eq(tokenbucket_redis_parse(&call, "-BUSY x\r\n", 9, &used, &res, NULL, NULL), -EBUSY);
	ck_assert_uint_eq(used, 9);
	/* A reply of the right shape with values out of range. */
	const char *odd = "*7\r\n:1\r\n$1\r\n0\r\n$2\r\n-x\r\n$1\r\n0\r\n$1\r\n1\r\n$1\r\n0\r\n$1\r\n0\r\n";
	ck_assert_int_eq(tokenbucket_redis_parse(&call, odd, strlen(odd), &used, &res, NULL, NULL), -EPROTO);
	const char *script = tokenbucket_redis_script(NULL);
	ck_assert_ptr_nonnull(strstr(script, "tb1"));
}
END_TEST

START_TEST(test_prefix_tcp_and_db)
{
	struct tokenbucket_redis *r;
	char url[160];
	snprintf(url, sizeof(url), "%s/3", srv.tcp_url);
	ck_assert_int_eq(tokenbucket_redis_open(&r, url, SEC, SEC), 0);
	ck_assert_int_eq(tokenbucket_redis_set_prefix(r, KEY("{app}:")), 0);
	struct tokenbucket_result res;
	ck_assert_int_eq(tokenbucket_redis_allow(r, KEY("user:7"), &lim, 1, &res), 0);
	ck_assert(res.allowed);
	tokenbucket_redis_close(r);
	redisContext *c = server_admin(&srv);
	redisReply *rep = redisCommand(c, "SELECT 3");
	freeReplyObject(rep);
	rep = redisCommand(c, "EXISTS {app}:user:7");
	ck_assert_int_eq(rep->integer, 1);
	freeReplyObject(rep);
	redisFree(c);
	/* Database 0 has no such key. */
	ck_assert_int_eq(server_cmd(&srv, "EXISTS {app}:user:7"), REDIS_REPLY_INTEGER);
	snprintf(url, sizeof(url), "unix://%s?db=3", srv.sock);
	ck_assert_int_eq(tokenbucket_redis_open(&r, url, SEC, SEC), 0);
	double tokens;
	ck_assert_int_eq(tokenbucket_redis_tokens(r, KEY("{app}:user:7"), &lim, &tokens, NULL), 0);
	ck_assert(tokens >= 4 && tokens < 5);
	tokenbucket_redis_close(r);
}
END_TEST

/*
 * The pool: many threads on one client, each with a connection of its own
 * (or, pipelined, all on one).  The client's timeout is long: 16 threads
 * under memcheck on a busy machine can hold a call past the suite's
 * 500 ms, and this test counts errors, not time.
 */
static struct tokenbucket_redis *shared_cli;

struct hammer {
	int calls;
	int errors;
};

static void *hammer(void *arg)
{
	struct hammer *h = arg;
	const struct tokenbucket_redis_limit many = { .tokens = 1, .period_ns = 1000, .burst = 1000 };
	for (int i = 0; i < 500; i++) {
		struct tokenbucket_result res;
		h->errors += tokenbucket_redis_allow(shared_cli, KEY("t"), &many, 1, &res) != 0;
		h->calls++;
	}
	return NULL;
}

START_TEST(test_threads_share_a_client)
{
	ck_assert_int_eq(tokenbucket_redis_open(&shared_cli, srv.url, SEC, 30 * SEC), 0);
	if (getenv("TOKENBUCKET_REDIS_PIPELINING") != NULL)
		ck_assert_int_eq(tokenbucket_redis_configure(shared_cli, REDIS_OPTIONS(.pipelining = 1)), 0);
	pthread_t t[16];
	struct hammer h[16] = { { 0, 0 } };
	for (int i = 0; i < 16; i++)
		ck_assert_int_eq(pthread_create(&t[i], NULL, hammer, &h[i]), 0);
	for (int i = 0; i < 16; i++) {
		pthread_join(t[i], NULL);
		ck_assert_int_eq(h[i].errors, 0);
		ck_assert_int_eq(h[i].calls, 500);
	}
	redisContext *c = server_admin(&srv);
	redisReply *rep = redisCommand(c, "INFO clients");
	ck_assert_ptr_nonnull(strstr(rep->str, "connected_clients:"));
	freeReplyObject(rep);
	redisFree(c);
	tokenbucket_redis_close(shared_cli);
}
END_TEST

/* Pipelined: 8 threads, one connection or a few, every grant exact. */
static struct tokenbucket_redis *piped;
static atomic_int piped_granted, piped_all_granted, piped_failed;

/* Even threads: allow on "piped" (1000 in all); odd ones: allow_all on "piped-all" (600). */
static void *piped_calls(void *arg)
{
	bool set = (intptr_t)arg % 2;
	const struct tokenbucket_limit fixed[2] = {
		{ .tokens = 0, .period_ns = SEC, .burst = 1000 },
		{ .tokens = 0, .period_ns = SEC, .burst = 600 },
	};
	for (int i = 0; i < 300; i++) {
		struct tokenbucket_result res;
		struct tokenbucket_set_result all;
		int err = set ? tokenbucket_redis_allow_all(piped, KEY("piped-all"), fixed, 2, 1, &all)
			      : tokenbucket_redis_allow(piped, KEY("piped"), TBR_OLD(&fixed[0]), 1, &res);
		if (err != 0)
			atomic_fetch_add(&piped_failed, 1);
		else if (set ? all.allowed : res.allowed)
			atomic_fetch_add(set ? &piped_all_granted : &piped_granted, 1);
	}
	return NULL;
}

/* The connections srv has now, the one asking included. */
static int server_clients(void)
{
	return (int)redis_clients() + 1;
}

/* Each of 8 threads: 300 allow of 1 on keys of its own, burst 1: each granted. */
static void *spread_calls(void *arg)
{
	const struct tokenbucket_redis_limit one = { .tokens = 0, .period_ns = SEC, .burst = 1 };
	for (int i = 0; i < 300; i++) {
		char key[32];
		snprintf(key, sizeof(key), "spread:%d:%d", (int)(intptr_t)arg, i);
		struct tokenbucket_result res;
		int err = tokenbucket_redis_allow(piped, KEY(key), &one, 1, &res);
		if (err != 0)
			atomic_fetch_add(&piped_failed, 1);
		else if (res.allowed)
			atomic_fetch_add(&piped_granted, 1);
	}
	return NULL;
}

/* Eight threads of fn (its argument the thread's number) on piped: every call answered. */
static void piped_run(void *(*fn)(void *))
{
	atomic_store(&piped_granted, 0);
	atomic_store(&piped_all_granted, 0);
	atomic_store(&piped_failed, 0);
	pthread_t t[8];
	for (int i = 0; i < 8; i++)
		ck_assert_int_eq(pthread_create(&t[i], NULL, fn, (void *)(intptr_t)i), 0);
	for (int i = 0; i < 8; i++)
		pthread_join(t[i], NULL);
	ck_assert_int_eq(atomic_load(&piped_failed), 0);
}

/* piped_calls' grants: exactly the bursts. */
static void piped_exact(void)
{
	piped_run(piped_calls);
	ck_assert_int_eq(atomic_load(&piped_granted), 1000);
	ck_assert_int_eq(atomic_load(&piped_all_granted), 600);
}

START_TEST(test_pipelining_shares_one_connection)
{
	ck_assert_int_eq(tokenbucket_redis_open(&piped, srv.url, SEC, 2 * SEC), 0);
	ck_assert_int_eq(tokenbucket_redis_configure(piped, REDIS_OPTIONS(.pipelining = 2)), -EINVAL);
	ck_assert_int_eq(tokenbucket_redis_configure(NULL, REDIS_OPTIONS(.pipelining = 1)), -EINVAL);
	ck_assert_int_eq(tokenbucket_redis_configure(piped, NULL), -EINVAL);
	ck_assert_int_eq(tokenbucket_redis_configure(piped, REDIS_OPTIONS(.module = 3)), -EINVAL);
	ck_assert_int_eq(tokenbucket_redis_configure(piped, REDIS_OPTIONS(.module = -1)), -EINVAL);
	ck_assert_int_eq(tokenbucket_redis_configure(piped, REDIS_OPTIONS(.connections = -1)),
			 -EINVAL);
	ck_assert_int_eq(tokenbucket_redis_configure(
				 piped, REDIS_OPTIONS(.connections = TOKENBUCKET_REDIS_CONNECTIONS_MAX + 1)),
			 -EINVAL);
	/* A caller built against a later, larger struct: its new fields must be 0. */
	struct {
		struct tokenbucket_redis_options o;
		uint64_t later;
	} newer = { { .size = sizeof(newer), .pipelining = 1, .connections = 1 }, 1 };
	ck_assert_int_eq(tokenbucket_redis_configure(piped, &newer.o), -E2BIG);
	newer.o.size = sizeof(newer.o) - 1;
	ck_assert_int_eq(tokenbucket_redis_configure(piped, &newer.o), -EINVAL);
	newer.later = 0;
	newer.o.size = sizeof(newer);
	ck_assert_int_eq(tokenbucket_redis_configure(piped, &newer.o), 0);
	ck_assert_int_eq(tokenbucket_redis_configure(piped, &newer.o), 0); /* again: the last counts */
	piped_exact();
	/*
	 * One connection for all eight threads, the several-limit calls
	 * included: with cli's and the admin's, three.
	 */
	ck_assert_int_le(server_clients(), 3);
	/*
	 * Four allowed: the same calls (two keys, each always in flight, so
	 * each stays on one connection) exact as before, and never more than
	 * four; then eight threads on keys of their own, which the engine
	 * spreads over spares opened while all are busy.
	 */
	tokenbucket_redis_close(piped);
	ck_assert_int_eq(tokenbucket_redis_open(&piped, srv.url, SEC, 2 * SEC), 0);
	ck_assert_int_eq(tokenbucket_redis_configure(piped, REDIS_OPTIONS(.pipelining = 1,
									  .connections = 4)),
			 0);
	ck_assert_int_eq(server_cmd(&srv, "DEL piped piped-all"), REDIS_REPLY_INTEGER);
	piped_exact();
	ck_assert_int_le(server_clients(), 6);
	piped_run(spread_calls);
	ck_assert_int_eq(atomic_load(&piped_granted), 8 * 300);
	int lines = server_clients();
	ck_assert_int_ge(lines, 4);
	ck_assert_int_le(lines, 6);
	/* Options are set before the first call, never under calls. */
	ck_assert_int_eq(tokenbucket_redis_configure(piped, REDIS_OPTIONS(.pipelining = 0)), -EBUSY);
	double tokens = -1;
	const struct tokenbucket_redis_limit fixed = { .tokens = 0, .period_ns = SEC, .burst = 1000 };
	ck_assert_int_eq(tokenbucket_redis_tokens(piped, KEY("piped"), &fixed, &tokens, NULL), 0);
	ck_assert(tokens == 0);
	tokenbucket_redis_close(piped); /* with the I/O thread running */
}
END_TEST

/*
 * More pipelined callers than the I/O thread has wake slots (256): some
 * threads share a slot, so one's answer wakes the other too, which must
 * check its own and sleep again.  300 threads started together, 20 calls
 * each on one key of burst 3000 that never refills: every call answered,
 * exactly 3000 granted.  A lost wake-up hangs a thread (the suite's
 * timeout); a wake-up taken as an answer gives a wrong count.
 */
#define CROWD 300
static pthread_barrier_t crowd_start;

static void *crowd_calls(void *arg)
{
	(void)arg;
	const struct tokenbucket_redis_limit fixed = { .tokens = 0, .period_ns = SEC, .burst = 3000 };
	pthread_barrier_wait(&crowd_start);
	for (int i = 0; i < 20; i++) {
		struct tokenbucket_result res = { .allowed = true, .remaining = UINT64_MAX };
		int err = tokenbucket_redis_allow(piped, KEY("crowd"), &fixed, 1, &res);
		if (err != 0)
			atomic_fetch_add(&piped_failed, 1);
		else if (res.allowed)
			atomic_fetch_add(&piped_granted, 1);
		else if (res.remaining != 0)
			atomic_fetch_add(&piped_failed, 1); /* refused with tokens left: not its answer */
	}
	return NULL;
}

START_TEST(test_pipelined_crowd_shares_wake_slots)
{
	ck_assert_int_eq(tokenbucket_redis_open(&piped, srv.url, SEC, 30 * SEC), 0);
	ck_assert_int_eq(tokenbucket_redis_configure(piped, REDIS_OPTIONS(.pipelining = 1)), 0);
	atomic_store(&piped_granted, 0);
	atomic_store(&piped_failed, 0);
	pthread_attr_t attr;
	ck_assert_int_eq(pthread_attr_init(&attr), 0);
	ck_assert_int_eq(pthread_attr_setstacksize(&attr, 256 * 1024), 0);
	ck_assert_int_eq(pthread_barrier_init(&crowd_start, NULL, CROWD), 0);
	static pthread_t t[CROWD];
	for (int i = 0; i < CROWD; i++)
		ck_assert_int_eq(pthread_create(&t[i], &attr, crowd_calls, NULL), 0);
	for (int i = 0; i < CROWD; i++)
		pthread_join(t[i], NULL);
	pthread_barrier_destroy(&crowd_start);
	pthread_attr_destroy(&attr);
	ck_assert_int_eq(atomic_load(&piped_failed), 0);
	ck_assert_int_eq(atomic_load(&piped_granted), 3000);
	tokenbucket_redis_close(piped);
}
END_TEST

/*
 * fork() while other threads' calls are in flight on a pipelined client:
 * the child closes its copy of the parent's client.  The I/O thread may
 * have been anywhere in the engine, holding the lock its callbacks take,
 * and is not in the child: the close must neither wait for it nor keep
 * what it was running (memcheck follows the children).
 */
static atomic_bool forking_stop;

static void *forking_calls(void *arg)
{
	(void)arg;
	const struct tokenbucket_redis_limit many = { .tokens = 1, .period_ns = 1000, .burst = 1000 };
	while (!atomic_load(&forking_stop)) {
		struct tokenbucket_result res;
		if (tokenbucket_redis_allow(piped, KEY("fork"), &many, 1, &res) != 0)
			atomic_fetch_add(&piped_failed, 1);
	}
	return NULL;
}

START_TEST(test_fork_while_pipelined)
{
	ck_assert_int_eq(tokenbucket_redis_open(&piped, srv.url, SEC, 2 * SEC), 0);
	ck_assert_int_eq(tokenbucket_redis_configure(piped, REDIS_OPTIONS(.pipelining = 1)), 0);
	atomic_store(&piped_failed, 0);
	atomic_store(&forking_stop, false);
	pthread_t t[4];
	for (int i = 0; i < 4; i++)
		ck_assert_int_eq(pthread_create(&t[i], NULL, forking_calls, NULL), 0);
	for (int i = 0; i < 20; i++) {
		usleep(5000);
		pid_t child = fork();
		TBT_FORKED(child);
		if (child == 0) {
			tokenbucket_redis_close(piped);
			_exit(0);
		}
		/* Generous: a child under memcheck starts slowly, and one that hangs never ends. */
		int status = -1;
		for (int waited = 0; waited < 6000; waited++) {
			if (waitpid(child, &status, WNOHANG) == child)
				break;
			usleep(10000);
		}
		if (status == -1) {
			kill(child, SIGKILL);
			waitpid(child, NULL, 0);
		}
		ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0,
			      "child %d: status %#x", i, (unsigned)status);
	}
	atomic_store(&forking_stop, true);
	for (int i = 0; i < 4; i++)
		pthread_join(t[i], NULL);
	ck_assert_int_eq(atomic_load(&piped_failed), 0);
	tokenbucket_redis_close(piped);
}
END_TEST

/* xorshift64*: the tests' own numbers, the same on every run. */
static uint64_t next_random(uint64_t *x)
{
	*x ^= *x >> 12;
	*x ^= *x << 25;
	*x ^= *x >> 27;
	return *x * UINT64_C(0x2545f4914f6cdd1d);
}

START_TEST(test_tokens_bit_for_bit)
{
	/*
	 * tokens_at on the server and on the local library, bit for bit: a
	 * bucket reset to a random level, read a fraction of a few tokens'
	 * time later, at rates whose fractions need every bit of a double.
	 */
	uint64_t x = 0x5eed7b1u;
	int fractional = 0;
	for (int i = 0; i < 3000; i++) {
		struct tokenbucket_redis_limit l = {
			.tokens = 1 + next_random(&x) % 1000000007,
			.period_ns = 1 + (int64_t)(next_random(&x) % 999999999937),
			/* Mostly small: a double rounded twice differs most often below 2^6. */
			.burst = 1 + next_random(&x) % (i % 8 == 0 ? UINT64_C(1) << 40 : 64),
		};
		int64_t t0 = (int64_t)(next_random(&x) % (UINT64_C(1) << 50));
		uint64_t level = next_random(&x) % l.burst;
		/* Up to the time of about 3 tokens, so that most values have a fraction. */
		uint64_t span = (uint64_t)l.period_ns * 3 / l.tokens + 2;
		int64_t t1 = t0 + (int64_t)(next_random(&x) % span);
		struct tokenbucket *tb;
		ck_assert_int_eq(tokenbucket_create_every(&tb, l.tokens, l.period_ns, l.burst, 0), 0);
		ck_assert_int_eq(tokenbucket_reset_at(tb, t0, level), 0);
		double local = tokenbucket_tokens_at(tb, t1);
		tokenbucket_free(tb);
		char key[32];
		snprintf(key, sizeof(key), "bits:%d", i);
		ck_assert_int_eq(tokenbucket_redis_reset_at(cli, KEY(key), &l, t0, level), 0);
		double remote = -1;
		ck_assert_int_eq(tokenbucket_redis_tokens_at(cli, KEY(key), &l, t1, &remote, NULL), 0);
		ck_assert_msg(memcmp(&remote, &local, sizeof(remote)) == 0,
			      "%s: tokens %a, local %a", key, remote, local);
		fractional += remote != (double)(uint64_t)remote;
	}
	/* The comparison is worth something only on values with fractions. */
	ck_assert_int_gt(fractional, 2000);
}
END_TEST

/* The value at key on the test's server (NULL: none), as a string to free. */
static char *value_of(redisContext *x, const char *key)
{
	redisReply *r = redisCommand(x, "GET %s", key);
	ck_assert_ptr_nonnull(r);
	char *v = r->type == REDIS_REPLY_STRING ? strdup(r->str) : NULL;
	freeReplyObject(r);
	return v;
}

static long long pttl_of(redisContext *x, const char *key)
{
	redisReply *r = redisCommand(x, "PTTL %s", key);
	ck_assert(r != NULL && r->type == REDIS_REPLY_INTEGER);
	long long v = r->integer;
	freeReplyObject(r);
	return v;
}

/* "10 a second and 3 an hour" in one key: all or nothing, the report, time and kinds. */
START_TEST(test_allow_all)
{
	const struct tokenbucket_limit two[3] = {
		{ .tokens = 1, .period_ns = 100 * MS, .burst = 5 },
		{ .tokens = 1, .period_ns = 3600 * SEC, .burst = 3 },
		{ .tokens = 1, .period_ns = 1 * SEC, .burst = 2 },
	};
	redisContext *x = server_admin(&srv);
	ck_assert_ptr_nonnull(x);
	const int64_t t0 = 1000 * SEC;
	struct tokenbucket_set_result res;
	/* Taken from both: the hour's limit is the one closest to refusing. */
	for (uint64_t i = 0; i < 3; i++) {
		ck_assert_int_eq(tokenbucket_redis_allow_all_at(cli, KEY("a"), two, 2, t0, 1, &res), 0);
		ck_assert(res.allowed);
		ck_assert_uint_eq(res.index, 1);
		ck_assert_uint_eq(res.limit, 3);
		ck_assert_uint_eq(res.remaining, 2 - i);
		ck_assert_int_eq(res.retry_after_ns, 0);
		ck_assert_int_eq(res.reset_after_ns, (int64_t)(i + 1) * 3600 * SEC);
		ck_assert_uint_eq(res.flags, 0);
	}
	char *v = value_of(x, "a");
	ck_assert_str_eq(v, "tbs1 1000000000000 2 0 1 100000000 5 0 0 1 3600000000000 3");
	free(v);
	/* The hour refuses: nothing taken from the second's limit either. */
	ck_assert_int_eq(tokenbucket_redis_allow_all_at(cli, KEY("a"), two, 2, t0, 1, &res), 0);
	ck_assert(!res.allowed);
	ck_assert_uint_eq(res.index, 1);
	ck_assert_uint_eq(res.remaining, 0);
	ck_assert_int_eq(res.retry_after_ns, 3600 * SEC);
	v = value_of(x, "a");
	ck_assert_str_eq(v, "tbs1 1000000000000 2 0 1 100000000 5 0 0 1 3600000000000 3");
	free(v);
	/* Both short: the lowest is reported, the wait is the latest. */
	ck_assert_int_eq(tokenbucket_redis_allow_all_at(cli, KEY("a"), two, 2, t0 + 50 * MS, 3, &res), 0);
	ck_assert(!res.allowed);
	ck_assert_uint_eq(res.index, 0);
	ck_assert_uint_eq(res.remaining, 2);
	ck_assert_int_eq(res.retry_after_ns, 3 * 3600 * SEC - 50 * MS);
	ck_assert_int_eq(res.reset_after_ns, 3 * 3600 * SEC - 50 * MS);
	/* Time never runs backwards: an earlier now is the key's clock. */
	ck_assert_int_eq(tokenbucket_redis_allow_all_at(cli, KEY("a"), two, 2, t0 - SEC, 1, &res), 0);
	ck_assert(!res.allowed);
	ck_assert_int_eq(res.retry_after_ns, 3600 * SEC - 50 * MS);
	/* An hour on, one more; the caller's time sets no expiry. */
	ck_assert_int_eq(tokenbucket_redis_allow_all_at(cli, KEY("a"), two, 2, t0 + 3600 * SEC, 1, &res), 0);
	ck_assert(res.allowed);
	ck_assert_int_eq(pttl_of(x, "a"), -1);
	/* A third limit joins full; fewer limits drop the rest. */
	ck_assert_int_eq(tokenbucket_redis_allow_all_at(cli, KEY("a"), two, 3, t0 + 7200 * SEC, 1, &res), 0);
	ck_assert(res.allowed);
	ck_assert_uint_eq(res.index, 1);
	ck_assert_uint_eq(res.remaining, 0);
	v = value_of(x, "a");
	ck_assert_str_eq(v, "tbs1 8200000000000 4 0 1 100000000 5 0 0 1 3600000000000 3 1 0 1 1000000000 2");
	free(v);
	ck_assert_int_eq(tokenbucket_redis_allow_all_at(cli, KEY("a"), two, 1, t0 + 7200 * SEC, 1, &res), 0);
	ck_assert(res.allowed);
	ck_assert_uint_eq(res.remaining, 3);
	v = value_of(x, "a");
	ck_assert_str_eq(v, "tbs1 8200000000000 3 0 1 100000000 5");
	free(v);

	/* The server's clock: the key expires a second after every limit is full. */
	ck_assert_int_eq(tokenbucket_redis_allow_all(cli, KEY("s"), two, 3, 2, &res), 0);
	ck_assert(res.allowed);
	ck_assert_uint_eq(res.index, 2);
	ck_assert_uint_eq(res.remaining, 0);
	ck_assert_int_eq(res.reset_after_ns, 2 * 3600 * SEC);
	long long ms = pttl_of(x, "s");
	ck_assert(ms > 2 * 3600 * 1000 + 900 && ms <= 2 * 3600 * 1000 + 1000);
	ck_assert_int_eq(tokenbucket_redis_allow_all(cli, KEY("s"), two, 3, 2, &res), 0);
	ck_assert(!res.allowed);
	ck_assert_uint_eq(res.index, 1);
	ck_assert(res.retry_after_ns > 3600 * SEC - 60 * SEC && res.retry_after_ns <= 3600 * SEC);
	/* The script's text again after SCRIPT FLUSH (NOSCRIPT), as every call. */
	freeReplyObject(redisCommand(x, "SCRIPT FLUSH"));
	ck_assert_int_eq(tokenbucket_redis_allow_all(cli, KEY("s"), two, 2, 1, &res), 0);
	ck_assert(res.allowed);
	ck_assert_uint_eq(res.index, 1);

	/* A key holds one kind: each refuses the other's value, which stays. */
	ck_assert_int_eq(tokenbucket_redis_allow_at(cli, KEY("one"), TBR_OLD(&two[0]), t0, 1, NULL), 0);
	char *before = value_of(x, "one");
	ck_assert_int_eq(tokenbucket_redis_allow_all_at(cli, KEY("one"), two, 2, t0, 1, &res), -EBADMSG);
	v = value_of(x, "one");
	ck_assert_str_eq(v, before);
	free(v);
	free(before);
	before = value_of(x, "a");
	ck_assert_int_eq(tokenbucket_redis_allow_at(cli, KEY("a"), TBR_OLD(&two[0]), t0, 1, NULL), -EBADMSG);
	ck_assert_int_eq(tokenbucket_redis_reserve_at(cli, KEY("a"), TBR_OLD(&two[0]), t0, 1, 0, &(struct tokenbucket_reservation){ 0 }, NULL), -EBADMSG);
	double tokens;
	ck_assert_int_eq(tokenbucket_redis_tokens_at(cli, KEY("a"), TBR_OLD(&two[0]), t0, &tokens, NULL), -EBADMSG);
	/* Hostile values: refused, unchanged. */
	static const char *const hostile[] = { "tbs1 5 6 0 1 1 3", "tbs1 5 1 0 1 1", "tbs1 x",
					       "tbs1 5 1 0 1 1 3 ", "tbs1 5 -1 0 1 1 3" };
	for (size_t i = 0; i < sizeof(hostile) / sizeof(hostile[0]); i++) {
		freeReplyObject(redisCommand(x, "SET h %s", hostile[i]));
		memset(&res, 0x5a, sizeof(res));
		struct tokenbucket_set_result same = res;
		ck_assert_int_eq(tokenbucket_redis_allow_all(cli, KEY("h"), two, 2, 1, &res), -EBADMSG);
		ck_assert(memcmp(&res, &same, sizeof(res)) == 0);
		v = value_of(x, "h");
		ck_assert_str_eq(v, hostile[i]);
		free(v);
	}
	v = value_of(x, "a");
	ck_assert_str_eq(v, before);
	free(v);
	free(before);
	freeReplyObject(redisCommand(x, "RPUSH l a"));
	ck_assert_int_eq(tokenbucket_redis_allow_all(cli, KEY("l"), two, 2, 1, &res), -EPROTOTYPE);

	/* Bad calls change nothing, *res untouched. */
	memset(&res, 0x5a, sizeof(res));
	struct tokenbucket_set_result same = res;
	struct tokenbucket_limit bad[TOKENBUCKET_SET_MAX + 1];
	for (size_t i = 0; i <= TOKENBUCKET_SET_MAX; i++)
		bad[i] = two[0];
	ck_assert_int_eq(tokenbucket_redis_allow_all(cli, KEY("e"), two, 2, 4, &res), -E2BIG);
	ck_assert_int_eq(tokenbucket_redis_allow_all(NULL, KEY("e"), two, 2, 1, &res), -EINVAL);
	ck_assert_int_eq(tokenbucket_redis_allow_all(cli, NULL, 3, two, 2, 1, &res), -EINVAL);
	ck_assert_int_eq(tokenbucket_redis_allow_all(cli, KEY("e"), NULL, 2, 1, &res), -EINVAL);
	ck_assert_int_eq(tokenbucket_redis_allow_all(cli, KEY("e"), two, 0, 1, &res), -EINVAL);
	ck_assert_int_eq(tokenbucket_redis_allow_all(cli, KEY("e"), bad, TOKENBUCKET_SET_MAX + 1, 1, &res), -EINVAL);
	ck_assert_int_eq(tokenbucket_redis_allow_all(cli, KEY("e"), two, 2, 1, NULL), -EINVAL);
	bad[1].period_ns = 0;
	ck_assert_int_eq(tokenbucket_redis_allow_all(cli, KEY("e"), bad, 2, 1, &res), -EINVAL);
	bad[1].period_ns = 1;
	bad[1].burst = TOKENBUCKET_BURST_MAX + 1;
	ck_assert_int_eq(tokenbucket_redis_allow_all_at(cli, KEY("e"), bad, 2, t0, 1, &res), -ERANGE);
	ck_assert(memcmp(&res, &same, sizeof(res)) == 0);
	redisReply *r = redisCommand(x, "EXISTS e");
	ck_assert_int_eq(r->integer, 0);
	freeReplyObject(r);
	/* Sixteen limits at once. */
	bad[1] = two[1];
	ck_assert_int_eq(tokenbucket_redis_allow_all_at(cli, KEY("16"), bad, TOKENBUCKET_SET_MAX, t0, 1, &res), 0);
	ck_assert(res.allowed);
	ck_assert_uint_eq(res.index, 1);
	/* The reply form, as allow's ARGV[8]: "1" integers (from the common case), "0" decimals. */
	const char *form[] = { "EVAL", tokenbucket_redis_script(NULL), "1", "f", "allow_all", "", "1",
			       "1", "1000", "5", "1", "1000000", "9", "1" };
	r = redisCommandArgv(x, 14, form, NULL);
	ck_assert(r != NULL && r->type == REDIS_REPLY_ARRAY && r->elements == 5);
	ck_assert(r->element[0]->integer == 1 && r->element[1]->integer == 0 && r->element[2]->integer == 4);
	ck_assert_int_eq(r->element[3]->integer, 0);
	ck_assert_int_eq(r->element[4]->integer, 1000000); /* the latest: the second limit */
	freeReplyObject(r);
	form[13] = "0";
	r = redisCommandArgv(x, 14, form, NULL);
	ck_assert(r != NULL && r->type == REDIS_REPLY_ARRAY && r->elements == 6);
	freeReplyObject(r);
	form[13] = "2";
	r = redisCommandArgv(x, 14, form, NULL);
	ck_assert(r != NULL && r->type == REDIS_REPLY_ERROR);
	ck_assert_str_eq(r->str, "ERR tokenbucket: bad reply form");
	freeReplyObject(r);
	/* An op past those the library knows is refused. */
	struct tokenbucket_redis_call call = { .op = (enum tokenbucket_redis_op)64, .key = "k",
					       .keylen = 1, .limit = *TBR_OLD(&two[0]) };
	char *cmd;
	size_t len, used;
	ck_assert_int_eq(tokenbucket_redis_format(&call, &cmd, &len), -EINVAL);
	ck_assert_int_eq(tokenbucket_redis_parse(&call, "*0\r\n", 4, &used, NULL, NULL, NULL), -EINVAL);
	/* The public codec says allow_all through a struct tokenbucket_redis_call_all. */
	struct tokenbucket_set_result set;
	struct tokenbucket_redis_call_all all = {
		.call = { .op = TOKENBUCKET_REDIS_ALLOW_ALL, .key = "k", .keylen = 1, .n = 1 },
		.limits = two, .count = 2, .res = &set,
	};
	ck_assert_int_eq(tokenbucket_redis_format(&all.call, &cmd, &len), 0);
	ck_assert_ptr_nonnull(memmem(cmd, len, "allow_all", 9));
	free(cmd);
	/* { code 1, index 1, level 2, wait 0, full in 1000 ns }: taken, limit 1 the fewest. */
	static const char reply[] = "*5\r\n:1\r\n:1\r\n:2\r\n:0\r\n:1000\r\n";
	struct tokenbucket_result one;
	ck_assert_int_eq(tokenbucket_redis_parse(&all.call, reply, sizeof(reply) - 1, &used, &one,
						 NULL, NULL),
			 0);
	ck_assert_uint_eq(used, sizeof(reply) - 1);
	ck_assert(set.allowed && one.allowed);
	ck_assert_uint_eq(set.index, 1);
	ck_assert_uint_eq(set.limit, 3);
	ck_assert_uint_eq(one.limit, 3);
	ck_assert_uint_eq(set.remaining, 2);
	ck_assert_uint_eq(one.remaining, 2);
	ck_assert_int_eq(set.reset_after_ns, 1000);
	ck_assert_int_eq(one.reset_after_ns, 1000);
	/* Index 2 of 2 limits: not a reply to this call. */
	static const char beyond[] = "*5\r\n:1\r\n:2\r\n:2\r\n:0\r\n:1000\r\n";
	ck_assert_int_eq(tokenbucket_redis_parse(&all.call, beyond, sizeof(beyond) - 1, &used, NULL,
						 NULL, NULL),
			 -EPROTO);
	all.count = 0;
	ck_assert_int_eq(tokenbucket_redis_format(&all.call, &cmd, &len), -EINVAL);
	redisFree(x);
}
END_TEST

/* Redis unreachable: the local fallback decides allow_all, a bucket per limit. */
START_TEST(test_allow_all_fallback)
{
	const struct tokenbucket_limit two[2] = {
		{ .tokens = 1, .period_ns = 3600 * SEC, .burst = 4 },
		{ .tokens = 1, .period_ns = 3600 * SEC, .burst = 2 },
	};
	struct tokenbucket_redis *r;
	/* Port 1: nothing listens there. */
	ck_assert_int_eq(tokenbucket_redis_open(&r, "redis://127.0.0.1:1", 200 * MS, 200 * MS), 0);
	struct tokenbucket_set_result res;
	int err = tokenbucket_redis_allow_all(r, KEY("fb"), two, 2, 1, &res);
	ck_assert_msg(err < 0 && err != -EINVAL, "no fallback yet: %d", err);
	ck_assert_int_eq(tokenbucket_redis_set_fallback(r, 0.5), 0);
	/* Half of each burst: 2 and 1. */
	ck_assert_int_eq(tokenbucket_redis_allow_all(r, KEY("fb"), two, 2, 1, &res), 0);
	ck_assert(res.allowed);
	ck_assert_uint_eq(res.flags, TOKENBUCKET_RESULT_LOCAL);
	ck_assert_uint_eq(res.index, 1);
	ck_assert_uint_eq(res.remaining, 0);
	ck_assert_int_eq(tokenbucket_redis_allow_all(r, KEY("fb"), two, 2, 1, &res), 0);
	ck_assert(!res.allowed);
	ck_assert_uint_eq(res.flags, TOKENBUCKET_RESULT_LOCAL);
	ck_assert_uint_eq(res.index, 1);
	ck_assert(res.retry_after_ns > 3600 * SEC);
	/* Nothing was taken from the first limit by the refusal. */
	ck_assert_int_eq(tokenbucket_redis_allow_all(r, KEY("fb"), two, 1, 1, &res), 0);
	ck_assert(res.allowed);
	ck_assert_uint_eq(res.remaining, 0);
	/* n above a local share of a burst: refused, never. */
	ck_assert_int_eq(tokenbucket_redis_allow_all(r, KEY("fb2"), two, 2, 2, &res), 0);
	ck_assert(!res.allowed);
	ck_assert_uint_eq(res.index, 1);
	ck_assert_int_eq(res.retry_after_ns, TOKENBUCKET_NEVER);
	tokenbucket_redis_close(r);
}
END_TEST

Suite *redis_api_suite(void)
{
	Suite *s = suite_create("redis-api");
	redis_tcase(s, "api", redis_setup, 30,
		    (const TTest *const[]){ test_result, test_wait, test_format_and_parse, test_format_bytes, test_prefix_tcp_and_db, test_threads_share_a_client,
					    test_tokens_bit_for_bit, test_pipelining_shares_one_connection,
					    test_pipelined_crowd_shares_wake_slots, test_fork_while_pipelined, test_allow_all,
					    test_allow_all_fallback, NULL });
	return s;
}
