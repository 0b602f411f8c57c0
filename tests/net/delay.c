/* SPDX-License-Identifier: MIT */
/*
 * usage: tb-delay --listen ADDR:PORT --to ADDR:PORT --delay-ms D
 *                 [--jitter-ms J] [--stall-ms S] [--seed N]
 *
 * A TCP forwarder for the tests: every connection accepted on --listen is
 * joined to a new one to --to, and the bytes of each direction are held
 * D ms, plus a jitter drawn uniformly from [-J, J] (never below 0), before
 * they are passed on.  A chunk is never released before the chunk read
 * before it in the same direction: jitter delays, it never reorders
 * (TCP's byte order is what the client sees).  SIGUSR1 stops all
 * forwarding for S ms (default 2000): nothing is read or written, as on a
 * link that carries nothing, then the held bytes go on in order.  Stops on
 * SIGTERM or SIGINT.  One thread, poll(); a test program, not installed.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define CHUNK 65536
/* Held bytes a direction may have before its source is no longer read. */
#define HELD_MAX (4 << 20)

struct chunk {
	struct chunk *next;
	int64_t due;
	size_t len, off;
	char data[];
};

struct dir {
	int from, to;
	struct chunk *head, *tail;
	size_t held;
	int64_t last_due;
	bool eof;      /* from gave EOF: shut to's writing once all is passed on */
	bool shut;
};

struct conn {
	struct dir d[2];
	bool dead;
};

static struct conn **conns;
static size_t nconns, capconns;
static double delay_ns, jitter_ns;
static int64_t stall_ns = 2000000000;
static int64_t stalled_until;
static volatile sig_atomic_t stop, stall;
static uint64_t rng = 0x853c49e6748fea9bu;

static int64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Uniform in [0, 1). */
static double uniform(void)
{
	rng = rng * 6364136223846793005u + 1442695040888963407u;
	return (double)(rng >> 11) / 9007199254740992.0;
}

static void on_signal(int sig)
{
	if (sig == SIGUSR1)
		stall = 1;
	else
		stop = 1;
}

static int parse_addr(const char *s, struct sockaddr_in *sa)
{
	char host[64];
	const char *colon = strrchr(s, ':');
	if (colon == NULL || (size_t)(colon - s) >= sizeof(host))
		return -1;
	memcpy(host, s, (size_t)(colon - s));
	host[colon - s] = '\0';
	char *end;
	long port = strtol(colon + 1, &end, 10);
	if (*end != '\0' || port < 1 || port > 65535)
		return -1;
	memset(sa, 0, sizeof(*sa));
	sa->sin_family = AF_INET;
	sa->sin_port = htons((uint16_t)port);
	return inet_pton(AF_INET, host, &sa->sin_addr) == 1 ? 0 : -1;
}

static void set_nonblock(int fd)
{
	fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
	int one = 1;
	setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

static void conn_free(struct conn *c)
{
	for (int i = 0; i < 2; i++) {
		struct chunk *k = c->d[i].head;
		while (k != NULL) {
			struct chunk *n = k->next;
			free(k);
			k = n;
		}
	}
	close(c->d[0].from);
	close(c->d[0].to);
	free(c);
}

static void accept_one(int lfd, const struct sockaddr_in *to)
{
	int a = accept(lfd, NULL, NULL);
	if (a < 0)
		return;
	/* A blocking connect: the upstream is a local server in the tests. */
	int b = socket(AF_INET, SOCK_STREAM, 0);
	if (b < 0 || connect(b, (const struct sockaddr *)to, sizeof(*to)) != 0) {
		close(a);
		if (b >= 0)
			close(b);
		return;
	}
	struct conn *c = calloc(1, sizeof(*c));
	if (c == NULL || (nconns == capconns && (capconns = capconns ? 2 * capconns : 64,
						 conns = realloc(conns, capconns * sizeof(*conns))) == NULL)) {
		fprintf(stderr, "tb-delay: out of memory\n");
		exit(1);
	}
	set_nonblock(a);
	set_nonblock(b);
	c->d[0].from = a;
	c->d[0].to = b;
	c->d[1].from = b;
	c->d[1].to = a;
	conns[nconns++] = c;
}

/* Reads what from has into a chunk due after the delay; false on an error. */
static bool take(struct dir *d, int64_t now)
{
	struct chunk *k = malloc(sizeof(*k) + CHUNK);
	if (k == NULL)
		return false;
	ssize_t n = read(d->from, k->data, CHUNK);
	if (n <= 0) {
		free(k);
		if (n == 0) {
			d->eof = true;
			return true;
		}
		return errno == EAGAIN || errno == EINTR;
	}
	double j = jitter_ns > 0 ? (2 * uniform() - 1) * jitter_ns : 0;
	double wait = delay_ns + j;
	k->due = now + (int64_t)(wait > 0 ? wait : 0);
	/* Never ahead of the chunk before: jitter must not reorder. */
	if (k->due < d->last_due)
		k->due = d->last_due;
	d->last_due = k->due;
	k->len = (size_t)n;
	k->off = 0;
	k->next = NULL;
	if (d->tail != NULL)
		d->tail->next = k;
	else
		d->head = k;
	d->tail = k;
	d->held += (size_t)n;
	return true;
}

/* Writes the chunks that are due; false on an error. */
static bool pass(struct dir *d, int64_t now)
{
	while (d->head != NULL && d->head->due <= now) {
		struct chunk *k = d->head;
		ssize_t n = write(d->to, k->data + k->off, k->len - k->off);
		if (n < 0)
			return errno == EAGAIN || errno == EINTR;
		k->off += (size_t)n;
		d->held -= (size_t)n;
		if (k->off < k->len)
			return true;
		d->head = k->next;
		if (d->head == NULL)
			d->tail = NULL;
		free(k);
	}
	if (d->eof && d->head == NULL && !d->shut) {
		shutdown(d->to, SHUT_WR);
		d->shut = true;
	}
	return true;
}

static _Noreturn void usage(const char *prog)
{
	fprintf(stderr, "usage: %s --listen ADDR:PORT --to ADDR:PORT --delay-ms D "
			"[--jitter-ms J] [--stall-ms S] [--seed N]\n", prog);
	exit(2);
}

static double arg_ms(const char *s)
{
	char *end;
	double v = strtod(s, &end);
	if (*end != '\0' || !(v >= 0) || v > 60000) {
		fprintf(stderr, "tb-delay: bad milliseconds: %s\n", s);
		exit(2);
	}
	return v;
}

int main(int argc, char **argv)
{
	struct sockaddr_in listen_at, to;
	bool have_listen = false, have_to = false;
	for (int i = 1; i < argc; i += 2) {
		const char *v = i + 1 < argc ? argv[i + 1] : NULL;
		if (v == NULL)
			usage(argv[0]);
		if (strcmp(argv[i], "--listen") == 0 && parse_addr(v, &listen_at) == 0)
			have_listen = true;
		else if (strcmp(argv[i], "--to") == 0 && parse_addr(v, &to) == 0)
			have_to = true;
		else if (strcmp(argv[i], "--delay-ms") == 0)
			delay_ns = arg_ms(v) * 1e6;
		else if (strcmp(argv[i], "--jitter-ms") == 0)
			jitter_ns = arg_ms(v) * 1e6;
		else if (strcmp(argv[i], "--stall-ms") == 0)
			stall_ns = (int64_t)(arg_ms(v) * 1e6);
		else if (strcmp(argv[i], "--seed") == 0)
			rng ^= strtoull(v, NULL, 10) * 0x9e3779b97f4a7c15u;
		else
			usage(argv[0]);
	}
	if (!have_listen || !have_to)
		usage(argv[0]);

	struct sigaction sa = { .sa_handler = on_signal };
	sigaction(SIGTERM, &sa, NULL);
	sigaction(SIGINT, &sa, NULL);
	sigaction(SIGUSR1, &sa, NULL);
	signal(SIGPIPE, SIG_IGN);
	/* Wake when due, not up to 50 us later (the default slack), each hop. */
	prctl(PR_SET_TIMERSLACK, 1UL);

	int lfd = socket(AF_INET, SOCK_STREAM, 0);
	int one = 1;
	setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
	if (lfd < 0 || bind(lfd, (struct sockaddr *)&listen_at, sizeof(listen_at)) != 0 ||
	    listen(lfd, 128) != 0) {
		perror("tb-delay: listen");
		return 1;
	}
	fcntl(lfd, F_SETFL, fcntl(lfd, F_GETFL) | O_NONBLOCK);

	struct pollfd *pfd = NULL;
	size_t cappfd = 0;
	while (!stop) {
		int64_t now = now_ns();
		if (stall) {
			stall = 0;
			stalled_until = now + stall_ns;
		}
		bool stalled = now < stalled_until;
		if (cappfd < 1 + 4 * nconns) {
			cappfd = 1 + 4 * nconns + 64;
			pfd = realloc(pfd, cappfd * sizeof(*pfd));
			if (pfd == NULL)
				return 1;
		}
		size_t np = 0;
		pfd[np++] = (struct pollfd){ .fd = lfd, .events = POLLIN };
		int64_t next = stalled ? stalled_until : INT64_MAX;
		for (size_t i = 0; i < nconns; i++) {
			for (int k = 0; k < 2; k++) {
				struct dir *d = &conns[i]->d[k];
				bool rd = !stalled && !d->eof && d->held < HELD_MAX;
				bool wr = !stalled && d->head != NULL && d->head->due <= now;
				if (!stalled && d->head != NULL && d->head->due > now && d->head->due < next)
					next = d->head->due;
				pfd[np++] = (struct pollfd){ .fd = rd ? d->from : -1, .events = POLLIN };
				pfd[np++] = (struct pollfd){ .fd = wr ? d->to : -1, .events = POLLOUT };
			}
		}
		struct timespec ts, *tp = NULL;
		if (next != INT64_MAX) {
			int64_t w = next > now ? next - now : 0;
			ts.tv_sec = w / 1000000000;
			ts.tv_nsec = w % 1000000000;
			tp = &ts;
		}
		if (ppoll(pfd, np, tp, NULL) < 0 && errno != EINTR)
			return 1;
		now = now_ns();
		if (now < stalled_until)
			continue;
		size_t polled = nconns;
		for (size_t i = 0, p = 1; i < polled; i++) {
			struct conn *c = conns[i];
			for (int k = 0; k < 2; k++, p += 2) {
				struct dir *d = &c->d[k];
				if (pfd[p].revents != 0 && !take(d, now))
					c->dead = true;
				if (!pass(d, now))
					c->dead = true;
			}
			if (c->d[0].shut && c->d[1].shut)
				c->dead = true;
		}
		size_t kept = 0;
		for (size_t i = 0; i < nconns; i++) {
			if (conns[i]->dead)
				conn_free(conns[i]);
			else
				conns[kept++] = conns[i];
		}
		nconns = kept;
		if (pfd[0].revents & POLLIN)
			accept_one(lfd, &to);
	}
	for (size_t i = 0; i < nconns; i++)
		conn_free(conns[i]);
	free(conns);
	free(pfd);
	close(lfd);
	return 0;
}
