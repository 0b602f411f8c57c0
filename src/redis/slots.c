/* SPDX-License-Identifier: MIT */
/*
 * Redis Cluster's arithmetic and the replies that steer routing, with no
 * I/O: a key's hash slot (CRC16/XMODEM of the key or of its hash tag),
 * the reply to CLUSTER SLOTS, and the MOVED and ASK errors.  Every reply
 * is input: anything that is not what Redis sends gives -EPROTO and
 * leaves the caller's state alone.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "slots.h"

/* CRC16/XMODEM (polynomial 0x1021, initial 0, no reflection), a nibble at a time. */
uint16_t tbr__crc16(const void *data, size_t len)
{
	static const uint16_t nibble[16] = {
		0x0000, 0x1021, 0x2042, 0x3063, 0x4084, 0x50a5, 0x60c6, 0x70e7,
		0x8108, 0x9129, 0xa14a, 0xb16b, 0xc18c, 0xd1ad, 0xe1ce, 0xf1ef,
	};
	const unsigned char *p = data;
	uint16_t crc = 0;
	for (size_t i = 0; i < len; i++) {
		crc = (uint16_t)((crc << 4) ^ nibble[(crc >> 12) ^ (p[i] >> 4)]);
		crc = (uint16_t)((crc << 4) ^ nibble[(crc >> 12) ^ (p[i] & 0x0f)]);
	}
	return crc;
}

/*
 * The cluster specification's rule: if the key holds a '{' and, after the
 * first one, a '}' with at least one byte between them, only those bytes
 * are hashed; otherwise (no '{', no '}' after it, or "{}") the whole key.
 */
unsigned tbr__slot(const void *key, size_t len)
{
	const char *k = key;
	const char *open = len > 0 ? memchr(k, '{', len) : NULL;
	if (open != NULL) {
		size_t from = (size_t)(open - k) + 1;
		const char *close = memchr(k + from, '}', len - from);
		if (close != NULL && close > k + from)
			return tbr__crc16(k + from, (size_t)(close - (k + from))) & (TBR__SLOTS - 1);
	}
	return tbr__crc16(k, len) & (TBR__SLOTS - 1);
}

/* A port as Redis sends it: an integer from 1 to 65535. */
int tbr__key_join(const char *prefix, size_t prefixlen, const void *key, size_t keylen,
		  char **full, size_t *len)
{
	if (key == NULL && keylen > 0)
		return -EINVAL;
	size_t n = prefixlen + keylen;
	if (n < keylen || n == SIZE_MAX)
		return -EINVAL;
	char *p = malloc(n + 1);
	if (p == NULL)
		return -ENOMEM;
	if (prefixlen > 0)
		memcpy(p, prefix, prefixlen);
	if (keylen > 0)
		memcpy(p + prefixlen, key, keylen);
	*full = p;
	*len = n;
	return 0;
}

static bool read_port(const redisReply *e, int *port)
{
	if (e == NULL || e->type != REDIS_REPLY_INTEGER || e->integer < 1 || e->integer > 65535)
		return false;
	*port = (int)e->integer;
	return true;
}

static bool read_slot(const redisReply *e, unsigned *slot)
{
	if (e == NULL || e->type != REDIS_REPLY_INTEGER || e->integer < 0 ||
	    e->integer >= TBR__SLOTS)
		return false;
	*slot = (unsigned)e->integer;
	return true;
}

/*
 * [[start, end, [host, port, id...], replicas...], ...].  Only the primary
 * (the first node of a range) matters.  An empty host means "the node you
 * asked" (Redis 7's cluster-preferred-endpoint-type); "?" or a null host
 * is an endpoint the node does not know, and leaves the range unowned.
 */
int tbr__slots_parse(const redisReply *rep, struct tbr__range **out, size_t *n)
{
	if (rep == NULL || out == NULL || n == NULL)
		return -EINVAL;
	if (rep->type != REDIS_REPLY_ARRAY || rep->elements > TBR__SLOTS)
		return -EPROTO;
	struct tbr__range *r = calloc(rep->elements > 0 ? rep->elements : 1, sizeof(*r));
	uint64_t *seen = calloc(TBR__SLOTS / 64, sizeof(uint64_t));
	int err = r == NULL || seen == NULL ? -ENOMEM : 0;
	size_t count = 0;
	for (size_t i = 0; err == 0 && i < rep->elements; i++) {
		const redisReply *e = rep->element[i];
		struct tbr__range *g = &r[count];
		if (e == NULL || e->type != REDIS_REPLY_ARRAY || e->elements < 3 ||
		    !read_slot(e->element[0], &g->start) || !read_slot(e->element[1], &g->end) ||
		    g->start > g->end) {
			err = -EPROTO;
			break;
		}
		const redisReply *node = e->element[2];
		if (node == NULL || node->type != REDIS_REPLY_ARRAY || node->elements < 2 ||
		    !read_port(node->element[1], &g->port)) {
			err = -EPROTO;
			break;
		}
		const redisReply *host = node->element[0];
		bool unknown = host != NULL && host->type == REDIS_REPLY_NIL;
		if (!unknown && (host == NULL || host->type != REDIS_REPLY_STRING ||
				 host->len > TBR__HOST_MAX || memchr(host->str, '\0', host->len) != NULL)) {
			err = -EPROTO;
			break;
		}
		unknown = unknown || (host->len == 1 && host->str[0] == '?');
		/* Two ranges claiming one slot: the map is not one the cluster could hold. */
		for (unsigned s = g->start; s <= g->end; s++) {
			if (seen[s / 64] & (UINT64_C(1) << (s % 64))) {
				err = -EPROTO;
				break;
			}
			seen[s / 64] |= UINT64_C(1) << (s % 64);
		}
		if (err != 0 || unknown)
			continue;
		g->host = host->str;
		g->hostlen = host->len;
		count++;
	}
	free(seen);
	if (err != 0) {
		free(r);
		return err;
	}
	*out = r;
	*n = count;
	return 0;
}

/* "MOVED <slot> <host>:<port>" or "ASK <slot> <host>:<port>"; an IPv6 host keeps its colons. */
int tbr__redirect_parse(const char *s, size_t len, struct tbr__redirect *rd)
{
	if (s == NULL || rd == NULL)
		return -EINVAL;
	size_t skip;
	if (len > 6 && memcmp(s, "MOVED ", 6) == 0) {
		rd->ask = false;
		skip = 6;
	} else if (len > 4 && memcmp(s, "ASK ", 4) == 0) {
		rd->ask = true;
		skip = 4;
	} else {
		return -EPROTO;
	}
	const char *p = s + skip, *end = s + len;
	unsigned slot = 0;
	int digits = 0;
	while (p < end && *p >= '0' && *p <= '9' && digits < 6) {
		slot = slot * 10 + (unsigned)(*p++ - '0');
		digits++;
	}
	if (digits == 0 || slot >= TBR__SLOTS || p >= end || *p++ != ' ')
		return -EPROTO;
	const char *colon = NULL;
	for (const char *q = p; q < end; q++)
		if (*q == ':')
			colon = q;
	if (colon == NULL || colon == end - 1 || (size_t)(end - colon) > 6)
		return -EPROTO;
	long port = 0;
	for (const char *q = colon + 1; q < end; q++) {
		if (*q < '0' || *q > '9')
			return -EPROTO;
		port = port * 10 + (*q - '0');
	}
	size_t hostlen = (size_t)(colon - p);
	if (port < 1 || port > 65535 || hostlen > TBR__HOST_MAX || memchr(p, '\0', hostlen) != NULL ||
	    memchr(p, ' ', hostlen) != NULL)
		return -EPROTO;
	rd->slot = slot;
	rd->host = p;
	rd->hostlen = hostlen;
	rd->port = (int)port;
	return 0;
}
