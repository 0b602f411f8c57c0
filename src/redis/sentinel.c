/* SPDX-License-Identifier: MIT */
/*
 * Redis Sentinel: which server is the primary of a master name.  Each new
 * connection of a Sentinel client asks the sentinels (SENTINEL
 * get-master-addr-by-name) and connects to the address named, so a
 * failover is followed by the next connection made; the pool then checks
 * with ROLE that it reached a primary.
 */
#include <errno.h>
#include <limits.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "sentinel.h"
#include "sigpipe.h"
#include "sleep.h"

/* The longest host name (RFC 1035's 253 characters); longer ones failed to resolve with -EMSGSIZE. */
#define TBR__HOST_MAX 253
/* At most this many sentinels in a URL. */
#define TBR__SENTINELS_MAX 16

struct tbr__sentinel {
	char *name;
	size_t n;
	char *host[TBR__SENTINELS_MAX];
	int port[TBR__SENTINELS_MAX];
	_Atomic unsigned first; /* the one to ask first: the last that answered */
};

void tbr__sentinel_free(struct tbr__sentinel *s)
{
	if (s == NULL)
		return;
	for (size_t i = 0; i < s->n; i++)
		free(s->host[i]);
	free(s->name);
	free(s);
}

static int parse_port(const char *p, const char *end, int *port)
{
	long v = 0;
	if (p == end || end - p > 5)
		return -EINVAL;
	for (; p < end; p++) {
		if (*p < '0' || *p > '9')
			return -EINVAL;
		v = v * 10 + (*p - '0');
	}
	if (v < 1 || v > 65535)
		return -EINVAL;
	*port = (int)v;
	return 0;
}

int tbr__sentinel_parse(struct tbr__sentinel **sp, const char *spec, int *db)
{
	struct tbr__sentinel *s = calloc(1, sizeof(*s));
	if (s == NULL)
		return -ENOMEM;
	int err = 0;
	const char *p = spec;
	/* host[:port] items up to the '/' before the name */
	while (err == 0) {
		size_t len = strcspn(p, ",/");
		const char *colon = memchr(p, ':', len);
		size_t hostlen = colon != NULL ? (size_t)(colon - p) : len;
		if (hostlen == 0 || s->n == TBR__SENTINELS_MAX) {
			err = -EINVAL;
			break;
		}
		s->port[s->n] = 26379;
		if (colon != NULL)
			err = parse_port(colon + 1, p + len, &s->port[s->n]);
		if (err == 0 && (s->host[s->n] = strndup(p, hostlen)) == NULL)
			err = -ENOMEM;
		if (err == 0)
			s->n++;
		p += len;
		if (*p != ',')
			break;
		p++;
	}
	if (err == 0 && *p != '/')
		err = -EINVAL;
	const char *name = p + 1;
	size_t namelen = err == 0 ? strcspn(name, "/") : 0;
	if (err == 0 && namelen == 0)
		err = -EINVAL;
	if (err == 0 && (s->name = strndup(name, namelen)) == NULL)
		err = -ENOMEM;
	*db = 0;
	if (err == 0 && name[namelen] == '/' && name[namelen + 1] != '\0') {
		char *end;
		errno = 0;
		long v = strtol(name + namelen + 1, &end, 10);
		if (errno != 0 || *end != '\0' || v < 0 || v > INT_MAX || end == name + namelen + 1)
			err = -EINVAL;
		else
			*db = (int)v;
	} else if (err == 0 && name[namelen] == '/' ) {
		err = 0; /* a trailing '/': database 0 */
	}
	if (err != 0) {
		tbr__sentinel_free(s);
		return err;
	}
	*sp = s;
	return 0;
}

int tbr__sentinel_reply(const redisReply *rep, char **host, int *port)
{
	/* [host, port], or nil (an error: no answer) for a name it does not monitor. */
	if (rep->type == REDIS_REPLY_NIL || rep->type == REDIS_REPLY_ERROR)
		return 1;
	/* Anything else is not a sentinel's answer; a NUL would cut the host short. */
	if (rep->type != REDIS_REPLY_ARRAY || rep->elements != 2 ||
	    rep->element[0]->type != REDIS_REPLY_STRING ||
	    rep->element[1]->type != REDIS_REPLY_STRING || rep->element[0]->len == 0 ||
	    rep->element[0]->len > TBR__HOST_MAX || memchr(rep->element[0]->str, '\0', rep->element[0]->len) ||
	    parse_port(rep->element[1]->str, rep->element[1]->str + rep->element[1]->len, port) != 0)
		return -EPROTO;
	*host = strndup(rep->element[0]->str, rep->element[0]->len);
	return *host == NULL ? -ENOMEM : 0;
}

const char *tbr__sentinel_name(const struct tbr__sentinel *s)
{
	return s->name;
}

size_t tbr__sentinel_count(const struct tbr__sentinel *s)
{
	return s->n;
}

void tbr__sentinel_addr(const struct tbr__sentinel *s, size_t i, const char **host, int *port)
{
	*host = s->host[i];
	*port = s->port[i];
}

size_t tbr__sentinel_first(const struct tbr__sentinel *s)
{
	return atomic_load_explicit(&s->first, memory_order_relaxed) % s->n;
}

void tbr__sentinel_answered(struct tbr__sentinel *s, size_t i)
{
	atomic_store_explicit(&s->first, (unsigned)i, memory_order_relaxed);
}

/* One sentinel's answer: 0 with *host and *port, 1 when it knows no such master, or -errno. */
static int ask(const char *shost, int sport, const char *name, struct timeval connect_tv,
	       int64_t timeout_ns, char **host, int *port)
{
	/* The question's whole exchange within timeout_ns, however the answer comes. */
	int64_t deadline = tokenbucket_now() + timeout_ns;
	redisContext *c = redisConnectWithTimeout(shost, sport, connect_tv);
	if (c == NULL)
		return -ENOMEM;
	int err = 0;
	if (c->err || redisSetTimeout(c, tb__timeval_of(timeout_ns)) != REDIS_OK)
		err = tbr__conn_errno(c);
	redisReply *rep = NULL;
	if (err == 0) {
		const char *argv[] = { "SENTINEL", "get-master-addr-by-name", name };
		int64_t set = timeout_ns;
		struct tbr__bound bound = { 0 };
		int r = redisAppendCommandArgv(c, 3, argv, NULL) != REDIS_OK ? -ENOMEM
			: tbr__write_nosignal(c) < 0			    ? 1
									    : tbr__read_by(c, &bound, deadline, &set, &rep);
		err = r == 1 ? tbr__conn_errno(c) : r;
	}
	if (err == 0)
		err = tbr__sentinel_reply(rep, host, port);
	if (rep != NULL)
		freeReplyObject(rep);
	redisFree(c);
	return err;
}

int tbr__sentinel_primary(struct tbr__sentinel *s, struct timeval connect_tv, int64_t timeout_ns,
			  char **host, int *port)
{
	size_t first = tbr__sentinel_first(s);
	int last = -EHOSTUNREACH;
	bool answered = false;
	for (size_t k = 0; k < s->n; k++) {
		size_t i = (first + k) % s->n;
		int r = ask(s->host[i], s->port[i], s->name, connect_tv, timeout_ns, host, port);
		if (r == 0) {
			tbr__sentinel_answered(s, i);
			return 0;
		}
		if (r < 0)
			last = r;
		else
			answered = true;
	}
	/* A sentinel that answered without a primary says more than ones that did not answer. */
	return answered ? -EHOSTUNREACH : last;
}

int tbr__sentinel_ask_first(struct tbr__sentinel *s, struct timeval connect_tv, int64_t timeout_ns,
			    char **host, int *port)
{
	size_t i = tbr__sentinel_first(s);
	return ask(s->host[i], s->port[i], s->name, connect_tv, timeout_ns, host, port);
}
