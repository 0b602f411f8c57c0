/* SPDX-License-Identifier: MIT */
/*
 * tokenbucket-redis-async-check: the asynchronous client through each
 * adapter (libevent, libuv) against a real server.  Thousands of calls in
 * flight at once; faults in the middle of them (SIGKILL, SIGSTOP, close,
 * SCRIPT FLUSH); every callback exactly once, every answer what the
 * blocking call or the local library gives.
 */
#include <signal.h>
#include <stdio.h>
#include <sys/wait.h>
#include <stdlib.h>
#include <unistd.h>

#include "check_redis.h"
#include "cluster.h"
#include "loops.h"

/* ---- Calls and their completions ------------------------------------------ */

#define MAX_CALLS 6000

struct slot {
	int calls; /* how many times its callback ran */
	int err;
	struct tokenbucket_result res;
	struct tokenbucket_reservation rv;
	bool has_rv;
	double tokens;
};

static struct slot slots[MAX_CALLS];
static struct tokenbucket_redis_async *ac;
/* The blocking client ac is made from (the fixture's cli checks the server beside it). */
static struct tokenbucket_redis *acli;
static int started, completed;
/* Run from the callback after `at` completions, once. */
static int fault_at = -1;
static void (*fault)(void);
/* While fewer were started, each completion starts another (refill_call): calls stay in flight. */
static int refill_until;
static struct tokenbucket_redis_call refill_call;
/* Or, when set, the call of the i-th request. */
static struct tokenbucket_redis_call (*refill_fn)(int i);
static void start(const struct tokenbucket_redis_call *call);

static void done(void *arg, int err, const struct tokenbucket_result *res,
		 const struct tokenbucket_reservation *rv, double tokens)
{
	struct slot *s = arg;
	s->calls++;
	s->err = err;
	ck_assert_ptr_nonnull(res);
	s->res = *res;
	s->has_rv = rv != NULL;
	if (rv != NULL)
		s->rv = *rv;
	s->tokens = tokens;
	if (++completed == fault_at && fault != NULL)
		fault();
	if (started < refill_until && ac != NULL) {
		struct tokenbucket_redis_call c = refill_fn != NULL ? refill_fn(started) : refill_call;
		start(&c);
	}
}

static void start(const struct tokenbucket_redis_call *call)
{
	ck_assert_int_lt(started, MAX_CALLS);
	ck_assert_int_eq(tokenbucket_redis_async_start(ac, call, done, &slots[started]), 0);
	started++;
}

static void run_until_done(void)
{
	while (completed < started)
		loop_once();
}

/* Every call started completed exactly once. */
static void each_once(void)
{
	ck_assert_int_eq(completed, started);
	for (int i = 0; i < started; i++)
		ck_assert_msg(slots[i].calls == 1, "call %d completed %d times", i, slots[i].calls);
}

/* No call started, no fault or refill planned. */
static void counts_reset(void)
{
	memset(slots, 0, sizeof(slots));
	started = completed = 0;
	fault_at = -1;
	fault = NULL;
	refill_until = 0;
	refill_fn = NULL;
}

static void setup(void)
{
	redis_setup();
	counts_reset();
	loop_init();
	/* Thousands queue on one connection behind each other: a timeout for all of them. */
	ck_assert_int_eq(tokenbucket_redis_open(&acli, srv.url, SEC, 5 * SEC * multiplier()), 0);
	ac = async_open(acli);
}

/* Closes ac, its loop and the client *r it was made from. */
static void async_fini(struct tokenbucket_redis **r)
{
	tokenbucket_redis_async_close(ac);
	ac = NULL;
	loop_fini();
	tokenbucket_redis_close(*r);
	*r = NULL;
}

static void teardown(void)
{
	async_fini(&acli);
	redis_teardown();
}

static const struct tokenbucket_redis_limit lim = { .tokens = 1, .period_ns = 100 * MS, .burst = 5 };

#define ALLOW(key_, n_) \
	(struct tokenbucket_redis_call){ .op = TOKENBUCKET_REDIS_ALLOW, .key = (key_), \
					 .keylen = strlen(key_), .limit = lim, .n = (n_) }

/* ---- Tests ---------------------------------------------------------------- */

START_TEST(test_thousands_in_flight)
{
	/* 5000 at once on one key of burst 1000 and rate 0: exactly 1000 granted. */
	const struct tokenbucket_redis_limit fixed = { .tokens = 0, .period_ns = SEC, .burst = 1000 };
	for (int i = 0; i < 5000; i++) {
		struct tokenbucket_redis_call c = ALLOW("hot", 1);
		c.limit = fixed;
		start(&c);
	}
	run_until_done();
	each_once();
	int granted = 0;
	for (int i = 0; i < started; i++) {
		ck_assert_int_eq(slots[i].err, 0);
		granted += slots[i].res.allowed;
	}
	ck_assert_int_eq(granted, 1000);
	/* The blocking client agrees: nothing left. */
	double tokens = -1;
	ck_assert_int_eq(tokenbucket_redis_tokens(cli, KEY("hot"), &fixed, &tokens, NULL), 0);
	ck_assert(tokens == 0);
}
END_TEST

/* For many calls at once: how many completed, and how many with an error (the first kept). */
static int many_done, many_failed, many_err;

static void many_cb(void *arg, int err, const struct tokenbucket_result *res,
		    const struct tokenbucket_reservation *rv, double tokens)
{
	(void)arg;
	(void)res;
	(void)rv;
	(void)tokens;
	many_done++;
	if (err != 0 && many_failed++ == 0)
		many_err = err;
}

/* The calls srv has run, by whichever command the client picked. */
static long long calls_run(void)
{
	return redis_calls_of("evalsha") + redis_calls_of("eval") + redis_calls_of("fcall") +
	       redis_calls_of("tokenbucket.call");
}

START_TEST(test_hundred_thousand_starts_at_once)
{
	/*
	 * 10^5 starts outside any callback, in one turn of the loop: a start
	 * costs the same whatever is in flight, so all are sent and answered
	 * well within the timeout (when each start walked the calls in
	 * flight, 20,000 took longer than it and all failed with -ETIME).
	 * Starts outside callbacks are batched until the loop turns: none
	 * has reached the server before the loop runs, then they go out
	 * together.  Under a sanitizer or memcheck (a multiplier set) 10^4:
	 * what they check is memory, and 10^5 would cost that stage minutes.
	 */
	const int N = multiplier() > 1 ? 10000 : 100000;
	many_done = many_failed = many_err = 0;
	/* The connection made and set up first: what follows is the batching alone. */
	struct tokenbucket_redis_call first = ALLOW("many", 1);
	ck_assert_int_eq(tokenbucket_redis_async_start(ac, &first, many_cb, NULL), 0);
	while (many_done < 1)
		loop_once();
	ck_assert_int_eq(many_failed, 0);
	many_done = 0;
	long long before = calls_run();
	int64_t t0 = tokenbucket_now();
	for (int i = 0; i < N; i++) {
		struct tokenbucket_redis_call c = ALLOW("many", 1);
		ck_assert_int_eq(tokenbucket_redis_async_start(ac, &c, many_cb, NULL), 0);
	}
	int64_t t1 = tokenbucket_now();
	/* Written when they were started, 10^5 calls would be run by now (a fraction of them at least). */
	ck_assert_int_eq(calls_run(), before);
	while (many_done < N)
		loop_once();
	fprintf(stderr, "%d starts: %.3f us each; all answered in %.0f ms\n", N,
		(double)(t1 - t0) / N / 1e3, (double)(tokenbucket_now() - t0) / 1e6);
	ck_assert_msg(many_failed == 0, "%d of %d failed, the first with %d", many_failed, N,
		      many_err);
	ck_assert_int_ge(calls_run() - before, N);
}
END_TEST

START_TEST(test_same_answers_as_the_local_library)
{
	/* 2000 allow_at in flight on one key: answered in order, as a local bucket answers. */
	struct tokenbucket *tb;
	ck_assert_int_eq(tokenbucket_create_every(&tb, lim.tokens, lim.period_ns, lim.burst, 0), 0);
	struct tokenbucket_result want[2000];
	for (int i = 0; i < 2000; i++) {
		int64_t now = (int64_t)i * 37 * MS;
		uint64_t n = 1 + (uint64_t)i % 3;
		struct tokenbucket_redis_call c = ALLOW("seq", n);
		c.flags = TOKENBUCKET_REDIS_AT;
		c.now = now;
		start(&c);
		want[i].allowed = tokenbucket_allow_at(tb, now, n);
		want[i].remaining = (uint64_t)tokenbucket_tokens_at(tb, now);
	}
	tokenbucket_free(tb);
	run_until_done();
	each_once();
	for (int i = 0; i < 2000; i++) {
		ck_assert_int_eq(slots[i].err, 0);
		ck_assert_msg(slots[i].res.allowed == want[i].allowed, "call %d", i);
		ck_assert_uint_eq(slots[i].res.remaining, want[i].remaining);
	}
	/* Every op, _at and not: the blocking call's answers. */
	started = completed = 0;
	memset(slots, 0, sizeof(slots));
	struct tokenbucket_redis_call r = ALLOW("ops", 4);
	r.op = TOKENBUCKET_REDIS_RESERVE;
	r.arg = TOKENBUCKET_NEVER;
	r.flags = TOKENBUCKET_REDIS_AT;
	r.now = 0;
	start(&r); /* 0: 5 - 4 = 1 left */
	r.now = 50 * MS;
	start(&r); /* 1: 1.5 - 4: a debt paid at 300 ms */
	struct tokenbucket_redis_call t = ALLOW("ops", 0);
	t.op = TOKENBUCKET_REDIS_TOKENS;
	t.flags = TOKENBUCKET_REDIS_AT;
	t.now = 75 * MS;
	start(&t); /* 2: -2.25 */
	struct tokenbucket_redis_call x = ALLOW("ops", 2);
	x.op = TOKENBUCKET_REDIS_RESET;
	start(&x); /* 3: on the server's clock */
	t.flags = 0;
	start(&t); /* 4 */
	run_until_done();
	each_once();
	for (int i = 0; i < started; i++)
		ck_assert_int_eq(slots[i].err, 0);
	ck_assert_int_eq(tokenbucket_create_every(&tb, lim.tokens, lim.period_ns, lim.burst, 0), 0);
	struct tokenbucket_reservation v0, v1;
	ck_assert_int_eq(tokenbucket_reserve_at(tb, 0, 4, TOKENBUCKET_NEVER, &v0), 0);
	ck_assert_int_eq(tokenbucket_reserve_at(tb, 50 * MS, 4, TOKENBUCKET_NEVER, &v1), 0);
	double level = tokenbucket_tokens_at(tb, 75 * MS);
	tokenbucket_free(tb);
	ck_assert(slots[0].has_rv && slots[0].rv.tokens == 4);
	ck_assert_int_eq(slots[0].rv.time_to_act, v0.time_to_act);
	ck_assert(slots[1].has_rv);
	ck_assert_int_eq(slots[1].rv.time_to_act, v1.time_to_act);
	ck_assert(!slots[2].has_rv && memcmp(&slots[2].tokens, &level, sizeof(level)) == 0);
	ck_assert(slots[4].tokens >= 2 && slots[4].tokens < 3);
	/* A cancel in flight gives back what the second reservation took. */
	started = completed = 0;
	memset(slots, 0, sizeof(slots));
	struct tokenbucket_redis_call c = ALLOW("ops2", 4);
	c.op = TOKENBUCKET_REDIS_CANCEL;
	c.flags = TOKENBUCKET_REDIS_AT;
	c.now = 10 * MS;
	c.arg = 20 * MS;
	r.key = "ops2";
	r.keylen = 4;
	r.now = 0;
	start(&r);
	start(&c);
	t.key = "ops2";
	t.keylen = 4;
	t.flags = TOKENBUCKET_REDIS_AT;
	t.now = 10 * MS;
	start(&t);
	run_until_done();
	each_once();
	ck_assert_int_eq(slots[1].err, 0);
	ck_assert(slots[2].tokens == 5);
}
END_TEST

/* The i-th call of order_run: allow_at on one of order_nkeys keys named order_name. */
#define ORDER_KEYS 499
#define ORDER_CALLS 6000
static char order_keys[ORDER_KEYS][16];
static int order_nkeys;
static char order_name;

static struct tokenbucket_redis_call order_call(int i)
{
	int k = i % order_nkeys;
	snprintf(order_keys[k], sizeof(order_keys[k]), "%c%d", order_name, k);
	struct tokenbucket_redis_call c = ALLOW(order_keys[k], 1 + (uint64_t)(i / 7) % 3);
	c.flags = TOKENBUCKET_REDIS_AT;
	c.now = (int64_t)(i / order_nkeys) * 37 * MS + (int64_t)k;
	return c;
}

/*
 * ORDER_CALLS calls of order_call on nkeys keys named name, at_once in
 * flight (each completion starts the next): each key's answers in the
 * order started, as a local bucket per key gives them.
 */
static void order_run(char name, int nkeys, int at_once)
{
	counts_reset();
	order_name = name;
	order_nkeys = nkeys;
	struct tokenbucket *tb[ORDER_KEYS];
	for (int k = 0; k < nkeys; k++)
		ck_assert_int_eq(tokenbucket_create_every(&tb[k], lim.tokens, lim.period_ns, lim.burst, 0), 0);
	static struct tokenbucket_result want[ORDER_CALLS];
	for (int i = 0; i < ORDER_CALLS; i++) {
		struct tokenbucket_redis_call c = order_call(i);
		struct tokenbucket *b = tb[i % nkeys];
		want[i].allowed = tokenbucket_allow_at(b, c.now, c.n);
		want[i].remaining = (uint64_t)tokenbucket_tokens_at(b, c.now);
	}
	for (int k = 0; k < nkeys; k++)
		tokenbucket_free(tb[k]);
	refill_fn = order_call;
	refill_until = ORDER_CALLS;
	for (int i = 0; i < at_once; i++) {
		struct tokenbucket_redis_call c = order_call(i);
		start(&c);
	}
	run_until_done();
	each_once();
	int allowed = 0;
	for (int i = 0; i < ORDER_CALLS; i++) {
		ck_assert_int_eq(slots[i].err, 0);
		ck_assert_msg(slots[i].res.allowed == want[i].allowed, "call %d", i);
		ck_assert_uint_eq(slots[i].res.remaining, want[i].remaining);
		allowed += slots[i].res.allowed;
	}
	ck_assert(allowed > ORDER_CALLS / 10 && allowed < ORDER_CALLS - ORDER_CALLS / 10);
}

START_TEST(test_connections_spread_keep_key_order)
{
	/* acli made an asynchronous client: its options (4 connections, the default) are set. */
	ck_assert_int_eq(tokenbucket_redis_configure(acli, REDIS_OPTIONS(.connections = 4)), -EBUSY);
	long before = redis_clients();
	/* One call at a time: never busy, so one connection. */
	for (int i = 0; i < 20; i++) {
		struct tokenbucket_redis_call c = ALLOW("quiet", 1);
		start(&c);
		run_until_done();
	}
	each_once();
	ck_assert_int_eq(redis_clients(), before + 1);
	/*
	 * 200 in flight over 499 keys: a key's calls in flight end now and
	 * then, so its next may go on another connection; spares open one at
	 * a time as the ready ones are all busy, up to four.
	 */
	order_run('o', 499, 200);
	ck_assert_int_eq(redis_clients(), before + 4);
	/*
	 * With the four up, 6000 at once over 61 keys: the fewest in flight
	 * would spread each key's calls over all four, and they would be
	 * decided out of order; they stay on their key's connection.
	 */
	order_run('p', 61, ORDER_CALLS);
	ck_assert_int_eq(redis_clients(), before + 4);
}
END_TEST

START_TEST(test_spare_refused_fails_nothing)
{
	/*
	 * One connection up, then the server full (room for adm, which asks):
	 * every spare is closed at once, before its setup is answered.
	 */
	struct tokenbucket_redis_call c = ALLOW("full", 0);
	start(&c);
	run_until_done();
	redisContext *adm = server_admin(&srv);
	ck_assert_ptr_nonnull(adm);
	long before = redis_clients_on(adm);
	redisReply *r = redisCommand(adm, "CONFIG SET maxclients %ld", before + 1);
	ck_assert(r != NULL && r->type == REDIS_REPLY_STATUS);
	freeReplyObject(r);
	counts_reset();
	refill_until = 3000;
	refill_call = ALLOW("full", 0);
	for (int i = 0; i < 200; i++)
		start(&refill_call);
	run_until_done();
	each_once();
	for (int i = 0; i < started; i++)
		ck_assert_msg(slots[i].err == 0, "call %d: %d", i, slots[i].err);
	ck_assert_int_eq(redis_clients_on(adm), before);
	r = redisCommand(adm, "CONFIG SET maxclients 10000");
	ck_assert(r != NULL && r->type == REDIS_REPLY_STATUS);
	freeReplyObject(r);
	redisFree(adm);
	/* A second later spares may open again: the next calls, on many keys, get them. */
	usleep(1100 * 1000);
	counts_reset();
	order_name = 'q';
	order_nkeys = ORDER_KEYS;
	refill_fn = order_call;
	refill_until = ORDER_CALLS;
	for (int i = 0; i < 200; i++) {
		struct tokenbucket_redis_call k = order_call(i);
		start(&k);
	}
	run_until_done();
	each_once();
	for (int i = 0; i < started; i++)
		ck_assert_int_eq(slots[i].err, 0);
	ck_assert_int_gt(redis_clients(), before);
}
END_TEST

START_TEST(test_script_flushed_in_flight)
{
	for (int i = 0; i < 1000; i++) {
		struct tokenbucket_redis_call c = ALLOW("f", 0);
		start(&c);
		if (i == 500)
			ck_assert_int_eq(server_cmd(&srv, "SCRIPT FLUSH"), REDIS_REPLY_STATUS);
	}
	run_until_done();
	ck_assert_int_eq(server_cmd(&srv, "SCRIPT FLUSH"), REDIS_REPLY_STATUS);
	for (int i = 0; i < 1000; i++) {
		struct tokenbucket_redis_call c = ALLOW("f", 0);
		start(&c);
	}
	run_until_done();
	each_once();
	for (int i = 0; i < started; i++)
		ck_assert_int_eq(slots[i].err, 0);
}
END_TEST

static void kill_server(void)
{
	server_stop(&srv, true);
}

static void stop_server(void)
{
	ck_assert_int_eq(kill(srv.pid, SIGSTOP), 0);
}

/*
 * 2000 in flight, kept there until 4000 were started; f() after 500
 * answers; then, recovered, 200 more all succeed.
 */
static void fault_mid_flight(const char *name, void (*f)(void), void (*recover)(void),
			     bool (*expected)(int))
{
	fault_at = 500;
	fault = f;
	refill_call = ALLOW("m", 0);
	refill_until = 4000;
	for (int i = 0; i < 2000; i++)
		start(&refill_call);
	int64_t t0 = tokenbucket_now();
	run_until_done();
	int64_t took = tokenbucket_now() - t0;
	refill_until = 0;
	int failed = 0;
	for (int i = 0; i < started; i++) {
		ck_assert_msg(slots[i].err == 0 || expected(slots[i].err), "call %d: %d", i, slots[i].err);
		failed += slots[i].err != 0;
	}
	printf("async (%s) %s: %d of %d calls failed, all done in %.0f ms\n",
	       kind == LIBEVENT ? "libevent" : "libuv", name, failed, started, (double)took / 1e6);
	ck_assert_int_ge(failed, 1);
	/* Calls time out after the timeout, in a few waves at most: not a hang. */
	ck_assert_msg(took < 30 * SEC * multiplier(), "took %lld ms", (long long)(took / MS));
	recover();
	int before = started;
	for (int i = 0; i < 200; i++) {
		struct tokenbucket_redis_call c = ALLOW("m", 0);
		start(&c);
	}
	run_until_done();
	each_once();
	for (int i = before; i < started; i++)
		ck_assert_msg(slots[i].err == 0, "after recovery, call %d: %d", i, slots[i].err);
}

static bool lost_connection(int err)
{
	return err == -ECONNRESET || err == -EPIPE || err == -ECONNREFUSED || err == -ENOENT;
}

static bool timed_out(int err)
{
	return err == -ETIME;
}

static void restart(void)
{
	ck_assert_int_eq(server_restart(&srv), 0);
}

static void resume(void)
{
	ck_assert_int_eq(kill(srv.pid, SIGCONT), 0);
}

START_TEST(test_killed_mid_flight)
{
	fault_mid_flight("SIGKILL", kill_server, restart, lost_connection);
}
END_TEST

START_TEST(test_stopped_mid_flight)
{
	/* A shorter timeout: every call in flight waits it out, in waves. */
	tokenbucket_redis_async_close(ac);
	tokenbucket_redis_close(acli);
	ck_assert_int_eq(tokenbucket_redis_open(&acli, srv.url, SEC, 500 * MS * multiplier()), 0);
	ac = async_open(acli);
	fault_mid_flight("SIGSTOP", stop_server, resume, timed_out);
}
END_TEST

static void close_client(void)
{
	tokenbucket_redis_async_close(ac);
	ac = NULL;
}

START_TEST(test_close_in_flight)
{
	/* Closed before the loop ever ran: every call -ECANCELED, right there. */
	for (int i = 0; i < 2000; i++) {
		struct tokenbucket_redis_call c = ALLOW("c", 0);
		start(&c);
	}
	close_client();
	each_once();
	for (int i = 0; i < started; i++)
		ck_assert_int_eq(slots[i].err, -ECANCELED);
	/* Closed from a callback: the rest -ECANCELED once that callback returns. */
	ac = async_open(acli);
	started = completed = 0;
	memset(slots, 0, sizeof(slots));
	fault_at = 100;
	fault = close_client;
	for (int i = 0; i < 2000; i++) {
		struct tokenbucket_redis_call c = ALLOW("c", 0);
		start(&c);
	}
	run_until_done();
	each_once();
	int cancelled = 0;
	for (int i = 0; i < started; i++) {
		ck_assert(slots[i].err == 0 || slots[i].err == -ECANCELED);
		cancelled += slots[i].err == -ECANCELED;
	}
	ck_assert_int_ge(cancelled, 1);
	ck_assert_ptr_null(ac);
}
END_TEST

START_TEST(test_fallback_when_down)
{
	ck_assert_int_eq(tokenbucket_redis_set_fallback(acli, 0.5), 0);
	server_stop(&srv, true);
	for (int i = 0; i < 8; i++) {
		struct tokenbucket_redis_call c = ALLOW("fb", 1);
		start(&c);
	}
	run_until_done();
	each_once();
	int granted = 0;
	for (int i = 0; i < started; i++) {
		ck_assert_int_eq(slots[i].err, 0);
		ck_assert_uint_eq(slots[i].res.flags, TOKENBUCKET_RESULT_LOCAL);
		ck_assert_uint_eq(slots[i].res.limit, 2); /* half of 5, rounded down */
		granted += slots[i].res.allowed;
	}
	ck_assert_int_eq(granted, 2);
	/* tokens is not decided locally: the outage shows. */
	struct tokenbucket_redis_call t = ALLOW("fb", 0);
	t.op = TOKENBUCKET_REDIS_TOKENS;
	start(&t);
	run_until_done();
	ck_assert(lost_connection(slots[started - 1].err));
	ck_assert_int_eq(server_restart(&srv), 0);
}
END_TEST

static void no_watch(void *data, int fd, unsigned events)
{
	(void)data;
	(void)fd;
	(void)events;
	ck_abort_msg("not called");
}

static void no_timer(void *data, int64_t ns)
{
	(void)data;
	(void)ns;
	ck_abort_msg("not called");
}

START_TEST(test_bad_arguments)
{
	struct tokenbucket_redis_call c = ALLOW("b", 1);
	ck_assert_int_eq(tokenbucket_redis_async_start(NULL, &c, done, slots), -EINVAL);
	ck_assert_int_eq(tokenbucket_redis_async_start(ac, NULL, done, slots), -EINVAL);
	ck_assert_int_eq(tokenbucket_redis_async_start(ac, &c, NULL, slots), -EINVAL);
	c.op = (enum tokenbucket_redis_op)99;
	ck_assert_int_eq(tokenbucket_redis_async_start(ac, &c, done, slots), -EINVAL);
	c = ALLOW("b", 1);
	c.limit.period_ns = 0;
	ck_assert_int_lt(tokenbucket_redis_async_start(ac, &c, done, slots), 0);
	ck_assert_int_eq(slots[0].calls, 0);
	struct tokenbucket_redis_loop none = { 0 };
	struct tokenbucket_redis_async *a;
	ck_assert_int_eq(tokenbucket_redis_async_open(&a, acli, &none), -EINVAL);
	struct tokenbucket_redis_loop some = { .watch = no_watch, .timer = no_timer };
	ck_assert_int_eq(tokenbucket_redis_async_open(NULL, acli, &some), -EINVAL);
	ck_assert_int_eq(tokenbucket_redis_async_open(&a, NULL, &some), -EINVAL);
	tokenbucket_redis_async_close(NULL);
}
END_TEST

/* ---- A real cluster: 3 primaries, 3 replicas ------------------------------ */

static struct cluster cl;
static struct tokenbucket_redis *ccli;

#define CKEYS 12
static const struct tokenbucket_redis_limit fixed100 = { .tokens = 0, .period_ns = SEC, .burst = 100 };
static char ckeys[CKEYS][48];
static int ckey_owner[CKEYS];

static void cluster_setup(void)
{
	counts_reset();
	/* Failover 1 s after a primary stops answering. */
	ck_assert_msg(cluster_start(&cl, 1000) == 0, "the cluster did not come up");
	/* One seed: the client learns the rest from MOVED and CLUSTER SLOTS. */
	ck_assert_int_eq(tokenbucket_redis_open_cluster(&ccli, cl.seeds, 1, SEC, 5 * SEC * multiplier()),
			 0);
	int p[CLUSTER_NODES];
	ck_assert_int_eq(cluster_primaries(&cl, p), 3);
	for (int k = 0; k < CKEYS; k++) {
		char name[16];
		snprintf(name, sizeof(name), "ak%d", k);
		ckey_owner[k] = p[k % 3];
		ck_assert_ptr_nonnull(cluster_key_on(&cl, p[k % 3], name, ckeys[k], sizeof(ckeys[k])));
	}
	loop_init();
	ac = async_open(ccli);
}

static void cluster_teardown(void)
{
	async_fini(&ccli);
	cluster_stop(&cl);
}

/* The call of the i-th request: the keys in turn, rate 0, burst 100. */
static struct tokenbucket_redis_call ckey_call(int i)
{
	const char *k = ckeys[i % CKEYS];
	return (struct tokenbucket_redis_call){ .op = TOKENBUCKET_REDIS_ALLOW, .key = k,
						.keylen = strlen(k), .limit = fixed100, .n = 1 };
}

/* Granted calls per key among slots [from, to). */
static void granted_per_key(int from, int to, int granted[CKEYS])
{
	memset(granted, 0, CKEYS * sizeof(int));
	for (int i = from; i < to; i++)
		granted[i % CKEYS] += slots[i].err == 0 && slots[i].res.allowed;
}

START_TEST(test_cluster_thousands_in_flight)
{
	/* 3600 at once over keys on all three primaries: exactly the burst of each granted. */
	for (int i = 0; i < 3600; i++) {
		struct tokenbucket_redis_call c = ckey_call(i);
		start(&c);
	}
	run_until_done();
	each_once();
	for (int i = 0; i < started; i++)
		ck_assert_msg(slots[i].err == 0, "call %d: %d", i, slots[i].err);
	int granted[CKEYS];
	granted_per_key(0, started, granted);
	for (int k = 0; k < CKEYS; k++)
		ck_assert_int_eq(granted[k], 100);
	/* The script flushed on every node while 2000 are in flight: none fails. */
	int before = started;
	for (int i = 0; i < 2000; i++) {
		struct tokenbucket_redis_call c = ckey_call(i);
		c.op = TOKENBUCKET_REDIS_TOKENS;
		start(&c);
		if (i == 1000)
			for (int n = 0; n < CLUSTER_NODES; n++)
				ck_assert_int_eq(server_cmd(&cl.node[n], "SCRIPT FLUSH"), REDIS_REPLY_STATUS);
	}
	run_until_done();
	each_once();
	for (int i = before; i < started; i++) {
		ck_assert_msg(slots[i].err == 0, "call %d: %d", i, slots[i].err);
		ck_assert(slots[i].tokens == 0);
	}
}
END_TEST

static int killed = -1;

static void kill_primary(void)
{
	killed = ckey_owner[0];
	ck_assert_int_eq(kill(cl.node[killed].pid, SIGKILL), 0);
	waitpid(cl.node[killed].pid, NULL, 0);
	cl.node[killed].pid = 0;
}

START_TEST(test_cluster_failover_in_flight)
{
	/*
	 * 1200 in flight, refilled up to 5000, a primary SIGKILLed after 600
	 * answers: its keys' calls fail (each once, within the timeout) until
	 * the replica is promoted; the other primaries' keys lose nothing.
	 */
	fault_at = 600;
	fault = kill_primary;
	for (int i = 0; i < 1200; i++) {
		struct tokenbucket_redis_call c = ckey_call(i);
		start(&c);
	}
	/* The refill goes on with the same keys in turn. */
	refill_fn = ckey_call;
	refill_until = 5000;
	run_until_done();
	refill_until = 0;
	refill_fn = NULL;
	each_once();
	int failed = 0, first_err = 0;
	for (int i = 0; i < started; i++) {
		int err = slots[i].err;
		if (err != 0 && first_err == 0)
			first_err = err;
		failed += err != 0;
		ck_assert_msg(err == 0 || err == -ETIME || err == -ECONNRESET || err == -EPIPE ||
				      err == -ECONNREFUSED ||
				      err == -EAGAIN,
			      "call %d: %d", i, err);
		/* Only the dead primary's keys fail. */
		ck_assert_msg(err == 0 || ckey_owner[i % CKEYS] == killed, "call %d on a live primary: %d",
			      i, err);
	}
	int granted[CKEYS];
	granted_per_key(0, started, granted);
	for (int k = 0; k < CKEYS; k++)
		if (ckey_owner[k] != killed)
			ck_assert_int_le(granted[k], 100);
	ck_assert_msg(cluster_settle(&cl, 30 * SEC, false) == 0, "no settled cluster after the kill");
	/* Recovered: every key answers again, the dead primary's through its replica. */
	int before = started;
	for (int i = 0; i < 600; i++) {
		struct tokenbucket_redis_call c = ckey_call(started);
		start(&c);
	}
	run_until_done();
	each_once();
	for (int i = before; i < started; i++)
		ck_assert_msg(slots[i].err == 0, "after the failover, call %d: %d", i, slots[i].err);
	int after[CKEYS];
	granted_per_key(before, started, after);
	for (int k = 0; k < CKEYS; k++)
		if (ckey_owner[k] != killed)
			ck_assert_int_eq(granted[k] + after[k], 100);
	printf("cluster async (%s) SIGKILL of a primary: %d of %d calls failed (first %d)\n",
	       kind == LIBEVENT ? "libevent" : "libuv", failed, before, first_err);
}
END_TEST

START_TEST(test_cluster_close_in_flight)
{
	for (int i = 0; i < 3000; i++) {
		struct tokenbucket_redis_call c = ckey_call(i);
		start(&c);
	}
	/* A few turns of the loop, then closed with most still in flight. */
	for (int t = 0; t < 3 && completed < started; t++)
		loop_once();
	close_client();
	each_once();
	for (int i = 0; i < started; i++)
		ck_assert_msg(slots[i].err == 0 || slots[i].err == -ECANCELED, "call %d: %d", i,
			      slots[i].err);
}
END_TEST

static void cluster_setup_libevent(void)
{
	kind = LIBEVENT;
	cluster_setup();
}

static void cluster_setup_libuv(void)
{
	kind = LIBUV;
	cluster_setup();
}

static void setup_libevent(void)
{
	kind = LIBEVENT;
	setup();
}

static void setup_libuv(void)
{
	kind = LIBUV;
	setup();
}

/* A suite of one test case: tests with setup_fn and teardown_fn around each. */
static Suite *suite_of(const char *name, void (*setup_fn)(void), void (*teardown_fn)(void),
		       int timeout, const TTest *const *tests)
{
	Suite *s = suite_create(name);
	TCase *tc = tcase_create(name);
	tcase_add_checked_fixture(tc, setup_fn, teardown_fn);
	tcase_set_timeout(tc, timeout);
	for (int i = 0; tests[i] != NULL; i++)
		tcase_add_test(tc, tests[i]);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	const TTest *const one_server[] = {
		test_thousands_in_flight, test_hundred_thousand_starts_at_once,
		test_same_answers_as_the_local_library,
		test_connections_spread_keep_key_order, test_spare_refused_fails_nothing,
		test_script_flushed_in_flight,
		test_killed_mid_flight, test_stopped_mid_flight,
		test_close_in_flight, test_fallback_when_down, test_bad_arguments, NULL
	};
	const TTest *const cluster[] = { test_cluster_thousands_in_flight,
					 test_cluster_failover_in_flight, test_cluster_close_in_flight,
					 NULL };
	Suite *const suites[] = {
		suite_of("redis-async-libevent", setup_libevent, teardown, 60, one_server),
		suite_of("redis-async-libuv", setup_libuv, teardown, 60, one_server),
		suite_of("cluster-async-libevent", cluster_setup_libevent, cluster_teardown, 120, cluster),
		suite_of("cluster-async-libuv", cluster_setup_libuv, cluster_teardown, 120, cluster),
		redis_async_all_suite("redis-async-all-libevent", false, false),
		redis_async_all_suite("redis-async-all-libuv", true, false),
		redis_async_all_suite("cluster-async-all-libevent", false, true),
		redis_async_all_suite("cluster-async-all-libuv", true, true),
		NULL
	};
	return redis_run(suites, cluster_available(),
			 "redis-server or redis-cli (package redis-server, redis-tools)");
}
