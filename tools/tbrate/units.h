/* SPDX-License-Identifier: MIT */
/*
 * tbrate's quantities, parsed strictly and exactly.
 *
 *   rate     := ( number [prefix] [unit] [ "/" period ] ) | "unlimited"
 *   size     := number [prefix] [unit]           (a whole number of tokens)
 *   duration := number [ "ns" | "us" | "ms" | "s" | "min" | "h" | "d" ]
 *   number   := digits [ "." digits ]            (no sign, no exponent)
 *   prefix   := k M G T P E  (SI, powers of 1000)
 *             | Ki Mi Gi Ti Pi Ei  (IEC, powers of 1024)
 *   unit     := "B" (bytes) | "b" or "bit" (bits: 8 make a byte token)
 *             | "r" (requests, nginx's spelling: a token, as no unit)
 *   period   := [count] ( "s" | "min" | "h" | "d" )   (default "s";
 *               count: a whole multiple, "7r/3s" is 7 tokens per 3 s)
 *
 * A rate is kept as an exact ratio in lowest terms: tokens per period_ns
 * ("2.5M/s" is 1 token per 400 ns, "1.5Ki/min" 128 per 5e9 ns, "10Mbit/s"
 * 1 per 800 ns).  Nothing is rounded: a value that needs more than 64 bits
 * (tokens) or 63 bits (ns) after reduction is an error, not an
 * approximation.  The functions write no output; on failure they return a
 * negative errno and a message naming the bad part in err.
 */
#ifndef TBRATE_UNITS_H
#define TBRATE_UNITS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct tbrate_rate {
	bool unlimited;     /* "unlimited": tokens and period_ns are 0 */
	bool bytes_unit;    /* the text named a byte or bit unit */
	uint64_t tokens;    /* >= 1 unless unlimited */
	int64_t period_ns;  /* >= 1 unless unlimited */
	/* The period as written ("1GB/h": an hour), in ns, INT64_MAX if longer;
	 * 0 if unlimited.  A quota's natural burst is the rate over it. */
	int64_t span_ns;
};

/* Room for any message the parsers write. */
#define TBRATE_ERR_SIZE 160

/* 0, or -EINVAL (malformed, trailing or zero) or -ERANGE (overflow). */
int tbrate_parse_rate(const char *s, struct tbrate_rate *out, char err[TBRATE_ERR_SIZE]);
/* A whole, positive number of tokens no larger than max. */
int tbrate_parse_size(const char *s, uint64_t max, uint64_t *out,
		      char err[TBRATE_ERR_SIZE]);
/* A positive duration, in whole nanoseconds (seconds by default). */
int tbrate_parse_duration(const char *s, int64_t *out_ns, char err[TBRATE_ERR_SIZE]);
/* The rate in tokens per second (a double: for display and comparison only). */
double tbrate_rate_per_second(const struct tbrate_rate *r);
/* Writes the rate as "N/s" in plain decimal, or "unlimited"; returns buf. */
const char *tbrate_rate_format(const struct tbrate_rate *r, char *buf, size_t size);

#endif
