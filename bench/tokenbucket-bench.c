/* SPDX-License-Identifier: MIT */
/*
 * tokenbucket-bench: what each call costs, next to the floors it is built
 * from (a clock read, one compare-and-swap), measured in one process.
 *
 * Each metric is calibrated once to a loop lasting about --ms milliseconds.
 * Then every repetition runs one such loop of every metric, round-robin, so
 * that frequency or load drift hits all metrics alike.  Multi-threaded
 * metrics start their threads behind a barrier and count the wall time from
 * the first thread's start to the last one's end, divided by the operations
 * of one thread.
 *
 * --merge reads --tsv lines of several runs (of this program or of the Go
 * peer, which shares the metric names) and prints them as one.
 */
#include <errno.h>
#include <getopt.h>
#include <pthread.h>
#include <sched.h>
#include <stdalign.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <tokenbucket.h>

/* Only for the size of the state and of its hot line, and the tables' keyed hash. */
#include "core.h"
#include "siphash.h"
#include "table.h"

#define T0 INT64_C(1000000000) /* the first "now" of the _at loops */
#define MAX_THREADS 4

/* Results are summed into this so that no call can be dropped. */
static volatile uint64_t sink;

/* With --pin, thread i runs on cpus[i % ncpus]; without, the scheduler places threads. */
static int cpus[CPU_SETSIZE];
static int ncpus;

/* The word of the compare-and-swap floors, alone on its cache line; w2 shares it. */
static struct {
	alignas(64) _Atomic uint64_t v;
	_Atomic uint64_t w2;
} word;

static int64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void die(const char *what, int err)
{
	fprintf(stderr, "tokenbucket-bench: %s: %s\n", what, strerror(err < 0 ? -err : err));
	exit(1);
}

/* ---- The loops ----------------------------------------------------------- */

/* What one timed loop works on; thread i uses tb[i & 1]. */
struct ctx {
	struct tokenbucket *tb[2];
	uint64_t ticket;
	void *map; /* a bucket placed in shared memory (1.1): unmapped, not freed */
	struct tokenbucket_table *table; /* the per-key tables (1.1) */
	uint64_t keys;                   /* warm keys in it: 0 to keys - 1 */
	struct tokenbucket_table *table2; /* a second limit on the same keys (1.2) */
};

static struct tokenbucket *bucket(double rate, uint64_t burst)
{
	struct tokenbucket *tb;
	int err = tokenbucket_create(&tb, rate, burst, 0);
	if (err)
		die("tokenbucket_create", err);
	return tb;
}

static uint64_t loop_clock(struct ctx *c, int id, uint64_t n)
{
	(void)c, (void)id;
	uint64_t sum = 0;
	for (uint64_t i = 0; i < n; i++) {
		struct timespec ts;
		clock_gettime(CLOCK_MONOTONIC, &ts);
		sum += (uint64_t)ts.tv_nsec;
	}
	return sum;
}

/* The library's take: a relaxed load seeds the CAS, which retries on failure. */
static uint64_t loop_cas(struct ctx *c, int id, uint64_t n)
{
	(void)c, (void)id;
	for (uint64_t i = 0; i < n; i++) {
		uint64_t v = atomic_load_explicit(&word.v, memory_order_relaxed);
		while (!atomic_compare_exchange_strong(&word.v, &v, v + 1))
			;
	}
	return 0;
}

/*
 * Two CASes on two words of one line: what a take writes by contract (it
 * records the time in the clock, then moves the tail), without the rest.
 */
static uint64_t loop_cas2(struct ctx *c, int id, uint64_t n)
{
	(void)c, (void)id;
	for (uint64_t i = 0; i < n; i++) {
		uint64_t v = atomic_load_explicit(&word.w2, memory_order_relaxed);
		while (!atomic_compare_exchange_strong(&word.w2, &v, v + 1))
			;
		v = atomic_load_explicit(&word.v, memory_order_relaxed);
		while (!atomic_compare_exchange_strong(&word.v, &v, v + 1))
			;
	}
	return 0;
}

static uint64_t loop_fetch_add(struct ctx *c, int id, uint64_t n)
{
	(void)c, (void)id;
	uint64_t sum = 0;
	for (uint64_t i = 0; i < n; i++)
		sum += atomic_fetch_add(&word.v, 1);
	return sum;
}

static uint64_t loop_allow(struct ctx *c, int id, uint64_t n)
{
	struct tokenbucket *tb = c->tb[id & 1];
	uint64_t sum = 0;
	for (uint64_t i = 0; i < n; i++)
		sum += tokenbucket_allow(tb, 1);
	return sum;
}

static uint64_t loop_allow_at(struct ctx *c, int id, uint64_t n)
{
	struct tokenbucket *tb = c->tb[id & 1];
	uint64_t sum = 0;
	int64_t t = T0;
	for (uint64_t i = 0; i < n; i++)
		sum += tokenbucket_allow_at(tb, t++, 1);
	return sum;
}

static uint64_t loop_grab(struct ctx *c, int id, uint64_t n)
{
	struct tokenbucket *tb = c->tb[id & 1];
	uint64_t sum = 0;
	for (uint64_t i = 0; i < n; i++)
		sum += tokenbucket_grab(tb, 1);
	return sum;
}

static uint64_t loop_deficiency(struct ctx *c, int id, uint64_t n)
{
	struct tokenbucket *tb = c->tb[id & 1];
	uint64_t sum = 0;
	for (uint64_t i = 0; i < n; i++)
		sum += tokenbucket_deficiency(tb, c->ticket);
	return sum;
}

/* Returns the tokens credited, which must be one per call. */
static uint64_t loop_replenish(struct ctx *c, int id, uint64_t n)
{
	struct tokenbucket *tb = c->tb[id & 1];
	int64_t t = T0;
	for (uint64_t i = 0; i < n; i++) {
		t += 1000;
		tokenbucket_replenish(tb, t);
	}
	return (uint64_t)tokenbucket_tokens_at(tb, t);
}

static uint64_t loop_reserve_cancel(struct ctx *c, int id, uint64_t n)
{
	struct tokenbucket *tb = c->tb[id & 1];
	struct tokenbucket_reservation r = { 0 };
	uint64_t sum = 0;
	int64_t t = T0;
	for (uint64_t i = 0; i < n; i++, t++) {
		sum += tokenbucket_reserve_at(tb, t, 1, TOKENBUCKET_NEVER, &r) == 0;
		tokenbucket_cancel_at(tb, &r, t);
	}
	return sum;
}

/* The single decision the set rows compare with: allow_at and its report. */
static uint64_t loop_allow_result_at(struct ctx *c, int id, uint64_t n)
{
	struct tokenbucket *tb = c->tb[id & 1];
	struct tokenbucket_result res;
	uint64_t sum = 0;
	int64_t t = T0;
	for (uint64_t i = 0; i < n; i++) {
		tokenbucket_allow_result_at(tb, t++, 1, &res);
		sum += res.allowed;
	}
	return sum;
}

/* 1.2: one decision on a set of k buckets, tb[0] (and tb[1]), with its report. */
static uint64_t loop_allow_all(struct ctx *c, size_t k, uint64_t n)
{
	struct tokenbucket *set[2] = { c->tb[0], c->tb[1] };
	struct tokenbucket_set_result res;
	uint64_t sum = 0;
	int64_t t = T0;
	for (uint64_t i = 0; i < n; i++) {
		tokenbucket_allow_all_at(set, k, t++, 1, &res);
		sum += res.allowed;
	}
	return sum;
}

static uint64_t loop_allow_all_1(struct ctx *c, int id, uint64_t n)
{
	(void)id;
	return loop_allow_all(c, 1, n);
}

static uint64_t loop_allow_all_2(struct ctx *c, int id, uint64_t n)
{
	(void)id;
	return loop_allow_all(c, 2, n);
}

static uint64_t loop_reserve_cancel_2(struct ctx *c, int id, uint64_t n)
{
	(void)id;
	struct tokenbucket *set[2] = { c->tb[0], c->tb[1] };
	struct tokenbucket_reservation r[2];
	uint64_t sum = 0;
	int64_t t = T0;
	for (uint64_t i = 0; i < n; i++, t++) {
		sum += tokenbucket_reserve_all_at(set, 2, t, 1, TOKENBUCKET_NEVER, r) == 0;
		tokenbucket_cancel_all_at(set, 2, t, r);
	}
	return sum;
}

/* ---- The buckets --------------------------------------------------------- */

/* Rate 1/s and a burst that never empties: every call takes, none claims. */
static void setup_full(struct ctx *c)
{
	c->tb[0] = c->tb[1] = bucket(1, TOKENBUCKET_BURST_MAX);
}

/* As setup_full, one bucket per thread (two allocations). */
static void setup_full_2b(struct ctx *c)
{
	c->tb[0] = bucket(1, TOKENBUCKET_BURST_MAX);
	c->tb[1] = bucket(1, TOKENBUCKET_BURST_MAX);
}

/* 1.2: a set whose second bucket is empty (rate 0): every decision is refused. */
static void setup_full_empty(struct ctx *c)
{
	c->tb[0] = bucket(1, TOKENBUCKET_BURST_MAX);
	c->tb[1] = bucket(0, 1);
	if (!tokenbucket_allow_at(c->tb[1], T0 - 1, 1))
		die("draining a bucket", EPROTO);
}

/* A token every ns: every call with "now" 1 ns later claims one. */
static void setup_claim(struct ctx *c)
{
	int err = tokenbucket_create_every(&c->tb[0], 1, 1, 1000, 0);
	if (err)
		die("tokenbucket_create_every", err);
	c->tb[1] = c->tb[0];
}

/* A byte rate through the clock: 1e15 per second, so every call finds new tokens. */
static void setup_fast(struct ctx *c)
{
	c->tb[0] = c->tb[1] = bucket(1e15, 1000);
}

/* Empty, and the next token a second away: every call is refused. */
static void setup_empty(struct ctx *c)
{
	c->tb[0] = c->tb[1] = bucket(1, 1);
	if (!tokenbucket_allow_at(c->tb[0], T0 - 1, 1))
		die("draining a bucket", EPROTO);
}

static void setup_deny(struct ctx *c)
{
	c->tb[0] = c->tb[1] = bucket(1, 1);
	if (!tokenbucket_allow(c->tb[0], 1))
		die("draining a bucket", EPROTO);
}

static void setup_ticket(struct ctx *c)
{
	setup_full(c);
	c->ticket = tokenbucket_grab(c->tb[0], 1);
}

/* A token every 1000 ns, starting empty so that every credit fits under burst. */
static void setup_replenish(struct ctx *c)
{
	c->tb[0] = c->tb[1] = bucket(1e6, TOKENBUCKET_BURST_MAX);
	int err = tokenbucket_reset_at(c->tb[0], T0, 0);
	if (err)
		die("tokenbucket_reset_at", err);
}

/* As setup_full, placed in a MAP_SHARED mapping that forked processes share (1.1). */
static void setup_placed(struct ctx *c)
{
	size_t size = tokenbucket_shared_size();
	c->map = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	if (c->map == MAP_FAILED)
		die("mmap", errno);
	int err = tokenbucket_init_shared(&c->tb[0], c->map, size, 1, TOKENBUCKET_BURST_MAX, 0);
	if (err)
		die("tokenbucket_init_shared", err);
	c->tb[1] = c->tb[0];
}

/* ---- Per-key tables (1.1) -------------------------------------------------- */

/*
 * Keys are 8-byte integers (an IPv4 address and port, a user id), hashed
 * as bytes.  The rate and burst are those of setup_full: a warm key always
 * has a token, so every call takes the path measured.
 */
static void table_with(struct ctx *c, uint64_t tokens, int64_t period, uint64_t burst,
		       uint64_t capacity, uint64_t keys)
{
	/* Fail open: the rare key that finds no slot (1 in 10^6 at 0.4 keys a slot) still passes. */
	int err = tokenbucket_table_create(&c->table, tokens, period, burst, capacity,
					   TOKENBUCKET_TABLE_FAIL_OPEN);
	if (err)
		die("tokenbucket_table_create", err);
	c->keys = keys;
	for (uint64_t k = 0; k < keys; k++)
		tokenbucket_table_allow_at(c->table, T0, &k, sizeof(k), 1);
}

static void setup_table_1(struct ctx *c)
{
	table_with(c, 1, 1, TOKENBUCKET_TABLE_BURST_MAX, 64, 1);
}

static void setup_table_1k(struct ctx *c)
{
	table_with(c, 1, 1, TOKENBUCKET_TABLE_BURST_MAX, 2048, 1000);
}

static void setup_table_1m(struct ctx *c)
{
	table_with(c, 1, 1, TOKENBUCKET_TABLE_BURST_MAX, 2500000, 1000000);
}

/* Keys never seen again: each call gives a new key the slot of a full one (1 token a us, burst 1). */
static void setup_table_cold(struct ctx *c)
{
	table_with(c, 1, 1000, 1, 100000, 0);
}

static uint64_t loop_hash(struct ctx *c, int id, uint64_t n)
{
	(void)c, (void)id;
	uint64_t sum = 0;
	for (uint64_t i = 0; i < n; i++)
		sum += tb__siphash13(sum, 1, &i, sizeof(i));
	return sum;
}

/* Warm keys in turn (1 key: the same one), as allow_at's loop. */
static uint64_t loop_table_at(struct ctx *c, int id, uint64_t n)
{
	uint64_t sum = 0, k = (uint64_t)id * 7919 % (c->keys ? c->keys : 1);
	int64_t t = T0;
	for (uint64_t i = 0; i < n; i++) {
		sum += tokenbucket_table_allow_at(c->table, t++, &k, sizeof(k), 1);
		if (++k == c->keys)
			k = 0;
	}
	return sum;
}

/* 1.2: two limits per key, table and table2, both shaped as table_with makes them. */
static void two_tables(struct ctx *c, uint64_t capacity, uint64_t keys)
{
	table_with(c, 1, 1, TOKENBUCKET_TABLE_BURST_MAX, capacity, keys);
	struct tokenbucket_table *first = c->table;
	table_with(c, 1, 1, TOKENBUCKET_TABLE_BURST_MAX, capacity, keys);
	c->table2 = c->table;
	c->table = first;
}

/* One warm key in each, as table_at_1's. */
static void setup_table_2(struct ctx *c)
{
	two_tables(c, 64, 1);
}

/* 10^6 warm keys in each, as table_at_1m's: 160 MB. */
static void setup_table_2_1m(struct ctx *c)
{
	two_tables(c, 2500000, 1000000);
}

/* Warm keys in turn (1 key: the same one), with the report: a decision on one limit of a set. */
static uint64_t loop_table_result_at(struct ctx *c, int id, uint64_t n)
{
	(void)id;
	struct tokenbucket_result res;
	uint64_t sum = 0, k = 0;
	int64_t t = T0;
	for (uint64_t i = 0; i < n; i++) {
		tokenbucket_table_allow_result_at(c->table, t++, &k, sizeof(k), 1, &res);
		sum += res.allowed;
		if (++k >= c->keys)
			k = 0;
	}
	return sum;
}

static uint64_t loop_table_allow_all_2(struct ctx *c, int id, uint64_t n)
{
	(void)id;
	struct tokenbucket_table *set[2] = { c->table, c->table2 };
	struct tokenbucket_set_result res;
	uint64_t sum = 0, k = 0;
	int64_t t = T0;
	for (uint64_t i = 0; i < n; i++) {
		tokenbucket_table_allow_all_at(set, 2, t++, &k, sizeof(k), 1, &res);
		sum += res.allowed;
		if (++k >= c->keys)
			k = 0;
	}
	return sum;
}

/* Random warm keys (an xorshift), from each thread. */
static uint64_t loop_table_random(struct ctx *c, int id, uint64_t n)
{
	uint64_t sum = 0, x = 88172645463325252u + (uint64_t)id;
	int64_t t = T0;
	for (uint64_t i = 0; i < n; i++) {
		x ^= x << 13;
		x ^= x >> 7;
		x ^= x << 17;
		uint64_t k = x % c->keys;
		sum += tokenbucket_table_allow_at(c->table, t++, &k, sizeof(k), 1);
	}
	return sum;
}

static uint64_t loop_table_cold(struct ctx *c, int id, uint64_t n)
{
	uint64_t sum = 0, k = ((uint64_t)id << 48) + 1000000;
	int64_t t = T0;
	for (uint64_t i = 0; i < n; i++, k++) {
		t += 1000;
		sum += tokenbucket_table_allow_at(c->table, t, &k, sizeof(k), 1);
	}
	return sum;
}

/* ---- The metrics --------------------------------------------------------- */

enum expect {
	ANY,  /* the loop's sum means nothing */
	ALL,  /* it is the number of calls: each took its path */
	NONE, /* it is 0 */
};

struct metric {
	const char *name;
	const char *floor; /* the metric that bounds this one from below */
	int threads;       /* 0: run in the main thread */
	void (*setup)(struct ctx *c);
	uint64_t (*loop)(struct ctx *c, int id, uint64_t n); /* NULL: computed */
	enum expect expect;
	bool procs; /* threads are forked processes instead (the bucket must be placed) */

	bool on;
	bool warned;
	uint64_t n;      /* iterations per loop (per thread), from calibration */
	double *samples; /* ns per op, one per repetition (per round with --merge) */
	size_t count;
	double med, min, max;
};

#define METRIC(name_, floor_, threads_, setup_, loop_, expect_)                           \
	{ .name = name_, .floor = floor_, .threads = threads_, .setup = setup_, .loop = loop_, \
	  .expect = expect_ }

/* threads_ processes, forked, on a bucket in shared memory. */
#define METRIC_PROCS(name_, floor_, procs_, setup_, loop_, expect_)                        \
	{ .name = name_, .floor = floor_, .threads = procs_, .setup = setup_, .loop = loop_, \
	  .expect = expect_, .procs = true }

static struct metric metrics[] = {
	METRIC("clock", NULL, 0, NULL, loop_clock, ANY),
	METRIC("cas", NULL, 0, NULL, loop_cas, ANY),
	METRIC("fetch_add", NULL, 0, NULL, loop_fetch_add, ANY),
	METRIC("cas_2t", NULL, 2, NULL, loop_cas, ANY),
	METRIC("cas_4t", NULL, 4, NULL, loop_cas, ANY),
	METRIC("cas2", NULL, 0, NULL, loop_cas2, ANY),
	METRIC("cas2_2t", NULL, 2, NULL, loop_cas2, ANY),
	METRIC("clock_cas", NULL, 0, NULL, NULL, ANY),
	METRIC("allow", "clock_cas", 0, setup_full, loop_allow, ALL),
	METRIC("allow_at", "cas", 0, setup_full, loop_allow_at, ALL),
	METRIC("allow_at_claim", "cas", 0, setup_claim, loop_allow_at, ALL),
	METRIC("deny", "clock_cas", 0, setup_deny, loop_allow, NONE),
	METRIC("deny_at", "cas", 0, setup_empty, loop_allow_at, NONE),
	METRIC("grab", "cas", 0, setup_full, loop_grab, ANY),
	METRIC("deficiency", "cas", 0, setup_ticket, loop_deficiency, NONE),
	METRIC("replenish", "cas", 0, setup_replenish, loop_replenish, ALL),
	METRIC("reserve_cancel", "cas", 0, setup_full, loop_reserve_cancel, ALL),
	METRIC("allow_claim", "clock_cas", 0, setup_fast, loop_allow, ALL),
	METRIC("allow_2t", "cas_2t", 2, setup_full, loop_allow, ALL),
	METRIC("allow_4t", "cas_4t", 4, setup_full, loop_allow, ALL),
	METRIC("allow_2t_claim", "cas_2t", 2, setup_fast, loop_allow, ALL),
	METRIC("allow_4t_claim", "cas_4t", 4, setup_fast, loop_allow, ALL),
	METRIC("grab_2t", "cas_2t", 2, setup_full, loop_grab, ANY),
	METRIC("grab_4t", "cas_4t", 4, setup_full, loop_grab, ANY),
	METRIC("allow_at_2b", "allow_at", 2, setup_full_2b, loop_allow_at, ALL),
	METRIC("allow_at_shared", "cas_2t", 2, setup_full, loop_allow_at, ALL),
	/* 1.1: a bucket shared between processes against one shared between threads. */
	METRIC("allow_at_placed", "allow_at", 0, setup_placed, loop_allow_at, ALL),
	METRIC_PROCS("allow_at_2p", "allow_at_shared", 2, setup_placed, loop_allow_at, ALL),
	METRIC_PROCS("allow_2p", "allow_2t", 2, setup_placed, loop_allow, ALL),
	/* 1.1: per-key tables against a single bucket's allow_at. */
	METRIC("siphash13_8B", NULL, 0, NULL, loop_hash, ANY),
	METRIC("table_at_1", "allow_at", 0, setup_table_1, loop_table_at, ALL),
	METRIC("table_at_1k", "allow_at", 0, setup_table_1k, loop_table_at, ALL),
	METRIC("table_at_1m", "allow_at", 0, setup_table_1m, loop_table_at, ALL),
	METRIC("table_cold", "allow_at", 0, setup_table_cold, loop_table_cold, ALL),
	METRIC("table_2t_1k", "allow_at_shared", 2, setup_table_1k, loop_table_random, ALL),
	/* 1.2: several limits in one decision against a single one. */
	METRIC("allow_result_at", "cas", 0, setup_full, loop_allow_result_at, ALL),
	METRIC("allow_all_at_1", "allow_result_at", 0, setup_full, loop_allow_all_1, ALL),
	METRIC("allow_all_at_2", "allow_result_at", 0, setup_full_2b, loop_allow_all_2, ALL),
	METRIC("deny_all_at_2", "allow_result_at", 0, setup_full_empty, loop_allow_all_2, NONE),
	METRIC("reserve_cancel_2", "reserve_cancel", 0, setup_full_2b, loop_reserve_cancel_2, ALL),
	/* 1.2: two limits per key (two tables) against one. */
	METRIC("table_result_at_1", "table_at_1", 0, setup_table_1, loop_table_result_at, ALL),
	METRIC("table_allow_all_at_2", "table_result_at_1", 0, setup_table_2, loop_table_allow_all_2, ALL),
	METRIC("table_result_at_1m", "table_at_1m", 0, setup_table_1m, loop_table_result_at, ALL),
	METRIC("table_allow_all_at_2_1m", "table_result_at_1m", 0, setup_table_2_1m, loop_table_allow_all_2, ALL),
};
#define NMETRICS (sizeof(metrics) / sizeof(metrics[0]))

static struct metric *find(const char *name)
{
	for (size_t i = 0; i < NMETRICS; i++)
		if (strcmp(metrics[i].name, name) == 0)
			return &metrics[i];
	return NULL;
}

/* ---- Timing -------------------------------------------------------------- */

/* Aligned so that the start and end stamps of two threads never share a line. */
struct worker {
	alignas(64) pthread_t thread;
	struct metric *m;
	struct ctx *c;
	pthread_barrier_t *barrier;
	int id;
	uint64_t n, sum;
	int64_t start, end;
};

static void *work(void *arg)
{
	struct worker *w = arg;
	if (ncpus) {
		cpu_set_t set;
		CPU_ZERO(&set);
		CPU_SET(cpus[w->id % ncpus], &set);
		int err = pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
		if (err)
			die("pthread_setaffinity_np", err);
	}
	pthread_barrier_wait(w->barrier);
	w->start = now_ns();
	w->sum = w->m->loop(w->c, w->id, w->n);
	w->end = now_ns();
	return NULL;
}

/*
 * The loop of m in m->threads forked processes behind a barrier in shared
 * memory, as the threads of work() run; returns the sum, and the first
 * start and last end.
 */
static uint64_t run_procs(struct metric *m, struct ctx *c, uint64_t n, int64_t *start,
			  int64_t *end)
{
	struct procs {
		atomic_int ready;
		struct {
			alignas(64) int64_t start, end;
			uint64_t sum;
		} p[MAX_THREADS];
	} *sh = mmap(NULL, sizeof(*sh), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	if (sh == MAP_FAILED)
		die("mmap", errno);
	pid_t pid[MAX_THREADS];
	for (int i = 0; i < m->threads; i++) {
		pid[i] = fork();
		if (pid[i] < 0)
			die("fork", errno);
		if (pid[i] == 0) {
			if (ncpus) {
				cpu_set_t set;
				CPU_ZERO(&set);
				CPU_SET(cpus[i % ncpus], &set);
				sched_setaffinity(0, sizeof(set), &set);
			}
			atomic_fetch_add(&sh->ready, 1);
			while (atomic_load(&sh->ready) < m->threads)
				;
			sh->p[i].start = now_ns();
			sh->p[i].sum = m->loop(c, i, n);
			sh->p[i].end = now_ns();
			_exit(0);
		}
	}
	uint64_t sum = 0;
	*start = INT64_MAX;
	*end = INT64_MIN;
	for (int i = 0; i < m->threads; i++) {
		int status;
		if (waitpid(pid[i], &status, 0) != pid[i] || !WIFEXITED(status) ||
		    WEXITSTATUS(status) != 0)
			die("a benchmark process", ECHILD);
		*start = sh->p[i].start < *start ? sh->p[i].start : *start;
		*end = sh->p[i].end > *end ? sh->p[i].end : *end;
		sum += sh->p[i].sum;
	}
	munmap(sh, sizeof(*sh));
	return sum;
}

/* One timed loop of n iterations (in each thread) on fresh state; its wall time in ns. */
static double run(struct metric *m, uint64_t n)
{
	struct ctx c = { { NULL, NULL }, 0, NULL, NULL, 0, NULL };
	if (m->setup)
		m->setup(&c);
	int64_t start, end;
	uint64_t sum = 0;
	if (m->threads == 0) {
		start = now_ns();
		sum = m->loop(&c, 0, n);
		end = now_ns();
	} else if (m->procs) {
		sum = run_procs(m, &c, n, &start, &end);
	} else {
		struct worker w[MAX_THREADS];
		pthread_barrier_t barrier;
		int err = pthread_barrier_init(&barrier, NULL, (unsigned)m->threads);
		if (err)
			die("pthread_barrier_init", err);
		for (int i = 0; i < m->threads; i++) {
			w[i] = (struct worker){ .m = m, .c = &c, .barrier = &barrier, .id = i, .n = n };
			err = pthread_create(&w[i].thread, NULL, work, &w[i]);
			if (err)
				die("pthread_create", err);
		}
		start = INT64_MAX;
		end = INT64_MIN;
		for (int i = 0; i < m->threads; i++) {
			pthread_join(w[i].thread, NULL);
			start = w[i].start < start ? w[i].start : start;
			end = w[i].end > end ? w[i].end : end;
			sum += w[i].sum;
		}
		pthread_barrier_destroy(&barrier);
	}
	uint64_t calls = n * (uint64_t)(m->threads ? m->threads : 1);
	if (!m->warned && ((m->expect == ALL && sum != calls) || (m->expect == NONE && sum != 0))) {
		fprintf(stderr, "tokenbucket-bench: warning: %s: %llu of %llu calls did not take "
			"the path measured\n", m->name,
			(unsigned long long)(m->expect == ALL ? calls - sum : sum),
			(unsigned long long)calls);
		m->warned = true;
	}
	sink += sum;
	if (c.table) {
		tokenbucket_table_free(c.table);
		tokenbucket_table_free(c.table2);
		return (double)(end - start);
	}
	if (c.map) {
		munmap(c.map, tokenbucket_shared_size());
		return (double)(end - start);
	}
	if (c.tb[1] != c.tb[0])
		tokenbucket_free(c.tb[1]);
	tokenbucket_free(c.tb[0]);
	return (double)(end - start);
}

/* Iterations for a loop of target_ns; the first loops double as warm-up. */
static uint64_t calibrate(struct metric *m, double target_ns)
{
	uint64_t n = 256;
	for (;;) {
		double t = run(m, n);
		if (t >= target_ns / 4 || n >= UINT64_C(1) << 40) {
			double scaled = (double)n * target_ns / (t > 0 ? t : 1);
			return scaled < 1 ? 1 : (uint64_t)scaled;
		}
		n *= t < target_ns / 64 ? 16 : 4;
	}
}

/* ---- Statistics and output ----------------------------------------------- */

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return (x > y) - (x < y);
}

static double median(double *v, size_t n)
{
	qsort(v, n, sizeof(*v), cmp_double);
	return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

static void add_sample(struct metric *m, double v)
{
	double *s = realloc(m->samples, (m->count + 1) * sizeof(*s));
	if (s == NULL)
		die("realloc", ENOMEM);
	m->samples = s;
	m->samples[m->count++] = v;
}

/* clock_cas is a sum of two medians, not a measurement: it is what allow can hope for. */
static void compute_clock_cas(void)
{
	struct metric *cc = find("clock_cas"), *clk = find("clock"), *cas = find("cas");
	cc->count = 0;
	if (!clk->count || !cas->count)
		return;
	cc->count = 1;
	cc->med = clk->med + cas->med;
	cc->min = clk->min + cas->min;
	cc->max = clk->max + cas->max;
}

static const struct metric *floor_of(const struct metric *m)
{
	const struct metric *f = m->floor ? find(m->floor) : NULL;
	return f && f->count ? f : NULL;
}

static void print_ratio(const char *a, const char *b, const char *why)
{
	const struct metric *x = find(a), *y = find(b);
	if (x->count && y->count)
		printf("  %s / %s = %.2f  (%s)\n", a, b, x->med / y->med, why);
}

static void print_bucket(void)
{
	printf("bucket: sizeof(struct tokenbucket) = %zu bytes; hot part: offset 0, %zu bytes "
	       "(the fields before gen)", sizeof(struct tokenbucket),
	       offsetof(struct tokenbucket, gen));
#if defined(__GLIBC__)
	struct tokenbucket *tb = bucket(1, 1);
	printf("; malloc_usable_size = %zu", malloc_usable_size(tb));
	tokenbucket_free(tb);
#endif
	printf("\n");
}

static void print_keys(void)
{
	printf("table: %zu bytes per slot (buckets of %d slots, two choices); "
	       "tokenbucket_table_size(2000000) = %zu bytes: %.1f bytes per key for 10^6 keys\n",
	       sizeof(struct tbt_slot), TBT_BUCKET_SLOTS, tokenbucket_table_size(2000000),
	       (double)tokenbucket_table_size(2000000) / 1e6);
}

static void print_table(const char *what)
{
	printf("libtokenbucket %s, %s\n", tokenbucket_version_string(), what);
	printf("ns per operation; spread = (max - min) / median; ratio = median / floor's median\n\n");
	printf("%-16s| %10s | %9s | %9s | %7s | %-10s| %6s\n", "metric", "median ns", "min", "max",
	       "spread", "floor", "ratio");
	printf("----------------+------------+-----------+-----------+---------+-----------+-------\n");
	for (size_t i = 0; i < NMETRICS; i++) {
		const struct metric *m = &metrics[i];
		if (!m->count)
			continue;
		printf("%-16s| %10.2f | %9.2f | %9.2f | %6.1f%% |", m->name, m->med, m->min, m->max,
		       100 * (m->max - m->min) / m->med);
		const struct metric *f = floor_of(m);
		if (f)
			printf(" %-10s| %6.2f\n", f->name, m->med / f->med);
		else
			printf(" %-10s| %6s\n", m->loop ? "" : "(sum)", "");
	}
	printf("\n");
	print_ratio("deny", "allow", "a refusal should cost no more than a take");
	print_ratio("deny_at", "allow_at", "the same without the clock");
	print_ratio("allow_at", "cas2", "a take writes two words: the clock, then the tail");
	print_ratio("allow_2t", "cas2_2t", "the same two writes from two threads");
	print_ratio("allow_at_2b", "allow_at", "about 1: no false sharing between buckets");
	print_ratio("allow_at_shared", "allow_at_2b", "the cost of sharing one bucket");
	print_ratio("allow_at_placed", "allow_at", "a bucket in shared memory alone: goal 1");
	print_ratio("allow_at_2p", "allow_at_shared", "2 processes vs 2 threads on one bucket: goal 1 +- 10%");
	print_ratio("allow_2p", "allow_2t", "the same through the clock: goal 1 +- 10%");
	print_ratio("table_at_1", "allow_at", "a warm key of a table: goal <= 3");
	print_ratio("table_at_1k", "allow_at", "10^3 warm keys in turn: goal <= 3");
	print_ratio("table_at_1m", "allow_at", "10^6 warm keys in turn, 64 MB: memory-bound");
	print_ratio("table_cold", "allow_at", "a new key each call, reusing full slots");
	print_ratio("table_2t_1k", "allow_at_shared", "2 threads on random keys vs 2 on one bucket");
	print_ratio("table_at_1", "siphash13_8B", "the hash's share of a warm call");
	print_ratio("allow_all_at_2", "allow_result_at", "a two-limit decision vs a single one: goal <= 2");
	print_ratio("allow_all_at_1", "allow_result_at", "a set of one: what the set costs beyond its bucket");
	print_ratio("deny_all_at_2", "allow_result_at", "two limits, the second refusing ahead: goal <= 2");
	print_ratio("reserve_cancel_2", "reserve_cancel", "reserve and cancel on two limits vs one: goal <= 2");
	print_ratio("table_allow_all_at_2", "table_at_1", "two limits per key vs a warm key's allow, no report");
	print_ratio("table_allow_all_at_2", "table_result_at_1", "two limits per key vs one, both with the report: goal <= 2");
	print_ratio("table_allow_all_at_2_1m", "table_result_at_1m", "the same over 10^6 keys in turn, missing the caches: goal <= 2");
	print_bucket();
	print_keys();
}

static void print_tsv(void)
{
	for (size_t i = 0; i < NMETRICS; i++) {
		const struct metric *m = &metrics[i];
		if (m->count)
			printf("%s\t%.3f\t%.3f\t%.3f\n", m->name, m->med, m->min, m->max);
	}
}

/* Rounds of --tsv lines on stdin: median of the medians, min of the mins, max of the maxes. */
static int merge(const char *filter)
{
	char line[256];
	size_t rounds = 0;
	while (fgets(line, sizeof(line), stdin)) {
		char name[64];
		double med, min, max;
		if (line[0] == '#' || sscanf(line, "%63s %lf %lf %lf", name, &med, &min, &max) != 4)
			continue;
		struct metric *m = find(name);
		if (m == NULL) {
			fprintf(stderr, "tokenbucket-bench: unknown metric %s\n", name);
			continue;
		}
		if (!m->loop || (filter && !strstr(name, filter)))
			continue;
		m->min = m->count == 0 || min < m->min ? min : m->min;
		m->max = m->count == 0 || max > m->max ? max : m->max;
		add_sample(m, med);
		rounds = m->count > rounds ? m->count : rounds;
	}
	for (size_t i = 0; i < NMETRICS; i++)
		if (metrics[i].count)
			metrics[i].med = median(metrics[i].samples, metrics[i].count);
	return (int)rounds;
}

static void pin_threads(void)
{
	cpu_set_t set;
	if (sched_getaffinity(0, sizeof(set), &set))
		die("sched_getaffinity", errno);
	for (int cpu = 0; cpu < CPU_SETSIZE; cpu++)
		if (CPU_ISSET(cpu, &set))
			cpus[ncpus++] = cpu;
}

static void usage(FILE *f)
{
	fprintf(f, "usage: tokenbucket-bench [-r N] [--ms MS] [--filter SUBSTR] [--tsv] [--pin]\n"
		   "       tokenbucket-bench --merge [--tsv] < runs.tsv\n"
		   "       tokenbucket-bench --calls N --filter METRIC\n"
		   "  -r N             repetitions per metric (default 11)\n"
		   "  --ms MS          length of one repetition in milliseconds (default 20)\n"
		   "  --filter SUBSTR  only the metrics whose name contains SUBSTR\n"
		   "  --tsv            print metric<TAB>median<TAB>min<TAB>max lines\n"
		   "  --pin            pin thread i of a multi-threaded metric to the i-th CPU allowed\n"
		   "  --merge          read --tsv lines of several runs on stdin and print them as one\n"
		   "  --calls N        run the metric --filter names (exactly, one thread) N times,\n"
		   "                   untimed: for counting its instructions (bench/instructions)\n");
}

int main(int argc, char **argv)
{
	static const struct option options[] = {
		{ "ms", required_argument, NULL, 'm' },
		{ "filter", required_argument, NULL, 'f' },
		{ "tsv", no_argument, NULL, 't' },
		{ "merge", no_argument, NULL, 'M' },
		{ "pin", no_argument, NULL, 'p' },
		{ "calls", required_argument, NULL, 'c' },
		{ "help", no_argument, NULL, 'h' },
		{ NULL, 0, NULL, 0 },
	};
	long reps = 11;
	double ms = 20;
	const char *filter = NULL;
	bool tsv = false, merging = false;
	unsigned long long calls = 0;
	int opt;
	while ((opt = getopt_long(argc, argv, "r:h", options, NULL)) != -1) {
		char *end;
		switch (opt) {
		case 'r':
			reps = strtol(optarg, &end, 10);
			if (*end || reps < 1 || reps > 100000) {
				fprintf(stderr, "tokenbucket-bench: -r wants a count from 1\n");
				return 2;
			}
			break;
		case 'm':
			ms = strtod(optarg, &end);
			if (*end || !(ms > 0 && ms < 1e6)) {
				fprintf(stderr, "tokenbucket-bench: --ms wants a positive number\n");
				return 2;
			}
			break;
		case 'f':
			filter = optarg;
			break;
		case 't':
			tsv = true;
			break;
		case 'M':
			merging = true;
			break;
		case 'p':
			pin_threads();
			break;
		case 'c':
			calls = strtoull(optarg, &end, 10);
			if (*end || *optarg == '-' || calls < 1 || calls > 1000000000) {
				fprintf(stderr, "tokenbucket-bench: --calls wants a count from 1\n");
				return 2;
			}
			break;
		case 'h':
			usage(stdout);
			return 0;
		default:
			usage(stderr);
			return 2;
		}
	}
	if (optind < argc) {
		usage(stderr);
		return 2;
	}

	if (calls) {
		/* Setup, the loop and teardown once: a counter subtracts two runs. */
		struct metric *m = filter ? find(filter) : NULL;
		if (m == NULL || m->loop == NULL || m->threads != 0) {
			fprintf(stderr, "tokenbucket-bench: --calls wants --filter naming one "
					"single-threaded metric\n");
			return 2;
		}
		run(m, calls);
		return 0;
	}
	if (merging) {
		int rounds = merge(filter);
		compute_clock_cas();
		if (tsv) {
			print_tsv();
		} else {
			char what[128];
			snprintf(what, sizeof(what), "%d round%s: median of the round medians, "
				 "min and max over all repetitions", rounds, rounds == 1 ? "" : "s");
			print_table(what);
		}
		return 0;
	}

	size_t on = 0;
	for (size_t i = 0; i < NMETRICS; i++) {
		struct metric *m = &metrics[i];
		m->on = m->loop && (!filter || strstr(m->name, filter));
		on += m->on;
	}
	if (!on) {
		fprintf(stderr, "tokenbucket-bench: no metric matches \"%s\"\n", filter);
		return 2;
	}
	for (size_t i = 0; i < NMETRICS; i++)
		if (metrics[i].on)
			metrics[i].n = calibrate(&metrics[i], ms * 1e6);
	/* Round-robin: repetition r of every metric before repetition r + 1 of any. */
	for (long r = 0; r < reps; r++)
		for (size_t i = 0; i < NMETRICS; i++)
			if (metrics[i].on)
				add_sample(&metrics[i], run(&metrics[i], metrics[i].n) /
								(double)metrics[i].n);
	for (size_t i = 0; i < NMETRICS; i++) {
		struct metric *m = &metrics[i];
		if (!m->count)
			continue;
		m->min = m->max = m->samples[0];
		for (size_t k = 1; k < m->count; k++) {
			m->min = m->samples[k] < m->min ? m->samples[k] : m->min;
			m->max = m->samples[k] > m->max ? m->samples[k] : m->max;
		}
		m->med = median(m->samples, m->count);
	}
	compute_clock_cas();
	if (tsv) {
		print_tsv();
	} else {
		char what[128];
		snprintf(what, sizeof(what), "%ld repetitions of ~%g ms per metric, interleaved",
			 reps, ms);
		print_table(what);
	}
	return 0;
}
