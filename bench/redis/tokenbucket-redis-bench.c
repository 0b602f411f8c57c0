/* SPDX-License-Identifier: MIT */
/*
 * usage: tokenbucket-redis-bench URL INFLIGHT KEYS SECONDS [pipe|trivial|async|async2|piped]
 *
 * Allow calls on one hot key (KEYS 1) or on random keys out of KEYS, with
 * INFLIGHT of them outstanding, for SECONDS.  By default INFLIGHT threads
 * share one client (a connection each, from its pool) and block in
 * tokenbucket_redis_allow; with "pipe" one thread keeps INFLIGHT calls
 * outstanding on one TCP connection (URL redis://HOST:PORT) through
 * tokenbucket_redis_format and tokenbucket_redis_parse, as an event loop
 * would, and "trivial" the same with EVALSHA of "return 1" (loaded
 * beforehand) instead of our calls; with "async" one thread keeps INFLIGHT calls outstanding through
 * the asynchronous client on a libevent loop, "async2" the same with
 * TOKENBUCKET_REDIS_ALLOW_ALL on two limits (the one below and a
 * quota of 10^6 an hour); with "piped" the threads
 * block as by default, their calls pipelined on a few connections
 * (tokenbucket_redis_configure, pipelining).  TOKENBUCKET_REDIS_BENCH_MODULE=script or
 * =module in the environment forces the script or the native module
 * (tokenbucket_redis_configure, module); unset or empty, the client detects it.
 * TOKENBUCKET_REDIS_BENCH_CONNECTIONS=K sets the connections per server of
 * the async and piped modes (tokenbucket_redis_configure, connections).
 * TOKENBUCKET_REDIS_BENCH_TIMEOUT_MS=T sets the command timeout (default
 * 1000): 10^4 calls in flight queue for longer than 1 s on a busy server.  URL "cluster:redis://H:P[,redis://H:P...]" opens a Redis Cluster
 * client from those seeds instead (threads only).  Prints "decisions/s
 * p50_us p99_us errors".
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <event2/event.h>

#include <tokenbucket-redis-libevent.h>
#include <tokenbucket-redis.h>

#define SAMPLES 400000

struct worker {
	struct tokenbucket_redis *r;
	long keys;
	int64_t until;
	uint64_t seed;
	long calls, errors, nsamples;
	int64_t *samples;
};

/* 1000 tokens per second, burst 100: the hot key refuses most calls. */
static const struct tokenbucket_redis_limit limit = { .tokens = 1, .period_ns = 1000000, .burst = 100 };
/* async2: that limit and an hourly quota that rarely refuses. */
static const struct tokenbucket_limit limits2[2] = {
	{ .tokens = 1, .period_ns = 1000000, .burst = 100 },
	{ .tokens = 1000000, .period_ns = 3600000000000, .burst = 1000000 },
};

static uint64_t next_key(uint64_t *seed, long keys)
{
	if (keys <= 1)
		return 0;
	*seed = *seed * 6364136223846793005u + 1442695040888963407u;
	return (*seed >> 33) % (uint64_t)keys;
}

static void *work(void *arg)
{
	struct worker *w = arg;
	char key[32];
	while (tokenbucket_now() < w->until) {
		int len = snprintf(key, sizeof(key), "bench:%llu",
				   (unsigned long long)next_key(&w->seed, w->keys));
		struct tokenbucket_result res;
		int64_t t0 = tokenbucket_now();
		int err = tokenbucket_redis_allow(w->r, key, (size_t)len, &limit, 1, &res);
		int64_t t1 = tokenbucket_now();
		w->calls++;
		w->errors += err != 0;
		if (w->nsamples < SAMPLES)
			w->samples[w->nsamples++] = t1 - t0;
	}
	return NULL;
}

static int cmp64(const void *a, const void *b)
{
	int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
	return (x > y) - (x < y);
}

/* EVALSHA of "return 1" (bench/redis/run loads it): the trivial script, the floor of a script call. */
static const char trivial_cmd[] =
	"*3\r\n$7\r\nEVALSHA\r\n$40\r\ne0e1f9fabfc9d4800c877a703b823ac0578ff8db\r\n$1\r\n0\r\n";

/*
 * The trivial script's reply at the start of in (have bytes): its length
 * and err 0 for ":1", -EPROTO for anything else; -EAGAIN while incomplete.
 */
static int trivial_parse(const char *in, size_t have, size_t *used)
{
	const char *end = memchr(in, '\n', have);
	if (end == NULL)
		return -EAGAIN;
	*used = (size_t)(end - in) + 1;
	return *used == 4 && memcmp(in, ":1\r\n", 4) == 0 ? 0 : -EPROTO;
}

/*
 * One connection, inflight calls outstanding; fills w as the threads do.
 * trivial: the trivial script instead of our calls, pipelined alike.
 */
static int pipelined(const char *url, int inflight, bool trivial, struct worker *w)
{
	char host[64];
	int port;
	if (sscanf(url, "redis://%63[^:]:%d", host, &port) != 2)
		return -1;
	int fd = socket(AF_INET, SOCK_STREAM, 0);
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons((uint16_t)port) };
	int one = 1;
	if (fd < 0 || inet_pton(AF_INET, host, &a.sin_addr) != 1 ||
	    connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0 ||
	    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)) != 0)
		return -1;
	struct tokenbucket_redis_call call = { .op = TOKENBUCKET_REDIS_ALLOW, .limit = limit, .n = 1 };
	int64_t *sent = calloc((size_t)inflight, sizeof(int64_t)); /* a FIFO: replies come in order */
	size_t cap = 1 << 20, have = 0, head = 0, out = 0;
	char *in = malloc(cap), key[32];
	/* Load the script once, as a client does on its first NOSCRIPT. */
	call.flags = trivial ? 0 : TOKENBUCKET_REDIS_EVAL;
	for (;;) {
		bool more = tokenbucket_now() < w->until;
		char *batch = NULL;
		size_t blen = 0;
		while (more && out < (size_t)inflight) {
			int len = snprintf(key, sizeof(key), "bench:%llu",
					   (unsigned long long)next_key(&w->seed, w->keys));
			call.key = key;
			call.keylen = (size_t)len;
			char *cmd = NULL;
			size_t clen = sizeof(trivial_cmd) - 1;
			if (!trivial && tokenbucket_redis_format(&call, &cmd, &clen) != 0)
				return -1;
			batch = realloc(batch, blen + clen);
			memcpy(batch + blen, trivial ? trivial_cmd : cmd, clen);
			blen += clen;
			free(cmd);
			sent[(head + out++) % (size_t)inflight] = tokenbucket_now();
			if (call.flags != 0) {
				call.flags = 0;
				break; /* the EVAL goes alone */
			}
		}
		if (blen > 0 && write(fd, batch, blen) != (ssize_t)blen)
			return -1;
		free(batch);
		if (out == 0)
			break;
		ssize_t n = read(fd, in + have, cap - have);
		if (n <= 0)
			return -1;
		have += (size_t)n;
		for (;;) {
			size_t used;
			struct tokenbucket_result res;
			int err = trivial ? trivial_parse(in, have, &used)
					  : tokenbucket_redis_parse(&call, in, have, &used, &res, NULL, NULL);
			if (err == -EAGAIN)
				break;
			int64_t lat = tokenbucket_now() - sent[head];
			head = (head + 1) % (size_t)inflight;
			out--;
			w->calls++;
			w->errors += err != 0;
			if (w->nsamples < SAMPLES)
				w->samples[w->nsamples++] = lat;
			memmove(in, in + used, have - used);
			have -= used;
		}
	}
	free(sent);
	free(in);
	close(fd);
	return 0;
}

/* ---- The asynchronous client: INFLIGHT calls kept outstanding on one loop ---- */

struct async_run {
	struct tokenbucket_redis_async *a;
	struct worker *w;
	int outstanding;
	bool two; /* async2 */
	char key[32];
};

struct async_slot {
	struct async_run *run;
	int64_t t0;
};

static void async_done(void *arg, int err, const struct tokenbucket_result *res,
		       const struct tokenbucket_reservation *rv, double tokens);

static void async_next(struct async_slot *s)
{
	struct async_run *run = s->run;
	struct worker *w = run->w;
	int len = snprintf(run->key, sizeof(run->key), "bench:%llu",
			   (unsigned long long)next_key(&w->seed, w->keys));
	struct tokenbucket_redis_call call = { .op = TOKENBUCKET_REDIS_ALLOW, .key = run->key,
					       .keylen = (size_t)len, .limit = limit, .n = 1 };
	struct tokenbucket_redis_call_all two = { .call = call, .limits = limits2, .count = 2 };
	two.call.op = TOKENBUCKET_REDIS_ALLOW_ALL;
	s->t0 = tokenbucket_now();
	int err = tokenbucket_redis_async_start(run->a, run->two ? &two.call : &call, async_done, s);
	if (err == 0)
		run->outstanding++;
	else
		w->errors++;
}

static void async_done(void *arg, int err, const struct tokenbucket_result *res,
		       const struct tokenbucket_reservation *rv, double tokens)
{
	struct async_slot *s = arg;
	struct worker *w = s->run->w;
	(void)res;
	(void)rv;
	(void)tokens;
	int64_t t1 = tokenbucket_now();
	s->run->outstanding--;
	w->calls++;
	w->errors += err != 0;
	if (w->nsamples < SAMPLES)
		w->samples[w->nsamples++] = t1 - s->t0;
	if (t1 < w->until)
		async_next(s);
}

static int async_loop(struct tokenbucket_redis *r, int inflight, bool two, struct worker *w)
{
	struct event_base *base = event_base_new();
	struct async_run run = { .w = w, .two = two };
	if (base == NULL || tokenbucket_redis_libevent_open(&run.a, r, base) != 0)
		return -1;
	struct async_slot *slots = calloc((size_t)inflight, sizeof(*slots));
	for (int i = 0; i < inflight; i++) {
		slots[i].run = &run;
		async_next(&slots[i]);
	}
	while (run.outstanding > 0)
		event_base_loop(base, EVLOOP_ONCE);
	tokenbucket_redis_async_close(run.a);
	event_base_free(base);
	free(slots);
	return 0;
}

int main(int argc, char **argv)
{
	bool piped = argc == 6 && strcmp(argv[5], "piped") == 0;
	if (piped)
		argc = 5; /* the threads' run, pipelined */
	bool two = argc == 6 && strcmp(argv[5], "async2") == 0;
	if (argc != 5 && !(argc == 6 && (strcmp(argv[5], "pipe") == 0 || strcmp(argv[5], "async") == 0 ||
					 strcmp(argv[5], "trivial") == 0 || two))) {
		fprintf(stderr, "usage: %s URL INFLIGHT KEYS SECONDS [pipe|trivial|async|async2|piped]\n",
			argv[0]);
		return 2;
	}
	int inflight = atoi(argv[2]);
	long keys = atol(argv[3]);
	double seconds = atof(argv[4]);
	if (inflight < 1 || keys < 1 || seconds <= 0)
		return 2;
	struct tokenbucket_redis *r;
	const char *timeout_ms = getenv("TOKENBUCKET_REDIS_BENCH_TIMEOUT_MS");
	int64_t command_timeout = timeout_ms != NULL ? atoll(timeout_ms) * 1000000 : 1000000000;
	if (command_timeout <= 0)
		return 2;
	if (strncmp(argv[1], "cluster:", 8) == 0) {
		char *list = strdup(argv[1] + 8), *save = NULL;
		const char *seeds[16];
		size_t nseeds = 0;
		for (char *s = strtok_r(list, ",", &save); s != NULL && nseeds < 16; s = strtok_r(NULL, ",", &save))
			seeds[nseeds++] = s;
		int err = argc == 5 ? tokenbucket_redis_open_cluster(&r, seeds, nseeds, 1000000000, 1000000000)
				    : -EINVAL;
		free(list);
		if (err != 0)
			return 1;
	} else if (tokenbucket_redis_open(&r, argv[1], 1000000000, command_timeout) != 0) {
		return 1;
	}
	/*
	 * TOKENBUCKET_REDIS_BENCH_MODULE=script|module forces one server side;
	 * TOKENBUCKET_REDIS_BENCH_CONNECTIONS=K: connections per server.
	 */
	struct tokenbucket_redis_options opts = { .size = sizeof(opts), .pipelining = piped };
	const char *side = getenv("TOKENBUCKET_REDIS_BENCH_MODULE");
	if (side != NULL && *side != '\0')
		opts.module = strcmp(side, "module") == 0 ? TOKENBUCKET_REDIS_MODULE_ALWAYS
							  : TOKENBUCKET_REDIS_MODULE_NEVER;
	const char *conns = getenv("TOKENBUCKET_REDIS_BENCH_CONNECTIONS");
	if (conns != NULL)
		opts.connections = atoi(conns);
	if (tokenbucket_redis_configure(r, &opts) != 0)
		return 1;
	struct worker *w = calloc((size_t)inflight, sizeof(*w));
	pthread_t *t = calloc((size_t)inflight, sizeof(*t));
	int64_t start = tokenbucket_now();
	if (argc == 6) {
		/* One worker record holds the pipelined run's counts and samples. */
		w[0] = (struct worker){ .keys = keys, .seed = 1, .until = start + (int64_t)(seconds * 1e9),
					.samples = malloc(SAMPLES * sizeof(int64_t)) };
		int err = strcmp(argv[5], "async") == 0 || two
				  ? async_loop(r, inflight, two, &w[0])
				  : pipelined(argv[1], inflight, strcmp(argv[5], "trivial") == 0, &w[0]);
		if (err != 0) {
			fprintf(stderr, "pipelined run failed\n");
			return 1;
		}
		inflight = 1;
	}
	for (int i = 0; i < inflight && argc == 5; i++) {
		w[i] = (struct worker){ .r = r, .keys = keys, .seed = (uint64_t)i * 7919 + 1,
					.until = start + (int64_t)(seconds * 1e9),
					.samples = malloc(SAMPLES * sizeof(int64_t)) };
		pthread_create(&t[i], NULL, work, &w[i]);
	}
	long calls = 0, errors = 0, n = 0;
	for (int i = 0; i < inflight; i++) {
		if (argc == 5)
			pthread_join(t[i], NULL);
		calls += w[i].calls;
		errors += w[i].errors;
		n += w[i].nsamples;
	}
	double elapsed = (double)(tokenbucket_now() - start) / 1e9;
	int64_t *all = malloc((size_t)n * sizeof(int64_t));
	long at = 0;
	for (int i = 0; i < inflight; i++) {
		memcpy(all + at, w[i].samples, (size_t)w[i].nsamples * sizeof(int64_t));
		at += w[i].nsamples;
		free(w[i].samples);
	}
	qsort(all, (size_t)n, sizeof(int64_t), cmp64);
	printf("%.0f %.1f %.1f %ld\n", (double)calls / elapsed, (double)all[n / 2] / 1e3,
	       (double)all[n * 99 / 100] / 1e3, errors);
	free(all);
	free(w);
	free(t);
	tokenbucket_redis_close(r);
	return errors == 0 ? 0 : 1;
}
