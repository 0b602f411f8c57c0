/* SPDX-License-Identifier: MIT */
/*
 * usage: tokenbucket-redis-bench URL INFLIGHT KEYS SECONDS
 *
 * INFLIGHT threads share one client (a connection each, from its pool) and
 * call tokenbucket_redis_allow on one hot key (KEYS 1) or on random keys out
 * of KEYS, for SECONDS.  Prints "decisions/s p50_us p99_us errors".
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

static void *work(void *arg)
{
	struct worker *w = arg;
	char key[32];
	while (tokenbucket_now() < w->until) {
		long k = 0;
		if (w->keys > 1) {
			w->seed = w->seed * 6364136223846793005u + 1442695040888963407u;
			k = (long)((w->seed >> 33) % (uint64_t)w->keys);
		}
		int len = snprintf(key, sizeof(key), "bench:%ld", k);
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

int main(int argc, char **argv)
{
	if (argc != 5) {
		fprintf(stderr, "usage: %s URL INFLIGHT KEYS SECONDS\n", argv[0]);
		return 2;
	}
	int inflight = atoi(argv[2]);
	long keys = atol(argv[3]);
	double seconds = atof(argv[4]);
	if (inflight < 1 || keys < 1 || seconds <= 0)
		return 2;
	struct tokenbucket_redis *r;
	if (tokenbucket_redis_open(&r, argv[1], 1000000000, 1000000000) != 0)
		return 1;
	struct worker *w = calloc((size_t)inflight, sizeof(*w));
	pthread_t *t = calloc((size_t)inflight, sizeof(*t));
	int64_t start = tokenbucket_now();
	for (int i = 0; i < inflight; i++) {
		w[i] = (struct worker){ .r = r, .keys = keys, .seed = (uint64_t)i * 7919 + 1,
					.until = start + (int64_t)(seconds * 1e9),
					.samples = malloc(SAMPLES * sizeof(int64_t)) };
		pthread_create(&t[i], NULL, work, &w[i]);
	}
	long calls = 0, errors = 0, n = 0;
	for (int i = 0; i < inflight; i++) {
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
