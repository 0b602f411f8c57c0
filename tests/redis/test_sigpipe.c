/* SPDX-License-Identifier: MIT */
/*
 * The library's writes to a server that has gone: an error, never a
 * SIGPIPE, with the signal at its default action (which would end this
 * process) and unblocked.  src/redis/sigpipe.c compiled in, on socket
 * pairs whose other end is closed: no server, no timing.
 */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <hiredis/hiredis.h>
#include <hiredis/sds.h>

#include "sigpipe.h"

/* A blocking (or not) hiredis context on one end of a socket pair, the other end closed. */
static redisContext *orphan(bool blocking)
{
	int sv[2];
	ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
	close(sv[1]);
	redisContext *c = redisConnectFd(sv[0]);
	ck_assert_ptr_nonnull(c);
	if (!blocking) {
		ck_assert_int_eq(fcntl(sv[0], F_SETFL, O_NONBLOCK), 0);
		c->flags &= ~REDIS_BLOCK;
	}
	return c;
}

static void default_sigpipe(void)
{
	signal(SIGPIPE, SIG_DFL);
	sigset_t pipe;
	sigemptyset(&pipe);
	sigaddset(&pipe, SIGPIPE);
	ck_assert_int_eq(pthread_sigmask(SIG_UNBLOCK, &pipe, NULL), 0);
}

static bool sigpipe_pending(void)
{
	sigset_t pending;
	sigpending(&pending);
	return sigismember(&pending, SIGPIPE);
}

START_TEST(test_write_to_a_closed_peer)
{
	default_sigpipe();
	for (int blocking = 0; blocking <= 1; blocking++) {
		redisContext *c = orphan(blocking);
		ck_assert_int_eq(redisAppendCommand(c, "PING"), REDIS_OK);
		/* Alive to see it: a SIGPIPE would have ended the process. */
		ck_assert_int_eq(tbr__write_nosignal(c), -EPIPE);
		ck_assert_int_eq(c->err, REDIS_ERR_IO);
		ck_assert_ptr_nonnull(strstr(c->errstr, strerror(EPIPE)));
		/* hiredis then writes nothing: its own write sees the error first. */
		int done = 0;
		ck_assert_int_eq(redisBufferWrite(c, &done), REDIS_ERR);
		redisFree(c);
	}
	ck_assert(!sigpipe_pending());
}
END_TEST

START_TEST(test_write_all_and_would_block)
{
	default_sigpipe();
	int sv[2];
	ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
	ck_assert_int_eq(fcntl(sv[0], F_SETFL, O_NONBLOCK), 0);
	redisContext *c = redisConnectFd(sv[0]);
	ck_assert_ptr_nonnull(c);
	c->flags &= ~REDIS_BLOCK;
	ck_assert_int_eq(redisAppendCommand(c, "SET k %s", "v"), REDIS_OK);
	size_t len = sdslen(c->obuf);
	char want[64];
	ck_assert_uint_lt(len, sizeof(want));
	memcpy(want, c->obuf, len);
	ck_assert_int_eq(tbr__write_nosignal(c), 0);
	ck_assert_uint_eq(sdslen(c->obuf), 0);
	char got[64];
	ck_assert_int_eq(read(sv[1], got, sizeof(got)), (ssize_t)len);
	ck_assert(memcmp(got, want, len) == 0);
	/* A full socket: what does not fit stays buffered, in order, for the loop. */
	int small = 4096;
	setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &small, sizeof(small));
	setsockopt(sv[1], SOL_SOCKET, SO_RCVBUF, &small, sizeof(small));
	char big[1 << 16];
	memset(big, 'x', sizeof(big));
	ck_assert_int_eq(redisAppendCommand(c, "SET k %b", big, sizeof(big)), REDIS_OK);
	size_t total = sdslen(c->obuf);
	ck_assert_int_eq(tbr__write_nosignal(c), 1);
	size_t left = sdslen(c->obuf);
	ck_assert(left > 0 && left < total);
	/* Drain and finish: every byte arrives once. */
	size_t seen = 0;
	while (sdslen(c->obuf) > 0 || seen < total) {
		char buf[8192];
		ssize_t r = read(sv[1], buf, sizeof(buf));
		ck_assert(r > 0);
		seen += (size_t)r;
		if (sdslen(c->obuf) > 0)
			ck_assert_int_ge(tbr__write_nosignal(c), 0);
	}
	ck_assert_uint_eq(seen, total);
	redisFree(c);
	close(sv[1]);
}
END_TEST

START_TEST(test_block_discards_its_own)
{
	default_sigpipe();
	redisContext *c = orphan(true);
	ck_assert_int_eq(redisAppendCommand(c, "PING"), REDIS_OK);
	/* hiredis's own write(2), as a connection's setup uses it, within the block. */
	struct tbr__sigpipe sp;
	tbr__sigpipe_block(&sp);
	int done = 0;
	ck_assert_int_eq(redisBufferWrite(c, &done), REDIS_ERR);
	tbr__sigpipe_restore(&sp);
	ck_assert(!sigpipe_pending());
	redisFree(c);
}
END_TEST

Suite *sigpipe_suite(void);
Suite *sigpipe_suite(void)
{
	Suite *s = suite_create("redis-sigpipe");
	TCase *tc = tcase_create("sigpipe");
	tcase_add_test(tc, test_write_to_a_closed_peer);
	tcase_add_test(tc, test_write_all_and_would_block);
	tcase_add_test(tc, test_block_discards_its_own);
	suite_add_tcase(s, tc);
	return s;
}
