/* SPDX-License-Identifier: MIT */
/*
 * usage: tb-lease-probe URL OUTDIR steady PROCS THREADS SECONDS RATE BURST WINDOW_MS
 *        tb-lease-probe URL OUTDIR partition PACE_US SECONDS RATE BURST WINDOW_MS
 *                       DOWN_AT_S DOWN_FOR_S
 *        tb-lease-probe URL OUTDIR rush PROCS THREADS RUSH_MS HOLD_S RATE BURST WINDOW_MS
 *
 * Leases on one key of the server at URL (normally through tb-delay, from
 * a network namespace of tests/net/netns.sh), public API only.
 *
 * steady: PROCS processes, THREADS threads each, call
 * tokenbucket_redis_lease_allow(1) as fast as they are granted (backing off
 * after refusals, as the redis-lease fleet does) for SECONDS on a lease of
 * share 1/PROCS (at most 1) and window WINDOW_MS.
 *
 * partition: one process, two threads, each calling every PACE_US; at
 * DOWN_AT_S it runs "ip link set dev $TB_NETNS_LINK down", and
 * DOWN_FOR_S later "... up".  20 ms after the link went down (time for a
 * reply already received to land) it notes the tokens the lease holds
 * (held), and counts the grants of the calls begun after that and decided
 * before the link is up again (partition_grants): with no way to the
 * server, the lease can grant only what it held.
 *
 * rush: hold, then rush (the pattern that a lease keeping its tokens
 * while the shared bucket refills would exceed the bound with): PROCS
 * processes of THREADS threads, each process 10 calls a second for HOLD_S,
 * then each as fast as it is granted for RUSH_MS.
 *
 * Every grant's span goes to OUTDIR/grants.P.T, one per line: the
 * CLOCK_REALTIME ns (the clock of the server's TIME) read before and after
 * the call; the grant, and the server's take of its token, came no later
 * than the second.  The files fit tb-interval-check --spans.
 *
 * Prints one line of "name value" pairs: first_ns (before the first lease_open, all of which wait for
 * start: before the key's first call), start_ns, end_ns, decisions,
 * grants, late_grants (the second half's), errors, allow_ns (a
 * lease_allow's mean wall time, one clock read included), max_allow_ns
 * (the longest), and for partition held, partition_grants, down_ns, up_ns.
 * Exits 1 on a failure to run, 2 on bad arguments.
 */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <tokenbucket-redis.h>

#define SEC 1000000000LL
#define MAX_THREADS 16

struct result {
	int64_t first_ns, start_ns, end_ns;
	long decisions, grants, late_grants, errors;
	int64_t allow_ns, max_allow_ns;
	long held, partition_grants;
	int64_t down_ns, up_ns;
};

/*
 * The partition's count: grants of calls that began (t1) after the held
 * tokens were read (from), decided before the link came up (until, stored
 * before "up" runs; a call that read INT64_MAX there ended before that).
 */
struct window {
	_Atomic int64_t from, until;
	atomic_long grants;
};

struct thread {
	pthread_t th;
	struct tokenbucket_redis_lease *l;
	int64_t start, until, pace_ns, rush_at, offset_ns;
	struct window *w;
	int64_t *log;
	size_t nlog, caplog;
	long decisions, late, errors;
	int64_t allow_ns, max_allow_ns;
	int failed;
};

static int64_t clock_ns(clockid_t id)
{
	struct timespec ts;
	clock_gettime(id, &ts);
	return (int64_t)ts.tv_sec * SEC + ts.tv_nsec;
}

static void sleep_until(int64_t t)
{
	struct timespec ts = { .tv_sec = t / SEC, .tv_nsec = t % SEC };
	while (clock_nanosleep(CLOCK_REALTIME, TIMER_ABSTIME, &ts, NULL) == EINTR)
		;
}

static void *work(void *arg)
{
	struct thread *t = arg;
	int refused = 0;
	int64_t next = t->start + t->offset_ns;
	for (;;) {
		if (t->pace_ns > 0 && next < t->rush_at) {
			next += t->pace_ns;
			sleep_until(next < t->rush_at ? next : t->rush_at);
		}
		int64_t now = clock_ns(CLOCK_REALTIME);
		if (now >= t->until)
			break;
		struct tokenbucket_result res;
		int err = tokenbucket_redis_lease_allow(t->l, 1, &res);
		int64_t after = clock_ns(CLOCK_REALTIME), took = after - now;
		t->allow_ns += took;
		if (took > t->max_allow_ns)
			t->max_allow_ns = took;
		t->decisions++;
		if (err != 0) {
			t->errors++;
			continue;
		}
		if (!res.allowed) {
			/* As the redis-lease fleet: yield, then sleep after a run of refusals. */
			if (t->pace_ns == 0 || next >= t->rush_at) {
				if (++refused < 64) {
					sched_yield();
				} else {
					int64_t ns = res.retry_after_ns;
					ns = ns < 50000 ? 50000 : ns > 1000000 ? 1000000 : ns;
					sleep_until(clock_ns(CLOCK_REALTIME) + ns);
				}
			}
			continue;
		}
		refused = 0;
		if (now >= atomic_load(&t->w->from) && after <= atomic_load(&t->w->until))
			atomic_fetch_add(&t->w->grants, 1);
		t->late += now >= t->start + (t->until - t->start) / 2;
		if (t->nlog == t->caplog) {
			t->caplog = t->caplog ? 2 * t->caplog : 131072;
			int64_t *p = realloc(t->log, t->caplog * sizeof(*p));
			if (p == NULL) {
				t->failed = 1;
				break;
			}
			t->log = p;
		}
		/* The grant, and the server's take before it, are no later than after. */
		t->log[t->nlog++] = now;
		t->log[t->nlog++] = after;
	}
	return NULL;
}

static int link_set(const char *state)
{
	const char *dev = getenv("TB_NETNS_LINK");
	if (dev == NULL || strspn(dev, "abcdefghijklmnopqrstuvwxyz0123456789-_") != strlen(dev))
		return -1;
	char cmd[128];
	snprintf(cmd, sizeof(cmd), "ip link set dev %s %s", dev, state);
	return system(cmd) == 0 ? 0 : -1;
}

struct plan {
	const char *url, *outdir;
	int procs, threads;
	int64_t start, run_ns, pace_ns, rush_ns; /* rush: the last rush_ns unpaced */
	struct tokenbucket_limit lim;
	double share;
	int64_t window_ns;
	int64_t down_at, down_for; /* partition: from start; 0: none */
};

static int one(const struct plan *p, int proc, struct result *out)
{
	struct tokenbucket_redis *r;
	struct tokenbucket_redis_lease *l;
	if (tokenbucket_redis_open(&r, p->url, SEC, SEC) != 0)
		return 1;
	/* The leases open together at start: no lease takes tokens before it. */
	sleep_until(p->start);
	out->first_ns = clock_ns(CLOCK_REALTIME);
	if (tokenbucket_redis_lease_open(&l, r, "probe", 5, &p->lim, p->share, p->window_ns) != 0)
		return 1;
	struct window w = { .from = INT64_MAX, .until = INT64_MAX };
	struct thread th[MAX_THREADS];
	memset(th, 0, sizeof(th));
	for (int i = 0; i < p->threads; i++) {
		th[i].l = l;
		th[i].start = p->start;
		th[i].until = p->start + p->run_ns;
		th[i].pace_ns = p->pace_ns;
		th[i].rush_at = p->rush_ns > 0 ? p->start + p->run_ns - p->rush_ns : INT64_MAX;
		/* the threads' paced calls in turn, not at once */
		th[i].offset_ns = p->rush_ns > 0 ? p->pace_ns / p->threads * i : 0;
		th[i].w = &w;
	}
	for (int i = 0; i < p->threads; i++)
		if (pthread_create(&th[i].th, NULL, work, &th[i]) != 0)
			return 1;
	int status = 0;
	if (p->down_at > 0) {
		sleep_until(p->start + p->down_at);
		out->down_ns = clock_ns(CLOCK_REALTIME);
		if (link_set("down") != 0)
			status = 1;
		sleep_until(out->down_ns + 20000000);
		uint64_t held = 0;
		tokenbucket_redis_lease_tokens(l, &held);
		atomic_store(&w.from, clock_ns(CLOCK_REALTIME));
		sleep_until(out->down_ns + p->down_for);
		out->up_ns = clock_ns(CLOCK_REALTIME);
		atomic_store(&w.until, out->up_ns);
		out->held = (long)held;
		if (link_set("up") != 0)
			status = 1;
		out->partition_grants = atomic_load(&w.grants);
	}
	out->start_ns = p->start;
	out->end_ns = p->start + p->run_ns;
	for (int i = 0; i < p->threads; i++) {
		pthread_join(th[i].th, NULL);
		status |= th[i].failed;
		out->decisions += th[i].decisions;
		out->grants += (long)th[i].nlog / 2;
		out->late_grants += th[i].late;
		out->errors += th[i].errors;
		out->allow_ns += th[i].allow_ns;
		if (th[i].max_allow_ns > out->max_allow_ns)
			out->max_allow_ns = th[i].max_allow_ns;
		char path[512];
		snprintf(path, sizeof(path), "%s/grants.%d.%d", p->outdir, proc, i);
		FILE *f = fopen(path, "w");
		if (f == NULL)
			return 1;
		for (size_t k = 0; k < th[i].nlog; k += 2)
			fprintf(f, "%" PRId64 " %" PRId64 "\n", th[i].log[k], th[i].log[k + 1]);
		if (fclose(f) != 0)
			status = 1;
		free(th[i].log);
	}
	if (tokenbucket_redis_lease_close(l) != 0)
		status = 1;
	tokenbucket_redis_close(r);
	return status;
}

static double arg(const char *s)
{
	char *end;
	double v = strtod(s, &end);
	if (*end != '\0' || !(v > 0) || v > 1e9) {
		fprintf(stderr, "tb-lease-probe: bad number: %s\n", s);
		exit(2);
	}
	return v;
}

int main(int argc, char **argv)
{
	struct plan p = { .procs = 1, .threads = 2 };
	const char *const *a = (const char *const *)argv;
	bool steady = argc == 10 && strcmp(argv[3], "steady") == 0;
	bool partition = argc == 11 && strcmp(argv[3], "partition") == 0;
	bool rush = argc == 11 && strcmp(argv[3], "rush") == 0;
	if (rush) {
		/* hold and rush: the run is their sum, the pace 10 a second a process */
		p.procs = (int)arg(a[4]);
		p.threads = (int)arg(a[5]);
		p.rush_ns = (int64_t)(arg(a[6]) * 1e6);
		p.pace_ns = (int64_t)p.threads * (SEC / 10);
		a += 7;
	} else if (steady) {
		p.procs = (int)arg(a[4]);
		p.threads = (int)arg(a[5]);
		a += 6;
	} else if (partition) {
		p.pace_ns = (int64_t)(arg(a[4]) * 1e3);
		p.down_at = (int64_t)(arg(a[9]) * 1e9);
		p.down_for = (int64_t)(arg(a[10]) * 1e9);
		a += 5;
	}
	if ((!steady && !partition && !rush) || p.procs > 64 || p.threads > MAX_THREADS) {
		fprintf(stderr, "usage: tb-lease-probe URL OUTDIR steady PROCS THREADS SECONDS RATE BURST WINDOW_MS\n"
				"       tb-lease-probe URL OUTDIR partition PACE_US SECONDS RATE BURST WINDOW_MS "
				"DOWN_AT_S DOWN_FOR_S\n"
				"       tb-lease-probe URL OUTDIR rush PROCS THREADS RUSH_MS HOLD_S RATE BURST "
				"WINDOW_MS\n");
		return 2;
	}
	p.url = argv[1];
	p.outdir = argv[2];
	p.run_ns = (int64_t)(arg(a[0]) * 1e9) + p.rush_ns;
	p.lim = (struct tokenbucket_limit){ .tokens = (uint64_t)arg(a[1]),
						  .period_ns = SEC,
						  .burst = (uint64_t)arg(a[2]) };
	p.window_ns = (int64_t)(arg(a[3]) * 1e6);
	p.share = 1.0 / p.procs;
	if (p.down_at + p.down_for >= p.run_ns && partition) {
		fprintf(stderr, "tb-lease-probe: the partition must end within the run\n");
		return 2;
	}
	int fds[2];
	if (pipe(fds) != 0)
		return 1;
	/* Every process connects first, then all open their leases together. */
	p.start = clock_ns(CLOCK_REALTIME) + 300000000;
	for (int i = 0; i < p.procs; i++) {
		pid_t pid = fork();
		if (pid < 0)
			return 1;
		if (pid == 0) {
			close(fds[0]);
			struct result res = { 0 };
			int err = one(&p, i, &res);
			_exit(err != 0 ? 1 : write(fds[1], &res, sizeof(res)) == sizeof(res) ? 0 : 1);
		}
	}
	close(fds[1]);
	struct result sum = { .first_ns = INT64_MAX };
	int status = 0;
	for (int i = 0; i < p.procs; i++) {
		int st;
		if (wait(&st) < 0 || !WIFEXITED(st) || WEXITSTATUS(st) != 0)
			status = 1;
		struct result r;
		if (read(fds[0], &r, sizeof(r)) != sizeof(r)) {
			status = 1;
			continue;
		}
		sum.first_ns = r.first_ns < sum.first_ns ? r.first_ns : sum.first_ns;
		sum.start_ns = r.start_ns;
		sum.end_ns = r.end_ns;
		sum.decisions += r.decisions;
		sum.grants += r.grants;
		sum.late_grants += r.late_grants;
		sum.errors += r.errors;
		sum.allow_ns += r.allow_ns;
		sum.max_allow_ns = r.max_allow_ns > sum.max_allow_ns ? r.max_allow_ns : sum.max_allow_ns;
		sum.held += r.held;
		sum.partition_grants += r.partition_grants;
		sum.down_ns = r.down_ns;
		sum.up_ns = r.up_ns;
	}
	if (status != 0 || sum.decisions == 0)
		return 1;
	printf("first_ns %" PRId64 " start_ns %" PRId64 " end_ns %" PRId64
	       " decisions %ld grants %ld late_grants %ld errors %ld allow_ns %.1f"
	       " max_allow_ns %" PRId64,
	       sum.first_ns, sum.start_ns, sum.end_ns, sum.decisions, sum.grants, sum.late_grants,
	       sum.errors, (double)sum.allow_ns / (double)sum.decisions, sum.max_allow_ns);
	if (partition)
		printf(" held %ld partition_grants %ld down_ns %" PRId64 " up_ns %" PRId64, sum.held,
		       sum.partition_grants, sum.down_ns, sum.up_ns);
	printf("\n");
	return 0;
}
