/* SPDX-License-Identifier: MIT */
/* Redis Cluster's slots and redirections, without I/O (slots.c); nothing here is exported. */
#ifndef TOKENBUCKET_REDIS_SLOTS_H
#define TOKENBUCKET_REDIS_SLOTS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <hiredis/hiredis.h>

#define TBR__SLOTS 16384
/* Longest host name accepted from a reply (a DNS name is at most 253 bytes). */
#define TBR__HOST_MAX 255

/* A range of slots and its primary; host points into the parsed reply (not NUL-terminated). */
struct tbr__range {
	unsigned start, end; /* inclusive */
	const char *host;    /* empty: the node that sent the reply */
	size_t hostlen;
	int port;
};

/* A MOVED or ASK error reply; host points into the reply. */
struct tbr__redirect {
	bool ask;
	unsigned slot;
	const char *host;
	size_t hostlen;
	int port;
};

uint16_t tbr__crc16(const void *data, size_t len);
/* The key's hash slot, 0 to 16383 ({hash tag} rules applied). */
unsigned tbr__slot(const void *key, size_t len);
/*
 * prefix (prefixlen bytes) then key in a new buffer *full (free(); one
 * byte more, unset) of *len bytes, as a call sends its key.  -EINVAL (key
 * NULL with keylen > 0, a length that overflows), -ENOMEM.
 */
int tbr__key_join(const char *prefix, size_t prefixlen, const void *key, size_t keylen,
		  char **full, size_t *len);
/*
 * The ranges with a known primary in a CLUSTER SLOTS reply: 0 and *out
 * (free() it) of *n ranges.  -EPROTO: wrong types, a slot out of range,
 * start > end, overlapping ranges, missing fields, a bad port or host.
 * -ENOMEM.  -EINVAL: a NULL pointer.
 */
int tbr__slots_parse(const redisReply *rep, struct tbr__range **out, size_t *n);
/* An error reply's text: 0 for a well-formed MOVED or ASK, -EPROTO otherwise. */
int tbr__redirect_parse(const char *s, size_t len, struct tbr__redirect *rd);

#endif
