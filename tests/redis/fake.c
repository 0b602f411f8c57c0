/* SPDX-License-Identifier: MIT */
/* A fake Redis server on loopback (fake.h). */
#include <arpa/inet.h>
#include <check.h>
#include <netinet/in.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "fake.h"

#define FAKE_CONNS 16

/* Writes out a byte at a time, s->trickle_ns apart, until s stops. */
static void trickle(struct fake_server *s, int fd, const char *out, size_t len, bool *closed)
{
	for (size_t i = 0; i < len && !atomic_load(&s->stop); i++) {
		struct timespec ts = { .tv_sec = s->trickle_ns / 1000000000, .tv_nsec = s->trickle_ns % 1000000000 };
		nanosleep(&ts, NULL);
		if (send(fd, out + i, 1, MSG_NOSIGNAL) < 0) {
			*closed = true;
			return;
		}
	}
}

static void serve(struct fake_server *s, int fd, redisReader *rd, bool *closed)
{
	char buf[65536];
	ssize_t n = read(fd, buf, sizeof(buf));
	if (n <= 0) {
		*closed = true;
		return;
	}
	redisReaderFeed(rd, buf, (size_t)n);
	void *r;
	while (redisReaderGetReply(rd, &r) == REDIS_OK && r != NULL) {
		if (s->hang_up) {
			freeReplyObject(r);
			*closed = true;
			return;
		}
		char out[4096];
		size_t len = s->reply(s, r, out, sizeof(out));
		freeReplyObject(r);
		if (s->trickle_ns > 0)
			trickle(s, fd, out, len, closed);
		else if (send(fd, out, len, MSG_NOSIGNAL) < 0)
			*closed = true;
	}
}

static void *fake_main(void *arg)
{
	struct fake_server *s = arg;
	struct pollfd p[FAKE_CONNS + 1];
	redisReader *rd[FAKE_CONNS + 1] = { 0 };
	int n = 1;
	p[0] = (struct pollfd){ .fd = s->listen_fd, .events = POLLIN };
	while (!atomic_load(&s->stop)) {
		if (poll(p, (nfds_t)n, 20) <= 0)
			continue;
		if ((p[0].revents & POLLIN) && n <= FAKE_CONNS) {
			int fd = accept(s->listen_fd, NULL, NULL);
			if (fd >= 0) {
				atomic_fetch_add(&s->accepted, 1);
				if (s->greeting != NULL && send(fd, s->greeting, s->greeting_len, MSG_NOSIGNAL) < 0) {
					close(fd);
					continue;
				}
				p[n] = (struct pollfd){ .fd = fd, .events = POLLIN };
				rd[n++] = redisReaderCreate();
			}
		}
		for (int i = 1; i < n; i++) {
			bool closed = false;
			if (p[i].revents & (POLLIN | POLLHUP | POLLERR))
				serve(s, p[i].fd, rd[i], &closed);
			if (closed) {
				close(p[i].fd);
				redisReaderFree(rd[i]);
				p[i] = p[n - 1];
				rd[i] = rd[n - 1];
				n--;
				i--;
			}
		}
	}
	for (int i = 1; i < n; i++) {
		close(p[i].fd);
		redisReaderFree(rd[i]);
	}
	return NULL;
}

void fake_server_bind(struct fake_server *s,
		      size_t (*reply)(struct fake_server *, redisReply *, char *, size_t))
{
	memset(s, 0, sizeof(*s));
	s->reply = reply;
	s->listen_fd = socket(AF_INET, SOCK_STREAM, 0);
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	socklen_t len = sizeof(a);
	ck_assert_int_eq(bind(s->listen_fd, (struct sockaddr *)&a, sizeof(a)), 0);
	ck_assert_int_eq(listen(s->listen_fd, 16), 0);
	ck_assert_int_eq(getsockname(s->listen_fd, (struct sockaddr *)&a, &len), 0);
	s->port = ntohs(a.sin_port);
}

void fake_server_run(struct fake_server *s)
{
	ck_assert_int_eq(pthread_create(&s->thread, NULL, fake_main, s), 0);
}

void fake_server_stop(struct fake_server *s)
{
	atomic_store(&s->stop, true);
	pthread_join(s->thread, NULL);
	close(s->listen_fd);
}
