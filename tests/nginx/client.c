/* SPDX-License-Identifier: MIT */
/*
 * A small HTTP/1.1 client for the nginx tests: sends N GET requests on one
 * keep-alive connection (reconnecting when the server closes it), one every
 * INTERVAL microseconds (0: back to back), and prints one line per response:
 *
 *   <CLOCK_MONOTONIC ns when sent> <status> <remaining or -> <Retry-After or ->
 *   <ns the response took>
 *
 * remaining is RateLimit's r= (the draft's field) or RateLimit-Remaining.
 *
 *   tbnginx-client PORT N INTERVAL_US PATH [HEADER ...]
 *   tbnginx-client port        (prints a free loopback port the kernel chose)
 *
 * "%d" in a header is replaced by the request's index, for distinct keys
 * (from N - 1 down to 0 when TBNGINX_REVERSE is set).
 * Times are absolute, so that the lines of clients run at once compare.
 * Exit 0 when every request got a response, 1 otherwise.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static int64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static int connect_to(int port)
{
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons((uint16_t)port) };
	int one = 1, fd = socket(AF_INET, SOCK_STREAM, 0);
	a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	if (fd < 0)
		return -1;
	setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
	if (connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0) {
		close(fd);
		return -1;
	}
	return fd;
}

static int write_all(int fd, const char *p, size_t n)
{
	while (n > 0) {
		ssize_t w = write(fd, p, n);
		if (w < 0 && errno == EINTR)
			continue;
		if (w <= 0)
			return -1;
		p += w;
		n -= (size_t)w;
	}
	return 0;
}

/* The value of header name in the head (NUL-terminated), copied into out. */
static void header(const char *head, const char *name, char *out, size_t size)
{
	size_t len = strlen(name);
	snprintf(out, size, "-");
	for (const char *p = strstr(head, "\r\n"); p != NULL; p = strstr(p + 2, "\r\n")) {
		if (strncasecmp(p + 2, name, len) == 0 && p[2 + len] == ':') {
			const char *v = p + 3 + len;
			while (*v == ' ')
				v++;
			size_t n = strcspn(v, "\r");
			if (n >= size)
				n = size - 1;
			memcpy(out, v, n);
			out[n] = '\0';
			return;
		}
	}
}

/* One response: its status and head; 1 if the server will close. -1 on error. */
static int response(int fd, int *status, char *head, size_t size)
{
	static char buf[65536];
	size_t have = 0;
	char *end;
	for (;;) {
		ssize_t r = read(fd, buf + have, sizeof(buf) - 1 - have);
		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0)
			return -1;
		have += (size_t)r;
		buf[have] = '\0';
		if ((end = strstr(buf, "\r\n\r\n")) != NULL)
			break;
		if (have == sizeof(buf) - 1)
			return -1;
	}
	size_t hlen = (size_t)(end - buf) + 4;
	snprintf(head, size, "%.*s", (int)hlen, buf);
	if (sscanf(buf, "HTTP/1.%*d %d", status) != 1)
		return -1;
	char cl[32], conn[32];
	header(head, "Content-Length", cl, sizeof(cl));
	header(head, "Connection", conn, sizeof(conn));
	long body = cl[0] == '-' ? 0 : atol(cl);
	long got = (long)(have - hlen);
	while (got < body) {
		ssize_t r = read(fd, buf, sizeof(buf));
		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0)
			return -1;
		got += r;
	}
	return strcasecmp(conn, "close") == 0;
}

/* A port the kernel picks on loopback, released for the server to take. */
static int free_port(void)
{
	struct sockaddr_in a = { .sin_family = AF_INET };
	socklen_t len = sizeof(a);
	int fd = socket(AF_INET, SOCK_STREAM, 0);
	a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof(a)) != 0 ||
	    getsockname(fd, (struct sockaddr *)&a, &len) != 0)
		return 1;
	printf("%d\n", ntohs(a.sin_port));
	close(fd);
	return 0;
}

int main(int argc, char **argv)
{
	if (argc == 2 && strcmp(argv[1], "port") == 0)
		return free_port();
	if (argc < 5) {
		fprintf(stderr, "usage: %s PORT N INTERVAL_US PATH [HEADER ...]\n", argv[0]);
		return 2;
	}
	int port = atoi(argv[1]);
	long n = atol(argv[2]);
	int64_t interval = atoll(argv[3]) * 1000;
	const char *path = argv[4];
	int fd = -1, failed = 0;
	int64_t start = now_ns();
	static char req[8192], head[16384];

	int reverse = getenv("TBNGINX_REVERSE") != NULL;
	setvbuf(stdout, NULL, _IOLBF, 0);
	for (long i = 0; i < n; i++) {
		int64_t due = start + i * interval, t = now_ns();
		if (due > t) {
			struct timespec ts = { .tv_sec = due / 1000000000, .tv_nsec = due % 1000000000 };
			while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
				;
		}
		int len = snprintf(req, sizeof(req), "GET %s HTTP/1.1\r\nHost: localhost\r\n", path);
		for (int h = 5; h < argc; h++) {
			const char *pct = strstr(argv[h], "%d");
			if (pct != NULL)
				len += snprintf(req + len, sizeof(req) - (size_t)len, "%.*s%ld%s\r\n",
						(int)(pct - argv[h]), argv[h], reverse ? n - 1 - i : i,
						pct + 2);
			else
				len += snprintf(req + len, sizeof(req) - (size_t)len, "%s\r\n", argv[h]);
		}
		len += snprintf(req + len, sizeof(req) - (size_t)len, "\r\n");
		int status = 0, rc = -1;
		int64_t sent = 0;
		for (int attempt = 0; attempt < 3 && rc < 0; attempt++) {
			if (fd < 0 && (fd = connect_to(port)) < 0)
				continue;
			sent = now_ns();
			if (write_all(fd, req, (size_t)len) == 0)
				rc = response(fd, &status, head, sizeof(head));
			if (rc != 0) {
				close(fd);
				fd = -1;
			}
		}
		if (rc < 0) {
			printf("%lld 000 - - 0\n", (long long)now_ns());
			failed = 1;
			continue;
		}
		char rem[128], retry[32];
		header(head, "RateLimit", rem, sizeof(rem));
		const char *r = strstr(rem, ";r=");
		if (r != NULL) {
			size_t d = strspn(r + 3, "0123456789");
			memmove(rem, r + 3, d);
			rem[d] = '\0';
		} else {
			header(head, "RateLimit-Remaining", rem, sizeof(rem));
		}
		header(head, "Retry-After", retry, sizeof(retry));
		printf("%lld %d %s %s %lld\n", (long long)sent, status, rem, retry,
		       (long long)(now_ns() - sent));
	}
	if (fd >= 0)
		close(fd);
	return failed;
}
