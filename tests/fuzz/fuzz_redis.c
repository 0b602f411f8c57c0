/* SPDX-License-Identifier: MIT */
/*
 * A Redis reply is input: any bytes, scanned against the bounds
 * (tbr__bound_scan) and read by hiredis's reader as the client reads a
 * server's stream, then given to one of the client's reply decoders.
 * Each must return a documented value, never crash, and never take out of
 * range fields for an answer; the bounds must keep every count and length
 * that reaches hiredis within them.  Traps (after a line on stderr) on a
 * broken promise.
 *
 * Encoding: byte 0 picks the decoder (% 6): a decision (op from byte 1,
 * burst from byte 2), allow_all's (byte 1: how many limits), CLUSTER
 * SLOTS, a sentinel's answer, the probes (ROLE, TOKENBUCKET.VERSION,
 * FCALL, FUNCTION LOAD, an error's errno and a redirection), or
 * tokenbucket_redis_parse; from byte 3 on, the stream.
 *
 * Built with -DFUZZ_REPLAY_MAIN it gets a main() that replays files and
 * directories without libFuzzer (ctest fuzz-redis-replay).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "sentinel.h"
#include "slots.h"

#ifdef FUZZ_REPLAY_MAIN
#include "replay.h"
#endif

/* The script and function texts go into commands, never into decoding. */
const char tbr__script_text[] = "";
const char tbr__script_sha1[] = "0000000000000000000000000000000000000000";
const char tbr__function_text[] = "";
const char tbr__function_name[] = "tokenbucket";

static void fail(const char *what)
{
	fprintf(stderr, "tokenbucket redis fuzz: %s\n", what);
	__builtin_trap();
}

/* Every count and length hiredis made an object of stays within the bounds; *elements counts them. */
static void check_bounded(const redisReply *r, int depth, size_t *elements)
{
	if (depth > 16)
		fail("nested deeper than hiredis allows");
	if ((r->type == REDIS_REPLY_STRING || r->type == REDIS_REPLY_STATUS ||
	     r->type == REDIS_REPLY_ERROR) && r->len > TBR__REPLY_STRING_MAX)
		fail("a string past the bound reached hiredis");
	if (r->type == REDIS_REPLY_ARRAY) {
		*elements += r->elements;
		if (*elements > TBR__REPLY_COUNT_MAX)
			fail("a count past the bound reached hiredis");
		for (size_t i = 0; i < r->elements; i++)
			check_bounded(r->element[i], depth + 1, elements);
	}
}

static bool documented(int err, const int *ok, size_t n)
{
	for (size_t i = 0; i < n; i++)
		if (err == ok[i])
			return true;
	return false;
}

static void decision(const uint8_t *cfg, const redisReply *rep)
{
	static const uint64_t bursts[] = { 1, 10, 1000, UINT64_C(1) << 40, TOKENBUCKET_BURST_MAX };
	struct tokenbucket_redis_call call = {
		.op = (enum tokenbucket_redis_op)(cfg[1] % 6), .key = "k", .keylen = 1,
		.limit = { .tokens = 1, .period_ns = 1000000000, .burst = bursts[cfg[2] % 5] },
		.n = 1, .arg = cfg[2] & 0x80 ? TOKENBUCKET_NEVER : 1000000000,
	};
	struct tokenbucket_result res;
	struct tokenbucket_reservation rv;
	double tokens;
	int err = tbr__decode(&call, rep, &res, &rv, &tokens);
	if (err > 0)
		fail("decode: a positive return");
	bool filled = err == 0 || err == -ETIMEDOUT || err == -E2BIG || err == -EOVERFLOW;
	if (filled && res.remaining > call.limit.burst)
		fail("decode: more remaining than the burst");
	if (filled && res.limit != call.limit.burst)
		fail("decode: a limit other than the burst");
	if (err == 0 && call.op == TOKENBUCKET_REDIS_TOKENS && !(tokens <= (double)call.limit.burst))
		fail("decode: more tokens than the burst");
}

static void decision_all(const uint8_t *cfg, const redisReply *rep)
{
	struct tokenbucket_limit limits[TOKENBUCKET_SET_MAX];
	size_t count = 1 + cfg[1] % TOKENBUCKET_SET_MAX;
	for (size_t i = 0; i < count; i++)
		limits[i] = (struct tokenbucket_limit){ .tokens = 1, .period_ns = 1000000,
							      .burst = 1 + (cfg[2] + i) % 16 };
	struct tokenbucket_set_result res;
	memset(&res, 0xa5, sizeof(res));
	struct tokenbucket_redis_call_all all = {
		.call = { .op = TOKENBUCKET_REDIS_ALLOW_ALL, .key = "k", .keylen = 1, .n = 1 },
		.limits = limits, .count = count, .res = &res,
	};
	int err = tbr__decode(&all.call, rep, NULL, NULL, NULL);
	if (err > 0)
		fail("decode_all: a positive return");
	if (err == 0 && res.remaining > res.limit)
		fail("decode_all: more remaining than the limit");
}

static void slots(const redisReply *rep)
{
	struct tbr__range *g = NULL;
	size_t n = 0;
	int err = tbr__slots_parse(rep, &g, &n);
	static const int ok[] = { 0, -EPROTO, -ENOMEM };
	if (!documented(err, ok, 3))
		fail("slots: an undocumented errno");
	for (size_t i = 0; err == 0 && i < n; i++)
		if (g[i].start > g[i].end || g[i].end >= TBR__SLOTS || g[i].port < 1 ||
		    g[i].port > 65535 || g[i].hostlen > TBR__HOST_MAX ||
		    memchr(g[i].host, 0, g[i].hostlen) != NULL)
			fail("slots: a range out of range");
	free(g);
}

static void sentinel(const redisReply *rep)
{
	char *host = NULL;
	int port = 0;
	int err = tbr__sentinel_reply(rep, &host, &port);
	static const int ok[] = { 0, 1, -EPROTO, -ENOMEM };
	if (!documented(err, ok, 4))
		fail("sentinel: an undocumented return");
	if (err == 0 && (host == NULL || host[0] == 0 || strlen(host) > 253 || port < 1 || port > 65535))
		fail("sentinel: a host or port out of range");
	free(host);
}

static void probes(const redisReply *rep)
{
	(void)tbr__role_primary(rep);
	(void)tbr__module_speaks(rep);
	(void)tbr__function_loaded(rep);
	(void)tbr__unknown_command(rep);
	int f = tbr__function_found(rep);
	if (f < -1 || f > 1)
		fail("function_found: out of range");
	if (rep->type == REDIS_REPLY_ERROR || rep->type == REDIS_REPLY_STATUS ||
	    rep->type == REDIS_REPLY_STRING) {
		if (tbr__error(rep->str, rep->len) >= 0)
			fail("error: not negative");
		struct tbr__redirect rd;
		int r = tbr__redirect_parse(rep->str, rep->len, &rd);
		if (r != 0 && r != -EPROTO)
			fail("redirect: an undocumented return");
		if (r == 0 && (rd.slot >= TBR__SLOTS || rd.port < 1 || rd.port > 65535 ||
			       rd.hostlen > TBR__HOST_MAX))
			fail("redirect: out of range");
	}
}

static void parse_public(const uint8_t *cfg, const uint8_t *data, size_t size)
{
	struct tokenbucket_redis_call call = {
		.op = (enum tokenbucket_redis_op)(cfg[1] % 6), .key = "k", .keylen = 1,
		.limit = { .tokens = 1, .period_ns = 1000000000, .burst = 1 + cfg[2] },
		.n = 1, .arg = 1000000000,
	};
	size_t used = 0;
	struct tokenbucket_result res;
	int err = tokenbucket_redis_parse(&call, (const char *)data, size, &used, &res, NULL, NULL);
	if (err > 0 || (err == 0 && used > size))
		fail("parse: out of range");
	if ((err == 0 || err == -ETIMEDOUT) && res.remaining > call.limit.burst)
		fail("parse: more remaining than the burst");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	if (size < 3)
		return 0;
	const uint8_t *cfg = data;
	data += 3;
	size -= 3;
	unsigned which = cfg[0] % 6;
	if (which == 5) {
		parse_public(cfg, data, size);
		return 0;
	}
	struct tbr__bound b = { 0 };
	/* In two parts, as a stream comes in reads. */
	size_t half = size / 2;
	size_t good = tbr__bound_scan(&b, (const char *)data, half);
	if (good == half && !b.bad)
		good += tbr__bound_scan(&b, (const char *)data + half, size - half);
	if (good > size || (b.bad != (good < size) && !b.bad))
		fail("bound_scan: a count of good bytes out of range");
	redisReader *rd = redisReaderCreate();
	if (rd == NULL)
		return 0;
	if (good > 0)
		redisReaderFeed(rd, (const char *)data, good);
	for (int k = 0; k < 4; k++) {
		void *r = NULL;
		if (redisReaderGetReply(rd, &r) != REDIS_OK || r == NULL)
			break;
		const redisReply *rep = r;
		size_t elements = 0;
		check_bounded(rep, 0, &elements);
		switch (which) {
		case 0: decision(cfg, rep); break;
		case 1: decision_all(cfg, rep); break;
		case 2: slots(rep); break;
		case 3: sentinel(rep); break;
		default: probes(rep); break;
		}
		freeReplyObject(r);
	}
	redisReaderFree(rd);
	return 0;
}

#ifdef FUZZ_REPLAY_MAIN
int main(int argc, char **argv)
{
	return fuzz_replay_main(argc, argv, NULL, false, "");
}
#endif
