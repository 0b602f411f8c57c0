/* SPDX-License-Identifier: MIT */
/*
 * tokenbucket-redis-sentinel-check: a client of a redis-sentinel:// URL
 * against a real primary, its replica and three sentinels (redis-server
 * --sentinel) that each test starts: the primary found, calls exact, and a
 * failover under load (the primary SIGKILLed, a sentinel promotes the
 * replica) with the grants bound checked as in the cluster tests.
 */
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check_redis.h"

#define SENTINELS 3
#define THREADS 8
#define EVENTS 200000
#define TIMEOUT SEC

static struct server primary, replica, sentinel[SENTINELS];
static char url[512];
static struct tokenbucket_redis *sc;

static redisReply *on(const struct server *s, const char *cmd)
{
	redisContext *c = server_admin(s);
	ck_assert_ptr_nonnull(c);
	redisReply *r = redisCommand(c, cmd);
	redisFree(c);
	ck_assert_ptr_nonnull(r);
	return r;
}

/* The port the sentinels name for "tb" now, or -1. */
static int named_port(void)
{
	for (int i = 0; i < SENTINELS; i++) {
		if (sentinel[i].pid == 0)
			continue;
		redisReply *r = on(&sentinel[i], "SENTINEL get-master-addr-by-name tb");
		int port = r->type == REDIS_REPLY_ARRAY && r->elements == 2 ? atoi(r->element[1]->str) : -1;
		freeReplyObject(r);
		if (port > 0)
			return port;
	}
	return -1;
}

/* The replica is attached and in sync, and every sentinel knows both. */
static bool settled(void)
{
	redisReply *r = on(&primary, "INFO replication");
	bool ok = r->type == REDIS_REPLY_STRING && strstr(r->str, "connected_slaves:1") != NULL &&
		  strstr(r->str, "state=online") != NULL;
	freeReplyObject(r);
	for (int i = 0; ok && i < SENTINELS; i++) {
		r = on(&sentinel[i], "SENTINEL replicas tb");
		ok = r->type == REDIS_REPLY_ARRAY && r->elements == 1;
		freeReplyObject(r);
	}
	return ok;
}

static void setup(void)
{
	ck_assert_int_eq(server_start(&primary, NULL), 0);
	char port[16];
	snprintf(port, sizeof(port), "%d", primary.port);
	const char *const as_replica[] = { "--replicaof", "127.0.0.1", port, NULL };
	ck_assert_int_eq(server_start(&replica, as_replica), 0);
	/* Down after 1 s without an answer; a quorum of 2 of the 3. */
	char conf[512];
	snprintf(conf, sizeof(conf),
		 "sentinel monitor tb 127.0.0.1 %d 2\n"
		 "sentinel down-after-milliseconds tb 1000\n"
		 "sentinel failover-timeout tb 5000\n"
		 "sentinel parallel-syncs tb 1\n",
		 primary.port);
	int n = snprintf(url, sizeof(url), "redis-sentinel://");
	for (int i = 0; i < SENTINELS; i++) {
		ck_assert_int_eq(server_start_sentinel(&sentinel[i], conf), 0);
		n += snprintf(url + n, sizeof(url) - (size_t)n, "%s127.0.0.1:%d", i > 0 ? "," : "",
			      sentinel[i].port);
	}
	snprintf(url + n, sizeof(url) - (size_t)n, "/tb");
	/* The sentinels find the replica and each other within seconds. */
	int64_t until = tokenbucket_now() + 30 * SEC;
	while (!settled() && tokenbucket_now() < until)
		usleep(100000);
	ck_assert_msg(settled(), "the replica and the sentinels did not settle");
	ck_assert_int_eq(tokenbucket_redis_open(&sc, url, SEC, TIMEOUT), 0);
}

static void teardown(void)
{
	tokenbucket_redis_close(sc);
	sc = NULL;
	for (int i = 0; i < SENTINELS; i++)
		server_stop(&sentinel[i], false);
	server_stop(&replica, false);
	server_stop(&primary, false);
}

START_TEST(test_urls)
{
	struct tokenbucket_redis *r;
	static const char *const bad[] = {
		"redis-sentinel://", "redis-sentinel:///tb", "redis-sentinel://h:1",
		"redis-sentinel://h:1/", "redis-sentinel://h:0/tb", "redis-sentinel://h:65536/tb",
		"redis-sentinel://h:1,/tb", "redis-sentinel://h:x/tb", "redis-sentinel://h:1/tb/x",
		"redis-sentinel://h:1/tb/-1",
	};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
		ck_assert_msg(tokenbucket_redis_open(&r, bad[i], SEC, SEC) == -EINVAL, "%s", bad[i]);
	static const char *const good[] = { "redis-sentinel://h/tb", "redis-sentinel://h:1,k:2/tb/3",
					    "redis-sentinel://h:1/tb/" };
	for (size_t i = 0; i < sizeof(good) / sizeof(good[0]); i++) {
		ck_assert_msg(tokenbucket_redis_open(&r, good[i], SEC, SEC) == 0, "%s", good[i]);
		tokenbucket_redis_close(r);
	}
	/* Nobody there: the sentinels' error, within their timeouts. */
	ck_assert_int_eq(tokenbucket_redis_open(&r, "redis-sentinel://127.0.0.1:1/tb", SEC, SEC), 0);
	struct tokenbucket_result res;
	const struct tokenbucket_redis_limit lim = { .tokens = 1, .period_ns = SEC, .burst = 1 };
	ck_assert_int_eq(tokenbucket_redis_allow(r, KEY("k"), &lim, 1, &res), -ECONNREFUSED);
	tokenbucket_redis_close(r);
}
END_TEST

START_TEST(test_primary_found)
{
	const struct tokenbucket_redis_limit fixed = { .tokens = 0, .period_ns = SEC, .burst = 10 };
	struct tokenbucket_result res;
	int granted = 0;
	for (int i = 0; i < 15; i++) {
		ck_assert_int_eq(tokenbucket_redis_allow(sc, KEY("k"), &fixed, 1, &res), 0);
		granted += res.allowed;
	}
	ck_assert_int_eq(granted, 10);
	/* Written on the primary, replicated to the replica. */
	redisReply *r = on(&primary, "EXISTS k");
	ck_assert_int_eq(r->integer, 1);
	freeReplyObject(r);
	/* A master name the sentinels do not watch. */
	char other[600];
	snprintf(other, sizeof(other), "%.*sother", (int)(strlen(url) - 2), url);
	struct tokenbucket_redis *o;
	ck_assert_int_eq(tokenbucket_redis_open(&o, other, SEC, TIMEOUT), 0);
	ck_assert_int_eq(tokenbucket_redis_allow(o, KEY("k"), &fixed, 1, &res), -EHOSTUNREACH);
	tokenbucket_redis_close(o);
	/* The asynchronous engine does not ask sentinels (yet). */
	ck_assert_int_eq(tokenbucket_redis_set_pipelining(sc, 1), -EOPNOTSUPP);
}
END_TEST

/* ---- A failover under load ------------------------------------------------ */

/* Key 0 limited (1000/s, burst 50); key 1 counts (rate 0, a burst no run empties). */
#define COUNT_BURST UINT64_C(1000000000000)
static const struct tokenbucket_redis_limit lims[2] = {
	{ .tokens = 1, .period_ns = MS, .burst = 50 },
	{ .tokens = 0, .period_ns = SEC, .burst = COUNT_BURST },
};
static const char *const keys[2] = { "{f}:limited", "{f}:count" };

struct event {
	int64_t start, end;
	int err;
	short key;
	bool granted;
};

struct worker {
	pthread_t thread;
	struct event *ev;
	long n;
};

static struct worker workers[THREADS];
static atomic_bool stop;

static void *work(void *arg)
{
	struct worker *w = arg;
	int k = 0;
	while (!atomic_load(&stop) && w->n < EVENTS) {
		k ^= 1;
		struct event *e = &w->ev[w->n++];
		struct tokenbucket_result res = { 0 };
		e->key = (short)k;
		e->start = tokenbucket_now();
		e->err = tokenbucket_redis_allow(sc, KEY(keys[k]), &lims[k], 1, &res);
		e->end = tokenbucket_now();
		e->granted = e->err == 0 && res.allowed;
	}
	return NULL;
}

START_TEST(test_failover_under_load)
{
	atomic_store(&stop, false);
	for (int i = 0; i < THREADS; i++) {
		workers[i] = (struct worker){ .ev = calloc(EVENTS, sizeof(struct event)) };
		ck_assert_ptr_nonnull(workers[i].ev);
		ck_assert_int_eq(pthread_create(&workers[i].thread, NULL, work, &workers[i]), 0);
	}
	usleep(500000);
	int64_t kill_at = tokenbucket_now();
	ck_assert_int_eq(kill(primary.pid, SIGKILL), 0);
	waitpid(primary.pid, NULL, 0);
	primary.pid = 0;
	/* The sentinels promote the replica: about 1 s down-after, then the election. */
	int64_t until = tokenbucket_now() + 30 * SEC;
	while (named_port() != replica.port && tokenbucket_now() < until)
		usleep(50000);
	ck_assert_int_eq(named_port(), replica.port);
	int64_t promoted_at = tokenbucket_now();
	usleep(1000000);
	atomic_store(&stop, true);
	for (int i = 0; i < THREADS; i++)
		pthread_join(workers[i].thread, NULL);

	long calls = 0, failed = 0, granted[2] = { 0, 0 };
	int64_t first = INT64_MAX, last = INT64_MIN, longest = 0, recovered = INT64_MAX;
	int first_err = 0;
	for (int i = 0; i < THREADS; i++)
		for (long j = 0; j < workers[i].n; j++) {
			const struct event *e = &workers[i].ev[j];
			calls++;
			failed += e->err != 0;
			if (e->err != 0 && first_err == 0)
				first_err = e->err;
			granted[e->key] += e->granted;
			first = e->start < first ? e->start : first;
			last = e->end > last ? e->end : last;
			longest = e->end - e->start > longest ? e->end - e->start : longest;
			if (e->err == 0 && e->start >= kill_at && e->end < recovered)
				recovered = e->end;
		}
	/* What the new primary holds of the counting key; the grants it misses were lost. */
	double level = 0;
	ck_assert_int_eq(tokenbucket_redis_tokens(sc, KEY(keys[1]), &lims[1], &level, NULL), 0);
	long held = (long)((double)COUNT_BURST - level);
	long lost = granted[1] > held ? granted[1] - held : 0;
	double elapsed = (double)(last - first);
	double bound = 50 + floor(elapsed / 1e6);
	printf("sentinel failover (SIGKILL): promoted %.0f ms after the kill, first success after "
	       "it at +%.0f ms; %ld of %ld calls failed (first error %d), longest call %.1f ms; "
	       "limited key %ld granted (bound %.0f); counting grants lost in the replication lag: %ld\n",
	       (double)(promoted_at - kill_at) / 1e6, (double)(recovered - kill_at) / 1e6, failed, calls,
	       first_err, (double)longest / 1e6, granted[0], bound, lost);
	ck_assert_msg(recovered != INT64_MAX, "no call succeeded after the failover");
	/* Every call within the timeout (the sentinels' questions and the connection included). */
	ck_assert_int_le(longest, 3 * TIMEOUT + 300 * MS);
	/*
	 * The bound of the cluster tests: burst + rate x elapsed + what the
	 * replication lag lost.  The keys alternate, so the limited key lost
	 * at most as many grants as the counting key, plus the calls in flight.
	 */
	ck_assert_msg((double)granted[0] <= bound + (double)lost + THREADS, "limited key %ld granted, bound %.0f + %ld",
		      granted[0], bound, lost + THREADS);
	for (int i = 0; i < THREADS; i++)
		free(workers[i].ev);
}
END_TEST

int main(void)
{
	Suite *s = suite_create("redis-sentinel");
	TCase *tc = tcase_create("sentinel");
	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_set_timeout(tc, 120);
	tcase_add_test(tc, test_urls);
	tcase_add_test(tc, test_primary_found);
	tcase_add_test(tc, test_failover_under_load);
	suite_add_tcase(s, tc);
	Suite *const suites[] = { s, NULL };
	return redis_run(suites, server_available(), "redis-server (package redis-server)");
}
