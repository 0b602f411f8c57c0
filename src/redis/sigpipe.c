/* SPDX-License-Identifier: MIT */
/*
 * hiredis writes with write(2), which raises SIGPIPE when the server has
 * gone; the library never lets that reach the process.
 */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include <hiredis/sds.h>

#include "sigpipe.h"
#include "sleep.h"
#include "tokenbucket.h"

void tbr__sigpipe_block(struct tbr__sigpipe *s)
{
	sigset_t pipe, pending;
	sigemptyset(&pipe);
	sigaddset(&pipe, SIGPIPE);
	sigpending(&pending);
	s->pending_before = sigismember(&pending, SIGPIPE);
	pthread_sigmask(SIG_BLOCK, &pipe, &s->old);
}

void tbr__sigpipe_restore(struct tbr__sigpipe *s)
{
	sigset_t pipe, pending;
	sigemptyset(&pipe);
	sigaddset(&pipe, SIGPIPE);
	sigpending(&pending);
	if (!s->pending_before && sigismember(&pending, SIGPIPE)) {
		struct timespec zero = { 0, 0 };
		int saved = errno;
		sigtimedwait(&pipe, NULL, &zero);
		errno = saved;
	}
	pthread_sigmask(SIG_SETMASK, &s->old, NULL);
}

int tbr__write_nosignal(redisContext *c)
{
	size_t len = sdslen(c->obuf);
	size_t off = 0;
	while (off < len) {
		ssize_t w = send(c->fd, c->obuf + off, len - off, MSG_NOSIGNAL);
		if (w > 0) {
			off += (size_t)w;
			continue;
		}
		int e = w < 0 ? errno : EIO;
		if (e == EINTR)
			continue;
		sdsrange(c->obuf, (ssize_t)off, -1);
		if ((e == EAGAIN || e == EWOULDBLOCK) && (c->flags & REDIS_BLOCK) == 0)
			return 1;
		/* As hiredis's own write would leave it: c is not used again. */
		c->err = REDIS_ERR_IO;
		snprintf(c->errstr, sizeof(c->errstr), "%s", strerror(e));
		return -e;
	}
	sdsrange(c->obuf, (ssize_t)len, -1);
	return 0;
}

/*
 * What redisBufferRead does, with the bytes bounded (b) before the reader
 * has them: a stream past a bound fails c as a protocol error on the read
 * after the replies before that point.
 */
static int read_bounded(redisContext *c, struct tbr__bound *b)
{
	if (b->bad) {
		/* What came before the bound passed has been read: now c fails. */
		c->err = REDIS_ERR_PROTOCOL;
		snprintf(c->errstr, sizeof(c->errstr), "A reply longer than any the call can have");
		errno = EPROTO;
		return -1;
	}
	char buf[16 * 1024];
	ssize_t n;
	do
		n = recv(c->fd, buf, sizeof(buf), 0);
	while (n < 0 && errno == EINTR);
	if (n <= 0) {
		int e = errno;
		c->err = n == 0 ? REDIS_ERR_EOF : REDIS_ERR_IO;
		snprintf(c->errstr, sizeof(c->errstr), "%s",
			 n == 0 ? "Server closed the connection" : strerror(e));
		errno = e;
		return -1;
	}
	size_t good = tbr__bound_scan(b, buf, (size_t)n);
	if (good > 0 && redisReaderFeed(c->reader, buf, good) != REDIS_OK) {
		c->err = REDIS_ERR_OOM;
		snprintf(c->errstr, sizeof(c->errstr), "Out of memory");
		return -1;
	}
	return 0;
}

/* How far past its deadline a read may end rather than set its socket's timeout again. */
#define TBR__READ_SLACK_NS INT64_C(1000000)

int tbr__read_by(redisContext *c, struct tbr__bound *b, int64_t deadline, int64_t *timeout_ns,
		redisReply **rep)
{
	void *r = NULL;
	for (;;) {
		if (redisGetReplyFromReader(c, &r) != REDIS_OK)
			return 1;
		if (r != NULL)
			break;
		int64_t left = deadline - tokenbucket_now();
		/* Under a microsecond of socket timeout would mean none at all to the kernel. */
		if (left < 1000)
			return -ETIME;
		if (left < *timeout_ns - TBR__READ_SLACK_NS) {
			if (redisSetTimeout(c, tb__timeval_of(left)) != REDIS_OK)
				return 1;
			*timeout_ns = left;
		}
		errno = 0;
		if (read_bounded(c, b) != 0)
			return 1;
	}
	*rep = r;
	return 0;
}
