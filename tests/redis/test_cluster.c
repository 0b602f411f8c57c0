/* SPDX-License-Identifier: MIT */
/*
 * tokenbucket-redis-cluster-check: the client against a real Redis Cluster
 * of 3 primaries and 3 replicas that each test starts (tests/redis/cluster.c)
 * and stops by pid.  CK_RUN_SUITE picks one suite:
 *   cluster-diff         exactness over all three primaries, slots as Redis computes them
 *   cluster-reshard      a hot slot migrated while 8 threads hammer its keys
 *   cluster-failover     a manual CLUSTER FAILOVER, then a primary SIGKILLed, under load;
 *                        the other primaries' keys when one dies, per coverage setting
 *   cluster-unreachable  nodes that refuse or do not answer: the documented errors in time
 * TOKENBUCKET_CLUSTER_SECONDS scales the load phases (default 1).
 */
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check_redis.h"
#include "cluster.h"

/* Every call's whole time on the cluster client. */
#define TIMEOUT (1 * SEC)
#define THREADS 8
#define KEYS 8
#define EVENTS 200000

static struct cluster cl;
static struct tokenbucket_redis *cc;

static double multiplier(void)
{
	const char *s = getenv("CK_TIMEOUT_MULTIPLIER");
	return s != NULL && atof(s) >= 1 ? atof(s) : 1;
}

static int64_t load_ns(void)
{
	const char *s = getenv("TOKENBUCKET_CLUSTER_SECONDS");
	double v = s != NULL && atof(s) > 0 ? atof(s) : 1;
	return (int64_t)(v * (double)SEC);
}

/*
 * How far past the timeout a call may return on this machine (scheduling,
 * sanitizers, other tests on the same cores): under a whole timeout, so
 * that a call that tried once more after its timeout still fails.
 */
static int64_t late_ns(void)
{
	return (int64_t)(900 * MS * multiplier());
}

static void start(int node_timeout_ms)
{
	ck_assert_msg(cluster_start(&cl, node_timeout_ms) == 0, "the cluster did not come up");
	ck_assert_int_eq(tokenbucket_redis_open_cluster(&cc, cl.seeds, 1, SEC, TIMEOUT), 0);
	/* The same suites with every thread's calls pipelined on one connection per node. */
	if (getenv("TOKENBUCKET_REDIS_PIPELINING") != NULL)
		ck_assert_int_eq(tokenbucket_redis_configure(cc, REDIS_OPTIONS(.pipelining = 1)), 0);
}

static void setup_fast(void)
{
	/* Failover after 1 s without an answer. */
	start(1000);
}

static void setup_slow(void)
{
	/* No failover while a test pauses a node for a few seconds. */
	start(15000);
}

static void teardown(void)
{
	tokenbucket_redis_close(cc);
	cc = NULL;
	cluster_stop(&cl);
}

static void tcase(Suite *s, const char *name, void (*setup)(void), int timeout, const TTest *test)
{
	TCase *tc = tcase_create(name);
	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_set_timeout(tc, timeout);
	tcase_add_test(tc, test);
	suite_add_tcase(s, tc);
}

/* A command to node i over its unix socket; the reply (freed by the caller). */
static redisReply *on(int i, const char *fmt, ...)
{
	redisContext *c = server_admin(&cl.node[i]);
	ck_assert_ptr_nonnull(c);
	va_list ap;
	va_start(ap, fmt);
	redisReply *r = redisvCommand(c, fmt, ap);
	va_end(ap);
	redisFree(c);
	ck_assert_ptr_nonnull(r);
	return r;
}

static long long on_int(int i, const char *fmt, const char *arg)
{
	redisReply *r = on(i, fmt, arg);
	ck_assert_msg(r->type == REDIS_REPLY_INTEGER, "%s: %s", fmt, r->type == REDIS_REPLY_ERROR ? r->str : "?");
	long long v = r->integer;
	freeReplyObject(r);
	return v;
}

static void on_ok(int i, const char *fmt, const char *a, const char *b)
{
	redisReply *r = on(i, fmt, a, b);
	ck_assert_msg(r->type == REDIS_REPLY_STATUS, "%s %s %s: %s", fmt, a, b,
		      r->type == REDIS_REPLY_ERROR ? r->str : "not OK");
	freeReplyObject(r);
}

/* ---- Exactness ----------------------------------------------------------- */

static void exactness(void)
{
	int p[CLUSTER_NODES];
	ck_assert_int_eq(cluster_primaries(&cl, p), 3);
	/* The single-server suite's sequences, each on its own key: the keys fall in every slot range. */
	long count = redis_sequences(5000);
	long steps = 0;
	for (long i = 0; i < count; i++) {
		steps += redis_sequence(cc, 0x7b0c5e11u + (uint64_t)i * 0x9e3779b97f4a7c15u, 16, i);
		if (i == count / 2)
			for (int k = 0; k < 3; k++) {
				/* Each node loses its script cache: NOSCRIPT, node by node. */
				redisReply *r = on(p[k], "SCRIPT FLUSH");
				freeReplyObject(r);
			}
	}
	long long keys[3];
	for (int k = 0; k < 3; k++) {
		keys[k] = on_int(p[k], "DBSIZE", NULL);
		/* Spread by CRC16: about a third each. */
		ck_assert_msg(keys[k] > count / 10, "primary %d holds %lld keys of %ld", k, keys[k], count);
	}
	printf("cluster differential: %ld steps in %ld sequences over %lld/%lld/%lld keys, no difference\n",
	       steps, count, keys[0], keys[1], keys[2]);
	/* Several limits in one key: one slot, routed as any key. */
	long sets = count / 10, set_steps = 0;
	for (long i = 0; i < sets; i++)
		set_steps += redis_set_sequence(cc, 0x5e75e7u + (uint64_t)i * 0x9e3779b97f4a7c15u, 16, i);
	printf("cluster differential of allow_all: %ld steps in %ld sequences, no difference\n",
	       set_steps, sets);
}

static void slots_agree_with_redis(void)
{
	int p[CLUSTER_NODES];
	ck_assert_int_eq(cluster_primaries(&cl, p), 3);
	static const char *const edge[] = { "", "{}", "{", "}", "}{", "a{}b{c}", "{a}", "foo{{bar}}zap",
					    "foo{bar}{zap}", "{user}.following", "123456789" };
	char key[64];
	uint64_t rng = 42;
	for (int i = 0; i < 2000; i++) {
		const char *k = key;
		if (i < (int)(sizeof(edge) / sizeof(edge[0]))) {
			k = edge[i];
		} else {
			rng = rng * 6364136223846793005u + 1442695040888963407u;
			int len = (int)(rng >> 60);
			for (int j = 0; j < len; j++) {
				rng = rng * 6364136223846793005u + 1442695040888963407u;
				/* Mostly braces and a few letters: tags of every shape. */
				key[j] = "{}{}ab"[(rng >> 33) % 6];
			}
			key[len] = '\0';
		}
		long long want = on_int(p[0], "CLUSTER KEYSLOT %s", k);
		ck_assert_msg(tokenbucket_redis_slot(NULL, k, strlen(k)) == want, "\"%s\": %d, Redis %lld", k,
			      tokenbucket_redis_slot(NULL, k, strlen(k)), want);
	}
	/* A prefix with a tag keeps a client's keys on one node, and the calls work there. */
	ck_assert_int_eq(tokenbucket_redis_set_prefix(cc, "{tenant7}:", 10), 0);
	const struct tokenbucket_redis_limit lim = { .tokens = 10, .period_ns = SEC, .burst = 10 };
	for (int i = 0; i < 50; i++) {
		snprintf(key, sizeof(key), "user%d", i);
		ck_assert_int_eq(tokenbucket_redis_slot(cc, KEY(key)), tokenbucket_redis_slot(NULL, KEY("tenant7")));
		struct tokenbucket_result res;
		ck_assert_int_eq(tokenbucket_redis_allow(cc, KEY(key), &lim, 1, &res), 0);
		ck_assert(res.allowed);
	}
	int slot = tokenbucket_redis_slot(NULL, KEY("tenant7"));
	int owner = cluster_owner(&cl, (unsigned)slot);
	ck_assert_int_ge(owner, 0);
	snprintf(key, sizeof(key), "%d", slot);
	ck_assert_int_eq(on_int(owner, "CLUSTER COUNTKEYSINSLOT %s", key), 50);
}

/* Every call on the server's clock, on a key of each primary: the same functions as one server. */
static void every_call_on_every_primary(void)
{
	int p[CLUSTER_NODES];
	ck_assert_int_eq(cluster_primaries(&cl, p), 3);
	const struct tokenbucket_redis_limit lim = { .tokens = 1, .period_ns = 3600 * SEC, .burst = 10 };
	for (int k = 0; k < 3; k++) {
		char key[32];
		ck_assert_ptr_nonnull(cluster_key_on(&cl, p[k], "calls", key, sizeof(key)));
		ck_assert_int_eq(tokenbucket_redis_reset(cc, KEY(key), &lim, 3), 0);
		double tokens = 0;
		ck_assert_int_eq(tokenbucket_redis_tokens(cc, KEY(key), &lim, &tokens, NULL), 0);
		ck_assert(tokens >= 3 && tokens < 3.01);
		struct tokenbucket_reservation rv;
		struct tokenbucket_result res;
		ck_assert_int_eq(tokenbucket_redis_reserve(cc, KEY(key), &lim, 2, 0, &rv, &res), 0);
		/* Go's cancel gives nothing back once time_to_act (the reserve's now) has passed. */
		ck_assert_int_eq(tokenbucket_redis_cancel(cc, KEY(key), &lim, &rv), 0);
		ck_assert_uint_eq(rv.tokens, 0);
		ck_assert_int_eq(tokenbucket_redis_tokens(cc, KEY(key), &lim, &tokens, NULL), 0);
		ck_assert(tokens >= 1 && tokens < 1.01);
		ck_assert_int_eq(tokenbucket_redis_wait(cc, KEY(key), &lim, 1, tokenbucket_now() + SEC, -1), 0);
		ck_assert_int_eq(tokenbucket_redis_allow(cc, KEY(key), &lim, 1, &res), 0);
		ck_assert(!res.allowed);
		ck_assert_int_eq(tokenbucket_redis_wait(cc, KEY(key), &lim, 1, tokenbucket_now() + 10 * MS, -1),
				 -ETIMEDOUT);
		/* The bucket is on that primary. */
		ck_assert_int_eq(on_int(p[k], "EXISTS %s", key), 1);
	}
}

/* One cluster for all three: starting one costs seconds. */
START_TEST(test_exactness)
{
	every_call_on_every_primary();
	slots_agree_with_redis();
	ck_assert_int_eq(tokenbucket_redis_set_prefix(cc, NULL, 0), 0);
	exactness();
}
END_TEST

/* ---- Load: 8 threads on a few keys, every call recorded ------------------ */

struct event {
	int64_t start, end; /* tokenbucket_now() */
	int err;
	short key;
	bool granted;
	bool local; /* decided by the fallback */
};

struct load {
	const char *key[KEYS];
	struct tokenbucket_redis_limit lim[KEYS];
	int nkeys;
	bool round_robin; /* every key in turn, else one at random a call */
	atomic_bool stop;
};

struct worker {
	struct load *ld;
	pthread_t thread;
	uint64_t rng;
	struct event *ev;
	long n;
};

static void *work(void *arg)
{
	struct worker *w = arg;
	int k = 0;
	while (!atomic_load(&w->ld->stop) && w->n < EVENTS) {
		if (w->ld->round_robin) {
			k = (k + 1) % w->ld->nkeys;
		} else {
			w->rng = w->rng * 6364136223846793005u + 1442695040888963407u;
			k = (int)((w->rng >> 33) % (uint64_t)w->ld->nkeys);
		}
		struct event *e = &w->ev[w->n++];
		struct tokenbucket_result res = { 0 };
		e->key = (short)k;
		e->start = tokenbucket_now();
		e->err = tokenbucket_redis_allow(cc, KEY(w->ld->key[k]), &w->ld->lim[k], 1, &res);
		e->end = tokenbucket_now();
		e->granted = e->err == 0 && res.allowed;
		e->local = e->err == 0 && (res.flags & TOKENBUCKET_RESULT_LOCAL);
	}
	return NULL;
}

static struct worker workers[THREADS];

static void load_start(struct load *ld)
{
	atomic_store(&ld->stop, false);
	for (int i = 0; i < THREADS; i++) {
		workers[i] = (struct worker){ .ld = ld, .rng = 0x9e3779b97f4a7c15u * (uint64_t)(i + 1) };
		workers[i].ev = calloc(EVENTS, sizeof(struct event));
		ck_assert_ptr_nonnull(workers[i].ev);
		ck_assert_int_eq(pthread_create(&workers[i].thread, NULL, work, &workers[i]), 0);
	}
}

static void load_stop(struct load *ld)
{
	atomic_store(&ld->stop, true);
	for (int i = 0; i < THREADS; i++)
		pthread_join(workers[i].thread, NULL);
}

static void load_free(void)
{
	for (int i = 0; i < THREADS; i++) {
		free(workers[i].ev);
		workers[i].ev = NULL;
	}
}

static void sleep_ns(int64_t ns)
{
	nanosleep(&(struct timespec){ .tv_sec = ns / SEC, .tv_nsec = ns % SEC }, NULL);
}

struct tally {
	long calls, errors, granted[KEYS];
	int64_t first, last, longest;
	int first_err; /* the first error seen, 0 if none */
};

static struct tally tally(void)
{
	struct tally t = { .first = INT64_MAX, .last = INT64_MIN };
	for (int i = 0; i < THREADS; i++) {
		for (long j = 0; j < workers[i].n; j++) {
			const struct event *e = &workers[i].ev[j];
			t.calls++;
			if (e->err != 0 && t.first_err == 0)
				t.first_err = e->err;
			t.errors += e->err != 0;
			t.granted[e->key] += e->granted;
			t.first = e->start < t.first ? e->start : t.first;
			t.last = e->end > t.last ? e->end : t.last;
			t.longest = e->end - e->start > t.longest ? e->end - e->start : t.longest;
		}
	}
	return t;
}

/* granted <= burst + rate x elapsed for every key (elapsed: first call's start to last call's end). */
static void assert_within_limit(const struct load *ld, const struct tally *t, const long extra[KEYS])
{
	double elapsed = (double)(t->last - t->first);
	for (int k = 0; k < ld->nkeys; k++) {
		const struct tokenbucket_redis_limit *l = &ld->lim[k];
		double bound = (double)l->burst +
			       (l->tokens > 0 ? floor(elapsed * (double)l->tokens / (double)l->period_ns) : 0);
		ck_assert_msg((double)t->granted[k] <= bound + (double)extra[k],
			      "key %s: %ld granted, bound %.0f + %ld", ld->key[k], t->granted[k], bound,
			      extra[k]);
	}
}

/* ---- Resharding ---------------------------------------------------------- */

START_TEST(test_reshard_hot_slot)
{
	int p[CLUSTER_NODES];
	ck_assert_int_eq(cluster_primaries(&cl, p), 3);
	int from = p[0], to = p[1];
	char tag[32], keys[KEYS][48];
	ck_assert_ptr_nonnull(cluster_key_on(&cl, from, "hot", tag, sizeof(tag)));
	unsigned slot = (unsigned)tokenbucket_redis_slot(NULL, KEY(tag));
	struct load ld = { .nkeys = KEYS };
	for (int k = 0; k < KEYS; k++) {
		snprintf(keys[k], sizeof(keys[k]), "%s:%d", tag, k);
		ld.key[k] = keys[k];
		/* 1000 tokens a second, burst 20: 8 threads ask for far more. */
		ld.lim[k] = (struct tokenbucket_redis_limit){ .tokens = 1, .period_ns = MS, .burst = 20 };
	}
	char from_id[41], to_id[41], slotstr[8];
	ck_assert_int_eq(cluster_id(&cl, from, from_id), 0);
	ck_assert_int_eq(cluster_id(&cl, to, to_id), 0);
	snprintf(slotstr, sizeof(slotstr), "%u", slot);

	load_start(&ld);
	sleep_ns(load_ns() / 2);
	int64_t t0 = tokenbucket_now();
	/* The manual sequence redis-cli --cluster reshard runs, a key at a time and slowly,
	 * so that calls meet the slot half moved (ASK) and then moved (MOVED). */
	on_ok(to, "CLUSTER SETSLOT %s IMPORTING %s", slotstr, from_id);
	on_ok(from, "CLUSTER SETSLOT %s MIGRATING %s", slotstr, to_id);
	int moved = 0;
	for (;;) {
		redisReply *r = on(from, "CLUSTER GETKEYSINSLOT %s 1", slotstr);
		ck_assert_int_eq(r->type, REDIS_REPLY_ARRAY);
		if (r->elements == 0) {
			freeReplyObject(r);
			break;
		}
		char port[8];
		snprintf(port, sizeof(port), "%d", cl.node[to].port);
		redisReply *m = on(from, "MIGRATE 127.0.0.1 %s %s 0 5000", port, r->element[0]->str);
		ck_assert_msg(m->type == REDIS_REPLY_STATUS, "MIGRATE: %s", m->type == REDIS_REPLY_ERROR ? m->str : "?");
		freeReplyObject(m);
		freeReplyObject(r);
		moved++;
		sleep_ns(load_ns() / 20);
	}
	on_ok(to, "CLUSTER SETSLOT %s NODE %s", slotstr, to_id);
	on_ok(from, "CLUSTER SETSLOT %s NODE %s", slotstr, to_id);
	for (int k = 0; k < 3; k++)
		if (p[k] != from && p[k] != to)
			on_ok(p[k], "CLUSTER SETSLOT %s NODE %s", slotstr, to_id);
	/*
	 * Every key is on the target, checked while the load keeps the keys
	 * below burst: a full bucket's key expires (it is a new bucket), so
	 * after the load stops they may go at any time.
	 */
	for (int k = 0; k < KEYS; k++)
		ck_assert_int_eq(on_int(to, "EXISTS %s", keys[k]), 1);
	int64_t t1 = tokenbucket_now();
	sleep_ns(load_ns() / 2);
	load_stop(&ld);

	struct tally t = tally();
	long during = 0;
	for (int i = 0; i < THREADS; i++)
		for (long j = 0; j < workers[i].n; j++)
			during += workers[i].ev[j].start >= t0 && workers[i].ev[j].end <= t1;
	printf("cluster reshard: slot %u moved (%d keys) in %.0f ms under %ld calls (%ld during), "
	       "%ld errors, longest call %.1f ms\n",
	       slot, moved, (double)(t1 - t0) / 1e6, t.calls, during, t.errors, (double)t.longest / 1e6);
	ck_assert_msg(t.errors == 0, "%ld calls failed (first: %d)", t.errors, t.first_err);
	ck_assert_int_ge(moved, KEYS / 2);
	ck_assert_int_gt(during, 0);
	ck_assert_int_le(t.longest, TIMEOUT + late_ns());
	static const long none[KEYS];
	assert_within_limit(&ld, &t, none);
	ck_assert_int_eq(cluster_settle(&cl, 10 * SEC, false), 0);
	ck_assert_int_eq(cluster_owner(&cl, slot), to);
	load_free();
}
END_TEST

/* ---- Failover ------------------------------------------------------------ */

/*
 * Key 0 is limited (1000/s, burst 50); key 1 counts: rate 0 and a burst no
 * run empties, so burst - level after the run is how many takes the
 * surviving history holds, and the grants it misses are the ones the
 * failover lost.  Both keys share a tag, so one replication stream.
 */
#define COUNT_BURST UINT64_C(1000000000000)

struct failover {
	struct load ld;
	char keys[2][48];
	int primary, replica;
	int64_t kill_at, recovered_at;
};

/* Starts the load on keys that primary holds (tags from base). */
static void failover_load(struct failover *f, int primary, const char *base)
{
	f->primary = primary;
	f->replica = cluster_replica(&cl, f->primary);
	ck_assert_int_ge(f->replica, 0);
	char tag[32];
	ck_assert_ptr_nonnull(cluster_key_on(&cl, f->primary, base, tag, sizeof(tag)));
	snprintf(f->keys[0], sizeof(f->keys[0]), "%s:limited", tag);
	snprintf(f->keys[1], sizeof(f->keys[1]), "%s:count", tag);
	f->ld = (struct load){ .nkeys = 2, .round_robin = true };
	f->ld.key[0] = f->keys[0];
	f->ld.key[1] = f->keys[1];
	f->ld.lim[0] = (struct tokenbucket_redis_limit){ .tokens = 1, .period_ns = MS, .burst = 50 };
	f->ld.lim[1] = (struct tokenbucket_redis_limit){ .tokens = 0, .period_ns = SEC, .burst = COUNT_BURST };
	load_start(&f->ld);
	sleep_ns(load_ns());
}

/* Waits for the replica to be the primary everywhere, then loads on; *t the tally. */
static void failover_finish(struct failover *f, struct tally *t)
{
	/*
	 * CLUSTER FAILOVER answers before the replica takes over, and the
	 * nodes agree on the old map until it does: wait for the new owner
	 * first, then for every node to agree.
	 */
	unsigned slot = (unsigned)tokenbucket_redis_slot(NULL, KEY(f->keys[0]));
	int64_t until = tokenbucket_now() + (int64_t)(30 * SEC * multiplier());
	while (cluster_owner(&cl, slot) != f->replica && tokenbucket_now() < until)
		sleep_ns(50 * MS);
	ck_assert_msg(cluster_settle(&cl, (int64_t)(30 * SEC * multiplier()), false) == 0,
		      "the cluster did not settle after the failover");
	ck_assert_int_eq(cluster_owner(&cl, slot), f->replica);
	sleep_ns(load_ns());
	load_stop(&f->ld);
	*t = tally();
	/* The first successful call that started after the failure. */
	f->recovered_at = INT64_MAX;
	for (int i = 0; i < THREADS; i++)
		for (long j = 0; j < workers[i].n; j++) {
			const struct event *e = &workers[i].ev[j];
			if (e->err == 0 && e->start >= f->kill_at && e->end < f->recovered_at)
				f->recovered_at = e->end;
		}
	ck_assert_msg(f->recovered_at != INT64_MAX, "no call succeeded after the failover");
}

/* How many takes of the counting key the new primary holds. */
static long counted(const struct failover *f)
{
	double level = 0;
	ck_assert_int_eq(tokenbucket_redis_tokens(cc, KEY(f->keys[1]), &f->ld.lim[1], &level, NULL), 0);
	return (long)((double)COUNT_BURST - level);
}

/* SIGKILL of primary under load; the bound and the lag window. */
static void failover_sigkill(int primary)
{
	struct failover f;
	failover_load(&f, primary, "fk");
	f.kill_at = tokenbucket_now();
	ck_assert_int_eq(kill(cl.node[f.primary].pid, SIGKILL), 0);
	waitpid(cl.node[f.primary].pid, NULL, 0);
	cl.node[f.primary].pid = 0;
	struct tally t;
	failover_finish(&f, &t);

	/* Lost: counting-key grants the new primary does not hold.  Calls that failed
	 * at the kill may have been applied too, so the difference is a floor of 0. */
	long held = counted(&f);
	long lost = t.granted[1] > held ? t.granted[1] - held : 0;
	/* The lag window: from the earliest of the last `lost` counting grants before the kill. */
	int64_t window = 0;
	if (lost > 0) {
		long n = 0;
		int64_t *starts = calloc((size_t)t.granted[1] + 1, sizeof(int64_t));
		ck_assert_ptr_nonnull(starts);
		for (int i = 0; i < THREADS; i++)
			for (long j = 0; j < workers[i].n; j++) {
				const struct event *e = &workers[i].ev[j];
				if (e->key == 1 && e->granted && e->start < f.kill_at)
					starts[n++] = e->start;
			}
		/* The lost grants are the last ones the old primary made. */
		int64_t earliest = f.kill_at;
		for (long m = 0; m < lost && m < n; m++) {
			long best = -1;
			for (long q = 0; q < n; q++)
				if (starts[q] != INT64_MIN && (best < 0 || starts[q] > starts[best]))
					best = q;
			earliest = starts[best];
			starts[best] = INT64_MIN;
		}
		window = f.kill_at - earliest;
		free(starts);
	}
	/* What the limited key could have been granted in that window (its calls in flight count too). */
	long in_window = THREADS;
	for (int i = 0; i < THREADS; i++)
		for (long j = 0; j < workers[i].n; j++) {
			const struct event *e = &workers[i].ev[j];
			in_window += e->key == 0 && e->granted && e->end >= f.kill_at - window && e->start <= f.kill_at;
		}
	long failed_calls = 0;
	int64_t last_failure = 0;
	for (int i = 0; i < THREADS; i++)
		for (long j = 0; j < workers[i].n; j++)
			if (workers[i].ev[j].err != 0) {
				failed_calls++;
				last_failure = workers[i].ev[j].end > last_failure ? workers[i].ev[j].end : last_failure;
			}
	double elapsed = (double)(t.last - t.first) / 1e9;
	printf("cluster failover (SIGKILL): recovered %.0f ms after the kill, last failure at +%.0f ms, "
	       "%ld of %ld calls failed (first error %d), longest call %.1f ms; "
	       "limited key %ld granted in %.2f s (bound %.0f); lost in the replication lag: %ld "
	       "counting grants, a window of %.3f ms\n",
	       (double)(f.recovered_at - f.kill_at) / 1e6,
	       (double)(last_failure > f.kill_at ? last_failure - f.kill_at : 0) / 1e6, failed_calls,
	       t.calls, t.first_err, (double)t.longest / 1e6, t.granted[0], elapsed,
	       50 + floor(elapsed * 1000), lost, (double)window / 1e6);
	/* Calls fail, each within the timeout, and only until the replica has taken over. */
	ck_assert_int_le(t.longest, TIMEOUT + late_ns());
	ck_assert_int_le(f.recovered_at - f.kill_at, (int64_t)(20 * SEC * multiplier()));
	/* The documented bound: burst + rate x elapsed + what the lag window granted. */
	const long extra[KEYS] = { in_window, 0 };
	assert_within_limit(&f.ld, &t, extra);
	/* The window is the replication lag, far below the node timeout. */
	ck_assert_int_le(window, SEC);
	load_free();
}

/* CLUSTER FAILOVER on primary's replica under load; the replica's index. */
static int failover_manual(int primary)
{
	struct failover f;
	failover_load(&f, primary, "fm");
	f.kill_at = tokenbucket_now();
	/* Run by the replica: the primary stops writes, the replica catches up, then takes over. */
	redisReply *r = on(f.replica, "CLUSTER FAILOVER");
	ck_assert_msg(r->type == REDIS_REPLY_STATUS, "CLUSTER FAILOVER: %s", r->type == REDIS_REPLY_ERROR ? r->str : "?");
	freeReplyObject(r);
	struct tally t;
	failover_finish(&f, &t);
	long held = counted(&f);
	printf("cluster failover (manual): %ld calls, %ld failed, longest call %.1f ms; "
	       "counting key: %ld granted, %ld held by the new primary\n",
	       t.calls, t.errors, (double)t.longest / 1e6, t.granted[1], held);
	/* Clean: no call fails, nothing is lost, the limit holds exactly. */
	ck_assert_msg(t.errors == 0, "%ld calls failed (first: %d)", t.errors, t.first_err);
	ck_assert_int_eq(held, t.granted[1]);
	static const long none[KEYS];
	assert_within_limit(&f.ld, &t, none);
	load_free();
	return f.replica;
}

/*
 * One cluster for both: the manual failover first (the old primary becomes
 * the replica, in sync), then the new primary is killed.
 */
START_TEST(test_failover)
{
	int p[CLUSTER_NODES];
	ck_assert_int_eq(cluster_primaries(&cl, p), 3);
	int promoted = failover_manual(p[0]);
	ck_assert_int_eq(cluster_settle(&cl, (int64_t)(30 * SEC * multiplier()), true), 0);
	failover_sigkill(promoted);
}
END_TEST

/* ---- A dead primary and the other primaries' keys ----------------------- */

static int cmp_i64(const void *a, const void *b)
{
	int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
	return x < y ? -1 : x > y;
}

struct coverage {
	long calls, errors, local;
	long unexpected; /* errors other than -EAGAIN (refused) and -ETIME (timed out) */
	int first_err;
	int64_t gap;     /* the longest time between two successful answers after the kill */
	int64_t longest; /* the longest call */
};

/*
 * SIGKILL of primary under load on keys of the two other primaries (four
 * each); what that did to those keys until the replica took over.
 */
static struct coverage kill_and_watch_others(int primary, const char *base)
{
	int p[CLUSTER_NODES], np = cluster_primaries(&cl, p);
	ck_assert_int_eq(np, 3);
	static char keys[KEYS][48];
	struct load ld = { .nkeys = 0, .round_robin = false };
	for (int i = 0; i < np; i++) {
		if (p[i] == primary)
			continue;
		for (int k = 0; k < KEYS / 2; k++) {
			char name[16];
			snprintf(name, sizeof(name), "%s%d", base, k);
			ck_assert_ptr_nonnull(cluster_key_on(&cl, p[i], name, keys[ld.nkeys], sizeof(keys[0])));
			ld.key[ld.nkeys] = keys[ld.nkeys];
			ld.lim[ld.nkeys] = (struct tokenbucket_redis_limit){ .tokens = 1000000, .period_ns = SEC,
									   .burst = 1000000 };
			ld.nkeys++;
		}
	}
	load_start(&ld);
	sleep_ns(load_ns() / 2);
	int64_t kill_at = tokenbucket_now();
	ck_assert_int_eq(kill(cl.node[primary].pid, SIGKILL), 0);
	waitpid(cl.node[primary].pid, NULL, 0);
	cl.node[primary].pid = 0;
	ck_assert_msg(cluster_settle(&cl, (int64_t)(30 * SEC * multiplier()), false) == 0,
		      "the cluster did not settle after the kill");
	sleep_ns(load_ns() / 2);
	load_stop(&ld);
	struct coverage c = { 0 };
	long n = 0;
	for (int i = 0; i < THREADS; i++)
		n += workers[i].n;
	int64_t *ok = calloc((size_t)n + 2, sizeof(int64_t));
	ck_assert_ptr_nonnull(ok);
	long nok = 0;
	ok[nok++] = kill_at;
	int64_t last = kill_at;
	for (int i = 0; i < THREADS; i++)
		for (long j = 0; j < workers[i].n; j++) {
			const struct event *e = &workers[i].ev[j];
			if (e->end < kill_at)
				continue;
			c.calls++;
			c.errors += e->err != 0;
			c.local += e->local;
			if (e->err != 0 && c.first_err == 0)
				c.first_err = e->err;
			c.unexpected += e->err != 0 && e->err != -EAGAIN && e->err != -ETIME;
			c.longest = e->end - e->start > c.longest ? e->end - e->start : c.longest;
			last = e->end > last ? e->end : last;
			if (e->err == 0)
				ok[nok++] = e->end;
		}
	ok[nok++] = last;
	qsort(ok, (size_t)nok, sizeof(int64_t), cmp_i64);
	for (long i = 1; i < nok; i++)
		c.gap = ok[i] - ok[i - 1] > c.gap ? ok[i] - ok[i - 1] : c.gap;
	free(ok);
	load_free();
	return c;
}

static void print_coverage(const char *setting, const struct coverage *c)
{
	printf("cluster coverage (%s): other primaries' keys after the kill: %ld calls, %ld failed "
	       "(first error %d), %ld decided locally, longest gap without an answer %.0f ms, "
	       "longest call %.1f ms\n",
	       setting, c->calls, c->errors, c->first_err, c->local, (double)c->gap / 1e6,
	       (double)c->longest / 1e6);
}

static void set_full_coverage(const char *value)
{
	for (int i = 0; i < CLUSTER_NODES; i++)
		if (cluster_alive(&cl, i))
			on_ok(i, "CONFIG SET %s %s", "cluster-require-full-coverage", value);
}

/*
 * One cluster, three kills, one a primary each: under full coverage (the
 * default) the other keys are refused while the dead primary's slots have
 * no owner; without it they are served throughout; under full coverage
 * with a fallback they are decided locally meanwhile.
 */
START_TEST(test_coverage)
{
	int p[CLUSTER_NODES];
	ck_assert_int_eq(cluster_primaries(&cl, p), 3);

	set_full_coverage("yes");
	struct coverage yes = kill_and_watch_others(p[0], "cy");
	print_coverage("require-full-coverage yes", &yes);
	/*
	 * Refused (CLUSTERDOWN, tried again until the timeout), each within it:
	 * -EAGAIN, or -ETIME when the timeout fell while a retry was on its way.
	 */
	ck_assert_msg(yes.unexpected == 0, "%ld of %ld errors neither -EAGAIN nor -ETIME (first %d)",
		      yes.unexpected, yes.errors, yes.first_err);
	ck_assert_int_le(yes.longest, TIMEOUT + late_ns());

	set_full_coverage("no");
	struct coverage no = kill_and_watch_others(p[1], "cn");
	print_coverage("require-full-coverage no", &no);
	/* Served throughout: no call on another primary's key fails. */
	ck_assert_msg(no.errors == 0, "%ld calls failed (first %d)", no.errors, no.first_err);

	set_full_coverage("yes");
	ck_assert_int_eq(tokenbucket_redis_set_fallback(cc, 0.5), 0);
	struct coverage fb = kill_and_watch_others(p[2], "cf");
	print_coverage("require-full-coverage yes, fallback 0.5", &fb);
	/* The fallback decides what the cluster refuses: no call fails. */
	ck_assert_msg(fb.errors == 0, "%ld calls failed (first %d)", fb.errors, fb.first_err);
	ck_assert_int_le(fb.longest, TIMEOUT + late_ns());
}
END_TEST

/* ---- Unreachable nodes --------------------------------------------------- */

static const struct tokenbucket_redis_limit small = { .tokens = 10, .period_ns = SEC, .burst = 10 };

/* One allow on c: its error, its time in *ns. */
static int allow_timed(struct tokenbucket_redis *c, const char *key, int64_t *ns, struct tokenbucket_result *res)
{
	int64_t t0 = tokenbucket_now();
	int err = tokenbucket_redis_allow(c, KEY(key), &small, 1, res);
	*ns = tokenbucket_now() - t0;
	return err;
}

static void nobody_listens(void)
{
	/* The cluster's nodes all stopped: refused, retried until the timeout, then said so. */
	cluster_stop(&cl);
	struct tokenbucket_result res;
	int64_t ns;
	ck_assert_int_eq(allow_timed(cc, "k", &ns, &res), -ECONNREFUSED);
	ck_assert_msg(ns >= TIMEOUT * 9 / 10 && ns <= TIMEOUT + late_ns(), "took %.1f ms", (double)ns / 1e6);
	/* The local fallback decides instead, and says so. */
	ck_assert_int_eq(tokenbucket_redis_set_fallback(cc, 0.5), 0);
	ck_assert_int_eq(allow_timed(cc, "k", &ns, &res), 0);
	ck_assert(res.allowed);
	ck_assert_uint_eq(res.flags, TOKENBUCKET_RESULT_LOCAL);
	ck_assert_uint_eq(res.limit, 5);
	ck_assert_int_le(ns, TIMEOUT + late_ns());
}

/* A paused primary first, then every node stopped: one cluster for both. */
START_TEST(test_unreachable)
{
	int p[CLUSTER_NODES];
	ck_assert_int_eq(cluster_primaries(&cl, p), 3);
	char on_paused[32], on_other[32];
	ck_assert_ptr_nonnull(cluster_key_on(&cl, p[0], "paused", on_paused, sizeof(on_paused)));
	ck_assert_ptr_nonnull(cluster_key_on(&cl, p[1], "other", on_other, sizeof(on_other)));
	struct tokenbucket_result res;
	int64_t ns;
	ck_assert_int_eq(allow_timed(cc, on_paused, &ns, &res), 0);
	ck_assert_int_eq(allow_timed(cc, on_other, &ns, &res), 0);
	ck_assert_int_eq(kill(cl.node[p[0]].pid, SIGSTOP), 0);
	/* The paused node accepts connections (the kernel does) and never answers. */
	for (int i = 0; i < 3; i++) {
		ck_assert_int_eq(allow_timed(cc, on_paused, &ns, &res), -ETIME);
		ck_assert_msg(ns <= TIMEOUT + late_ns(), "took %.1f ms", (double)ns / 1e6);
		/* The other primaries answer meanwhile, in far less than the timeout. */
		ck_assert_int_eq(allow_timed(cc, on_other, &ns, &res), 0);
		ck_assert(res.allowed);
		ck_assert_msg(ns < TIMEOUT / 2, "took %.1f ms", (double)ns / 1e6);
	}
	ck_assert_int_eq(kill(cl.node[p[0]].pid, SIGCONT), 0);
	/* Back: the first call after works (the map and the pool recover). */
	int err;
	int tries = 0;
	while ((err = allow_timed(cc, on_paused, &ns, &res)) != 0 && ++tries < 3)
		;
	ck_assert_int_eq(err, 0);
	ck_assert_int_le(tries, 1);
	nobody_listens();
}
END_TEST

static Suite *suite(const char *name)
{
	return suite_create(name);
}

int main(void)
{
	Suite *diff = suite("cluster-diff"), *reshard = suite("cluster-reshard"),
	      *failover = suite("cluster-failover"), *unreachable = suite("cluster-unreachable");
	/* Check's timeouts are scaled by CK_TIMEOUT_MULTIPLIER already. */
	tcase(diff, "exactness", setup_slow, 240, test_exactness);
	tcase(reshard, "reshard", setup_slow, 120, test_reshard_hot_slot);
	tcase(failover, "failover", setup_fast, 180, test_failover);
	tcase(failover, "coverage", setup_fast, 180, test_coverage);
	tcase(unreachable, "unreachable", setup_slow, 120, test_unreachable);
	Suite *const suites[] = { diff, reshard, failover, unreachable, NULL };
	return redis_run(suites, cluster_available(), "redis-server or redis-cli (package redis-server, redis-tools)");
}
