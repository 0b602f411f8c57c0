/* SPDX-License-Identifier: MIT */
/*
 * One call of the tokenbucket script (src/redis/script-*.lua), computed
 * in C on the same stored value, with the script's reply and error texts.
 * Pure: no Redis here, so that the arithmetic can be checked on its own.
 */
#ifndef TOKENBUCKET_MODULE_BUCKET_H
#define TOKENBUCKET_MODULE_BUCKET_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* A string argument as Redis hands it: bytes and a length, no NUL needed. */
struct tbm_str {
	const char *p;
	size_t n;
};

/* The longest window a lease op takes, in ns (a day: below 2^53, so
 * that the script adds it to a time in doubles). */
#define LEASE_WINDOW_CAP (INT64_C(86400) * 1000000000)

/* The most limits of a set (TOKENBUCKET_SET_MAX). */
#define TBM_SET_MAX 16
/* The longest value written: a set's, "tbs1 " and 1 + 5 * TBM_SET_MAX
 * decimals of at most 20 characters each, with their spaces (a single
 * bucket's, "tb1 " and six, is shorter). */
#define TBM_VALUE_MAX (5 + 21 * (1 + 5 * TBM_SET_MAX))

struct tbm_out {
	const char *error;     /* an error reply's text, or NULL */
	bool write;            /* write value (and the expiry below) */
	bool expire;           /* expire_ms is the key's expiry */
	int64_t expire_ms;     /* relative to the call's ms on the server's clock */
	char value[TBM_VALUE_MAX];
	size_t value_len;
	long long code;
	bool several;          /* tbm_call_all's reply: code, index, then fields 0, 1, 4, 5 */
	long long index;
	bool lease;            /* a lease's reply: field 6 follows */
	char field[7][24];     /* now, level, rem, q, act, full, and a lease's group expiry */
	size_t field_len[7];
};

/*
 * arg[0..6]: op now tokens period burst n arg, as sent to the script;
 * op "lease" (arg the window) and "giveback" (arg the group's expiry) are
 * the lease ops of tokenbucket-redis(7).
 * stored: the key's value, or NULL for no key.  server_ns: the server's
 * clock in ns (whole microseconds, as TIME gives), used only when now is
 * "".  Fills out; never fails otherwise.
 */
void tbm_call(const struct tbm_str arg[7], const struct tbm_str *stored, int64_t server_ns,
	      struct tbm_out *out);

/*
 * allow_all: arg[0..nargs - 1] as sent to the script ("allow_all" now n,
 * then tokens period burst per limit), on the same stored value, filling
 * out as the script replies and writes.
 */
void tbm_call_all(const struct tbm_str *arg, size_t nargs, const struct tbm_str *stored,
		  int64_t server_ns, struct tbm_out *out);

#endif
