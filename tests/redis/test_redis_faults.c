/* SPDX-License-Identifier: MIT */
/*
 * Faults: each gives its documented error, no call outlasts the timeout,
 * and the first call after recovery works.
 */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check_redis.h"

static const struct tokenbucket_redis_limit lim = { .tokens = 10, .period_ns = SEC, .burst = 10 };

/* One allow: its return value, and how long it took in *ns. */
static int allow_timed(const char *key, int64_t *ns)
{
	struct tokenbucket_result res;
	int64_t t0 = tokenbucket_now();
	int err = tokenbucket_redis_allow(cli, KEY(key), &lim, 1, &res);
	if (ns != NULL)
		*ns = tokenbucket_now() - t0;
	return err;
}

static void works(const char *key)
{
	struct tokenbucket_result res = { 0 };
	ck_assert_int_eq(tokenbucket_redis_allow(cli, KEY(key), &lim, 1, &res), 0);
	ck_assert(res.allowed);
	ck_assert_uint_eq(res.flags, 0);
}

START_TEST(test_killed_and_restarted)
{
	works("k");
	server_stop(&srv, true);
	/* The pooled connection is gone: reset or refused, never a crash (SIGPIPE). */
	int err = allow_timed("k", NULL);
	ck_assert_msg(err == -ECONNRESET || err == -EPIPE || err == -ECONNREFUSED, "got %d", err);
	/* Nobody listens on the socket any more. */
	err = allow_timed("k", NULL);
	ck_assert_msg(err == -ECONNREFUSED || err == -ENOENT, "got %d", err);
	ck_assert_int_eq(server_restart(&srv), 0);
	/* An empty server: no script cached, no bucket.  Both come back. */
	works("k");
	double tokens;
	ck_assert_int_eq(tokenbucket_redis_tokens(cli, KEY("k"), &lim, &tokens, NULL), 0);
	/* The old state is gone: a new full bucket, less the one token just taken. */
	ck_assert(tokens >= 9 && tokens < 10);
}
END_TEST

START_TEST(test_paused_past_the_timeout)
{
	works("k");
	ck_assert_int_eq(kill(srv.pid, SIGSTOP), 0);
	int64_t ns;
	int err = allow_timed("k", &ns);
	ck_assert_int_eq(err, -ETIME);
	/* The command timeout is 500 ms. */
	ck_assert_msg(ns >= 450 * MS && ns < 1500 * MS, "took %lld ns", (long long)ns);
	/* A new connection is accepted by the kernel and times out the same way. */
	err = allow_timed("k", &ns);
	ck_assert_int_eq(err, -ETIME);
	ck_assert_msg(ns < 1500 * MS, "took %lld ns", (long long)ns);
	ck_assert_int_eq(kill(srv.pid, SIGCONT), 0);
	works("k");
}
END_TEST

START_TEST(test_script_flush)
{
	works("k");
	ck_assert_int_eq(server_cmd(&srv, "SCRIPT FLUSH"), REDIS_REPLY_STATUS);
	works("k");
	ck_assert_int_eq(server_cmd(&srv, "SCRIPT FLUSH"), REDIS_REPLY_STATUS);
	struct tokenbucket_reservation r;
	ck_assert_int_eq(tokenbucket_redis_reserve(cli, KEY("k"), &lim, 1, TOKENBUCKET_NEVER, &r, NULL), 0);
	ck_assert_int_eq(tokenbucket_redis_cancel(cli, KEY("k"), &lim, &r), 0);
}
END_TEST

/*
 * Redis 7: the client loaded its function library and calls it; FUNCTION
 * FLUSH loses it, and the next call (which did not run) goes as the script
 * and loads the library again.
 */
/* How many tokenbucket libraries the server has; -1 for no FUNCTION. */
static long libraries(void)
{
	redisContext *c = server_admin(&srv);
	ck_assert_ptr_nonnull(c);
	redisReply *r = redisCommand(c, "FUNCTION LIST LIBRARYNAME tokenbucket_*");
	ck_assert_ptr_nonnull(r);
	long n = r->type == REDIS_REPLY_ARRAY ? (long)r->elements : -1;
	freeReplyObject(r);
	redisFree(c);
	return n;
}

START_TEST(test_function_flush)
{
	works("k");
	if (libraries() < 0)
		return; /* no functions (Redis 5 and 6): the script, tested above */
	ck_assert_int_eq(libraries(), 1);
	for (int i = 0; i < 2; i++) {
		ck_assert_int_eq(server_cmd(&srv, "FUNCTION FLUSH"), REDIS_REPLY_STATUS);
		ck_assert_int_eq(libraries(), 0);
		works("k");
		ck_assert_int_eq(libraries(), 1);
	}
	ck_assert_int_eq(server_cmd(&srv, "FUNCTION FLUSH"), REDIS_REPLY_STATUS);
	struct tokenbucket_reservation r;
	ck_assert_int_eq(tokenbucket_redis_reserve(cli, KEY("k"), &lim, 1, TOKENBUCKET_NEVER, &r, NULL), 0);
	ck_assert_int_eq(tokenbucket_redis_cancel(cli, KEY("k"), &lim, &r), 0);
}
END_TEST

START_TEST(test_garbage_and_other_types)
{
	works("k");
	ck_assert_int_eq(server_cmd(&srv, "SET k %s", "garbage"), REDIS_REPLY_STATUS);
	ck_assert_int_eq(allow_timed("k", NULL), -EBADMSG);
	double tokens = -1;
	ck_assert_int_eq(tokenbucket_redis_tokens(cli, KEY("k"), &lim, &tokens, NULL), -EBADMSG);
	ck_assert(tokens == -1);
	ck_assert_int_eq(tokenbucket_redis_reset(cli, KEY("k"), &lim, 3), -EBADMSG);
	/* Untouched: the value is the operator's to look at. */
	ck_assert_int_eq(server_cmd(&srv, "DEL k"), REDIS_REPLY_INTEGER);
	works("k");

	ck_assert_int_eq(server_cmd(&srv, "HSET h f v"), REDIS_REPLY_INTEGER);
	ck_assert_int_eq(allow_timed("h", NULL), -EPROTOTYPE);
	ck_assert_int_eq(server_cmd(&srv, "DEL h"), REDIS_REPLY_INTEGER);
	works("h");
	ck_assert_int_eq(server_cmd(&srv, "LPUSH l x"), REDIS_REPLY_INTEGER);
	struct tokenbucket_reservation r;
	ck_assert_int_eq(tokenbucket_redis_reserve(cli, KEY("l"), &lim, 1, 0, &r, NULL), -EPROTOTYPE);
}
END_TEST

/* The server refuses writes after on, with err, and serves again after off. */
static void refused_until(const char *on, int err, const char *off)
{
	works("k");
	ck_assert_int_eq(server_cmd(&srv, on), REDIS_REPLY_STATUS);
	ck_assert_int_eq(allow_timed("k", NULL), err);
	ck_assert_int_eq(server_cmd(&srv, off), REDIS_REPLY_STATUS);
	works("k");
}

START_TEST(test_oom)
{
	refused_until("CONFIG SET maxmemory 1", -ENOMEM, "CONFIG SET maxmemory 0");
}
END_TEST

START_TEST(test_readonly_replica)
{
	/* A replica (read-only by default) of a master that is not there. */
	refused_until("REPLICAOF 127.0.0.1 1", -EROFS, "REPLICAOF NO ONE");
}
END_TEST

START_TEST(test_busy)
{
	works("k");
	pid_t child = fork();
	TBT_FORKED(child);
	if (child == 0) {
		tokenbucket_redis_close(cli); /* the parent's */
		/* Blocks the server in a script until SCRIPT KILL. */
		server_cmd(&srv, "EVAL %s 0", "while true do end");
		_exit(0);
	}
	usleep(300000); /* past busy-reply-threshold (100 ms, see the fixture) */
	ck_assert_int_eq(allow_timed("k", NULL), -EBUSY);
	ck_assert_int_eq(server_cmd(&srv, "SCRIPT KILL"), REDIS_REPLY_STATUS);
	waitpid(child, NULL, 0);
	works("k");
}
END_TEST

START_TEST(test_local_fallback)
{
	const struct tokenbucket_redis_limit slow = { .tokens = 1, .period_ns = 3600 * SEC, .burst = 10 };
	ck_assert_int_eq(tokenbucket_redis_set_fallback(cli, 0.5), 0);
	struct tokenbucket_result res;
	ck_assert_int_eq(tokenbucket_redis_allow(cli, KEY("f"), &slow, 1, &res), 0);
	ck_assert(res.allowed && res.flags == 0);
	server_stop(&srv, true);
	/* Half the burst, decided here, and said so. */
	int granted = 0;
	for (int i = 0; i < 8; i++) {
		ck_assert_int_eq(tokenbucket_redis_allow(cli, KEY("f"), &slow, 1, &res), 0);
		ck_assert_uint_eq(res.flags, TOKENBUCKET_RESULT_LOCAL);
		ck_assert_uint_eq(res.limit, 5);
		granted += res.allowed;
	}
	ck_assert_int_eq(granted, 5);
	struct tokenbucket_reservation r;
	ck_assert_int_eq(tokenbucket_redis_reserve(cli, KEY("f"), &slow, 1, TOKENBUCKET_NEVER, &r, &res), 0);
	ck_assert_uint_eq(res.flags, TOKENBUCKET_RESULT_LOCAL);
	ck_assert_int_eq(tokenbucket_redis_cancel(cli, KEY("f"), &slow, &r), 0);
	ck_assert_uint_eq(r.tokens, 0);
	/* Calls the fallback does not make still report the outage. */
	double tokens;
	int err = tokenbucket_redis_tokens(cli, KEY("f"), &slow, &tokens, NULL);
	ck_assert(err == -ECONNREFUSED || err == -ENOENT);
	ck_assert_int_eq(server_restart(&srv), 0);
	ck_assert_int_eq(tokenbucket_redis_allow(cli, KEY("f"), &slow, 1, &res), 0);
	ck_assert_uint_eq(res.flags, 0);
}
END_TEST

/* ---- Pooled connections the server closed --------------------------------- */

#define STALE_THREADS 8
#define STALE_CALLS 50

struct stale_worker {
	struct tokenbucket_redis *c;
	pthread_barrier_t *go;
	int failed; /* calls that did not return 0 */
	int last_err;
};

static void *stale_calls(void *arg)
{
	struct stale_worker *w = arg;
	static const struct tokenbucket_redis_limit many = {
		.tokens = 1000000, .period_ns = SEC, .burst = 1000000
	};
	pthread_barrier_wait(w->go);
	for (int i = 0; i < STALE_CALLS; i++) {
		struct tokenbucket_result res;
		int err = tokenbucket_redis_allow(w->c, KEY("stale"), &many, 1, &res);
		if (err != 0) {
			w->failed++;
			w->last_err = err;
		}
	}
	return NULL;
}

/* STALE_THREADS threads making STALE_CALLS calls each at once; the calls that failed. */
static int stale_burst(struct tokenbucket_redis *c)
{
	pthread_barrier_t go;
	pthread_barrier_init(&go, NULL, STALE_THREADS);
	pthread_t t[STALE_THREADS];
	struct stale_worker w[STALE_THREADS];
	for (int i = 0; i < STALE_THREADS; i++) {
		w[i] = (struct stale_worker){ .c = c, .go = &go };
		ck_assert_int_eq(pthread_create(&t[i], NULL, stale_calls, &w[i]), 0);
	}
	int failed = 0;
	for (int i = 0; i < STALE_THREADS; i++) {
		pthread_join(t[i], NULL);
		if (w[i].failed > 0)
			fprintf(stderr, "stale: %d calls failed, last %d\n", w[i].failed, w[i].last_err);
		failed += w[i].failed;
	}
	pthread_barrier_destroy(&go);
	return failed;
}

/* Clients connected now, the asking one included. */
static int clients_connected(void)
{
	redisContext *a = server_admin(&srv);
	ck_assert_ptr_nonnull(a);
	redisReply *rep = redisCommand(a, "CLIENT LIST");
	ck_assert_ptr_nonnull(rep);
	ck_assert_int_eq(rep->type, REDIS_REPLY_STRING);
	int n = 0;
	for (size_t i = 0; i < rep->len; i++)
		n += rep->str[i] == '\n';
	freeReplyObject(rep);
	redisFree(a);
	return n;
}

/*
 * The server closes every idle connection of c's pool (close() does it);
 * no call after that may see one: every call succeeds, from one thread and
 * from many.
 */
static void stale_pool(struct tokenbucket_redis *c, void (*close)(void))
{
	ck_assert_int_eq(stale_burst(c), 0);
	ck_assert_int_gt(clients_connected(), 1);
	close();
	/* Only the asking connection is left: the pool's are all closed. */
	ck_assert_int_eq(clients_connected(), 1);
	struct tokenbucket_result res;
	static const struct tokenbucket_redis_limit many = {
		.tokens = 1000000, .period_ns = SEC, .burst = 1000000
	};
	ck_assert_int_eq(tokenbucket_redis_allow(c, KEY("stale"), &many, 1, &res), 0);
	ck_assert_int_eq(stale_burst(c), 0);
	close();
	ck_assert_int_eq(stale_burst(c), 0);
}

static void kill_normal(void)
{
	ck_assert_int_eq(server_cmd(&srv, "CLIENT KILL TYPE normal"), REDIS_REPLY_INTEGER);
}

static void idle_timeout(void)
{
	/* The server closes connections idle for 1 s; 3 s leaves it room to notice. */
	ck_assert_int_eq(server_cmd(&srv, "CONFIG SET timeout 1"), REDIS_REPLY_STATUS);
	sleep(3);
	/* A server starved of CPU for a second may close this very connection too: ask again. */
	int type = -1;
	for (int i = 0; i < 5 && type != REDIS_REPLY_STATUS; i++)
		type = server_cmd(&srv, "CONFIG SET timeout 0");
	ck_assert_int_eq(type, REDIS_REPLY_STATUS);
}

START_TEST(test_client_kill)
{
	stale_pool(cli, kill_normal);
}
END_TEST

START_TEST(test_client_kill_tcp)
{
	struct tokenbucket_redis *tcp;
	ck_assert_int_eq(tokenbucket_redis_open(&tcp, srv.tcp_url, SEC, 500 * MS), 0);
	stale_pool(tcp, kill_normal);
	tokenbucket_redis_close(tcp);
}
END_TEST

START_TEST(test_idle_timeout)
{
	stale_pool(cli, idle_timeout);
}
END_TEST

START_TEST(test_idle_timeout_tcp)
{
	struct tokenbucket_redis *tcp;
	ck_assert_int_eq(tokenbucket_redis_open(&tcp, srv.tcp_url, SEC, 500 * MS), 0);
	stale_pool(tcp, idle_timeout);
	tokenbucket_redis_close(tcp);
}
END_TEST

static void busy_setup(void)
{
	static const char *const extra[] = { "--busy-reply-threshold", "100", NULL };
	ck_assert_int_eq(server_start(&srv, extra), 0);
	ck_assert_int_eq(tokenbucket_redis_open(&cli, srv.url, SEC, 500 * MS), 0);
}

Suite *redis_faults_suite(void)
{
	Suite *s = suite_create("redis-faults");
	redis_tcase(s, "faults", redis_setup, 30,
		    (const TTest *const[]){ test_killed_and_restarted, test_paused_past_the_timeout,
					    test_script_flush, test_function_flush, test_garbage_and_other_types,
					    test_oom, test_readonly_replica, test_local_fallback,
					    NULL });
	redis_tcase(s, "stale", redis_setup, 30,
		    (const TTest *const[]){ test_client_kill, test_client_kill_tcp, test_idle_timeout,
					    test_idle_timeout_tcp, NULL });
	redis_tcase(s, "busy", busy_setup, 30,
		    (const TTest *const[]){ test_busy, NULL });
	return s;
}
