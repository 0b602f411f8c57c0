/* SPDX-License-Identifier: MIT */
/*
 * tbrate: paces a pipe (bytes or lines) or the runs of a command with a
 * token bucket of libtokenbucket, private, shared by name between the
 * processes of a host, or kept in Redis and shared between hosts.
 *
 * One thread.  Every blocking point (waiting for input, for tokens, for the
 * output, for a command) also watches a self-pipe that the signal handlers
 * write to, so statistics, a rate change or an exit request are served at
 * once.  Tokens are always paid before the data they stand for is written:
 * reserve, sleep until the reservation is covered, then write.
 */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <bsd/libutil.h>
#include <bsd/stdlib.h>

#include <tokenbucket.h>
#ifdef TBRATE_HAVE_REDIS
#include <tokenbucket-redis.h>
#endif

#ifdef TBRATE_HAVE_REDIS
#include "redis-join.h"
#endif
#include "units.h"

/* Exit codes, as tbrate(1) lists them. */
enum {
	EXIT_OK = 0,
	EXIT_COMMAND_FAILED = 1, /* a run of the command failed; the others still ran */
	EXIT_USAGE = 2,          /* bad option, rate, size or duration */
	EXIT_DEADLINE = 3,       /* -t passed before the input or the runs were done */
	EXIT_BUCKET = 4,         /* the shared bucket or Redis could not be used */
	EXIT_IO = 5,             /* reading, writing, or starting a command failed */
	EXIT_CLOSED = 6,         /* the output was closed (EPIPE) */
	EXIT_CANNOT_RUN = 126,   /* the command exists but could not be executed */
	EXIT_NOT_FOUND = 127,    /* the command was not found */
	EXIT_SIGNAL = 128,       /* + the signal number, for SIGINT and SIGTERM */
};

/* A chunk of bytes is at most this long and at most this long in time. */
#define CHUNK_MAX ((size_t)64 * 1024)
#define CHUNK_NS INT64_C(5000000)
/*
 * The default burst in bytes: 20 ms of the rate (at most 4 chunks), so that
 * a wake-up up to 15 ms late, on a busy machine, still finds its tokens
 * instead of losing them to a full bucket.
 */
#define BURST_NS (4 * CHUNK_NS)
/*
 * In Redis, bytes go through a lease (docs/leases.md): the default burst is
 * a quarter second of the rate, so that the lease takes a few chunks a
 * second; each chunk is at most half the burst, and the lease's window is
 * twice the burst's time, so that a contended lease takes every half burst
 * and the shared bucket drops nothing meanwhile.
 */
#define REDIS_BURST_NS INT64_C(250000000)
#define LEASE_SHARE 0.5
/* The progress line is redrawn at most this often. */
#define PROGRESS_NS INT64_C(200000000)
/* Longest line in command mode (the argument that replaces {}). */
#define LINE_MAX_BYTES ((size_t)64 * 1024)

enum mode { MODE_BYTES, MODE_LINES, MODE_COMMAND };

static const char *const unit_words[] = { "bytes", "lines", "runs" };

struct pending {
	bool active;
	struct tokenbucket_reservation r[TOKENBUCKET_SET_MAX]; /* one per bucket of the set */
};

static struct {
	enum mode mode;
	/* As asked (or read from the rate file); period_ns 0: unlimited.  Its
	 * burst is the amount written, a further rate's default. */
	struct tokenbucket_limit rate;
	uint64_t burst;                /* as asked; 0: derived from the rate */
	const char *rate_file;
	const char *shared;
	const char *redis_url;
	const char *key;
	bool progress;
	bool no_splice;
	long long max_runs;            /* command mode; 0: no limit */
	int64_t deadline;              /* absolute; TOKENBUCKET_NEVER: none */
	char **command;
	char **run_argv;               /* the words of the run in progress */

	struct tokenbucket *tb;        /* private or named: the first rate's */
	/*
	 * Every -r a private bucket, taken all or nothing (tokenbucket_reserve_all);
	 * set[0] is tb.  One rate: count 1 and the single-bucket calls.
	 */
	struct tokenbucket *set[TOKENBUCKET_SET_MAX];
	size_t count;
#ifdef TBRATE_HAVE_REDIS
	struct tokenbucket_redis *redis;
	struct tokenbucket_redis_limit lim;
	struct tokenbucket_redis_lease *lease; /* bytes: decided locally */
	uint64_t lease_cap;                    /* the most one take of it may ask */
	int64_t lease_window;
#endif
	struct pending pending;

	int sig_pipe[2];
	int64_t start;
	int64_t waited;                /* ns spent waiting for tokens */
	uint64_t total;                /* tokens passed: bytes, lines or runs */
	uint64_t failed;               /* runs that failed */
	int64_t last_draw;
	bool drawn;
} g = { .sig_pipe = { -1, -1 }, .deadline = TOKENBUCKET_NEVER };

static volatile sig_atomic_t got_usr1, got_hup, got_term;

static void on_signal(int sig)
{
	int saved = errno;
	if (sig == SIGUSR1)
		got_usr1 = 1;
	else if (sig == SIGHUP)
		got_hup = 1;
	else
		got_term = sig;
	char b = 0;
	(void)!write(g.sig_pipe[1], &b, 1); /* full pipe: a wake-up is pending anyway */
	errno = saved;
}

static void warnx_(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void warnx_(const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	if (g.drawn) {
		fputc('\n', stderr);
		g.drawn = false;
	}
	fputs("tbrate: ", stderr);
	vfprintf(stderr, fmt, ap);
	fputc('\n', stderr);
	va_end(ap);
}

/* ---- The bucket: private, named, or in Redis ------------------------------ */

static bool in_redis(void)
{
#ifdef TBRATE_HAVE_REDIS
	return g.redis != NULL;
#else
	return false;
#endif
}

/* The rate and burst in force (a named bucket may be changed by others). */
static double bucket_rate(void)
{
#ifdef TBRATE_HAVE_REDIS
	if (g.redis)
		return g.lim.tokens == 0 ? 0 : (double)g.lim.tokens * 1e9 / (double)g.lim.period_ns;
#endif
	return tokenbucket_rate(g.tb);
}

/* The smallest burst of the set: no take may ask more. */
static uint64_t bucket_burst(void)
{
#ifdef TBRATE_HAVE_REDIS
	if (g.redis)
		return g.lim.burst;
#endif
	uint64_t b = tokenbucket_burst(g.tb);
	for (size_t i = 1; i < g.count; i++) {
		uint64_t bi = tokenbucket_burst(g.set[i]);
		if (bi < b)
			b = bi;
	}
	return b;
}

/* A burst computed wide, within [1, max]. */
static uint64_t burst_within(unsigned __int128 b, uint64_t max)
{
	return b < 1 ? 1 : b > max ? max : (uint64_t)b;
}

static uint64_t default_burst(const struct tokenbucket_limit *r)
{
	if (g.mode != MODE_BYTES)
		return 1;
	if (r->period_ns == 0)
		return 4 * CHUNK_MAX;
	if (g.redis_url != NULL) {
		/* REDIS_BURST_NS of the rate, at least 1. */
		unsigned __int128 b = (unsigned __int128)r->tokens * REDIS_BURST_NS /
				      (uint64_t)r->period_ns;
		return burst_within(b, TOKENBUCKET_BURST_MAX);
	}
	/* BURST_NS worth of the rate, within [1, 4 * CHUNK_MAX]. */
	unsigned __int128 b = (unsigned __int128)r->tokens * BURST_NS / (uint64_t)r->period_ns;
	return burst_within(b, 4 * CHUNK_MAX);
}

/*
 * The default burst of a second or later -r: the amount written, which
 * tokenbucket_limit_parse leaves in burst ("1GB/h" holds 1 GB, "1000/h"
 * 1000), so that a quota lets its whole amount through in any such period
 * at the first rate's pace.
 */
static uint64_t quota_burst(const struct tokenbucket_limit *r)
{
	return r->period_ns == 0 ? default_burst(r) : r->burst;
}

/* Bytes to read for the next chunk: CHUNK_NS of the rate in force, within burst. */
static size_t chunk_size(void)
{
	double rate = bucket_rate();
	double want = isinf(rate) ? (double)CHUNK_MAX : floor(rate * (double)CHUNK_NS / 1e9);
	uint64_t c = want < 1 ? 1 : want > (double)CHUNK_MAX ? CHUNK_MAX : (uint64_t)want;
	uint64_t b = bucket_burst();
	return (size_t)(c < b ? c : b > 0 ? b : 1);
}

static void cancel_pending(void)
{
	if (!g.pending.active)
		return;
	g.pending.active = false;
	/*
	 * Nothing of a pending reservation was used: Go's cancel that is never
	 * too late gives it all back, as a refund does (docs/core.md, "Giving
	 * back"), on every bucket, local or in Redis.
	 */
	for (size_t i = 0; i < (g.count > 1 ? g.count : 1); i++)
		g.pending.r[i].time_to_act = TOKENBUCKET_NEVER;
#ifdef TBRATE_HAVE_REDIS
	if (g.lease)
		return; /* a lease's wait takes nothing unless it succeeds */
	if (g.redis) {
		(void)tokenbucket_redis_cancel(g.redis, g.key, strlen(g.key), &g.lim, &g.pending.r[0]);
		return;
	}
#endif
	if (g.count > 1)
		(void)tokenbucket_cancel_all(g.set, g.count, g.pending.r);
	else
		tokenbucket_cancel(g.tb, &g.pending.r[0]);
}

static void draw_progress(bool final);

static _Noreturn void finish(int code)
{
	cancel_pending();
	if (g.progress)
		draw_progress(true);
	if (g.drawn)
		fputc('\n', stderr);
#ifdef TBRATE_HAVE_REDIS
	(void)tokenbucket_redis_lease_close(g.lease); /* what it holds goes back */
	tokenbucket_redis_close(g.redis);
#endif
	if (g.shared)
		tokenbucket_close(g.tb);
	else
		for (size_t i = 0; i < g.count; i++)
			tokenbucket_free(g.set[i]);
	exit(code);
}

/* A parsed rate with the burst in force in place of the amount written. */
static struct tokenbucket_limit exact_limit(const struct tokenbucket_limit *r, uint64_t burst)
{
	return (struct tokenbucket_limit){ r->tokens, r->period_ns, burst };
}

#ifdef TBRATE_HAVE_REDIS
/*
 * Bytes in Redis: a lease on the key for g.lim, replacing any before (its
 * tokens go back).  A limit no lease can serve (a burst of a byte, a rate
 * that makes its burst too fast) leaves the key call by call.
 */
static void open_lease(void)
{
	if (g.lease) {
		(void)tokenbucket_redis_lease_close(g.lease);
		g.lease = NULL;
	}
	if (g.mode != MODE_BYTES || g.lim.tokens == 0)
		return;
	/* Twice the burst's time: a quarter of it makes half a burst. */
	long double w = 2.0L * (long double)g.lim.burst * (long double)g.lim.period_ns /
			(long double)g.lim.tokens;
	g.lease_window = w > 3600e9L ? INT64_C(3600000000000) : w < 1 ? 1 : (int64_t)w;
	const struct tokenbucket_limit lim = { g.lim.tokens, g.lim.period_ns, g.lim.burst };
	if (tokenbucket_redis_lease_open(&g.lease, g.redis, g.key, strlen(g.key), &lim,
					 LEASE_SHARE, g.lease_window) != 0) {
		g.lease = NULL;
		return;
	}
	/* The lease's cap, as tokenbucket_redis_lease_open(3) computes it. */
	uint64_t cap = (uint64_t)floorl((long double)LEASE_SHARE * (long double)g.lim.burst);
	long double made = (long double)g.lim.tokens * (long double)g.lease_window /
			   (long double)g.lim.period_ns;
	if (made < (long double)cap)
		cap = (uint64_t)floorl(made);
	g.lease_cap = cap;
}
#endif

static int apply_rate(const struct tokenbucket_limit *r)
{
	uint64_t burst = g.burst ? g.burst : default_burst(r);
#ifdef TBRATE_HAVE_REDIS
	if (g.redis) {
		if (r->period_ns == 0) {
			warnx_("a bucket in Redis needs a finite rate; keeping the old one");
			return -EINVAL;
		}
		g.lim = (struct tokenbucket_redis_limit){ r->tokens, r->period_ns, burst };
		open_lease();
		return 0;
	}
#endif
	struct tokenbucket_limit lim = exact_limit(r, burst);
	return tokenbucket_set_limit(g.tb, &lim);
}

static int read_rate_file(struct tokenbucket_limit *r, char err[TBRATE_ERR_SIZE])
{
	FILE *f = fopen(g.rate_file, "re");
	if (f == NULL) {
		int e = errno;
		snprintf(err, TBRATE_ERR_SIZE, "%s: %s", g.rate_file, strerror(e));
		return -e;
	}
	char line[128];
	size_t n = fread(line, 1, sizeof(line) - 1, f);
	fclose(f);
	line[n] = '\0';
	char *s = line;
	while (*s == ' ' || *s == '\t' || *s == '\n')
		s++;
	char *e = s + strlen(s);
	while (e > s && (e[-1] == ' ' || e[-1] == '\t' || e[-1] == '\n' || e[-1] == '\r'))
		*--e = '\0';
	bool bytes = false;
	int rc = tbrate_parse_rate(s, r, &bytes, err);
	if (rc == 0 && bytes && g.mode != MODE_BYTES) {
		snprintf(err, TBRATE_ERR_SIZE, "\"%.100s\": a byte unit needs the byte mode", s);
		rc = -EINVAL;
	}
	return rc;
}

static void print_stats(void)
{
	int64_t now = tokenbucket_now();
	double secs = (double)(now - g.start) / 1e9;
	char rate[64];
	double r = bucket_rate();
	if (isinf(r))
		snprintf(rate, sizeof(rate), "unlimited");
	else
		snprintf(rate, sizeof(rate), "%.6g/s", r);
	/* Every further rate, with its burst and what it holds now. */
	char more[TOKENBUCKET_SET_MAX * 64] = "";
	size_t used = 0;
	for (size_t i = 1; i < g.count && used < sizeof(more); i++)
		used += (size_t)snprintf(more + used, sizeof(more) - used,
					 "; rate %.6g/s, burst %" PRIu64 ", %.0f left",
					 tokenbucket_rate(g.set[i]), tokenbucket_burst(g.set[i]),
					 floor(tokenbucket_tokens(g.set[i])));
	warnx_("%" PRIu64 " %s in %.3f s (%.6g/s), %.3f s waiting for tokens, rate %s, "
	       "burst %" PRIu64 "%s%s",
	       g.total, unit_words[g.mode], secs, secs > 0 ? (double)g.total / secs : 0.0,
	       (double)g.waited / 1e9, rate, g.count > 1 ? tokenbucket_burst(g.tb) : bucket_burst(),
	       more, g.mode == MODE_COMMAND && g.failed ? ", some runs failed" : "");
}

static void reload_rate(void)
{
	if (g.rate_file == NULL) {
		warnx_("SIGHUP without --rate-file: nothing to re-read");
		return;
	}
	struct tokenbucket_limit r;
	char err[TBRATE_ERR_SIZE];
	if (read_rate_file(&r, err)) {
		warnx_("rate file: %s; keeping the rate", err);
		return;
	}
	int e = apply_rate(&r);
	if (e) {
		warnx_("cannot change the rate: %s", strerror(-e));
		return;
	}
	g.rate = r;
	char buf[64];
	warnx_("rate now %s", tbrate_rate_format(&r, buf, sizeof(buf)));
}

/* Serves the signals that came; returns only if none asks to exit. */
static void handle_signals(void)
{
	char drain[64];
	while (read(g.sig_pipe[0], drain, sizeof(drain)) > 0)
		;
	if (got_usr1) {
		got_usr1 = 0;
		print_stats();
	}
	if (got_hup) {
		got_hup = 0;
		reload_rate();
	}
	if (got_term)
		finish(EXIT_SIGNAL + got_term);
}

static void draw_progress(bool final)
{
	int64_t now = tokenbucket_now();
	if (!final && g.drawn && now - g.last_draw < PROGRESS_NS)
		return;
	g.last_draw = now;
	double secs = (double)(now - g.start) / 1e9;
	char total[16], speed[16];
	int64_t per_s = secs > 0 ? (int64_t)((double)g.total / secs) : 0;
	/* The lengths make humanize_number scale to 3 or 4 digits: "2.9MiB", "948KiB". */
	if (g.mode == MODE_BYTES) {
		humanize_number(total, 7, (int64_t)g.total, "B", HN_AUTOSCALE,
				HN_DECIMAL | HN_NOSPACE | HN_IEC_PREFIXES);
		humanize_number(speed, 9, per_s, "B/s", HN_AUTOSCALE,
				HN_DECIMAL | HN_NOSPACE | HN_IEC_PREFIXES);
	} else {
		humanize_number(total, 6, (int64_t)g.total, "", HN_AUTOSCALE,
				HN_DECIMAL | HN_NOSPACE | HN_DIVISOR_1000);
		humanize_number(speed, 8, per_s, "/s", HN_AUTOSCALE,
				HN_DECIMAL | HN_NOSPACE | HN_DIVISOR_1000);
	}
	fprintf(stderr, "\rtbrate: %6s%s%s  %8s  %d:%02d:%02d ", total,
		g.mode == MODE_BYTES ? "" : " ", g.mode == MODE_BYTES ? "" : unit_words[g.mode],
		speed, (int)(secs / 3600), (int)(secs / 60) % 60, (int)secs % 60);
	g.drawn = true;
}

/*
 * Sleeps until abs (tokenbucket_now()'s clock), a signal, or a redraw of the
 * progress line; the caller loops.
 */
static void nap_until(int64_t abs)
{
	int64_t now = tokenbucket_now();
	if (g.progress && g.last_draw + PROGRESS_NS < abs)
		abs = g.last_draw + PROGRESS_NS;
	if (abs <= now)
		return;
	struct pollfd p = { .fd = g.sig_pipe[0], .events = POLLIN };
	int64_t d = abs - now;
	struct timespec ts = { .tv_sec = d / 1000000000, .tv_nsec = d % 1000000000 };
	if (abs == TOKENBUCKET_NEVER)
		(void)ppoll(&p, 1, NULL, NULL);
	else
		(void)ppoll(&p, 1, &ts, NULL);
}

/* Reserves n tokens (n <= burst) into g.pending; 0, -E2BIG or exits. */
static int reserve(uint64_t n, int64_t *target)
{
	int64_t now = tokenbucket_now();
	int64_t max_wait = TOKENBUCKET_NEVER;
	if (g.deadline != TOKENBUCKET_NEVER)
		max_wait = g.deadline > now ? g.deadline - now : 0;
	int e;
#ifdef TBRATE_HAVE_REDIS
	if (g.redis) {
		struct tokenbucket_result res;
		e = tokenbucket_redis_reserve(g.redis, g.key, strlen(g.key), &g.lim, n, max_wait,
					      &g.pending.r[0], &res);
		if (e == 0)
			*target = res.retry_after_ns == TOKENBUCKET_NEVER
					  ? TOKENBUCKET_NEVER
					  : now + res.retry_after_ns;
	} else
#endif
	{
		/* A set's every reservation holds the set's time: the latest bucket's. */
		if (g.count > 1)
			e = tokenbucket_reserve_all_at(g.set, g.count, now, n, max_wait, g.pending.r);
		else
			e = tokenbucket_reserve_at(g.tb, now, n, max_wait, &g.pending.r[0]);
		if (e == 0)
			*target = g.pending.r[0].time_to_act;
	}
	if (e == 0) {
		g.pending.active = true;
		return 0;
	}
	if (e == -E2BIG)
		return e;
	if (e == -ETIMEDOUT)
		finish(EXIT_DEADLINE);
	warnx_("cannot take tokens: %s", strerror(-e));
	finish(EXIT_BUCKET);
}

#ifdef TBRATE_HAVE_REDIS
/*
 * take() through the lease: waits of at most its cap each.  The wait sleeps
 * until the lease's refills bring the tokens, so it is woken by signals
 * (the signal pipe is its cancel descriptor) and ended in slices, between
 * which a lease that cannot reach Redis ends tbrate as a failed call would.
 */
static uint64_t take_leased(uint64_t n)
{
	while (n > 0) {
		uint64_t piece = n < g.lease_cap ? n : g.lease_cap;
		handle_signals();
		if (!g.lease)
			return n; /* a reload left the key without a lease */
		/* Longer than the lease's estimate can be (piece <= cap: a window and a round trip). */
		int64_t now = tokenbucket_now();
		int64_t slice = g.lease_window + INT64_C(2000000000);
		int64_t until = g.deadline - now > slice ? now + slice : g.deadline;
		int e = tokenbucket_redis_lease_wait(g.lease, piece, until, g.sig_pipe[0]);
		if (e == 0) {
			n -= piece;
			if (g.progress)
				draw_progress(false);
			continue;
		}
		if (e == -ECANCELED)
			continue; /* a signal: served at the top */
		if (e == -ETIMEDOUT && until == g.deadline)
			finish(EXIT_DEADLINE);
		uint64_t held;
		int le = tokenbucket_redis_lease_tokens(g.lease, &held);
		if (e == -ETIMEDOUT && le == 0)
			continue;
		warnx_("cannot take tokens: %s", strerror(-(e == -ETIMEDOUT ? le : e)));
		finish(EXIT_BUCKET);
	}
	return 0;
}
#endif

/* Takes n tokens, sleeping until they are there; exits at the deadline. */
static void take(uint64_t n)
{
	int64_t t0 = tokenbucket_now();
#ifdef TBRATE_HAVE_REDIS
	if (g.lease)
		n = take_leased(n); /* what is left goes call by call */
#endif
	while (n > 0) {
		uint64_t piece = bucket_burst();
		if (piece == 0)
			piece = 1;
		if (piece > n)
			piece = n;
		int64_t target;
		handle_signals();
		if (reserve(piece, &target) == -E2BIG) {
			if (bucket_burst() < piece && bucket_burst() > 0)
				continue; /* the burst was lowered meanwhile */
			warnx_("the bucket's burst (%" PRIu64 ") cannot hold %" PRIu64 " tokens",
			       bucket_burst(), piece);
			finish(EXIT_BUCKET);
		}
		for (;;) {
			handle_signals();
			int64_t now = tokenbucket_now();
			if (now >= target) {
				if (in_redis())
					break;
				/*
				 * A rate lowered since the reservation may hold the tokens
				 * back; the head rover counts what was produced once credited.
				 */
				int64_t more = 0;
				for (size_t i = 0; i < g.count; i++) {
					tokenbucket_replenish(g.set[i], now);
					uint64_t missing =
						tokenbucket_deficiency(g.set[i], g.pending.r[i].ticket);
					int64_t d = missing ? tokenbucket_duration_for(g.set[i], missing)
							    : 0;
					if (d > more)
						more = d;
				}
				if (more == 0)
					break;
				target = more == TOKENBUCKET_NEVER ? TOKENBUCKET_NEVER : now + more;
			}
			if (g.deadline != TOKENBUCKET_NEVER && now >= g.deadline)
				finish(EXIT_DEADLINE);
			nap_until(g.deadline < target ? g.deadline : target);
			if (g.progress)
				draw_progress(false);
		}
		g.pending.active = false;
		n -= piece;
	}
	g.waited += tokenbucket_now() - t0;
}

/* ---- Input and output ------------------------------------------------------ */

/* Waits until fd is ready for events, serving signals and the deadline. */
static void wait_fd(int fd, short events)
{
	for (;;) {
		handle_signals();
		int64_t now = tokenbucket_now();
		if (events == POLLIN && g.deadline != TOKENBUCKET_NEVER && now >= g.deadline)
			finish(EXIT_DEADLINE);
		int64_t until = events == POLLIN ? g.deadline : TOKENBUCKET_NEVER;
		if (g.progress && g.last_draw + PROGRESS_NS < until)
			until = g.last_draw + PROGRESS_NS;
		int ms = -1;
		if (until != TOKENBUCKET_NEVER)
			ms = until <= now ? 0 : (int)((until - now + 999999) / 1000000);
		struct pollfd p[2] = { { .fd = fd, .events = events },
				       { .fd = g.sig_pipe[0], .events = POLLIN } };
		int r = poll(p, 2, ms);
		if (g.progress)
			draw_progress(false);
		if (r > 0 && p[0].revents)
			return;
		if (r < 0 && errno != EINTR) {
			warnx_("poll: %s", strerror(errno));
			finish(EXIT_IO);
		}
	}
}

static _Noreturn void io_failed(const char *what, int err)
{
	if (err == EPIPE)
		finish(EXIT_CLOSED);
	warnx_("%s: %s", what, strerror(err));
	finish(EXIT_IO);
}

static void write_all(const char *p, size_t n)
{
	while (n > 0) {
		ssize_t w = write(STDOUT_FILENO, p, n);
		if (w > 0) {
			p += w;
			n -= (size_t)w;
		} else if (w < 0 && errno == EINTR) {
			handle_signals();
		} else if (w < 0 && errno == EAGAIN) {
			wait_fd(STDOUT_FILENO, POLLOUT); /* someone made our output non-blocking */
		} else {
			io_failed("write", w < 0 ? errno : EIO);
		}
	}
}

/* Reads at most n bytes into p once stdin is readable; 0 at the end. */
static size_t read_some(char *p, size_t n)
{
	for (;;) {
		wait_fd(STDIN_FILENO, POLLIN);
		ssize_t r = read(STDIN_FILENO, p, n);
		if (r >= 0)
			return (size_t)r;
		if (errno != EINTR && errno != EAGAIN)
			io_failed("read", errno);
	}
}

/*
 * Moves n bytes from the pipe sp to stdout with splice(2).  false, with
 * nothing moved by this call, when stdout does not take splice (a terminal,
 * a file opened for appending): the caller copies them instead.
 */
static bool splice_out(int sp, size_t n, bool *moved_any)
{
	while (n > 0) {
		ssize_t s = splice(sp, NULL, STDOUT_FILENO, NULL, n, SPLICE_F_MOVE);
		if (s > 0) {
			n -= (size_t)s;
			*moved_any = true;
		} else if (s < 0 && errno == EINTR) {
			handle_signals();
		} else if (s < 0 && errno == EAGAIN) {
			wait_fd(STDOUT_FILENO, POLLOUT);
		} else if (s < 0 && (errno == EINVAL || errno == ENOSYS) && !*moved_any) {
			return false;
		} else {
			io_failed("splice", s < 0 ? errno : EIO);
		}
	}
	return true;
}

static void run_bytes(void)
{
	static char buf[CHUNK_MAX];
	int sp[2] = { -1, -1 };
	bool use_splice = !g.no_splice && pipe2(sp, O_CLOEXEC) == 0;
	bool spliced_out = false;
	for (;;) {
		size_t want = chunk_size();
		size_t got;
		if (use_splice) {
			wait_fd(STDIN_FILENO, POLLIN);
			ssize_t s = splice(STDIN_FILENO, NULL, sp[1], NULL, want,
					   SPLICE_F_MOVE | SPLICE_F_NONBLOCK);
			if (s < 0 && (errno == EINTR || errno == EAGAIN))
				continue;
			if (s < 0 && (errno == EINVAL || errno == ENOSYS)) {
				use_splice = false; /* stdin does not splice: copy */
				continue;
			}
			if (s < 0)
				io_failed("splice", errno);
			got = (size_t)s;
		} else {
			got = read_some(buf, want);
		}
		if (got == 0)
			break;
		take(got);
		if (use_splice) {
			if (!splice_out(sp[0], got, &spliced_out)) {
				/* The bytes are in our pipe: copy them out, and copy from now on. */
				size_t left = got;
				while (left > 0) {
					ssize_t r = read(sp[0], buf, left);
					if (r <= 0)
						io_failed("read", r < 0 ? errno : EIO);
					write_all(buf, (size_t)r);
					left -= (size_t)r;
				}
				use_splice = false;
			}
		} else {
			write_all(buf, got);
		}
		g.total += got;
		if (g.progress)
			draw_progress(false);
	}
	if (sp[0] >= 0) {
		close(sp[0]);
		close(sp[1]);
	}
}

/* Standard input cut into lines, for -l and for {}. */
static struct {
	char buf[LINE_MAX_BYTES];
	size_t pos, len;
	bool eof;
} in;

/*
 * The next piece of input: a whole line with its newline, or a part of a
 * line that does not fit the buffer (*whole false), or the last bytes
 * before the end.  Returns its length; 0 at the end.
 */
static size_t next_piece(const char **p, bool *whole)
{
	for (;;) {
		char *nl = memchr(in.buf + in.pos, '\n', in.len - in.pos);
		size_t end = nl ? (size_t)(nl - in.buf) + 1 : in.len;
		if (nl || (in.eof && in.pos < in.len) || (in.pos == 0 && in.len == sizeof(in.buf))) {
			*p = in.buf + in.pos;
			*whole = nl != NULL;
			size_t n = end - in.pos;
			in.pos = end;
			return n;
		}
		if (in.eof)
			return 0;
		memmove(in.buf, in.buf + in.pos, in.len - in.pos);
		in.len -= in.pos;
		in.pos = 0;
		size_t r = read_some(in.buf + in.len, sizeof(in.buf) - in.len);
		if (r == 0)
			in.eof = true;
		in.len += r;
	}
}

static void run_lines(void)
{
	bool line_start = true;
	const char *p;
	bool whole;
	size_t n;
	while ((n = next_piece(&p, &whole)) > 0) {
		if (line_start) {
			take(1);
			g.total++;
		}
		write_all(p, n);
		line_start = whole;
		if (g.progress)
			draw_progress(false);
	}
}

/* ---- Command mode ------------------------------------------------------------ */

static bool has_placeholder(void)
{
	for (char **a = g.command; *a; a++)
		if (strstr(*a, "{}"))
			return true;
	return false;
}

/* arg with every "{}" replaced by line (malloc'd). */
static char *substitute(const char *arg, const char *line)
{
	size_t count = 0, ll = strlen(line);
	for (const char *s = arg; (s = strstr(s, "{}")); s += 2)
		count++;
	char *out = malloc(strlen(arg) + count * ll + 1), *o = out;
	if (out == NULL)
		return NULL;
	for (const char *s = arg;;) {
		const char *at = strstr(s, "{}");
		size_t k = at ? (size_t)(at - s) : strlen(s);
		memcpy(o, s, k);
		o += k;
		if (!at)
			break;
		memcpy(o, line, ll);
		o += ll;
		s = at + 2;
	}
	*o = '\0';
	return out;
}

/*
 * Runs the command once and waits for it: its wait status, or exits when it
 * cannot be started.  A pipe closed on exec tells a failed exec (its errno)
 * from a command that exits 126 or 127 itself.
 */
static int run_once(char **argv, bool null_stdin)
{
	int ep[2];
	if (pipe2(ep, O_CLOEXEC) < 0)
		io_failed("pipe", errno);
	pid_t pid = fork();
	if (pid < 0)
		io_failed("fork", errno);
	if (pid == 0) {
		signal(SIGPIPE, SIG_DFL);
		sigset_t none;
		sigemptyset(&none);
		sigprocmask(SIG_SETMASK, &none, NULL);
		if (null_stdin) {
			int fd = open("/dev/null", O_RDONLY);
			if (fd >= 0 && fd != STDIN_FILENO) {
				dup2(fd, STDIN_FILENO);
				close(fd);
			}
		}
		execvp(argv[0], argv);
		int e = errno;
		(void)!write(ep[1], &e, sizeof(e));
		_exit(EXIT_CANNOT_RUN);
	}
	close(ep[1]);
	int e = 0;
	ssize_t r;
	while ((r = read(ep[0], &e, sizeof(e))) < 0 && errno == EINTR)
		;
	close(ep[0]);
	int status;
	while (waitpid(pid, &status, 0) < 0) {
		if (errno != EINTR)
			io_failed("waitpid", errno);
		if (got_term)
			kill(pid, got_term); /* pass it on, then exit once it is gone */
		if (got_usr1 || got_hup) {
			int term = got_term;
			got_term = 0;
			handle_signals();
			got_term = term;
		}
	}
	if (r == (ssize_t)sizeof(e)) {
		warnx_("%s: %s", argv[0], strerror(e));
		finish(e == ENOENT ? EXIT_NOT_FOUND : EXIT_CANNOT_RUN);
	}
	handle_signals();
	return status;
}

static void run_command(void)
{
	bool subst = has_placeholder();
	size_t argc = 0;
	while (g.command[argc])
		argc++;
	/* Kept in g: finish() may exit from inside a run, with the words allocated. */
	char **argv = g.run_argv = calloc(argc + 1, sizeof(*argv));
	if (argv == NULL)
		io_failed("malloc", ENOMEM);
	static char line[LINE_MAX_BYTES + 1];
	for (long long run = 0; g.max_runs == 0 || run < g.max_runs; run++) {
		if (subst) {
			const char *p;
			bool whole;
			size_t n = next_piece(&p, &whole);
			if (n == 0)
				break;
			if (!whole && !in.eof) {
				warnx_("an input line is longer than %zu bytes", LINE_MAX_BYTES);
				finish(EXIT_IO);
			}
			if (whole)
				n--;
			memcpy(line, p, n);
			line[n] = '\0';
		}
		take(1);
		for (size_t i = 0; i < argc; i++) {
			argv[i] = subst ? substitute(g.command[i], line) : g.command[i];
			if (argv[i] == NULL)
				io_failed("malloc", ENOMEM);
		}
		int status = run_once(argv, subst);
		if (subst)
			for (size_t i = 0; i < argc; i++) {
				free(argv[i]);
				argv[i] = NULL;
			}
		g.total++;
		if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
			g.failed++;
		if (g.progress)
			draw_progress(false);
	}
	free(argv);
	g.run_argv = NULL;
}

/* ---- Set-up ------------------------------------------------------------------ */

static void usage(FILE *f)
{
	fprintf(f,
		"Usage: tbrate [OPTION]... [-- COMMAND [ARG]...]\n"
		"Copies standard input to standard output at a rate, in bytes or (-l) lines,\n"
		"or runs COMMAND once per token ({} in an ARG: a line of standard input).\n"
		"\n"
		"  -r, --rate=RATE        tokens per period: 10M/s, 2.5KiB/s, 64kbit/s, 5/min,\n"
		"                         unlimited (SI k M G T P E, IEC Ki Mi ... Ei; B bytes,\n"
		"                         b or bit bits; /s /min /h /d, default /s); again\n"
		"                         for more limits, all obeyed (-r 10MB/s -r 1GB/h)\n"
		"  -b, --burst=SIZE       the bucket's size (default: 20 ms of the rate in\n"
		"                         bytes, 250 ms with --redis, 1 line or run; a\n"
		"                         later rate's is its amount, 1GB/h holds 1GB); the\n"
		"                         first SIZE go at once; the n-th -b is the n-th -r's\n"
		"  -l, --lines            pace lines, not bytes\n"
		"  -n, --count=N          run COMMAND at most N times\n"
		"  -t, --deadline=TIME    give up after TIME (500ms, 30s, 2min, 1h; s default)\n"
		"  -p, --progress         a status line on standard error\n"
		"  -s, --shared=NAME      share the limit with every tbrate naming NAME here\n"
		"      --redis=URL        share it through Redis (redis://host:port/db,\n"
		"                         unix:/path; bytes through a lease) ...\n"
		"      --key=KEY          ... under KEY\n"
		"      --rate-file=FILE   read the rate from FILE, again on SIGHUP\n"
		"      --unlink           remove the shared bucket NAME and exit\n"
		"      --no-splice        copy with read(2) and write(2) only\n"
		"  -h, --help             this help\n"
		"  -V, --version          the version, and whether Redis is built in\n"
		"\n"
		"A shared bucket that exists is joined as it is (a warning says if its rate\n"
		"or burst differ).  SIGUSR1 prints statistics; SIGHUP re-reads --rate-file.\n"
		"\n"
		"Exit status: 0 done; 1 some run of COMMAND failed; 2 bad usage; 3 the\n"
		"deadline passed; 4 the shared bucket or Redis failed; 5 an input, output or\n"
		"process error; 6 the output was closed; 126 COMMAND cannot be executed;\n"
		"127 COMMAND not found; 130 SIGINT, 143 SIGTERM.\n");
#ifndef TBRATE_HAVE_REDIS
	fprintf(f, "This tbrate was built without Redis support: --redis is refused.\n");
#endif
}

static _Noreturn void bad_usage(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static _Noreturn void bad_usage(const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	fputs("tbrate: ", stderr);
	vfprintf(stderr, fmt, ap);
	fputs("\nTry 'tbrate --help' for more information.\n", stderr);
	va_end(ap);
	exit(EXIT_USAGE);
}

static void open_shared(void)
{
	char name[TOKENBUCKET_NAME_MAX + 2];
	snprintf(name, sizeof(name), "%s%s", g.shared[0] == '/' ? "" : "/", g.shared);
	double rate = tbrate_rate_per_second(&g.rate);
	uint64_t burst = g.burst ? g.burst : default_burst(&g.rate);
	/* Exact from the bucket's first instant: no process ever sees a rounded rate. */
	struct tokenbucket_limit lim = exact_limit(&g.rate, burst);
	unsigned status = 0;
	int e = tokenbucket_open_limit(&g.tb, name, &lim, 0, 0600, &status);
	if (e == -EINVAL || e == -ENAMETOOLONG)
		bad_usage("bad shared bucket name \"%s\": %s", g.shared, strerror(-e));
	if (e) {
		warnx_("shared bucket %s: %s", name, strerror(-e));
		exit(EXIT_BUCKET);
	}
	if (status & TOKENBUCKET_OPEN_DIFFERS) {
		warnx_("warning: shared bucket %s exists with rate %.6g/s and burst %" PRIu64
		       " (asked %.6g/s and %" PRIu64 "); joining it as it is",
		       name, tokenbucket_rate(g.tb), tokenbucket_burst(g.tb), rate, burst);
	}
}

#ifdef TBRATE_HAVE_REDIS
static void open_redis(void)
{
	if (g.rate.period_ns == 0)
		bad_usage("--redis needs a finite rate");
	int e = tokenbucket_redis_open(&g.redis, g.redis_url, 0, 0);
	if (e == -EINVAL)
		bad_usage("bad Redis URL \"%s\"", g.redis_url);
	if (e) {
		warnx_("redis: %s", strerror(-e));
		exit(EXIT_BUCKET);
	}
	uint64_t burst = g.burst ? g.burst : default_burst(&g.rate);
	g.lim = (struct tokenbucket_redis_limit){ g.rate.tokens, g.rate.period_ns, burst };
	struct tokenbucket_redis_limit stored;
	char err[TBRATE_ERR_SIZE];
	e = tbrate_redis_stored(g.redis_url, g.key, &stored, err);
	if (e < 0) {
		warnx_("redis: %s", err);
		finish(EXIT_BUCKET);
	}
	if (e == 1 && (stored.tokens != g.lim.tokens || stored.period_ns != g.lim.period_ns ||
		       stored.burst != g.lim.burst)) {
		warnx_("warning: Redis key %s exists with %" PRIu64 " per %" PRId64
		       " ns and burst %" PRIu64 " (asked %" PRIu64 " per %" PRId64
		       " ns and %" PRIu64 "); joining it as it is",
		       g.key, stored.tokens, stored.period_ns, stored.burst, g.lim.tokens,
		       g.lim.period_ns, g.lim.burst);
		g.lim = stored;
	}
	open_lease();
}
#endif

int main(int argc, char **argv)
{
	enum { OPT_REDIS = 256, OPT_KEY, OPT_RATE_FILE, OPT_UNLINK, OPT_NO_SPLICE };
	static const struct option opts[] = {
		{ "rate", required_argument, NULL, 'r' },
		{ "burst", required_argument, NULL, 'b' },
		{ "lines", no_argument, NULL, 'l' },
		{ "count", required_argument, NULL, 'n' },
		{ "deadline", required_argument, NULL, 't' },
		{ "progress", no_argument, NULL, 'p' },
		{ "shared", required_argument, NULL, 's' },
		{ "redis", required_argument, NULL, OPT_REDIS },
		{ "key", required_argument, NULL, OPT_KEY },
		{ "rate-file", required_argument, NULL, OPT_RATE_FILE },
		{ "unlink", no_argument, NULL, OPT_UNLINK },
		{ "no-splice", no_argument, NULL, OPT_NO_SPLICE },
		{ "help", no_argument, NULL, 'h' },
		{ "version", no_argument, NULL, 'V' },
		{ NULL, 0, NULL, 0 },
	};
	/* The n-th -b is the n-th -r's burst. */
	const char *rate_args[TOKENBUCKET_SET_MAX], *burst_args[TOKENBUCKET_SET_MAX];
	size_t nrate = 0, nburst = 0;
	int64_t deadline_ns = 0;
	bool lines = false, unlink_it = false;
	char err[TBRATE_ERR_SIZE];
	int c;
	while ((c = getopt_long(argc, argv, "+r:b:ln:t:ps:hV", opts, NULL)) != -1) {
		switch (c) {
		case 'r':
			if (nrate == TOKENBUCKET_SET_MAX)
				bad_usage("at most %d rates", TOKENBUCKET_SET_MAX);
			rate_args[nrate++] = optarg;
			break;
		case 'b':
			if (nburst == TOKENBUCKET_SET_MAX)
				bad_usage("at most %d bursts", TOKENBUCKET_SET_MAX);
			burst_args[nburst++] = optarg;
			break;
		case 'l':
			lines = true;
			break;
		case 'n': {
			const char *why = NULL;
			g.max_runs = strtonum(optarg, 1, LLONG_MAX, &why);
			if (why)
				bad_usage("-n \"%s\": %s", optarg, why);
			break;
		}
		case 't':
			if (tbrate_parse_duration(optarg, &deadline_ns, err))
				bad_usage("-t %s", err);
			break;
		case 'p':
			g.progress = true;
			break;
		case 's':
			g.shared = optarg;
			break;
		case OPT_REDIS:
			g.redis_url = optarg;
			break;
		case OPT_KEY:
			g.key = optarg;
			break;
		case OPT_RATE_FILE:
			g.rate_file = optarg;
			break;
		case OPT_UNLINK:
			unlink_it = true;
			break;
		case OPT_NO_SPLICE:
			g.no_splice = true;
			break;
		case 'h':
			usage(stdout);
			return EXIT_OK;
		case 'V':
			printf("tbrate %s (libtokenbucket %s), Redis %s\n", TOKENBUCKET_VERSION_STRING,
			       tokenbucket_version_string(),
#ifdef TBRATE_HAVE_REDIS
			       "built in"
#else
			       "not built in"
#endif
			);
			return EXIT_OK;
		default:
			fputs("Try 'tbrate --help' for more information.\n", stderr);
			return EXIT_USAGE;
		}
	}
	g.command = argv + optind;
	g.mode = *g.command ? MODE_COMMAND : lines ? MODE_LINES : MODE_BYTES;

	if (unlink_it) {
		if (!g.shared)
			bad_usage("--unlink needs --shared NAME");
		char name[TOKENBUCKET_NAME_MAX + 2];
		snprintf(name, sizeof(name), "%s%s", g.shared[0] == '/' ? "" : "/", g.shared);
		int e = tokenbucket_unlink(name);
		if (e == -EINVAL || e == -ENAMETOOLONG)
			bad_usage("bad shared bucket name \"%s\"", g.shared);
		if (e) {
			warnx_("%s: %s", name, strerror(-e));
			return EXIT_BUCKET;
		}
		return EXIT_OK;
	}
	if (lines && g.mode == MODE_COMMAND)
		bad_usage("-l and a COMMAND exclude each other");
	if (g.max_runs && g.mode != MODE_COMMAND)
		bad_usage("-n needs a COMMAND");
	if (g.shared && g.redis_url)
		bad_usage("--shared and --redis exclude each other");
	if (!g.redis_url != !g.key)
		bad_usage("--redis and --key go together");
#ifndef TBRATE_HAVE_REDIS
	if (g.redis_url)
		bad_usage("this tbrate was built without Redis support");
#endif
	if (nrate && g.rate_file)
		bad_usage("--rate and --rate-file exclude each other");
	if (nrate > 1 && (g.shared || g.redis_url))
		bad_usage("several rates are kept in private buckets: --shared and --redis take one");
	if (nburst > (nrate > 1 ? nrate : 1))
		bad_usage("%zu bursts for %zu rates: each -b is the burst of one -r", nburst,
			  nrate);
	struct tokenbucket_limit rates[TOKENBUCKET_SET_MAX];
	uint64_t bursts[TOKENBUCKET_SET_MAX] = { 0 };
	for (size_t i = 0; i < nrate; i++) {
		bool bytes = false;
		if (tbrate_parse_rate(rate_args[i], &rates[i], &bytes, err))
			bad_usage("rate %s", err);
		if (bytes && g.mode != MODE_BYTES)
			bad_usage("rate \"%s\": a byte unit needs the byte mode", rate_args[i]);
	}
	for (size_t i = 0; i < nburst; i++)
		if (tbrate_parse_size(burst_args[i], TOKENBUCKET_BURST_MAX, &bursts[i], err))
			bad_usage("burst %s", err);
	if (nrate) {
		g.rate = rates[0];
	} else if (g.rate_file) {
		if (read_rate_file(&g.rate, err))
			bad_usage("rate file %s", err);
	} else {
		bad_usage("a rate is needed (-r or --rate-file)");
	}
	g.burst = bursts[0];

	if (pipe2(g.sig_pipe, O_CLOEXEC | O_NONBLOCK) < 0) {
		warnx_("pipe: %s", strerror(errno));
		return EXIT_IO;
	}
	/* No SA_RESTART: a blocking call returns EINTR and the signal is served. */
	struct sigaction sa = { .sa_handler = on_signal };
	sigemptyset(&sa.sa_mask);
	sigaction(SIGUSR1, &sa, NULL);
	sigaction(SIGHUP, &sa, NULL);
	sigaction(SIGINT, &sa, NULL);
	sigaction(SIGTERM, &sa, NULL);
	signal(SIGPIPE, SIG_IGN);

	g.count = 1;
	if (g.shared) {
		open_shared();
		g.set[0] = g.tb;
	}
#ifdef TBRATE_HAVE_REDIS
	else if (g.redis_url) {
		open_redis();
	}
#endif
	else {
		uint64_t burst = g.burst ? g.burst : default_burst(&g.rate);
		struct tokenbucket_limit first = exact_limit(&g.rate, burst);
		int e = tokenbucket_create_limit(&g.tb, &first, 0);
		g.set[0] = g.tb;
		if (e) {
			warnx_("bucket: %s", strerror(-e));
			return EXIT_BUCKET;
		}
		for (size_t i = 1; i < nrate; i++) {
			uint64_t b = bursts[i] ? bursts[i] : quota_burst(&rates[i]);
			struct tokenbucket_limit lim = exact_limit(&rates[i], b);
			e = tokenbucket_create_limit(&g.set[i], &lim, 0);
			if (e) {
				warnx_("bucket for rate \"%s\": %s", rate_args[i], strerror(-e));
				finish(EXIT_BUCKET);
			}
			g.count = i + 1;
		}
	}
	g.start = tokenbucket_now();
	if (deadline_ns)
		g.deadline = deadline_ns >= TOKENBUCKET_NEVER - g.start ? TOKENBUCKET_NEVER
								       : g.start + deadline_ns;
	if (g.progress)
		draw_progress(true);

	if (g.mode == MODE_BYTES)
		run_bytes();
	else if (g.mode == MODE_LINES)
		run_lines();
	else
		run_command();
	finish(g.failed ? EXIT_COMMAND_FAILED : EXIT_OK);
}
