/* SPDX-License-Identifier: MIT */
/*
 * A Redis reply is input: a fake server on loopback answers the client's
 * calls with what a hostile or broken server may send (replies nobody
 * asked for, numbers with bytes after a NUL, grants past the caller's
 * deadline, hosts and roles with a NUL inside), and the client must
 * neither crash, nor hang, nor take any of it as an answer.  The errno of
 * each fault is tokenbucket-redis(7)'s fault table's.
 */
#include <check.h>
#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <tokenbucket-redis.h>

#include "fake.h"
#include "internal.h"
#include "loops.h"

/*
 * The fake: script calls answered with reply (or by answer), ROLE and
 * SENTINEL with role and sentinel, other commands (TOKENBUCKET.VERSION,
 * FCALL) as a server without the module or functions answers them.
 */
struct fake {
	struct fake_server srv;
	int port;         /* srv's */
	atomic_int calls; /* EVALSHA and EVAL received */
	/* The reply to a script call (the calls-th, from 1), into out; its length. */
	size_t (*answer)(struct fake *f, int calls, char *out, size_t size);
	/* Without answer: this reply to every script call. */
	const char *reply;
	size_t reply_len;
	/* The reply to ROLE, SENTINEL get-master-addr-by-name and CLUSTER SLOTS, NULL: an error. */
	const char *role, *sentinel, *slots;
	size_t role_len, sentinel_len, slots_len;
};

#define BYTES(s) s, sizeof(s) - 1

static size_t copy(char *out, size_t size, const char *s, size_t len)
{
	ck_assert_uint_le(len, size);
	memcpy(out, s, len);
	return len;
}

static size_t reply_to(struct fake_server *srv, redisReply *cmd, char *out, size_t size)
{
	struct fake *f = (struct fake *)((char *)srv - offsetof(struct fake, srv));
	const char *name = cmd->elements > 0 ? cmd->element[0]->str : "";
	if (strcasecmp(name, "EVALSHA") == 0 || strcasecmp(name, "EVAL") == 0) {
		int calls = atomic_fetch_add(&f->calls, 1) + 1;
		return f->answer != NULL ? f->answer(f, calls, out, size)
					 : copy(out, size, f->reply, f->reply_len);
	}
	if (strcasecmp(name, "ROLE") == 0 && f->role != NULL)
		return copy(out, size, f->role, f->role_len);
	if (strcasecmp(name, "SENTINEL") == 0 && f->sentinel != NULL)
		return copy(out, size, f->sentinel, f->sentinel_len);
	if (strcasecmp(name, "CLUSTER") == 0 && f->slots != NULL)
		return copy(out, size, f->slots, f->slots_len);
	return (size_t)snprintf(out, size, "-ERR unknown command '%s'\r\n", name);
}

/* Binds f (f->port); set what it answers, then fake_run_start. */
static void fake_start(struct fake *f, size_t (*answer)(struct fake *, int, char *, size_t))
{
	memset(f, 0, sizeof(*f));
	f->answer = answer;
	fake_server_bind(&f->srv, reply_to);
	f->port = f->srv.port;
}

static void fake_run_start(struct fake *f)
{
	fake_server_run(&f->srv);
}

static void fake_stop(struct fake *f)
{
	fake_server_stop(&f->srv);
}

/* A client of the fake (pipelined when pipelined), 1 s timeouts; as a sentinel when sentinel. */
static struct tokenbucket_redis *client_of(const struct fake *f, bool pipelined, bool sentinel)
{
	char url[64];
	snprintf(url, sizeof(url), sentinel ? "redis-sentinel://127.0.0.1:%d/m" : "redis://127.0.0.1:%d",
		 f->port);
	struct tokenbucket_redis *r;
	ck_assert_int_eq(tokenbucket_redis_open(&r, url, INT64_C(1000000000), INT64_C(1000000000)), 0);
	if (pipelined)
		ck_assert_int_eq(tokenbucket_redis_set_pipelining(r, 1), 0);
	return r;
}

static struct tokenbucket_redis *fake_client(const struct fake *f, bool pipelined)
{
	return client_of(f, pipelined, false);
}

static const struct tokenbucket_redis_limit lim = { .tokens = 1, .period_ns = 1000000000, .burst = 10 };

/* ---- The asynchronous client (libevent) ------------------------------- */

struct async_done {
	bool done;
	int err;
	struct tokenbucket_result res;
};

static void on_done(void *arg, int err, const struct tokenbucket_result *res,
		    const struct tokenbucket_reservation *rv, double tokens)
{
	struct async_done *d = arg;
	(void)rv;
	(void)tokens;
	d->done = true;
	d->err = err;
	if (res != NULL)
		d->res = *res;
}

/*
 * An allow on r's asynchronous client, run on a libevent loop until it
 * completes: its error, and in *ns how long it took.
 */
static int async_allow(struct tokenbucket_redis *r, int64_t *ns, struct tokenbucket_result *res)
{
	loop_kind_libevent();
	loop_init();
	struct tokenbucket_redis_async *a = async_open(r);
	struct tokenbucket_redis_call call = { .op = TOKENBUCKET_REDIS_ALLOW, .key = "k", .keylen = 1,
					       .limit = lim, .n = 1 };
	struct async_done d = { 0 };
	int64_t t0 = tokenbucket_now();
	ck_assert_int_eq(tokenbucket_redis_async_start(a, &call, on_done, &d), 0);
	/* Well past any deadline here: a call that outlives its own fails below. */
	while (!d.done && tokenbucket_now() - t0 < INT64_C(10000000000))
		loop_wait(INT64_C(50000000));
	if (ns != NULL)
		*ns = tokenbucket_now() - t0;
	ck_assert_msg(d.done, "the asynchronous call outlived 10 s");
	tokenbucket_redis_async_close(a);
	loop_fini();
	if (res != NULL)
		*res = d.res;
	return d.err;
}

/* The script's replies: refused (0 left, next token in 1 s) and allowed (5 left). */
static const char refused[] = "*7\r\n:0\r\n$1\r\n0\r\n$1\r\n0\r\n$1\r\n0\r\n$1\r\n1\r\n"
			      "$10\r\n1000000000\r\n$11\r\n10000000000\r\n";
static const char allowed[] = "*7\r\n:1\r\n$1\r\n0\r\n$1\r\n5\r\n$1\r\n0\r\n$1\r\n1\r\n"
			      "$1\r\n0\r\n$10\r\n5000000000\r\n";

/* An allow on f's server (its url), blocking, pipelined and asynchronous: each must give err. */
static void allow_everywhere_fails(const char *url, bool cluster, int err)
{
	int got[3];
	for (int path = 0; path < 3; path++) {
		struct tokenbucket_redis *r;
		if (cluster) {
			const char *seeds[] = { url };
			ck_assert_int_eq(tokenbucket_redis_open_cluster(&r, seeds, 1, INT64_C(1000000000),
									INT64_C(1000000000)),
					 0);
		} else {
			ck_assert_int_eq(tokenbucket_redis_open(&r, url, INT64_C(1000000000),
								INT64_C(1000000000)),
					 0);
		}
		if (path == 1)
			ck_assert_int_eq(tokenbucket_redis_set_pipelining(r, 1), 0);
		struct tokenbucket_result res;
		got[path] = path == 2 ? async_allow(r, NULL, &res)
				      : tokenbucket_redis_allow(r, "k", 1, &lim, 1, &res);
		tokenbucket_redis_close(r);
	}
	ck_assert_msg(got[0] == err && got[1] == err && got[2] == err,
		      "blocking %d, pipelined %d, asynchronous %d, not %d", got[0], got[1], got[2], err);
}

/* ---- A stale reply is never the next call's answer ----------------------- */

/* Every call is refused, with an allowed reply nobody asked for after it. */
static size_t answer_refused_and_extra(struct fake *f, int calls, char *out, size_t size)
{
	(void)f;
	(void)calls;
	size_t n = copy(out, size, BYTES(refused));
	return n + copy(out + n, size - n, BYTES(allowed));
}

START_TEST(test_stale_reply_not_taken)
{
	struct fake f;
	fake_start(&f, answer_refused_and_extra);
	fake_run_start(&f);
	struct tokenbucket_redis *r = fake_client(&f, false);
	for (int i = 0; i < 3; i++) {
		struct tokenbucket_result res = { .allowed = true };
		ck_assert_int_eq(tokenbucket_redis_allow(r, "k", 1, &lim, 1, &res), 0);
		ck_assert(!res.allowed);
		ck_assert_uint_eq(res.remaining, 0);
	}
	/* The connection that carried one is closed, not reused. */
	ck_assert_int_eq(atomic_load(&f.srv.accepted), 3);
	tokenbucket_redis_close(r);
	fake_stop(&f);
}
END_TEST

/*
 * The asynchronous engine (here under pipelining, on the client's I/O
 * thread): hiredis aborts the process on a reply with no callback; the
 * client closes the connection instead.
 */
static size_t answer_allowed_and_extra(struct fake *f, int calls, char *out, size_t size)
{
	(void)f;
	(void)calls;
	size_t n = copy(out, size, BYTES(allowed));
	return n + copy(out + n, size - n, BYTES(":1\r\n"));
}

START_TEST(test_unasked_reply_pipelined)
{
	struct fake f;
	fake_start(&f, answer_allowed_and_extra);
	fake_run_start(&f);
	struct tokenbucket_redis *r = fake_client(&f, true);
	for (int i = 0; i < 3; i++) {
		struct tokenbucket_result res = { .allowed = false };
		int err = tokenbucket_redis_allow(r, "k", 1, &lim, 1, &res);
		/* Answered before the extra reply closes its connection, or failed with it. */
		ck_assert(err == 0 || err == -EPROTO);
		ck_assert(err != 0 || (res.allowed && res.remaining == 5));
	}
	ck_assert_int_ge(atomic_load(&f.srv.accepted), 2);
	tokenbucket_redis_close(r);
	fake_stop(&f);
}
END_TEST

/* ---- Numbers and names are read whole --------------------------------- */

/* A fake server that answers every command with reply, running. */
static void fake_replying(struct fake *f, const char *reply, size_t len)
{
	fake_start(f, NULL);
	f->reply = reply;
	f->reply_len = len;
	fake_run_start(f);
}

/* An allow answered reply, which must fail with -EPROTO on every path. */
static void allow_refused_as_garbage(const char *reply, size_t len)
{
	struct fake f;
	fake_replying(&f, reply, len);
	char url[64];
	snprintf(url, sizeof(url), "redis://127.0.0.1:%d", f.port);
	allow_everywhere_fails(url, false, -EPROTO);
	fake_stop(&f);
	/* tokenbucket_redis_parse decodes it alike. */
	struct tokenbucket_redis_call call = { .op = TOKENBUCKET_REDIS_ALLOW, .key = "k", .keylen = 1,
					       .limit = lim, .n = 1 };
	struct tokenbucket_result res;
	size_t used;
	ck_assert_int_eq(tokenbucket_redis_parse(&call, reply, len, &used, &res, NULL, NULL), -EPROTO);
}

START_TEST(test_number_with_nul)
{
	/* The level "5\0junk": not 5. */
	static const char r[] = "*7\r\n:1\r\n$1\r\n0\r\n$6\r\n5\0junk\r\n$1\r\n0\r\n$1\r\n1\r\n"
				"$1\r\n0\r\n$1\r\n0\r\n";
	allow_refused_as_garbage(BYTES(r));
}
END_TEST

START_TEST(test_level_above_burst)
{
	static const char r[] = "*7\r\n:1\r\n$1\r\n0\r\n$19\r\n9223372036854775807\r\n$1\r\n0\r\n"
				"$1\r\n1\r\n$1\r\n0\r\n$1\r\n0\r\n";
	allow_refused_as_garbage(BYTES(r));
}
END_TEST

/*
 * A Sentinel client of the fake as sentinel and server: the call's error
 * on path 0 (blocking), 1 (pipelined) or 2 (asynchronous).
 */
static int sentinel_allow(struct fake *f, int path)
{
	struct tokenbucket_redis *r = client_of(f, path == 1, true);
	struct tokenbucket_result res;
	int err = path == 2 ? async_allow(r, NULL, &res) : tokenbucket_redis_allow(r, "k", 1, &lim, 1, &res);
	tokenbucket_redis_close(r);
	return err;
}

/* The same error on every path. */
static void sentinel_fails(struct fake *f, int err)
{
	int got[3];
	for (int path = 0; path < 3; path++)
		got[path] = sentinel_allow(f, path);
	ck_assert_msg(got[0] == err && got[1] == err && got[2] == err,
		      "blocking %d, pipelined %d, asynchronous %d, not %d", got[0], got[1], got[2], err);
}

/*
 * The fake as its own sentinel: it names host (its bulk string, NUL
 * allowed) at its port, and answers ROLE with role; sentinel holds the
 * answer.  Not serving yet: fake_run_start.
 */
static void sentinel_fake(struct fake *f, char *sentinel, size_t size, const char *host,
			  size_t hostlen, const char *role, size_t rolelen)
{
	fake_start(f, NULL);
	f->reply = allowed;
	f->reply_len = sizeof(allowed) - 1;
	int n = snprintf(sentinel, size, "*2\r\n$%zu\r\n", hostlen);
	memcpy(sentinel + n, host, hostlen);
	n += (int)hostlen;
	n += snprintf(sentinel + n, size - (size_t)n, "\r\n$%d\r\n%d\r\n", f->port >= 10000 ? 5 : 4,
		      f->port);
	f->sentinel = sentinel;
	f->sentinel_len = (size_t)n;
	f->role = role;
	f->role_len = rolelen;
}

/* A primary's ROLE. */
static const char master[] = "*3\r\n$6\r\nmaster\r\n:0\r\n*0\r\n";

START_TEST(test_sentinel_host_with_nul)
{
	struct fake f;
	char sentinel[128];
	/* Reached at 127.0.0.1, the fake would answer as a primary. */
	sentinel_fake(&f, sentinel, sizeof(sentinel), BYTES("127.0.0.1\0evil"), BYTES(master));
	fake_run_start(&f);
	sentinel_fails(&f, -EPROTO);
	ck_assert_int_eq(atomic_load(&f.calls), 0);
	fake_stop(&f);
}
END_TEST

/* The fake as its own sentinel and a primary, greeting every connection with greeting; running. */
static void sentinel_fake_greeting(struct fake *f, char *sentinel, size_t size, const char *greeting)
{
	sentinel_fake(f, sentinel, size, BYTES("127.0.0.1"), BYTES(master));
	f->srv.greeting = greeting;
	f->srv.greeting_len = strlen(greeting);
	fake_run_start(f);
}

START_TEST(test_sentinel_greets_with_two_replies)
{
	struct fake f;
	char sentinel[128];
	/* Every connection gets an error and a reply before it asks anything. */
	sentinel_fake_greeting(&f, sentinel, sizeof(sentinel), "-ERR hello\r\n:1\r\n");
	/* An error from a sentinel names no primary, whatever follows it. */
	sentinel_fails(&f, -EHOSTUNREACH);
	fake_stop(&f);
}
END_TEST

START_TEST(test_sentinel_host_too_long)
{
	struct fake f;
	char sentinel[512], host[255];
	memset(host, 'a', sizeof(host));
	sentinel_fake(&f, sentinel, sizeof(sentinel), host, sizeof(host), BYTES(master));
	fake_run_start(&f);
	sentinel_fails(&f, -EPROTO);
	fake_stop(&f);
}
END_TEST

START_TEST(test_role_with_nul)
{
	struct fake f;
	char sentinel[128];
	sentinel_fake(&f, sentinel, sizeof(sentinel), BYTES("127.0.0.1"),
		      BYTES("*3\r\n$8\r\nmaster\0x\r\n:0\r\n*0\r\n"));
	fake_run_start(&f);
	sentinel_fails(&f, -EROFS);
	ck_assert_int_eq(atomic_load(&f.calls), 0);
	/* The same server as a primary answers. */
	fake_stop(&f);
	sentinel_fake(&f, sentinel, sizeof(sentinel), BYTES("127.0.0.1"), BYTES(master));
	fake_run_start(&f);
	ck_assert_int_eq(sentinel_allow(&f, 0), 0);
	ck_assert_int_eq(sentinel_allow(&f, 2), 0);
	fake_stop(&f);
}
END_TEST

/* ---- A grant past the deadline is not one ---------------------------- */

/* tokenbucket_redis_wait with a deadline 1 s away, answered reply: -EPROTO at once. */
static void wait_refuses(const char *reply, size_t len)
{
	struct fake f;
	fake_replying(&f, reply, len);
	for (int pipelined = 0; pipelined < 2; pipelined++) {
		struct tokenbucket_redis *r = fake_client(&f, pipelined);
		int64_t t0 = tokenbucket_now();
		ck_assert_int_eq(tokenbucket_redis_wait(r, "k", 1, &lim, 1, t0 + INT64_C(1000000000), -1),
				 -EPROTO);
		ck_assert_int_lt(tokenbucket_now() - t0, INT64_C(1000000000));
		tokenbucket_redis_close(r);
	}
	fake_stop(&f);
}

START_TEST(test_grant_past_deadline)
{
	/* Granted 11 days after the bucket's clock. */
	wait_refuses(BYTES("*7\r\n:1\r\n$1\r\n0\r\n$1\r\n0\r\n$1\r\n0\r\n$1\r\n1\r\n"
			   "$15\r\n950400000000000\r\n$15\r\n950400000000000\r\n"));
}
END_TEST

START_TEST(test_grant_never)
{
	wait_refuses(BYTES("*7\r\n:1\r\n$1\r\n0\r\n$1\r\n0\r\n$1\r\n0\r\n$1\r\n1\r\n"
			   "$19\r\n9223372036854775807\r\n$19\r\n9223372036854775807\r\n"));
}
END_TEST

/* ---- One deadline for the whole exchange ------------------------------ */

/*
 * An allow on url (200 ms timeout), blocking and pipelined, whose server
 * trickles its replies a byte every 150 ms: every byte within a read's
 * timeout, each reply seconds long.  -ETIME, long before the reply.
 */
static void trickled_allow(struct fake *f, const char *url)
{
	f->srv.trickle_ns = 150 * 1000000;
	fake_run_start(f);
	for (int pipelined = 0; pipelined < 2; pipelined++) {
		struct tokenbucket_redis *r;
		ck_assert_int_eq(tokenbucket_redis_open(&r, url, INT64_C(1000000000), 200 * 1000000), 0);
		if (pipelined)
			ck_assert_int_eq(tokenbucket_redis_set_pipelining(r, 1), 0);
		struct tokenbucket_result res;
		int64_t t0 = tokenbucket_now();
		ck_assert_int_eq(tokenbucket_redis_allow(r, "k", 1, &lim, 1, &res), -ETIME);
		/* The timeout and a margin for a loaded machine. */
		ck_assert_int_lt(tokenbucket_now() - t0, INT64_C(2000000000));
		tokenbucket_redis_close(r);
	}
	fake_stop(f);
}

START_TEST(test_trickled_reply)
{
	struct fake f;
	fake_start(&f, NULL);
	f.reply = refused;
	f.reply_len = sizeof(refused) - 1;
	char url[64];
	snprintf(url, sizeof(url), "redis://127.0.0.1:%d", f.port);
	trickled_allow(&f, url);
}
END_TEST

START_TEST(test_trickled_sentinel)
{
	struct fake f;
	char sentinel[128];
	sentinel_fake(&f, sentinel, sizeof(sentinel), BYTES("127.0.0.1"), BYTES(master));
	char url[64];
	snprintf(url, sizeof(url), "redis-sentinel://127.0.0.1:%d/m", f.port);
	trickled_allow(&f, url);
}
END_TEST

/* ---- One errno per fault ------------------------------------------------ */

/*
 * A cluster node that owns every slot and sends every call to a port
 * where nothing listens: the node named cannot be reached, on every path.
 */
START_TEST(test_moved_to_unreachable)
{
	struct fake f;
	fake_start(&f, NULL);
	f.reply = "-MOVED 12539 127.0.0.1:1\r\n";
	f.reply_len = strlen(f.reply);
	char slots[128], url[64];
	f.slots = slots;
	f.slots_len = (size_t)snprintf(slots, sizeof(slots),
				       "*1\r\n*3\r\n:0\r\n:16383\r\n*2\r\n$9\r\n127.0.0.1\r\n:%d\r\n", f.port);
	fake_run_start(&f);
	snprintf(url, sizeof(url), "redis://127.0.0.1:%d", f.port);
	allow_everywhere_fails(url, true, -ECONNREFUSED);
	fake_stop(&f);
}
END_TEST

/* A loopback port where nothing listens: bound by the kernel's choice, then closed. */
static int closed_port(void)
{
	int fd = socket(AF_INET, SOCK_STREAM, 0);
	ck_assert_int_ge(fd, 0);
	struct sockaddr_in sa = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	socklen_t len = sizeof(sa);
	ck_assert_int_eq(bind(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
	ck_assert_int_eq(getsockname(fd, (struct sockaddr *)&sa, &len), 0);
	close(fd);
	return ntohs(sa.sin_port);
}

/* A server, and a sentinel, at host:port: err on every path. */
static void server_and_sentinel_fail(const char *host, int port, int err)
{
	char url[96];
	snprintf(url, sizeof(url), "redis://%s:%d", host, port);
	allow_everywhere_fails(url, false, err);
	snprintf(url, sizeof(url), "redis-sentinel://%s:%d/m", host, port);
	allow_everywhere_fails(url, false, err);
}

START_TEST(test_closed_port)
{
	server_and_sentinel_fail("127.0.0.1", closed_port(), -ECONNREFUSED);
}
END_TEST

/* Linux refuses TCP to a broadcast address with ENETUNREACH, whatever the routes. */
START_TEST(test_network_unreachable)
{
	server_and_sentinel_fail("255.255.255.255", 6379, -ENETUNREACH);
}
END_TEST

/* A server whose first bytes are no reply at all (hiredis: a protocol error). */
START_TEST(test_garbage_server)
{
	struct fake f;
	char sentinel[128];
	sentinel_fake_greeting(&f, sentinel, sizeof(sentinel), "!garbage\r\n");
	server_and_sentinel_fail("127.0.0.1", f.port, -EPROTO);
	fake_stop(&f);
}
END_TEST

/* A server, and a sentinel, that close each connection at its first command (EOF). */
START_TEST(test_server_hangs_up)
{
	struct fake f;
	fake_start(&f, NULL);
	f.srv.hang_up = true;
	fake_run_start(&f);
	server_and_sentinel_fail("127.0.0.1", f.port, -ECONNRESET);
	fake_stop(&f);
}
END_TEST

/*
 * Each kind of hiredis error, as hiredis and sigpipe.c record it (an
 * errno's text after an optional "what: "), and its errno: the rows of
 * docs/redis.md's fault table.
 */
START_TEST(test_conn_errno_table)
{
	static const struct {
		int kind, errnum; /* errnum: the text's errno, 0 for text of its own */
		const char *text;
		int err;
	} rows[] = {
		{ REDIS_ERR_IO, ECONNREFUSED, "", -ECONNREFUSED },
		{ REDIS_ERR_IO, ENOENT, "", -ENOENT },
		{ REDIS_ERR_IO, EACCES, "", -EACCES },
		{ REDIS_ERR_IO, ENETUNREACH, "", -ENETUNREACH },
		{ REDIS_ERR_OTHER, EHOSTUNREACH, "Can't create socket: ", -EHOSTUNREACH },
		{ REDIS_ERR_IO, ETIMEDOUT, "", -ETIME },
		{ REDIS_ERR_IO, EAGAIN, "", -ETIME },
		{ REDIS_ERR_IO, EINPROGRESS, "", -ETIME },
		{ REDIS_ERR_IO, ECONNRESET, "", -ECONNRESET },
		{ REDIS_ERR_IO, ECONNABORTED, "", -ECONNABORTED },
		{ REDIS_ERR_IO, EPIPE, "", -EPIPE },
		{ REDIS_ERR_IO, ENOTCONN, "", -ENOTCONN },
		{ REDIS_ERR_IO, EBADF, "setsockopt(SO_RCVTIMEO): ", -ECONNRESET },
		{ REDIS_ERR_OTHER, 0, "Name or service not known", -ECONNREFUSED },
		{ REDIS_ERR_EOF, 0, "Server closed the connection", -ECONNRESET },
		{ REDIS_ERR_PROTOCOL, 0, "Protocol error, got \"!\" as reply type byte", -EPROTO },
		{ REDIS_ERR_OOM, 0, "Out of memory", -ENOMEM },
	};
	for (size_t i = 0; i < sizeof(rows) / sizeof(rows[0]); i++) {
		redisContext c = { .err = rows[i].kind };
		snprintf(c.errstr, sizeof(c.errstr), "%s%s", rows[i].text,
			 rows[i].errnum != 0 ? strerror(rows[i].errnum) : "");
		ck_assert_msg(tbr__conn_errno(&c) == rows[i].err, "\"%s\": %d, not %d", c.errstr,
			      tbr__conn_errno(&c), rows[i].err);
	}
	ck_assert_int_eq(tbr__conn_errno(NULL), -ENOMEM);
}
END_TEST

/* ---- No reply longer than any a call can have ----------------------- */

/*
 * Counts and lengths hiredis 0.14 would allocate for before any element
 * came (16 GiB for 2^31 - 1 elements) or wait for: the connection closes
 * at once.
 */
START_TEST(test_huge_multibulk)
{
	allow_refused_as_garbage(BYTES("*2147483647\r\n"));
	allow_refused_as_garbage(BYTES("*7\r\n:1\r\n*2147483647\r\n"));
}
END_TEST

START_TEST(test_huge_bulk)
{
	allow_refused_as_garbage(BYTES("$2147483647\r\n"));
	allow_refused_as_garbage(BYTES("*7\r\n:1\r\n$2147483647\r\n"));
}
END_TEST

/* ---- The asynchronous client's one deadline --------------------------- */

START_TEST(test_trickled_async)
{
	struct fake f;
	fake_start(&f, NULL);
	f.reply = refused;
	f.reply_len = sizeof(refused) - 1;
	f.srv.trickle_ns = 150 * 1000000;
	fake_run_start(&f);
	char url[64];
	snprintf(url, sizeof(url), "redis://127.0.0.1:%d", f.port);
	struct tokenbucket_redis *r;
	ck_assert_int_eq(tokenbucket_redis_open(&r, url, INT64_C(1000000000), 200 * 1000000), 0);
	int64_t ns;
	ck_assert_int_eq(async_allow(r, &ns, NULL), -ETIME);
	/* The 200 ms timeout and a margin for a loaded machine; the reply takes seconds. */
	ck_assert_int_lt(ns, 3 * INT64_C(200000000) * multiplier());
	tokenbucket_redis_close(r);
	fake_stop(&f);
}
END_TEST

Suite *hostile_suite(void);
Suite *hostile_suite(void)
{
	Suite *s = suite_create("redis-hostile");
	TCase *tc = tcase_create("blocking");
	tcase_set_timeout(tc, 30);
	tcase_add_test(tc, test_stale_reply_not_taken);
	tcase_add_test(tc, test_unasked_reply_pipelined);
	tcase_add_test(tc, test_sentinel_greets_with_two_replies);
	tcase_add_test(tc, test_number_with_nul);
	tcase_add_test(tc, test_level_above_burst);
	tcase_add_test(tc, test_sentinel_host_with_nul);
	tcase_add_test(tc, test_role_with_nul);
	tcase_add_test(tc, test_sentinel_host_too_long);
	tcase_add_test(tc, test_grant_past_deadline);
	tcase_add_test(tc, test_grant_never);
	tcase_add_test(tc, test_trickled_reply);
	tcase_add_test(tc, test_trickled_sentinel);
	tcase_add_test(tc, test_moved_to_unreachable);
	tcase_add_test(tc, test_closed_port);
	tcase_add_test(tc, test_network_unreachable);
	tcase_add_test(tc, test_garbage_server);
	tcase_add_test(tc, test_server_hangs_up);
	tcase_add_test(tc, test_conn_errno_table);
	tcase_add_test(tc, test_huge_multibulk);
	tcase_add_test(tc, test_huge_bulk);
	tcase_add_test(tc, test_trickled_async);
	suite_add_tcase(s, tc);
	return s;
}
