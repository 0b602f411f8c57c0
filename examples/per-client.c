/* SPDX-License-Identifier: MIT */
/*
 * per-client: one limit per client address, in a table of fixed size.
 *
 * A server limits each client address to 5 requests per second with bursts
 * of 10, and answers as an HTTP server would: 200, or 429 with Retry-After
 * and RateLimit headers from the decision's result.  Addresses are keys of
 * 16 bytes (IPv4 as v4-mapped IPv6).  The table holds 1000 addresses whose
 * buckets are not full at once (32 KB); an address that stays away long
 * enough to be full again gives its slot up without loss.
 *
 * The traffic is simulated on a clock of its own (the _at functions), so the
 * output is the same on every run: a polite client (one request every
 * 250 ms), a greedy one (50 requests a second) and an IPv6 client that
 * bursts.  At the end, the status page: every live key and the counters.
 *
 * usage: per-client
 */
#include <arpa/inet.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <tokenbucket.h>

#define SEC INT64_C(1000000000)

/* An address as a 16-byte key; NULL if it is not one. */
static const struct in6_addr *key_of(const char *text, struct in6_addr *a)
{
	char mapped[64];
	if (inet_pton(AF_INET6, text, a) == 1)
		return a;
	snprintf(mapped, sizeof(mapped), "::ffff:%s", text);
	return inet_pton(AF_INET6, mapped, a) == 1 ? a : NULL;
}

/*
 * One request at now: true if served (200); a refusal prints the headers
 * the server would send with its 429, the first few times.
 */
static bool request(struct tokenbucket_table *t, const char *client, int64_t now, int *refused)
{
	struct in6_addr a;
	struct tokenbucket_result r;
	if (key_of(client, &a) == NULL ||
	    tokenbucket_table_allow_result_at(t, now, &a, sizeof(a), 1, &r) != 0) {
		fprintf(stderr, "per-client: bad request from %s\n", client);
		exit(1);
	}
	if (r.allowed)
		return true;
	if ((*refused)++ >= 3)
		return false;
	printf("%6.3f s  %-12s 429  Retry-After: %lld  RateLimit-Remaining: %llu  "
	       "RateLimit-Reset: %lld\n",
	       (double)now / SEC, client, (long long)((r.retry_after_ns + SEC - 1) / SEC),
	       (unsigned long long)r.remaining, (long long)((r.reset_after_ns + SEC - 1) / SEC));
	return false;
}

int main(void)
{
	struct tokenbucket_table *t;
	int err = tokenbucket_table_create(&t, 5, SEC, 10, 1000, 0);
	if (err) {
		fprintf(stderr, "per-client: tokenbucket_table_create: %s\n", strerror(-err));
		return 1;
	}
	/* Two seconds of traffic, in steps of 10 ms. */
	int sent[3] = { 0, 0, 0 }, served[3] = { 0, 0, 0 }, refused[3] = { 0, 0, 0 };
	const char *clients[3] = { "192.0.2.10", "198.51.100.7", "2001:db8::1" };
	for (int64_t ms = 0; ms < 2000; ms += 10) {
		int64_t now = ms * (SEC / 1000);
		bool due[3] = { ms % 250 == 0, ms % 20 == 0, false };
		for (int i = 0; i < 2; i++)
			if (due[i])
				sent[i]++, served[i] += request(t, clients[i], now, &refused[i]);
		if (ms == 1000)
			for (int j = 0; j < 12; j++)
				sent[2]++, served[2] += request(t, clients[2], now, &refused[2]);
	}
	printf("\n");
	for (int i = 0; i < 3; i++)
		printf("%-12s sent %3d, served %3d, refused %3d\n", clients[i], sent[i], served[i],
		       refused[i]);
	for (int i = 0; i < 3; i++) {
		struct in6_addr a;
		key_of(clients[i], &a);
		printf("%-12s now holds %.2f tokens\n", clients[i],
		       tokenbucket_table_tokens_at(t, 2 * SEC, &a, sizeof(a)));
	}
	printf("\nstatus page (keys by fingerprint):\n");
	uint64_t cursor = 0;
	struct tokenbucket_table_entry e;
	while (tokenbucket_table_next(t, &cursor, 2 * SEC, &e) == 0)
		printf("  %014llx  %5.2f tokens, last seen at %.3f s\n",
		       (unsigned long long)e.fingerprint, e.tokens, (double)e.clock / SEC);
	struct tokenbucket_table_stats s;
	tokenbucket_table_stats(t, &s);
	printf("slots %llu, in use %llu, reused %llu, evicted %llu, refused %llu\n",
	       (unsigned long long)s.capacity, (unsigned long long)s.in_use,
	       (unsigned long long)s.lossless, (unsigned long long)s.lossy,
	       (unsigned long long)s.refused);
	tokenbucket_table_free(t);
	return 0;
}
