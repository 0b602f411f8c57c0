/* SPDX-License-Identifier: MIT */
/*
 * tokenbucket-redis-sentinel-check: a client of a redis-sentinel:// URL
 * against a real primary, its replica and three sentinels (redis-server
 * --sentinel) that each test starts: the primary found, calls exact, and a
 * failover under load (the primary SIGKILLed, or SENTINEL FAILOVER) with
 * the grants bound checked as in the cluster tests.  The same through the
 * pipelined client (TOKENBUCKET_REDIS_PIPELINING=1) and through the
 * asynchronous API on each adapter (libevent, libuv).
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
#include "loops.h"

#define SENTINELS 3
#define THREADS 8
#define EVENTS 200000
#define TIMEOUT SEC
/*
 * Calls go on this long after the sentinels name the new primary: long
 * enough for a client's check to find that the sentinel it asks has
 * learnt of the failover (they tell each other every 2 s).
 */
#define AFTER (3 * SEC)

static struct server primary, replica, sentinel[SENTINELS];
static char url[512];
static struct tokenbucket_redis *sc;

/* A client of u, its blocking calls pipelined when the suite asks for it. */
static struct tokenbucket_redis *client_of(const char *u)
{
	struct tokenbucket_redis *r;
	ck_assert_int_eq(tokenbucket_redis_open(&r, u, SEC, TIMEOUT), 0);
	if (getenv("TOKENBUCKET_REDIS_PIPELINING") != NULL)
		ck_assert_int_eq(tokenbucket_redis_configure(r, REDIS_OPTIONS(.pipelining = 1)), 0);
	return r;
}

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
		/* Reached by the sentinel itself ("flags" just "slave"): a failover may choose it. */
		const redisReply *fields = ok ? r->element[0] : NULL;
		bool good = false;
		for (size_t k = 0; fields != NULL && k + 1 < fields->elements; k += 2)
			if (strcmp(fields->element[k]->str, "flags") == 0)
				good = strcmp(fields->element[k + 1]->str, "slave") == 0;
		ok = ok && good;
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
	sc = client_of(url);
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
	r = client_of("redis-sentinel://127.0.0.1:1/tb");
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
	struct tokenbucket_redis *o = client_of(other);
	ck_assert_int_eq(tokenbucket_redis_allow(o, KEY("k"), &fixed, 1, &res), -EHOSTUNREACH);
	tokenbucket_redis_close(o);
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

struct outcome {
	int64_t start, end;
	int err;
	short key;
	bool granted;
	unsigned char calls; /* callbacks run (asynchronous calls) */
};

struct worker {
	pthread_t thread;
	struct outcome *ev;
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
		struct outcome *e = &w->ev[w->n++];
		struct tokenbucket_result res = { 0 };
		e->key = (short)k;
		e->start = tokenbucket_now();
		e->err = tokenbucket_redis_allow(sc, KEY(keys[k]), &lims[k], 1, &res);
		e->end = tokenbucket_now();
		e->granted = e->err == 0 && res.allowed;
	}
	return NULL;
}

/* The faults: the primary dies, or the sentinels are told to fail over (it is demoted alive). */
static void kill_primary(void)
{
	ck_assert_int_eq(kill(primary.pid, SIGKILL), 0);
	waitpid(primary.pid, NULL, 0);
	primary.pid = 0;
}

static void failover_command(void)
{
	redisReply *r = on(&sentinel[0], "SENTINEL FAILOVER tb");
	ck_assert_msg(r->type == REDIS_REPLY_STATUS, "SENTINEL FAILOVER: %s", r->str);
	freeReplyObject(r);
}

/* Until the sentinels name the replica, with poll() between the checks. */
static int64_t wait_promoted(void (*poll)(int64_t until))
{
	/* An election the sentinels lose is tried again after 2 x failover-timeout (10 s). */
	int64_t until = tokenbucket_now() + 60 * SEC;
	while (named_port() != replica.port && tokenbucket_now() < until)
		poll(tokenbucket_now() + 50 * MS);
	ck_assert_int_eq(named_port(), replica.port);
	return tokenbucket_now();
}

/*
 * The calls of a failover (n[i] events in ev[i], i < nev): every call
 * within the timeout, some success after the fault, and the grants bound
 * of the cluster tests: burst + rate x elapsed + what the replication lag
 * lost (counted on the counting key), + inflight for the calls in flight
 * when it was lost.
 */
static void check_failover(const char *what, struct outcome *const *ev, const long *n, int nev,
			   int64_t fault_at, int64_t promoted_at, long inflight)
{
	long calls = 0, failed = 0, granted[2] = { 0, 0 }, early = 0;
	/* Every client asks the sentinels at least once a second while calls flow. */
	int64_t moved_by = promoted_at + 2 * SEC * multiplier();
	int64_t first = INT64_MAX, last = INT64_MIN, longest = 0, recovered = INT64_MAX;
	int first_err = 0, longest_err = 0;
	for (int i = 0; i < nev; i++)
		for (long j = 0; j < n[i]; j++) {
			const struct outcome *e = &ev[i][j];
			calls++;
			failed += e->err != 0;
			if (e->err != 0 && first_err == 0)
				first_err = e->err;
			granted[e->key] += e->granted;
			if (e->key == 1 && e->start < moved_by)
				early += e->granted;
			first = e->start < first ? e->start : first;
			last = e->end > last ? e->end : last;
			if (e->end - e->start > longest)
				longest_err = e->err;
			longest = e->end - e->start > longest ? e->end - e->start : longest;
			if (e->err == 0 && e->start >= fault_at && e->end < recovered)
				recovered = e->end;
		}
	/*
	 * What the new primary holds of the counting key; the grants it
	 * misses were lost.  Asked on a new connection, which goes where the
	 * sentinels say (sc's pooled ones may still be on the old primary).
	 */
	double level = 0;
	struct tokenbucket_redis *fresh;
	ck_assert_int_eq(tokenbucket_redis_open(&fresh, url, SEC, TIMEOUT), 0);
	ck_assert_int_eq(tokenbucket_redis_tokens(fresh, KEY(keys[1]), &lims[1], &level, NULL), 0);
	tokenbucket_redis_close(fresh);
	long held = (long)((double)COUNT_BURST - level);
	long lost = granted[1] > held ? granted[1] - held : 0;
	double elapsed = (double)(last - first);
	double bound = 50 + floor(elapsed / 1e6);
	printf("sentinel failover (%s): promoted %.0f ms after the fault, first success after "
	       "it at +%.0f ms; %ld of %ld calls failed (first error %d), longest call %.1f ms (%d); "
	       "limited key %ld granted (bound %.0f); counting grants lost in the replication lag: %ld\n",
	       what, (double)(promoted_at - fault_at) / 1e6, (double)(recovered - fault_at) / 1e6,
	       failed, calls, first_err, (double)longest / 1e6, longest_err, granted[0], bound, lost);
	ck_assert_msg(recovered != INT64_MAX, "no call succeeded after the failover");
	/* Every call within the timeout (the sentinels' questions and the connection included). */
	ck_assert_int_le(longest, 3 * TIMEOUT + SEC * multiplier());
	/*
	 * The keys alternate, so the limited key lost at most as many grants
	 * as the counting key, plus the calls in flight.
	 */
	ck_assert_msg((double)granted[0] <= bound + (double)lost + (double)inflight,
		      "limited key %ld granted, bound %.0f + %ld", granted[0], bound, lost + inflight);
	/*
	 * A primary demoted alive may go on taking writes: the clients leave
	 * it within a second of the sentinels naming the new one, so what
	 * was lost was granted before moved_by.
	 */
	ck_assert_msg(lost <= early + inflight,
		      "%ld counting grants lost, %ld granted up to 2 s after the promotion", lost,
		      early);
}

static void sleep_until(int64_t until)
{
	int64_t left = until - tokenbucket_now();
	if (left > 0)
		usleep((useconds_t)(left / 1000));
}

static void threads_through(const char *what, void (*fault)(void))
{
	atomic_store(&stop, false);
	for (int i = 0; i < THREADS; i++) {
		workers[i] = (struct worker){ .ev = calloc(EVENTS, sizeof(struct outcome)) };
		ck_assert_ptr_nonnull(workers[i].ev);
		ck_assert_int_eq(pthread_create(&workers[i].thread, NULL, work, &workers[i]), 0);
	}
	usleep(500000);
	int64_t fault_at = tokenbucket_now();
	fault();
	/* The sentinels promote the replica: about 1 s down-after, then the election. */
	int64_t promoted_at = wait_promoted(sleep_until);
	usleep((useconds_t)(AFTER / 1000));
	atomic_store(&stop, true);
	for (int i = 0; i < THREADS; i++)
		pthread_join(workers[i].thread, NULL);
	struct outcome *ev[THREADS];
	long n[THREADS];
	for (int i = 0; i < THREADS; i++) {
		ev[i] = workers[i].ev;
		n[i] = workers[i].n;
	}
	check_failover(what, ev, n, THREADS, fault_at, promoted_at, THREADS);
	for (int i = 0; i < THREADS; i++)
		free(workers[i].ev);
}

START_TEST(test_failover_under_load)
{
	threads_through(getenv("TOKENBUCKET_REDIS_PIPELINING") != NULL ? "SIGKILL, pipelined"
									: "SIGKILL",
			kill_primary);
}
END_TEST

START_TEST(test_failover_command)
{
	threads_through(getenv("TOKENBUCKET_REDIS_PIPELINING") != NULL
				? "SENTINEL FAILOVER, pipelined"
				: "SENTINEL FAILOVER",
			failover_command);
}
END_TEST

/* ---- The asynchronous API, through each adapter --------------------------- */

static struct tokenbucket_redis_async *as;

static void async_setup(void)
{
	setup();
	loop_init();
	as = async_open(sc);
}

static void async_teardown(void)
{
	tokenbucket_redis_async_close(as);
	as = NULL;
	loop_fini();
	teardown();
}

static void setup_libevent(void)
{
	kind = LIBEVENT;
	async_setup();
}

static void setup_libuv(void)
{
	kind = LIBUV;
	async_setup();
}

/* The asynchronous calls of a test: ev[i] is the i-th started. */
#define INFLIGHT 64
#define AEVENTS 400000
static struct outcome *aev;
static long astarted, acompleted;
static bool arefill; /* each completion starts another */
static struct tokenbucket_redis_async *aon; /* where refills go */
static struct tokenbucket_redis_limit alim[2];

static void astart(struct tokenbucket_redis_async *a, int key);

static void adone(void *arg, int err, const struct tokenbucket_result *res,
		  const struct tokenbucket_reservation *rv, double tokens)
{
	struct outcome *e = arg;
	(void)rv;
	(void)tokens;
	e->calls++;
	e->end = tokenbucket_now();
	e->err = err;
	e->granted = err == 0 && res->allowed;
	acompleted++;
	if (arefill && astarted < AEVENTS)
		astart(aon, (int)(astarted & 1));
}

/* Starts allow(keys[key], 1) with alim[key] on a. */
static void astart(struct tokenbucket_redis_async *a, int key)
{
	ck_assert_int_lt(astarted, AEVENTS);
	struct outcome *e = &aev[astarted];
	e->key = (short)key;
	e->start = tokenbucket_now();
	const struct tokenbucket_redis_call c = { .op = TOKENBUCKET_REDIS_ALLOW, .key = keys[key],
						  .keylen = strlen(keys[key]), .limit = alim[key],
						  .n = 1 };
	ck_assert_int_eq(tokenbucket_redis_async_start(a, &c, adone, e), 0);
	astarted++;
}

static void acalls_reset(void)
{
	free(aev);
	aev = calloc(AEVENTS, sizeof(*aev));
	ck_assert_ptr_nonnull(aev);
	astarted = acompleted = 0;
	arefill = false;
	aon = as;
	memcpy(alim, lims, sizeof(alim));
}

static void arun(void)
{
	while (acompleted < astarted)
		loop_once();
}

/* Every call started completed exactly once. */
static void aeach_once(void)
{
	ck_assert_int_eq(acompleted, astarted);
	for (long i = 0; i < astarted; i++)
		ck_assert_msg(aev[i].calls == 1, "call %ld completed %d times", i, aev[i].calls);
}

START_TEST(test_async_exact)
{
	acalls_reset();
	/* 15 at once on a burst of 10 and rate 0: exactly 10 granted, through the primary named. */
	alim[0] = (struct tokenbucket_redis_limit){ .tokens = 0, .period_ns = SEC, .burst = 10 };
	for (int i = 0; i < 15; i++)
		astart(as, 0);
	arun();
	aeach_once();
	long granted = 0;
	for (long i = 0; i < astarted; i++) {
		ck_assert_int_eq(aev[i].err, 0);
		granted += aev[i].granted;
	}
	ck_assert_int_eq(granted, 10);
	redisReply *r = on(&primary, "EXISTS {f}:limited");
	ck_assert_int_eq(r->integer, 1);
	freeReplyObject(r);
	/* A master name the sentinels do not watch, and no sentinel there: the blocking errors. */
	char other[600];
	snprintf(other, sizeof(other), "%.*sother", (int)(strlen(url) - 2), url);
	const char *const urls[] = { other, "redis-sentinel://127.0.0.1:1/tb" };
	const int errs[] = { -EHOSTUNREACH, -ECONNREFUSED };
	for (int u = 0; u < 2; u++) {
		struct tokenbucket_redis *o;
		ck_assert_int_eq(tokenbucket_redis_open(&o, urls[u], SEC, TIMEOUT), 0);
		aon = async_open(o);
		long from = astarted;
		for (int i = 0; i < 20; i++)
			astart(aon, 0);
		arun();
		aeach_once();
		for (long i = from; i < astarted; i++)
			ck_assert_int_eq(aev[i].err, errs[u]);
		tokenbucket_redis_async_close(aon);
		tokenbucket_redis_close(o);
	}
	/* Closed with calls waiting for the sentinels, and with calls sent: each -ECANCELED once. */
	aon = async_open(sc);
	long from = astarted;
	for (int i = 0; i < 500; i++)
		astart(aon, 0);
	tokenbucket_redis_async_close(aon);
	aeach_once();
	for (long i = from; i < astarted; i++)
		ck_assert_int_eq(aev[i].err, -ECANCELED);
	aon = async_open(sc);
	for (int i = 0; i < 10; i++)
		astart(aon, 0);
	arun();
	from = astarted;
	for (int i = 0; i < 500; i++)
		astart(aon, 0);
	loop_once();
	tokenbucket_redis_async_close(aon);
	aeach_once();
	for (long i = from; i < astarted; i++)
		ck_assert(aev[i].err == 0 || aev[i].err == -ECANCELED);
	/*
	 * 10^5 started in a row on a client whose one sentinel refuses, all
	 * waiting for an address: a start tries its own call alone, never the
	 * calls waiting before it, so they are all started well within the
	 * timeout and fail with the sentinel's error.  (Passing over them,
	 * the starts took minutes, and all but the last few failed with
	 * -ETIME.)  10^4 under a sanitizer or memcheck, as in the one-server
	 * suite.
	 */
	const long many = multiplier() > 1 ? 10000 : 100000;
	struct tokenbucket_redis *o;
	ck_assert_int_eq(tokenbucket_redis_open(&o, urls[1], SEC, 5 * SEC * multiplier()), 0);
	aon = async_open(o);
	from = astarted;
	for (long i = 0; i < many; i++)
		astart(aon, 0);
	arun();
	aeach_once();
	for (long i = from; i < astarted; i++)
		ck_assert_int_eq(aev[i].err, -ECONNREFUSED);
	tokenbucket_redis_async_close(aon);
	tokenbucket_redis_close(o);
	free(aev);
	aev = NULL;
}
END_TEST

/* n calls on a, alternating the keys: every one answered (error 0), each callback once. */
static void all_answered_on(struct tokenbucket_redis_async *a, int n)
{
	long from = astarted;
	for (int i = 0; i < n; i++)
		astart(a, i & 1);
	arun();
	aeach_once();
	for (long i = from; i < astarted; i++)
		ck_assert_int_eq(aev[i].err, 0);
}

START_TEST(test_async_sentinel_down)
{
	acalls_reset();
	struct tokenbucket_redis *o;
	/* A sentinel that refuses comes first: the next one is asked at once. */
	char u[600];
	snprintf(u, sizeof(u), "redis-sentinel://127.0.0.1:1,%s", url + strlen("redis-sentinel://"));
	ck_assert_int_eq(tokenbucket_redis_open(&o, u, SEC, TIMEOUT), 0);
	aon = async_open(o);
	all_answered_on(aon, 20);
	tokenbucket_redis_async_close(aon);
	tokenbucket_redis_close(o);
	/*
	 * One that does not answer (stopped) comes first: it is given the
	 * command timeout, which is the waiting calls' too; they end by it,
	 * answered or -ETIME, and the calls after them go to the one that
	 * answered, at once.
	 */
	ck_assert_int_eq(kill(sentinel[0].pid, SIGSTOP), 0);
	ck_assert_int_eq(tokenbucket_redis_open(&o, url, SEC, TIMEOUT), 0);
	aon = async_open(o);
	long from = astarted;
	for (int i = 0; i < 20; i++)
		astart(aon, i & 1);
	arun();
	for (long i = from; i < astarted; i++) {
		ck_assert_msg(aev[i].err == 0 || aev[i].err == -ETIME, "%d", aev[i].err);
		ck_assert_int_le(aev[i].end - aev[i].start, TIMEOUT + SEC * multiplier());
	}
	all_answered_on(aon, 20);
	tokenbucket_redis_async_close(aon);
	tokenbucket_redis_close(o);
	ck_assert_int_eq(kill(sentinel[0].pid, SIGCONT), 0);
	/*
	 * The primary paused for less than the sentinels' down-after: the
	 * calls sent -ETIME at a short timeout, the connection closed, and
	 * the next connection, asked for again, serves every call after.
	 * Where a checker slows this process, the timeout would outlast
	 * down-after and make it a failover: not there.
	 */
	if (200 * MS * multiplier() >= 900 * MS) {
		free(aev);
		aev = NULL;
		return;
	}
	ck_assert_int_eq(tokenbucket_redis_open(&o, url, SEC, 200 * MS * multiplier()), 0);
	aon = async_open(o);
	for (int i = 0; i < 4; i++)
		astart(aon, i & 1);
	arun();
	ck_assert_int_eq(kill(primary.pid, SIGSTOP), 0);
	from = astarted;
	for (int i = 0; i < 20; i++)
		astart(aon, i & 1);
	arun();
	ck_assert_int_eq(kill(primary.pid, SIGCONT), 0);
	for (long i = from; i < astarted; i++)
		ck_assert_int_eq(aev[i].err, -ETIME);
	all_answered_on(aon, 20);
	tokenbucket_redis_async_close(aon);
	tokenbucket_redis_close(o);
	free(aev);
	aev = NULL;
}
END_TEST

static void loop_until(int64_t until)
{
	while (tokenbucket_now() < until)
		loop_once(); /* INFLIGHT calls keep it turning */
}

static void async_through(const char *what, void (*fault)(void))
{
	acalls_reset();
	arefill = true;
	for (int i = 0; i < INFLIGHT; i++)
		astart(as, i & 1);
	loop_until(tokenbucket_now() + 500 * MS);
	int64_t fault_at = tokenbucket_now();
	fault();
	int64_t promoted_at = wait_promoted(loop_until);
	loop_until(tokenbucket_now() + AFTER);
	arefill = false;
	arun();
	aeach_once();
	char name[64];
	snprintf(name, sizeof(name), "%s, async %s", what, kind == LIBEVENT ? "libevent" : "libuv");
	long n = astarted;
	check_failover(name, &aev, &n, 1, fault_at, promoted_at, INFLIGHT);
	free(aev);
	aev = NULL;
}

START_TEST(test_async_failover_kill)
{
	async_through("SIGKILL", kill_primary);
}
END_TEST

START_TEST(test_async_failover_command)
{
	async_through("SENTINEL FAILOVER", failover_command);
}
END_TEST

static Suite *suite_of(const char *name, void (*setup_fn)(void), void (*teardown_fn)(void),
		       const TTest *const *tests)
{
	Suite *s = suite_create(name);
	TCase *tc = tcase_create(name);
	tcase_add_checked_fixture(tc, setup_fn, teardown_fn);
	tcase_set_timeout(tc, 120);
	for (int i = 0; tests[i] != NULL; i++)
		tcase_add_test(tc, tests[i]);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	const TTest *const blocking[] = { test_urls, test_primary_found, test_failover_under_load,
					  test_failover_command, NULL };
	const TTest *const async[] = { test_async_exact, test_async_sentinel_down,
				       test_async_failover_kill, test_async_failover_command, NULL };
	Suite *const suites[] = {
		suite_of("redis-sentinel", setup, teardown, blocking),
		suite_of("redis-sentinel-async-libevent", setup_libevent, async_teardown, async),
		suite_of("redis-sentinel-async-libuv", setup_libuv, async_teardown, async),
		NULL,
	};
	return redis_run(suites, server_available(), "redis-server (package redis-server)");
}
