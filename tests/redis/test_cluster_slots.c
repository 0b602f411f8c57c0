/* SPDX-License-Identifier: MIT */
/*
 * Redis Cluster routing without a server (src/redis/slots.c, compiled in):
 * CRC16 vectors, the hash tag rules, and CLUSTER SLOTS, MOVED and ASK
 * replies, well-formed and hostile.  Replies are made from protocol bytes
 * by hiredis's own reader, as a connection would make them.
 */
#include <check.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <tokenbucket-redis.h>

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
	SRunner *sr = srunner_create(s);
	srunner_run_all(sr, CK_NORMAL);
	int failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
