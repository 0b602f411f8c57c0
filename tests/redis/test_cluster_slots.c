/* SPDX-License-Identifier: MIT */
/*
 * Redis Cluster routing without a server (src/redis/slots.c, compiled in):
 * CRC16 vectors, the hash tag rules, and CLUSTER SLOTS, MOVED and ASK
 * replies, well-formed and hostile.  Replies are made from protocol bytes
 * by hiredis's own reader, as a connection would make them.  Then the
 * client's call loop against fake nodes on loopback that answer what a
 * real cluster rarely does on cue: endless redirections, TRYAGAIN,
 * CLUSTERDOWN, malformed maps, ASK to a node without the script.
 */
#include <arpa/inet.h>
#include <check.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <tokenbucket-redis.h>

#include "fake.h"
#include "slots.h"

/* The reply that the protocol bytes resp make; the test fails if they do not make one. */
static redisReply *reply(const char *resp)
{
	redisReader *rd = redisReaderCreate();
	ck_assert_ptr_nonnull(rd);
	ck_assert_int_eq(redisReaderFeed(rd, resp, strlen(resp)), REDIS_OK);
	void *r = NULL;
	ck_assert_int_eq(redisReaderGetReply(rd, &r), REDIS_OK);
	ck_assert_ptr_nonnull(r);
	redisReaderFree(rd);
	return r;
}

/* Parses resp as a CLUSTER SLOTS reply: the error, and the ranges in *g (freed by the caller). */
static int parse(const char *resp, struct tbr__range **g, size_t *n)
{
	redisReply *r = reply(resp);
	*g = NULL;
	*n = 0;
	int err = tbr__slots_parse(r, g, n);
	if (err != 0) {
		ck_assert_ptr_null(*g);
		freeReplyObject(r);
		return err;
	}
	/* Keep the hosts readable: copy them out before the reply goes. */
	for (size_t i = 0; i < *n; i++) {
		char *h = strndup((*g)[i].host, (*g)[i].hostlen);
		ck_assert_ptr_nonnull(h);
		(*g)[i].host = h;
	}
	freeReplyObject(r);
	return 0;
}

static void free_ranges(struct tbr__range *g, size_t n)
{
	for (size_t i = 0; i < n; i++)
		free((char *)g[i].host);
	free(g);
}

/* Scales time margins on slow (instrumented) runs. */
static int late(void)
{
	const char *s = getenv("CK_TIMEOUT_MULTIPLIER");
	return s != NULL && atoi(s) > 1 ? atoi(s) : 1;
}

static int slot_of(const char *key)
{
	return (int)tbr__slot(key, strlen(key));
}

START_TEST(test_crc16_vectors)
{
	/* The cluster specification's check value, and CRC16/XMODEM's. */
	ck_assert_uint_eq(tbr__crc16("123456789", 9), 0x31C3);
	ck_assert_uint_eq(tbr__crc16("", 0), 0);
	ck_assert_uint_eq(tbr__crc16("A", 1), 0x58E5);
	/* Every byte value goes through both nibble steps: a bitwise reference. */
	unsigned char all[256];
	for (int i = 0; i < 256; i++)
		all[i] = (unsigned char)i;
	for (size_t len = 0; len <= sizeof(all); len += 17) {
		unsigned crc = 0;
		for (size_t i = 0; i < len; i++) {
			crc ^= (unsigned)all[i] << 8;
			for (int b = 0; b < 8; b++)
				crc = crc & 0x8000 ? ((crc << 1) ^ 0x1021) & 0xffff : (crc << 1) & 0xffff;
		}
		ck_assert_uint_eq(tbr__crc16(all, len), crc);
	}
}
END_TEST

START_TEST(test_slots_of_known_keys)
{
	/* Slots that Redis's CLUSTER KEYSLOT gives for these keys. */
	ck_assert_int_eq(slot_of("foo"), 12182);
	ck_assert_int_eq(slot_of("bar"), 5061);
	ck_assert_int_eq(slot_of("hello"), 866);
	ck_assert_int_eq(slot_of("123456789"), 0x31C3 & 16383);
	ck_assert_int_eq(slot_of(""), 0);
	/* Binary keys: the length counts, not a NUL. */
	ck_assert_int_eq((int)tbr__slot("a\0b", 3), tbr__crc16("a\0b", 3) & 16383);
	ck_assert_int_ne((int)tbr__slot("a\0b", 3), slot_of("a"));
}
END_TEST

START_TEST(test_hash_tags)
{
	int user = slot_of("user");
	/* The tag alone is hashed. */
	ck_assert_int_eq(slot_of("{user}.following"), user);
	ck_assert_int_eq(slot_of("x{user}y"), user);
	ck_assert_int_eq(slot_of("{user}}"), user);
	/* Only the first '{' opens, only the first '}' after it closes. */
	ck_assert_int_eq(slot_of("foo{{bar}}zap"), slot_of("{bar"));
	ck_assert_int_eq(slot_of("foo{bar}{zap}"), slot_of("bar"));
	/* An empty tag, or none closed: the whole key. */
	ck_assert_int_eq(slot_of("{}"), tbr__crc16("{}", 2) & 16383);
	ck_assert_int_eq(slot_of("{"), tbr__crc16("{", 1) & 16383);
	ck_assert_int_eq(slot_of("}{"), tbr__crc16("}{", 2) & 16383);
	ck_assert_int_eq(slot_of("a{}b{c}"), tbr__crc16("a{}b{c}", 7) & 16383);
	ck_assert_int_ne(slot_of("a{}b{c}"), slot_of("c"));
	ck_assert_int_eq(slot_of("{}{user}"), tbr__crc16("{}{user}", 8) & 16383);
	ck_assert_int_eq(slot_of("user{"), tbr__crc16("user{", 5) & 16383);
	/* A tag of one byte, and a '}' at the very end. */
	ck_assert_int_eq(slot_of("{a}"), slot_of("a"));
	ck_assert_int_eq(slot_of("xx{a}"), slot_of("a"));
}
END_TEST

START_TEST(test_public_slot)
{
	ck_assert_int_eq(tokenbucket_redis_slot(NULL, "foo", 3), 12182);
	ck_assert_int_eq(tokenbucket_redis_slot(NULL, NULL, 0), 0);
	ck_assert_int_eq(tokenbucket_redis_slot(NULL, NULL, 1), -EINVAL);
	/* The prefix is part of the key as sent, tag and all. */
	struct tokenbucket_redis *r;
	ck_assert_int_eq(tokenbucket_redis_open(&r, "redis://127.0.0.1:1", 0, 0), 0);
	ck_assert_int_eq(tokenbucket_redis_set_prefix(r, "rl:", 3), 0);
	ck_assert_int_eq(tokenbucket_redis_slot(r, "foo", 3), slot_of("rl:foo"));
	ck_assert_int_eq(tokenbucket_redis_set_prefix(r, "{tenant}:", 9), 0);
	ck_assert_int_eq(tokenbucket_redis_slot(r, "a", 1), slot_of("tenant"));
	ck_assert_int_eq(tokenbucket_redis_slot(r, "b", 1), slot_of("tenant"));
	/* A prefix opening a tag that the key closes. */
	ck_assert_int_eq(tokenbucket_redis_set_prefix(r, "{", 1), 0);
	ck_assert_int_eq(tokenbucket_redis_slot(r, "x}y", 3), slot_of("x"));
	tokenbucket_redis_close(r);
}
END_TEST

START_TEST(test_open_cluster_arguments)
{
	struct tokenbucket_redis *r = NULL;
	const char *good[] = { "redis://127.0.0.1:7000", "redis://localhost" };
	ck_assert_int_eq(tokenbucket_redis_open_cluster(&r, good, 2, 0, 0), 0);
	tokenbucket_redis_close(r);
	ck_assert_int_eq(tokenbucket_redis_open_cluster(NULL, good, 2, 0, 0), -EINVAL);
	ck_assert_int_eq(tokenbucket_redis_open_cluster(&r, NULL, 2, 0, 0), -EINVAL);
	ck_assert_int_eq(tokenbucket_redis_open_cluster(&r, good, 0, 0, 0), -EINVAL);
	const char *bad[][2] = {
		{ "redis://127.0.0.1:7000", NULL },
		{ "redis://127.0.0.1:7000", "unix:/tmp/redis.sock" },
		{ "redis://127.0.0.1:7000", "/tmp/redis.sock" },
		{ "redis://127.0.0.1:7000/1", "redis://127.0.0.1:7001" },
		{ "redis://127.0.0.1:0", "redis://127.0.0.1:7001" },
		{ "redis://:7000", "redis://127.0.0.1:7001" },
		{ "http://127.0.0.1:7000", "redis://127.0.0.1:7001" },
	};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		r = (struct tokenbucket_redis *)&r;
		ck_assert_msg(tokenbucket_redis_open_cluster(&r, bad[i], 2, 0, 0) == -EINVAL, "seeds %zu", i);
		ck_assert_ptr_eq(r, (struct tokenbucket_redis *)&r); /* untouched */
	}
	/* Database 0 by name is database 0. */
	const char *db0[] = { "redis://127.0.0.1:7000/0" };
	ck_assert_int_eq(tokenbucket_redis_open_cluster(&r, db0, 1, 0, 0), 0);
	tokenbucket_redis_close(r);
}
END_TEST

START_TEST(test_slots_parse_good)
{
	struct tbr__range *g;
	size_t n;
	const char *three =
		"*3\r\n"
		"*4\r\n:0\r\n:5460\r\n*3\r\n$9\r\n127.0.0.1\r\n:7000\r\n$2\r\nid\r\n"
		"*3\r\n$9\r\n127.0.0.1\r\n:7003\r\n$2\r\nid\r\n"
		"*3\r\n:5461\r\n:10922\r\n*2\r\n$9\r\n127.0.0.2\r\n:7001\r\n"
		"*3\r\n:10923\r\n:16383\r\n*3\r\n$0\r\n\r\n:7002\r\n$2\r\nid\r\n";
	ck_assert_int_eq(parse(three, &g, &n), 0);
	ck_assert_uint_eq(n, 3);
	ck_assert_uint_eq(g[0].start, 0);
	ck_assert_uint_eq(g[0].end, 5460);
	ck_assert_str_eq(g[0].host, "127.0.0.1");
	ck_assert_int_eq(g[0].port, 7000);
	ck_assert_str_eq(g[1].host, "127.0.0.2");
	ck_assert_int_eq(g[1].port, 7001);
	/* An empty host: the node that answered. */
	ck_assert_uint_eq(g[2].hostlen, 0);
	ck_assert_uint_eq(g[2].end, 16383);
	free_ranges(g, n);

	/* No slots at all (a cluster being made), and one slot alone. */
	ck_assert_int_eq(parse("*0\r\n", &g, &n), 0);
	ck_assert_uint_eq(n, 0);
	free_ranges(g, n);
	ck_assert_int_eq(parse("*1\r\n*3\r\n:16383\r\n:16383\r\n*2\r\n$1\r\nh\r\n:1\r\n", &g, &n), 0);
	ck_assert_uint_eq(n, 1);
	free_ranges(g, n);

	/* An unknown endpoint ("?" or null): the range is left without a primary. */
	ck_assert_int_eq(parse("*2\r\n*3\r\n:0\r\n:9\r\n*2\r\n$1\r\n?\r\n:7000\r\n"
			       "*3\r\n:10\r\n:19\r\n*2\r\n$-1\r\n:7001\r\n", &g, &n), 0);
	ck_assert_uint_eq(n, 0);
	free_ranges(g, n);
}
END_TEST

START_TEST(test_slots_parse_hostile)
{
	static const char *const bad[] = {
		/* Not an array, or arrays of the wrong things. */
		"+OK\r\n",
		":3\r\n",
		"$5\r\nslots\r\n",
		"*1\r\n:0\r\n",
		"*1\r\n*-1\r\n",
		/* Missing fields. */
		"*1\r\n*2\r\n:0\r\n:10\r\n",
		"*1\r\n*3\r\n:0\r\n:10\r\n*1\r\n$1\r\nh\r\n",
		"*1\r\n*3\r\n:0\r\n:10\r\n*0\r\n",
		/* Wrong types. */
		"*1\r\n*3\r\n$1\r\n0\r\n:10\r\n*2\r\n$1\r\nh\r\n:7000\r\n",
		"*1\r\n*3\r\n:0\r\n$2\r\n10\r\n*2\r\n$1\r\nh\r\n:7000\r\n",
		"*1\r\n*3\r\n:0\r\n:10\r\n$1\r\nh\r\n",
		"*1\r\n*3\r\n:0\r\n:10\r\n*2\r\n:1\r\n:7000\r\n",
		"*1\r\n*3\r\n:0\r\n:10\r\n*2\r\n$1\r\nh\r\n$4\r\n7000\r\n",
		"*1\r\n*3\r\n:0\r\n:10\r\n*2\r\n*0\r\n:7000\r\n",
		/* Slots out of range, reversed. */
		"*1\r\n*3\r\n:-1\r\n:10\r\n*2\r\n$1\r\nh\r\n:7000\r\n",
		"*1\r\n*3\r\n:0\r\n:16384\r\n*2\r\n$1\r\nh\r\n:7000\r\n",
		"*1\r\n*3\r\n:9223372036854775807\r\n:1\r\n*2\r\n$1\r\nh\r\n:7000\r\n",
		"*1\r\n*3\r\n:11\r\n:10\r\n*2\r\n$1\r\nh\r\n:7000\r\n",
		/* Ports out of range. */
		"*1\r\n*3\r\n:0\r\n:10\r\n*2\r\n$1\r\nh\r\n:0\r\n",
		"*1\r\n*3\r\n:0\r\n:10\r\n*2\r\n$1\r\nh\r\n:65536\r\n",
		"*1\r\n*3\r\n:0\r\n:10\r\n*2\r\n$1\r\nh\r\n:-7000\r\n",
		/* Overlapping ranges, and one range twice. */
		"*2\r\n*3\r\n:0\r\n:10\r\n*2\r\n$1\r\nh\r\n:7000\r\n*3\r\n:10\r\n:20\r\n*2\r\n$1\r\ni\r\n:7001\r\n",
		"*2\r\n*3\r\n:5\r\n:5\r\n*2\r\n$1\r\nh\r\n:7000\r\n*3\r\n:0\r\n:16383\r\n*2\r\n$1\r\nh\r\n:7000\r\n",
	};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		redisReader *rd = redisReaderCreate();
		ck_assert_int_eq(redisReaderFeed(rd, bad[i], strlen(bad[i])), REDIS_OK);
		void *r = NULL;
		ck_assert_int_eq(redisReaderGetReply(rd, &r), REDIS_OK);
		ck_assert_msg(r != NULL, "reply %zu incomplete", i);
		struct tbr__range *g = (struct tbr__range *)&g;
		size_t n = 77;
		ck_assert_msg(tbr__slots_parse(r, &g, &n) == -EPROTO, "reply %zu accepted", i);
		ck_assert_ptr_eq(g, (struct tbr__range *)&g); /* outputs untouched */
		ck_assert_uint_eq(n, 77);
		freeReplyObject(r);
		redisReaderFree(rd);
	}
	/* A host with a NUL in it. */
	static const char nul[] = "*1\r\n*3\r\n:0\r\n:10\r\n*2\r\n$3\r\na\0b\r\n:7000\r\n";
	redisReader *rd = redisReaderCreate();
	ck_assert_int_eq(redisReaderFeed(rd, nul, sizeof(nul) - 1), REDIS_OK);
	void *r = NULL;
	ck_assert_int_eq(redisReaderGetReply(rd, &r), REDIS_OK);
	ck_assert_ptr_nonnull(r);
	struct tbr__range *g;
	size_t n;
	ck_assert_int_eq(tbr__slots_parse(r, &g, &n), -EPROTO);
	freeReplyObject(r);
	redisReaderFree(rd);
	/* A host longer than a DNS name. */
	char big[400];
	int len = snprintf(big, sizeof(big), "*1\r\n*3\r\n:0\r\n:1\r\n*2\r\n$300\r\n%0300d\r\n:7000\r\n", 0);
	ck_assert_int_lt(len, (int)sizeof(big));
	ck_assert_int_eq(parse(big, &g, &n), -EPROTO);
	ck_assert_int_eq(tbr__slots_parse(NULL, &g, &n), -EINVAL);
}
END_TEST

static int redirect(const char *s, struct tbr__redirect *rd)
{
	return tbr__redirect_parse(s, strlen(s), rd);
}

START_TEST(test_redirects)
{
	struct tbr__redirect rd;
	ck_assert_int_eq(redirect("MOVED 3999 127.0.0.1:6381", &rd), 0);
	ck_assert(!rd.ask);
	ck_assert_uint_eq(rd.slot, 3999);
	ck_assert_uint_eq(rd.hostlen, 9);
	ck_assert(memcmp(rd.host, "127.0.0.1", 9) == 0);
	ck_assert_int_eq(rd.port, 6381);
	ck_assert_int_eq(redirect("ASK 0 redis-2.example:1", &rd), 0);
	ck_assert(rd.ask);
	ck_assert_uint_eq(rd.slot, 0);
	ck_assert_int_eq(rd.port, 1);
	/* IPv6: the last colon separates the port. */
	ck_assert_int_eq(redirect("MOVED 16383 ::1:7000", &rd), 0);
	ck_assert_uint_eq(rd.slot, 16383);
	ck_assert_uint_eq(rd.hostlen, 3);
	ck_assert_int_eq(rd.port, 7000);
	/* An empty host: the node that sent it (Redis 7, unknown endpoint). */
	ck_assert_int_eq(redirect("MOVED 1 :7000", &rd), 0);
	ck_assert_uint_eq(rd.hostlen, 0);

	static const char *const bad[] = {
		"MOVED", "MOVED ", "MOVED 1", "MOVED 1 ", "MOVED 16384 h:1", "MOVED 99999999 h:1",
		"MOVED x h:1", "MOVED -1 h:1", "MOVED 1 h", "MOVED 1 h:", "MOVED 1 h:0",
		"MOVED 1 h:65536", "MOVED 1 h:123456", "MOVED 1 h:7x", "MOVED 1  h:7",
		"MOVED 1 a b:7", "ASK", "ASKING 1 h:7", "moved 1 h:7", "TRYAGAIN", "",
	};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		rd.slot = 12345;
		ck_assert_msg(redirect(bad[i], &rd) == -EPROTO, "\"%s\" accepted", bad[i]);
		ck_assert_uint_eq(rd.slot, 12345);
	}
	ck_assert_int_eq(tbr__redirect_parse(NULL, 0, &rd), -EINVAL);
}
END_TEST


/* ---- A fake cluster node on loopback: scripted answers, every command logged ---- */

struct fake {
	struct fake_server srv;
	int port; /* srv's */
	pthread_mutex_t lock;
	char log[4096];  /* the commands' names, space-separated */
	int evals;       /* EVALSHA and EVAL received */
	/* The answer to a command (argv[0] upper-cased): protocol bytes into out. */
	void (*answer)(struct fake *f, int argc, char **argv, char *out, size_t size);
	struct fake *peer; /* another fake a redirection may name */
	long delay_ms;     /* how long answer_tryagain takes to answer a script */
};

/* A script reply that decodes as "allowed, 5 left". */
static const char allowed_reply[] =
	"*7\r\n:1\r\n$1\r\n0\r\n$1\r\n5\r\n$1\r\n0\r\n$1\r\n1\r\n$1\r\n0\r\n$1\r\n0\r\n";

static size_t reply_one(struct fake_server *srv, redisReply *cmd, char *out, size_t size)
{
	struct fake *f = (struct fake *)((char *)srv - offsetof(struct fake, srv));
	char *argv[16] = { 0 };
	int argc = 0;
	for (size_t i = 0; i < cmd->elements && i < 16; i++)
		argv[argc++] = cmd->element[i]->str;
	for (char *c = argv[0]; c != NULL && *c; c++)
		*c = (char)(*c >= 'a' && *c <= 'z' ? *c - 32 : *c);
	pthread_mutex_lock(&f->lock);
	size_t used = strlen(f->log);
	snprintf(f->log + used, sizeof(f->log) - used, "%s ", argv[0] != NULL ? argv[0] : "?");
	f->evals += argv[0] != NULL && strncmp(argv[0], "EVAL", 4) == 0;
	pthread_mutex_unlock(&f->lock);
	if (argv[0] != NULL && strcmp(argv[0], "ASKING") == 0)
		snprintf(out, size, "+OK\r\n");
	else
		f->answer(f, argc, argv, out, size);
	return strlen(out);
}

static void fake_start(struct fake *f,
		       void (*answer)(struct fake *, int, char **, char *, size_t), struct fake *peer)
{
	memset(f, 0, sizeof(*f));
	pthread_mutex_init(&f->lock, NULL);
	f->answer = answer;
	f->peer = peer;
	fake_server_bind(&f->srv, reply_one);
	f->port = f->srv.port;
	fake_server_run(&f->srv);
}

/* The scripts received so far (the fake's thread counts them). */
static int evals(struct fake *f)
{
	pthread_mutex_lock(&f->lock);
	int n = f->evals;
	pthread_mutex_unlock(&f->lock);
	return n;
}

static void fake_stop(struct fake *f)
{
	fake_server_stop(&f->srv);
	pthread_mutex_destroy(&f->lock);
}

/* A cluster client of the fake alone, with a timeout of timeout_ms. */
static struct tokenbucket_redis *fake_client(const struct fake *f, int timeout_ms)
{
	char seed[64];
	snprintf(seed, sizeof(seed), "redis://127.0.0.1:%d", f->port);
	const char *seeds[] = { seed };
	struct tokenbucket_redis *r;
	ck_assert_int_eq(tokenbucket_redis_open_cluster(&r, seeds, 1, 200 * 1000000,
							(int64_t)timeout_ms * 1000000), 0);
	return r;
}

static const struct tokenbucket_redis_limit lim = { .tokens = 1, .period_ns = 1000000, .burst = 5 };

static int64_t allow_ms(struct tokenbucket_redis *r, const char *key, int *err)
{
	struct tokenbucket_result res;
	int64_t t0 = tokenbucket_now();
	*err = tokenbucket_redis_allow(r, key, strlen(key), &lim, 1, &res);
	return (tokenbucket_now() - t0) / 1000000;
}

static void answer_moved_to_self(struct fake *f, int argc, char **argv, char *out, size_t size)
{
	(void)argc;
	if (strcmp(argv[0], "CLUSTER") == 0)
		snprintf(out, size, "*0\r\n");
	else
		snprintf(out, size, "-MOVED 12182 :%d\r\n", f->port); /* empty host: this node's */
}

START_TEST(test_redirect_loop)
{
	struct fake f;
	fake_start(&f, answer_moved_to_self, NULL);
	struct tokenbucket_redis *r = fake_client(&f, 2000);
	int err;
	int64_t ms = allow_ms(r, "foo", &err);
	ck_assert_int_eq(err, -ELOOP);
	/* The first attempt and 16 redirections, then no more, long before the timeout. */
	ck_assert_int_eq(evals(&f), 17);
	ck_assert_int_lt(ms, 1000);
	tokenbucket_redis_close(r);
	fake_stop(&f);
}
END_TEST

static void answer_tryagain(struct fake *f, int argc, char **argv, char *out, size_t size)
{
	(void)argc;
	bool map = strcmp(argv[0], "CLUSTER") == 0;
	if (!map && f->delay_ms > 0)
		nanosleep(&(struct timespec){ .tv_sec = 0, .tv_nsec = f->delay_ms * 1000000 }, NULL);
	snprintf(out, size, "%s", map ? "*0\r\n" : "-TRYAGAIN Multiple keys request during rehashing of slot\r\n");
}

static void answer_clusterdown(struct fake *f, int argc, char **argv, char *out, size_t size)
{
	/* The map too: a node of a cluster that lost its quorum. */
	(void)f;
	(void)argc;
	(void)argv;
	snprintf(out, size, "-CLUSTERDOWN The cluster is down\r\n");
}

START_TEST(test_not_ready_until_the_timeout)
{
	void (*answers[])(struct fake *, int, char **, char *, size_t) = { answer_tryagain, answer_clusterdown };
	for (int i = 0; i < 2; i++) {
		struct fake f;
		fake_start(&f, answers[i], NULL);
		struct tokenbucket_redis *r = fake_client(&f, 300);
		int err;
		int64_t ms = allow_ms(r, "foo", &err);
		/* Tried again and again (each a call that did not run), then -EAGAIN at the timeout. */
		ck_assert_int_eq(err, -EAGAIN);
		ck_assert_msg(ms >= 270 && ms < 300 + 300 * late(), "took %lld ms", (long long)ms);
		ck_assert_int_gt(evals(&f), 3);
		tokenbucket_redis_close(r);
		fake_stop(&f);
	}
}
END_TEST

START_TEST(test_not_ready_slowly)
{
	/*
	 * Answers 45 ms late: a retry sent with less than that left would time
	 * out (-ETIME, outcome unknown); the client stops at the last answer
	 * it knows instead.
	 */
	struct fake f;
	fake_start(&f, answer_tryagain, NULL);
	f.delay_ms = 45;
	struct tokenbucket_redis *r = fake_client(&f, 300);
	int err;
	int64_t ms = allow_ms(r, "foo", &err);
	ck_assert_int_eq(err, -EAGAIN);
	ck_assert_msg(ms < 300 + 300 * late(), "took %lld ms", (long long)ms);
	/* How many fit depends on the round trips (fewer under a sanitizer). */
	ck_assert_int_ge(evals(&f), 1);
	tokenbucket_redis_close(r);
	fake_stop(&f);
}
END_TEST

START_TEST(test_down_goes_to_the_fallback)
{
	/* With a fallback, CLUSTERDOWN makes allow and reserve decide locally on the first answer. */
	struct fake f;
	fake_start(&f, answer_clusterdown, NULL);
	struct tokenbucket_redis *r = fake_client(&f, 5000);
	ck_assert_int_eq(tokenbucket_redis_set_fallback(r, 0.5), 0);
	struct tokenbucket_result res;
	ck_assert_int_eq(tokenbucket_redis_allow(r, "foo", 3, &lim, 1, &res), 0);
	ck_assert_uint_eq(res.flags, TOKENBUCKET_RESULT_LOCAL);
	ck_assert(res.allowed);
	ck_assert_int_eq(evals(&f), 1);
	struct tokenbucket_reservation rv;
	ck_assert_int_eq(tokenbucket_redis_reserve(r, "foo", 3, &lim, 1, TOKENBUCKET_NEVER, &rv, &res), 0);
	ck_assert_uint_eq(res.flags, TOKENBUCKET_RESULT_LOCAL);
	ck_assert_int_eq(evals(&f), 2);
	tokenbucket_redis_close(r);
	fake_stop(&f);
	/* TRYAGAIN (a slot on the move) is still tried again until the timeout. */
	fake_start(&f, answer_tryagain, NULL);
	r = fake_client(&f, 300);
	ck_assert_int_eq(tokenbucket_redis_set_fallback(r, 0.5), 0);
	ck_assert_int_eq(tokenbucket_redis_allow(r, "foo", 3, &lim, 1, &res), 0);
	ck_assert_uint_eq(res.flags, TOKENBUCKET_RESULT_LOCAL);
	ck_assert_int_gt(evals(&f), 3);
	tokenbucket_redis_close(r);
	fake_stop(&f);
}
END_TEST

/* Hostile maps, one a connection; the call itself is answered. */
static void answer_hostile_map(struct fake *f, int argc, char **argv, char *out, size_t size)
{
	(void)argc;
	static const char *const maps[] = {
		"*2\r\n*3\r\n:0\r\n:16383\r\n*2\r\n$9\r\n127.0.0.1\r\n:1\r\n*3\r\n:5\r\n:5\r\n*2\r\n$1\r\nh\r\n:2\r\n",
		"*1\r\n*3\r\n:0\r\n:99999\r\n*2\r\n$9\r\n127.0.0.1\r\n:1\r\n",
		"*1\r\n:7\r\n",
		"$5\r\nslots\r\n",
	};
	if (strcmp(argv[0], "CLUSTER") == 0)
		snprintf(out, size, "%s", maps[f->evals % 4]);
	else
		snprintf(out, size, "%s", allowed_reply);
}

START_TEST(test_hostile_map_is_not_used)
{
	struct fake f;
	fake_start(&f, answer_hostile_map, NULL);
	struct tokenbucket_redis *r = fake_client(&f, 1000);
	/* Each map names port 1 (nobody) for every slot, but is malformed: the
	 * client keeps sending to the seed, which answers. */
	for (int i = 0; i < 8; i++) {
		int err;
		allow_ms(r, "foo", &err);
		ck_assert_int_eq(err, 0);
	}
	ck_assert_int_eq(evals(&f), 8);
	tokenbucket_redis_close(r);
	fake_stop(&f);
}
END_TEST

/* The first node: ASK to its peer for the first call, then answers itself; NOSCRIPT once. */
static void answer_ask_first(struct fake *f, int argc, char **argv, char *out, size_t size)
{
	(void)argc;
	if (strcmp(argv[0], "CLUSTER") == 0)
		snprintf(out, size, "*1\r\n*3\r\n:0\r\n:16383\r\n*2\r\n$0\r\n\r\n:%d\r\n", f->port);
	else if (f->evals == 1)
		snprintf(out, size, "-ASK 12182 127.0.0.1:%d\r\n", f->peer->port);
	else
		snprintf(out, size, "%s", allowed_reply);
}

/* The peer: NOSCRIPT to EVALSHA, the answer to EVAL. */
static void answer_noscript(struct fake *f, int argc, char **argv, char *out, size_t size)
{
	(void)f;
	(void)argc;
	snprintf(out, size, "%s", strcmp(argv[0], "EVALSHA") == 0 ? "-NOSCRIPT No matching script.\r\n" : allowed_reply);
}

START_TEST(test_ask_then_noscript)
{
	struct fake a, b;
	fake_start(&b, answer_noscript, NULL);
	fake_start(&a, answer_ask_first, &b);
	struct tokenbucket_redis *r = fake_client(&a, 1000);
	int err;
	allow_ms(r, "foo", &err);
	ck_assert_int_eq(err, 0);
	/*
	 * The module's and the function library's questions on the new
	 * connection (the peer answers neither), ASKING before each attempt,
	 * the script's text after NOSCRIPT.
	 */
	pthread_mutex_lock(&b.lock);
	ck_assert_str_eq(b.log, "TOKENBUCKET.VERSION FCALL ASKING EVALSHA ASKING EVAL ");
	pthread_mutex_unlock(&b.lock);
	/* ASK changes no map: the next call goes to the first node again. */
	allow_ms(r, "foo", &err);
	ck_assert_int_eq(err, 0);
	ck_assert_int_eq(evals(&b), 2);
	ck_assert_int_eq(evals(&a), 2);
	tokenbucket_redis_close(r);
	fake_stop(&a);
	fake_stop(&b);
}
END_TEST

/* "foo" MOVED to the peer: the slot follows at once, the next call goes straight there. */
static void answer_moved_to_peer(struct fake *f, int argc, char **argv, char *out, size_t size)
{
	if (strcmp(argv[0], "CLUSTER") == 0)
		snprintf(out, size, "-ERR busy\r\n");
	else if (argc > 3 && strcmp(argv[3], "foo") == 0)
		snprintf(out, size, "-MOVED 12182 127.0.0.1:%d\r\n", f->peer->port);
	else
		snprintf(out, size, "%s", allowed_reply);
}

static void answer_allowed(struct fake *f, int argc, char **argv, char *out, size_t size)
{
	(void)f;
	(void)argc;
	snprintf(out, size, "%s", strcmp(argv[0], "CLUSTER") == 0 ? "-ERR busy\r\n" : allowed_reply);
}

START_TEST(test_moved_updates_the_slot)
{
	struct fake a, b;
	fake_start(&b, answer_allowed, NULL);
	fake_start(&a, answer_moved_to_peer, &b);
	struct tokenbucket_redis *r = fake_client(&a, 1000);
	int err;
	for (int i = 0; i < 3; i++) {
		allow_ms(r, "foo", &err);
		ck_assert_int_eq(err, 0);
	}
	/* One MOVED, then straight to the new owner. */
	ck_assert_int_eq(evals(&a), 1);
	ck_assert_int_eq(evals(&b), 3);
	/* No node gives a map here, so a slot nobody named goes to any known node. */
	allow_ms(r, "bar", &err);
	ck_assert_int_eq(err, 0);
	ck_assert_int_eq(evals(&a) + evals(&b), 5);
	tokenbucket_redis_close(r);
	fake_stop(&a);
	fake_stop(&b);
}
END_TEST

/* test_sigpipe.c: the library's writes, on socket pairs. */
Suite *sigpipe_suite(void);
/* test_redis_hostile.c: hostile and broken servers, faked. */
Suite *hostile_suite(void);

/* The suites of this program; CK_RUN_SUITE picks one (cluster-slots, redis-sigpipe, redis-hostile). */
int main(void)
{
	Suite *s = suite_create("cluster-slots");
	TCase *tc = tcase_create("slots");
	tcase_add_test(tc, test_crc16_vectors);
	tcase_add_test(tc, test_slots_of_known_keys);
	tcase_add_test(tc, test_hash_tags);
	tcase_add_test(tc, test_public_slot);
	tcase_add_test(tc, test_open_cluster_arguments);
	tcase_add_test(tc, test_slots_parse_good);
	tcase_add_test(tc, test_slots_parse_hostile);
	tcase_add_test(tc, test_redirects);
	suite_add_tcase(s, tc);
	TCase *net = tcase_create("fake-nodes");
	tcase_set_timeout(net, 30);
	tcase_add_test(net, test_redirect_loop);
	tcase_add_test(net, test_not_ready_until_the_timeout);
	tcase_add_test(net, test_not_ready_slowly);
	tcase_add_test(net, test_down_goes_to_the_fallback);
	tcase_add_test(net, test_hostile_map_is_not_used);
	tcase_add_test(net, test_ask_then_noscript);
	tcase_add_test(net, test_moved_updates_the_slot);
	suite_add_tcase(s, net);
	SRunner *sr = srunner_create(s);
	srunner_add_suite(sr, sigpipe_suite());
	srunner_add_suite(sr, hostile_suite());
	srunner_run_all(sr, CK_NORMAL);
	int failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
