/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <stdbool.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>

#include <hiredis/hiredis.h>

#include "redis-join.h"

/* Connects as tokenbucket_redis_open reads url; *db is the database to select. */
static redisContext *connect_url(const char *url, long *db, char *err)
{
	const struct timeval tv = { .tv_sec = 1 };
	char host[256];
	const char *rest;
	*db = 0;
	if (strncmp(url, "redis://", 8) == 0) {
		rest = url + 8;
		size_t n = strcspn(rest, ":/");
		if (n == 0 || n >= sizeof(host))
			goto bad;
		memcpy(host, rest, n);
		host[n] = '\0';
		rest += n;
		long port = 6379;
		char *end;
		if (*rest == ':') {
			port = strtol(rest + 1, &end, 10);
			if (end == rest + 1 || port < 1 || port > 65535)
				goto bad;
			rest = end;
		}
		if (*rest == '/' && rest[1] != '\0') {
			*db = strtol(rest + 1, &end, 10);
			if (*end != '\0' || *db < 0)
				goto bad;
		}
		return redisConnectWithTimeout(host, (int)port, tv);
	}
	const char *path = strncmp(url, "unix:", 5) == 0 ? url + 5 : url[0] == '/' ? url : NULL;
	if (path == NULL)
		goto bad;
	const char *q = strstr(path, "?db=");
	size_t n = q ? (size_t)(q - path) : strlen(path);
	if (n == 0 || n >= sizeof(host))
		goto bad;
	memcpy(host, path, n);
	host[n] = '\0';
	if (q) {
		char *end;
		*db = strtol(q + 4, &end, 10);
		if (*end != '\0' || *db < 0)
			goto bad;
	}
	return redisConnectUnixWithTimeout(host, tv);
bad:
	snprintf(err, TBRATE_ERR_SIZE, "bad URL \"%s\"", url);
	return NULL;
}

/*
 * The fields after "tb1 clock level rem": tokens period burst, strictly;
 * a leased key's "tbl1" value has its lease groups after them
 * (docs/leases.md), which this does not need.
 */
static int parse_value(const char *v, struct tokenbucket_redis_limit *lim)
{
	const char *p = v;
	bool leased = strncmp(p, "tbl1 ", 5) == 0;
	if (!leased && strncmp(p, "tb1 ", 4) != 0)
		return -EBADMSG;
	p += leased ? 5 : 4;
	for (int skip = 0; skip < 3; skip++) {
		p = strchr(p, ' ');
		if (p == NULL)
			return -EBADMSG;
		p++;
	}
	unsigned long long f[3];
	for (int i = 0; i < 3; i++) {
		char *end;
		if (*p < '0' || *p > '9')
			return -EBADMSG;
		errno = 0;
		f[i] = strtoull(p, &end, 10);
		if (errno || (*end != (i < 2 ? ' ' : '\0') && !(leased && i == 2 && *end == ' ')))
			return -EBADMSG;
		p = end + 1;
	}
	if (f[1] == 0 || f[1] > LLONG_MAX)
		return -EBADMSG;
	lim->tokens = f[0];
	lim->period_ns = (int64_t)f[1];
	lim->burst = f[2];
	return 0;
}

int tbrate_redis_stored(const char *url, const char *key, struct tokenbucket_redis_limit *lim,
			char err[TBRATE_ERR_SIZE])
{
	long db;
	redisContext *c = connect_url(url, &db, err);
	if (c == NULL)
		return -EINVAL;
	int rc = 0;
	redisReply *r = NULL;
	if (c->err) {
		snprintf(err, TBRATE_ERR_SIZE, "%s: %s", url, c->errstr);
		rc = -ECONNREFUSED;
		goto out;
	}
	if (db) {
		r = redisCommand(c, "SELECT %ld", db);
		if (r == NULL || r->type == REDIS_REPLY_ERROR) {
			snprintf(err, TBRATE_ERR_SIZE, "%s: SELECT %ld failed", url, db);
			rc = -EIO;
			goto out;
		}
		freeReplyObject(r);
	}
	r = redisCommand(c, "GET %s", key);
	if (r == NULL) {
		snprintf(err, TBRATE_ERR_SIZE, "%s: %s", url, c->errstr);
		rc = -EIO;
	} else if (r->type == REDIS_REPLY_NIL) {
		rc = 0;
	} else if (r->type == REDIS_REPLY_STRING && parse_value(r->str, lim) == 0) {
		rc = 1;
	} else {
		snprintf(err, TBRATE_ERR_SIZE, "key \"%s\" holds something that is not a bucket", key);
		rc = -EBADMSG;
	}
out:
	if (r)
		freeReplyObject(r);
	redisFree(c);
	return rc;
}
