/* SPDX-License-Identifier: MIT */
/*
 * TOKENBUCKET_REDIS_ALLOW_ALL calls of tokenbucket_redis_async_start
 * (struct tokenbucket_redis_call_all) through each adapter (libevent,
 * libuv) against a real server, with the module when TOKENBUCKET_REDIS_MODULE
 * names it, and on a real cluster.  Every answer what the blocking
 * tokenbucket_redis_allow_all[_at] gives on the same sequence, every
 * callback exactly once, under thousands in flight, a killed or stopped
 * server, a flushed script, a close.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check_redis.h"
#include "cluster.h"
#include "loops.h"

#define MAX_CALLS 6000

struct slot {
	int calls; /* how many times its callback ran */
	int err;
	struct tokenbucket_set_result res;
};

static struct slot slots[MAX_CALLS];
static struct tokenbucket_redis_async *ac;
static struct tokenbucket_redis *acli; /* ac's blocking client */
static int started, completed;
static int fault_at = -1; /* fault() runs after this many completions */
static void (*fault)(void);
static int refill_until; /* each completion starts another while fewer were started */

static const struct tokenbucket_limit two[2] = {
	{ .tokens = 0, .period_ns = SEC, .burst = 1000 },
	{ .tokens = 0, .period_ns = SEC, .burst = 3000 },
};

static void start_all(const char *key, const struct tokenbucket_limit *limits, size_t count,
		      uint64_t n);

/* A several-limits completion, as tests want it: the whole decision. */
typedef void set_done_fn(void *arg, int err, const struct tokenbucket_set_result *res);
struct set_start {
	struct tokenbucket_set_result res; /* the call_all's: the engine writes it */
	set_done_fn *done;
	void *arg;
};

static void set_started(void *p, int err, const struct tokenbucket_result *one,
			const struct tokenbucket_reservation *rv, double tokens)
{
	struct set_start *s = p;
	ck_assert_ptr_nonnull(one);
	ck_assert(rv == NULL && tokens == 0);
	if (err != 0) {
		memset(&s->res, 0, sizeof(s->res));
	} else {
		/* done's res is the decision in a single limit's terms. */
		ck_assert(one->allowed == s->res.allowed && one->flags == s->res.flags);
		ck_assert_uint_eq(one->limit, s->res.limit);
		ck_assert_uint_eq(one->remaining, s->res.remaining);
		ck_assert_int_eq(one->retry_after_ns, s->res.retry_after_ns);
		ck_assert_int_eq(one->reset_after_ns, s->res.reset_after_ns);
	}
	struct set_start copy = *s;
	free(s);
	copy.done(copy.arg, err, &copy.res);
}

/* Starts a TOKENBUCKET_REDIS_ALLOW_ALL call on a (_at: at now). */
static int start_set(struct tokenbucket_redis_async *a, const void *key, size_t keylen,
		     const struct tokenbucket_limit *limits, size_t count, bool at, int64_t now,
		     uint64_t n, set_done_fn *done, void *arg)
{
	struct set_start *s = calloc(1, sizeof(*s));
	ck_assert_ptr_nonnull(s);
	s->done = done;
	s->arg = arg;
	struct tokenbucket_redis_call_all all = {
		.call = { .op = TOKENBUCKET_REDIS_ALLOW_ALL, .flags = at ? TOKENBUCKET_REDIS_AT : 0,
			  .key = key, .keylen = keylen, .now = now, .n = n },
		.limits = limits,
		.count = count,
		.res = &s->res,
	};
	int err = tokenbucket_redis_async_start(a, &all.call, done != NULL ? set_started : NULL, s);
	if (err != 0)
		free(s);
	return err;
}

static int async_allow_all(struct tokenbucket_redis_async *a, const void *key, size_t keylen,
			   const struct tokenbucket_limit *limits, size_t count, uint64_t n,
			   set_done_fn *done, void *arg)
{
	return start_set(a, key, keylen, limits, count, false, 0, n, done, arg);
}

static int async_allow_all_at(struct tokenbucket_redis_async *a, const void *key, size_t keylen,
			      const struct tokenbucket_limit *limits, size_t count, int64_t now,
			      uint64_t n, set_done_fn *done, void *arg)
{
	return start_set(a, key, keylen, limits, count, true, now, n, done, arg);
}

static void set_done(void *arg, int err, const struct tokenbucket_set_result *res)
{
	struct slot *s = arg;
	s->calls++;
	s->err = err;
	ck_assert_ptr_nonnull(res);
	s->res = *res;
	if (++completed == fault_at && fault != NULL)
		fault();
	if (started < refill_until && ac != NULL)
		start_all("m", two, 2, 1);
}

static void start_all(const char *key, const struct tokenbucket_limit *limits, size_t count,
		      uint64_t n)
{
	ck_assert_int_lt(started, MAX_CALLS);
	ck_assert_int_eq(async_allow_all(ac, KEY(key), limits, count, n, set_done,
							   &slots[started]),
			 0);
	started++;
}

static void run_until_done(void)
{
	while (completed < started)
		loop_once();
}

static void each_once(void)
{
	ck_assert_int_eq(completed, started);
	for (int i = 0; i < started; i++)
		ck_assert_msg(slots[i].calls == 1, "call %d completed %d times", i, slots[i].calls);
}

static void counts_reset(void)
{
	memset(slots, 0, sizeof(slots));
	started = completed = 0;
	fault_at = -1;
	fault = NULL;
	refill_until = 0;
}

static void open_async(int64_t timeout)
{
	ck_assert_int_eq(tokenbucket_redis_open(&acli, srv.url, SEC, timeout), 0);
	ac = async_open(acli);
}

static void setup(void)
{
	redis_setup();
	counts_reset();
	loop_init();
	open_async(5 * SEC * multiplier());
}

static void close_async(void)
{
	tokenbucket_redis_async_close(ac);
	ac = NULL;
	tokenbucket_redis_close(acli);
	acli = NULL;
}

static void teardown(void)
{
	close_async();
	loop_fini();
	redis_teardown();
}

static void same_result(int i, int err, const struct tokenbucket_set_result *want)
{
	const struct slot *s = &slots[i];
	ck_assert_msg(s->err == err, "call %d: %d, blocking %d", i, s->err, err);
	if (err != 0)
		return;
	ck_assert_msg(s->res.allowed == want->allowed && s->res.flags == want->flags &&
			      s->res.index == want->index && s->res.limit == want->limit &&
			      s->res.remaining == want->remaining &&
			      s->res.retry_after_ns == want->retry_after_ns &&
			      s->res.reset_after_ns == want->reset_after_ns,
		      "call %d: allowed %d index %zu limit %llu remaining %llu retry %lld reset %lld; "
		      "blocking %d %zu %llu %llu %lld %lld",
		      i, s->res.allowed, s->res.index, (unsigned long long)s->res.limit,
		      (unsigned long long)s->res.remaining, (long long)s->res.retry_after_ns,
		      (long long)s->res.reset_after_ns, want->allowed, want->index,
		      (unsigned long long)want->limit, (unsigned long long)want->remaining,
		      (long long)want->retry_after_ns, (long long)want->reset_after_ns);
}

static uint64_t rnd(uint64_t *x)
{
	*x ^= *x << 13;
	*x ^= *x >> 7;
	*x ^= *x << 17;
	return *x;
}

/* ---- One server --------------------------------------------------------------- */

#define DIFF_STEPS 1500

START_TEST(test_same_as_blocking)
{
	/*
	 * One random sequence of allow_all_at, all in flight at once on one
	 * key, and the same sequence one call at a time through the blocking
	 * client on another: every field equal.  The configuration changes
	 * now and then (limits added, dropped, reconfigured), n goes past a
	 * burst now and then (-E2BIG).
	 */
	static struct tokenbucket_set_result want[DIFF_STEPS];
	static int want_err[DIFF_STEPS];
	static const struct tokenbucket_limit pool[5] = {
		{ .tokens = 10, .period_ns = SEC, .burst = 10 },
		{ .tokens = 1000, .period_ns = 3600 * SEC, .burst = 1000 },
		{ .tokens = 3, .period_ns = 7 * MS, .burst = 4 },
		{ .tokens = 0, .period_ns = SEC, .burst = 50 },
		{ .tokens = 7, .period_ns = 100 * MS, .burst = 20 },
	};
	uint64_t x = 0x9e3779b97f4a7c15u;
	struct tokenbucket_limit limits[4];
	size_t count = 0;
	int64_t now = 1000 * SEC;
	for (int i = 0; i < DIFF_STEPS; i++) {
		if (count == 0 || rnd(&x) % 50 == 0) {
			count = 1 + rnd(&x) % 4;
			for (size_t k = 0; k < count; k++)
				limits[k] = pool[rnd(&x) % 5];
		}
		now += (int64_t)(rnd(&x) % (200 * MS));
		uint64_t n = rnd(&x) % 6 == 0 ? rnd(&x) % 60 : rnd(&x) % 4;
		want_err[i] = tokenbucket_redis_allow_all_at(acli, KEY("diff:blocking"), limits, count,
							     now, n, &want[i]);
		ck_assert_int_eq(async_allow_all_at(ac, KEY("diff:async"), limits,
								      count, now, n, set_done,
								      &slots[started]),
				 0);
		started++;
	}
	run_until_done();
	each_once();
	int errors = 0, granted = 0;
	for (int i = 0; i < DIFF_STEPS; i++) {
		same_result(i, want_err[i], &want[i]);
		errors += want_err[i] != 0;
		granted += want_err[i] == 0 && want[i].allowed;
	}
	/* The sequence says something: some granted, some refused, some -E2BIG. */
	ck_assert_int_gt(errors, 0);
	ck_assert_int_gt(granted, 0);
	ck_assert_int_lt(granted, DIFF_STEPS - errors);
	/* On the server's clock, rate 0: the same answers, no clock in them. */
	counts_reset();
	struct tokenbucket_set_result w[30];
	for (int i = 0; i < 30; i++) {
		const struct tokenbucket_limit fixed[2] = {
			{ .tokens = 0, .period_ns = SEC, .burst = 25 },
			{ .tokens = 0, .period_ns = SEC, .burst = 10 },
		};
		ck_assert_int_eq(tokenbucket_redis_allow_all(acli, KEY("clock:blocking"), fixed, 2, 1, &w[i]),
				 0);
		start_all("clock:async", fixed, 2, 1);
	}
	run_until_done();
	each_once();
	for (int i = 0; i < 30; i++) {
		same_result(i, 0, &w[i]);
		ck_assert(slots[i].res.allowed == (i < 10));
	}
	/* Whichever way the calls went, they went as the engine sends single calls. */
	const char *module = getenv("TOKENBUCKET_REDIS_MODULE");
	if (module != NULL)
		ck_assert_int_ge(redis_calls_of("tokenbucket.call"), 2 * (DIFF_STEPS + 30));
	else
		ck_assert_int_ge(redis_calls_of("evalsha") + redis_calls_of("fcall"),
				 2 * (DIFF_STEPS + 30));
}
END_TEST

START_TEST(test_values_refused)
{
	/* A single limit's value, a string that is no bucket, a hash: refused, unchanged. */
	const struct tokenbucket_limit one = { .tokens = 1, .period_ns = SEC, .burst = 5 };
	ck_assert_int_eq(tokenbucket_redis_allow(cli, KEY("single"), TBR_OLD(&one), 1, NULL), 0);
	ck_assert_int_eq(server_cmd(&srv, "SET junk tbs1garbage"), REDIS_REPLY_STATUS);
	ck_assert_int_eq(server_cmd(&srv, "HSET hash f v"), REDIS_REPLY_INTEGER);
	start_all("single", two, 2, 1);
	start_all("junk", two, 2, 1);
	start_all("hash", two, 2, 1);
	start_all("fine", two, 2, 1001); /* above the first burst */
	start_all("fine", two, 2, 1000);
	run_until_done();
	each_once();
	ck_assert_int_eq(slots[0].err, -EBADMSG);
	ck_assert_int_eq(slots[1].err, -EBADMSG);
	ck_assert_int_eq(slots[2].err, -EPROTOTYPE);
	ck_assert_int_eq(slots[3].err, -E2BIG);
	for (int i = 0; i < 4; i++) /* all zero on error */
		ck_assert(!slots[i].res.allowed && slots[i].res.limit == 0);
	ck_assert_int_eq(slots[4].err, 0);
	ck_assert(slots[4].res.allowed);
	ck_assert_uint_eq(slots[4].res.index, 0);
	ck_assert_uint_eq(slots[4].res.remaining, 0);
	/* The single limit is still there, untouched by the refusal. */
	double tokens = -1;
	ck_assert_int_eq(tokenbucket_redis_tokens(cli, KEY("single"), TBR_OLD(&one), &tokens, NULL), 0);
	ck_assert(tokens >= 4 && tokens <= 5);
}
END_TEST

static int singles_done, singles_granted;

static void single_done(void *arg, int err, const struct tokenbucket_result *res,
			const struct tokenbucket_reservation *rv, double tokens)
{
	(void)arg;
	(void)rv;
	(void)tokens;
	ck_assert_int_eq(err, 0);
	singles_done++;
	singles_granted += res->allowed;
}

START_TEST(test_thousands_in_flight)
{
	/*
	 * 5000 at once on a key of two limits (bursts 1000 and 3000, rate 0),
	 * 500 single allows on another key among them: exactly 1000 and 100
	 * granted, in order.
	 */
	const struct tokenbucket_redis_limit single = { .tokens = 0, .period_ns = SEC, .burst = 100 };
	const struct tokenbucket_redis_call c = {
		.op = TOKENBUCKET_REDIS_ALLOW, .key = "other", .keylen = 5, .limit = single, .n = 1,
	};
	singles_done = singles_granted = 0;
	for (int i = 0; i < 5000; i++) {
		start_all("hot", two, 2, 1);
		if (i % 10 == 0)
			ck_assert_int_eq(tokenbucket_redis_async_start(ac, &c, single_done, NULL), 0);
	}
	while (completed < started || singles_done < 500)
		loop_once();
	each_once();
	ck_assert_int_eq(singles_done, 500);
	ck_assert_int_eq(singles_granted, 100);
	int granted = 0;
	for (int i = 0; i < started; i++) {
		ck_assert_int_eq(slots[i].err, 0);
		granted += slots[i].res.allowed;
		/* Refused by the first limit, in order. */
		ck_assert(slots[i].res.allowed == (i < 1000));
		if (!slots[i].res.allowed) {
			ck_assert_uint_eq(slots[i].res.index, 0);
			ck_assert_int_eq(slots[i].res.retry_after_ns, TOKENBUCKET_NEVER);
		}
	}
	ck_assert_int_eq(granted, 1000);
	struct tokenbucket_set_result res;
	ck_assert_int_eq(tokenbucket_redis_allow_all(cli, KEY("hot"), two, 2, 1, &res), 0);
	ck_assert(!res.allowed);
	ck_assert_uint_eq(res.index, 0);
}
END_TEST

START_TEST(test_script_flushed_in_flight)
{
	for (int i = 0; i < 2000; i++) {
		start_all("f", two, 2, 0);
		if (i == 700)
			ck_assert_int_eq(server_cmd(&srv, "SCRIPT FLUSH"), REDIS_REPLY_STATUS);
		if (i == 1400) /* Redis 7: the library goes; before, an error reply */
			server_cmd(&srv, "FUNCTION FLUSH");
	}
	run_until_done();
	each_once();
	for (int i = 0; i < started; i++) {
		ck_assert_msg(slots[i].err == 0, "call %d: %d", i, slots[i].err);
		ck_assert(slots[i].res.allowed);
	}
}
END_TEST

static bool lost_connection(int err)
{
	return err == -ECONNRESET || err == -EPIPE || err == -ECONNREFUSED || err == -ENOENT;
}

static void kill_server(void)
{
	server_stop(&srv, true);
}

/* 2000 in flight, refilled to 4000, the server SIGKILLed after 500 answers; each answered once. */
static void kill_in_flight(void)
{
	fault_at = 500;
	fault = kill_server;
	refill_until = 4000;
	for (int i = 0; i < 2000; i++)
		start_all("m", two, 2, 1);
	run_until_done();
	refill_until = 0;
	each_once();
}

START_TEST(test_killed_mid_flight)
{
	kill_in_flight();
	int failed = 0;
	for (int i = 0; i < started; i++) {
		ck_assert_msg(slots[i].err == 0 || lost_connection(slots[i].err), "call %d: %d", i,
			      slots[i].err);
		failed += slots[i].err != 0;
	}
	ck_assert_int_ge(failed, 1);
	ck_assert_int_eq(server_restart(&srv), 0);
	int before = started;
	for (int i = 0; i < 200; i++)
		start_all("m", two, 2, 1);
	run_until_done();
	each_once();
	for (int i = before; i < started; i++) {
		ck_assert_msg(slots[i].err == 0, "after the restart, call %d: %d", i, slots[i].err);
		ck_assert(slots[i].res.allowed && slots[i].res.flags == 0);
	}
}
END_TEST

START_TEST(test_stopped_times_out)
{
	close_async();
	open_async(300 * MS * multiplier());
	start_all("s", two, 2, 1);
	run_until_done();
	ck_assert_int_eq(slots[0].err, 0);
	ck_assert_int_eq(kill(srv.pid, SIGSTOP), 0);
	for (int i = 0; i < 100; i++)
		start_all("s", two, 2, 1);
	run_until_done();
	ck_assert_int_eq(kill(srv.pid, SIGCONT), 0);
	each_once();
	for (int i = 1; i < started; i++)
		ck_assert_msg(slots[i].err == -ETIME, "call %d: %d", i, slots[i].err);
}
END_TEST

START_TEST(test_fallback_when_down)
{
	/* The server down, the fallback on: local buckets at half of each burst (2 and 4) decide. */
	const struct tokenbucket_limit lims[2] = {
		{ .tokens = 0, .period_ns = SEC, .burst = 5 },
		{ .tokens = 0, .period_ns = SEC, .burst = 9 },
	};
	ck_assert_int_eq(tokenbucket_redis_set_fallback(acli, 0.5), 0);
	server_stop(&srv, true);
	for (int i = 0; i < 8; i++)
		start_all("fb", lims, 2, 1);
	run_until_done();
	each_once();
	for (int i = 0; i < started; i++) {
		ck_assert_int_eq(slots[i].err, 0);
		ck_assert_uint_eq(slots[i].res.flags, TOKENBUCKET_RESULT_LOCAL);
		ck_assert(slots[i].res.allowed == (i < 2));
		if (i >= 2) {
			ck_assert_uint_eq(slots[i].res.index, 0);
			ck_assert_uint_eq(slots[i].res.limit, 2);
		}
	}
	/* The blocking client's fallback decides with the same local buckets. */
	struct tokenbucket_set_result res;
	ck_assert_int_eq(tokenbucket_redis_allow_all(acli, KEY("fb"), lims, 2, 1, &res), 0);
	ck_assert(!res.allowed && res.flags == TOKENBUCKET_RESULT_LOCAL);
	/*
	 * Killed with 2000 in flight: every call answered, by the server or
	 * locally; neither grants past its own share.
	 */
	ck_assert_int_eq(server_restart(&srv), 0);
	counts_reset();
	kill_in_flight();
	int local = 0, granted = 0, granted_local = 0;
	for (int i = 0; i < started; i++) {
		ck_assert_msg(slots[i].err == 0, "call %d: %d", i, slots[i].err);
		bool here = slots[i].res.flags == TOKENBUCKET_RESULT_LOCAL;
		local += here;
		granted += !here && slots[i].res.allowed;
		granted_local += here && slots[i].res.allowed;
	}
	ck_assert_int_ge(local, 1);
	ck_assert_int_le(granted, 1000);
	ck_assert_int_le(granted_local, 500);
	ck_assert_int_eq(server_restart(&srv), 0);
}
END_TEST

static struct tokenbucket_redis_async *closed;
static int start_after_close;

static void close_client(void)
{
	closed = ac;
	tokenbucket_redis_async_close(ac);
	ac = NULL;
	/* Within the callback the client is still there, refusing new calls. */
	start_after_close = async_allow_all(closed, KEY("c"), two, 2, 1, set_done,
							      &slots[MAX_CALLS - 1]);
}

START_TEST(test_close_in_flight)
{
	/* Closed before the loop ever ran: every call -ECANCELED, right there. */
	for (int i = 0; i < 2000; i++)
		start_all("c", two, 2, 1);
	tokenbucket_redis_async_close(ac);
	ac = NULL;
	each_once();
	for (int i = 0; i < started; i++)
		ck_assert_int_eq(slots[i].err, -ECANCELED);
	/* Closed from a callback: the rest -ECANCELED once that callback returns. */
	ac = async_open(acli);
	counts_reset();
	fault_at = 100;
	fault = close_client;
	for (int i = 0; i < 2000; i++)
		start_all("c", two, 2, 1);
	run_until_done();
	each_once();
	ck_assert_int_eq(start_after_close, -ECANCELED);
	ck_assert_int_eq(slots[MAX_CALLS - 1].calls, 0);
	int cancelled = 0;
	for (int i = 0; i < started; i++) {
		ck_assert(slots[i].err == 0 || slots[i].err == -ECANCELED);
		cancelled += slots[i].err == -ECANCELED;
	}
	ck_assert_int_ge(cancelled, 1);
	ck_assert_ptr_null(ac);
}
END_TEST

START_TEST(test_bad_arguments)
{
	struct tokenbucket_limit many[TOKENBUCKET_SET_MAX + 1];
	for (size_t i = 0; i < TOKENBUCKET_SET_MAX + 1; i++)
		many[i] = two[0];
	struct slot *s = &slots[0];
	ck_assert_int_eq(async_allow_all(NULL, KEY("b"), two, 2, 1, set_done, s),
			 -EINVAL);
	ck_assert_int_eq(async_allow_all(ac, KEY("b"), NULL, 2, 1, set_done, s),
			 -EINVAL);
	ck_assert_int_eq(async_allow_all(ac, KEY("b"), two, 0, 1, set_done, s),
			 -EINVAL);
	ck_assert_int_eq(async_allow_all(ac, KEY("b"), many,
							   TOKENBUCKET_SET_MAX + 1, 1, set_done, s),
			 -EINVAL);
	ck_assert_int_eq(async_allow_all(ac, KEY("b"), two, 2, 1, NULL, s), -EINVAL);
	ck_assert_int_eq(async_allow_all_at(ac, NULL, 1, two, 2, 0, 1, set_done, s),
			 -EINVAL);
	struct tokenbucket_limit bad[2] = { two[0], two[1] };
	bad[1].tokens = 1;
	bad[1].period_ns = 0;
	ck_assert_int_eq(async_allow_all(ac, KEY("b"), bad, 2, 1, set_done, s),
			 -EINVAL);
	bad[1] = two[1];
	bad[1].burst = TOKENBUCKET_BURST_MAX + 1;
	ck_assert_int_eq(async_allow_all_at(ac, KEY("b"), bad, 2, 5, 1, set_done, s),
			 -ERANGE);
	/* The blocking call agrees on each. */
	struct tokenbucket_set_result res;
	ck_assert_int_eq(tokenbucket_redis_allow_all(acli, KEY("b"), bad, 2, 1, &res), -ERANGE);
	/* Nothing was started: the loop has nothing to run, no callback came. */
	for (int i = 0; i < 3; i++)
		loop_poll();
	ck_assert_int_eq(s->calls, 0);
	/* The full set of 16 is fine. */
	start_all("b", many, TOKENBUCKET_SET_MAX, 1);
	run_until_done();
	each_once();
	ck_assert_int_eq(slots[0].err, 0);
	ck_assert(slots[0].res.allowed);
}
END_TEST

/* ---- A real cluster ----------------------------------------------------------- */

static struct cluster cl;
#define CKEYS 9
static char ckeys[CKEYS][48];
static int ckey_owner[CKEYS];
static const struct tokenbucket_limit cfixed[2] = {
	{ .tokens = 0, .period_ns = SEC, .burst = 150 },
	{ .tokens = 0, .period_ns = SEC, .burst = 100 },
};

static void cluster_setup(void)
{
	counts_reset();
	ck_assert_msg(cluster_start(&cl, 1000) == 0, "the cluster did not come up");
	/* One seed: the rest is learnt from MOVED and CLUSTER SLOTS. */
	ck_assert_int_eq(tokenbucket_redis_open_cluster(&acli, cl.seeds, 1, SEC,
							5 * SEC * multiplier()),
			 0);
	int p[CLUSTER_NODES];
	ck_assert_int_eq(cluster_primaries(&cl, p), 3);
	for (int k = 0; k < CKEYS; k++) {
		char name[16];
		snprintf(name, sizeof(name), "set%d", k);
		ckey_owner[k] = p[k % 3];
		ck_assert_ptr_nonnull(cluster_key_on(&cl, p[k % 3], name, ckeys[k], sizeof(ckeys[k])));
	}
	loop_init();
	ac = async_open(acli);
}

static void cluster_teardown(void)
{
	close_async();
	loop_fini();
	cluster_stop(&cl);
}

static void start_ckey(int i)
{
	start_all(ckeys[i % CKEYS], cfixed, 2, 1);
}

START_TEST(test_cluster_thousands_in_flight)
{
	/* 2700 at once over keys of every primary: exactly the lower burst of each key granted. */
	for (int i = 0; i < 2700; i++)
		start_ckey(i);
	run_until_done();
	each_once();
	int granted[CKEYS] = { 0 };
	for (int i = 0; i < started; i++) {
		ck_assert_msg(slots[i].err == 0, "call %d: %d", i, slots[i].err);
		granted[i % CKEYS] += slots[i].res.allowed;
		if (!slots[i].res.allowed)
			ck_assert_uint_eq(slots[i].res.index, 1);
	}
	for (int k = 0; k < CKEYS; k++) {
		ck_assert_int_eq(granted[k], 100);
		/* The blocking client on the same keys: 50 left in the first limit, none in the second. */
		struct tokenbucket_set_result res;
		ck_assert_int_eq(tokenbucket_redis_allow_all(acli, KEY(ckeys[k]), cfixed, 2, 0, &res), 0);
		ck_assert(res.allowed);
		ck_assert_uint_eq(res.index, 1);
		ck_assert_uint_eq(res.remaining, 0);
	}
	/* The script flushed on every node mid-flight: none fails. */
	int before = started;
	for (int i = 0; i < 900; i++) {
		start_all(ckeys[i % CKEYS], cfixed, 2, 0);
		if (i == 450)
			for (int n = 0; n < CLUSTER_NODES; n++)
				ck_assert_int_eq(server_cmd(&cl.node[n], "SCRIPT FLUSH"), REDIS_REPLY_STATUS);
	}
	run_until_done();
	each_once();
	for (int i = before; i < started; i++)
		ck_assert_msg(slots[i].err == 0 && slots[i].res.allowed, "call %d: %d", i, slots[i].err);
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

START_TEST(test_cluster_primary_killed)
{
	/*
	 * 900 in flight, refilled to 3000, a primary SIGKILLed after 300
	 * answers: each callback once; only its keys fail, and every other
	 * key grants exactly its lower burst.
	 */
	fault_at = 300;
	fault = kill_primary;
	for (int i = 0; i < 900; i++)
		start_ckey(i);
	while (completed < started) {
		loop_once();
		while (started < 3000 && started - completed < 900)
			start_ckey(started);
	}
	each_once();
	int granted[CKEYS] = { 0 }, failed = 0;
	for (int i = 0; i < started; i++) {
		int err = slots[i].err;
		failed += err != 0;
		ck_assert_msg(err == 0 || err == -ETIME || lost_connection(err) || err == -EAGAIN,
			      "call %d: %d", i, err);
		ck_assert_msg(err == 0 || ckey_owner[i % CKEYS] == killed, "call %d on a live primary: %d",
			      i, err);
		granted[i % CKEYS] += err == 0 && slots[i].res.allowed;
	}
	ck_assert_int_ge(failed, 1);
	/*
	 * The dead primary's keys may grant again on its promoted replica what
	 * was not replicated yet (docs/redis.md, "What each fault can and
	 * cannot do"); the others are exact.
	 */
	for (int k = 0; k < CKEYS; k++)
		if (ckey_owner[k] != killed)
			ck_assert_int_eq(granted[k], 100);
}
END_TEST

Suite *redis_async_all_suite(const char *name, bool libuv, bool cluster)
{
	const TTest *const one_server[] = {
		test_same_as_blocking, test_values_refused, test_thousands_in_flight,
		test_script_flushed_in_flight, test_killed_mid_flight, test_stopped_times_out,
		test_fallback_when_down, test_close_in_flight, test_bad_arguments, NULL
	};
	const TTest *const on_cluster[] = { test_cluster_thousands_in_flight,
					    test_cluster_primary_killed, NULL };
	Suite *s = suite_create(name);
	TCase *tc = tcase_create(name);
	/* Checked fixtures run in the order added: the loop's kind, then the server. */
	tcase_add_checked_fixture(tc, libuv ? loop_kind_libuv : loop_kind_libevent, NULL);
	tcase_add_checked_fixture(tc, cluster ? cluster_setup : setup,
				  cluster ? cluster_teardown : teardown);
	tcase_set_timeout(tc, cluster ? 120 : 60);
	const TTest *const *tests = cluster ? on_cluster : one_server;
	for (int i = 0; tests[i] != NULL; i++)
		tcase_add_test(tc, tests[i]);
	suite_add_tcase(s, tc);
	return s;
}
