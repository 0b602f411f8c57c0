/* SPDX-License-Identifier: MIT */
/*
 * A server's bytes against the bounds (internal.h) before hiredis reads
 * them: the first check of a reply, beside its decoding (codec.c), used
 * by every reader of a server's stream (the blocking reads of sigpipe.c,
 * the engine's async.c, tokenbucket_redis_parse).  Apart from codec.c so
 * that a reader needs no more of the codec than this.
 */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "internal.h"

/* A header line ends: its count or length against the bounds; false past one. */
static bool bound_line(struct tbr__bound *b)
{
	if (b->pending == 0)
		b->pending = 1; /* a reply begins */
	b->pending--;
	char type = b->head[0];
	if (type != '*' && type != '$')
		return true;
	/* hiredis reads the number itself; here only its size matters (-1 is nil). */
	size_t n = b->line < sizeof(b->head) ? (size_t)b->line : sizeof(b->head);
	uint64_t v = 0;
	size_t first = b->head[1] == '-' ? 2 : 1, i = first;
	for (; i < n && b->head[i] != '\r'; i++) {
		if (b->head[i] < '0' || b->head[i] > '9' || v > UINT64_MAX / 16)
			return false;
		v = v * 10 + (uint64_t)(b->head[i] - '0');
	}
	if (i == first || b->line > sizeof(b->head))
		return false;
	if (b->head[1] == '-')
		return v == 1; /* nil; hiredis takes no other negative */
	if (type == '*') {
		if (v > TBR__REPLY_COUNT_MAX - b->elements)
			return false;
		b->elements += v;
		b->pending += v;
	} else {
		if (v > TBR__REPLY_STRING_MAX)
			return false;
		b->skip = v + 2;
	}
	return true;
}

size_t tbr__bound_scan(struct tbr__bound *b, const char *buf, size_t len)
{
	size_t i = 0, line_start = 0;
	while (i < len && !b->bad) {
		if (b->skip > 0) {
			size_t k = len - i < b->skip ? len - i : (size_t)b->skip;
			b->skip -= k;
			b->bytes += k;
			i += k;
		} else {
			if (b->line == 0)
				line_start = i;
			if (b->line < sizeof(b->head))
				b->head[b->line] = buf[i];
			b->line++;
			b->bytes++;
			/* A line ends where hiredis ends it: at CRLF, not at a bare LF. */
			bool end = buf[i] == '\n' && b->cr;
			b->cr = buf[i++] == '\r';
			if (b->line > TBR__REPLY_STRING_MAX || (end && !bound_line(b))) {
				b->bad = true;
				return line_start;
			}
			if (end)
				b->line = 0;
		}
		if (b->bytes > TBR__REPLY_BYTES_MAX) {
			b->bad = true;
			return line_start;
		}
		if (b->pending == 0 && b->skip == 0 && b->line == 0)
			b->bytes = b->elements = 0; /* between replies */
	}
	return b->bad ? 0 : len;
}
