/* SPDX-License-Identifier: MIT */
/*
 * tbrate's quantities.  Rates, bursts and the deadline's duration are
 * read by the library, tokenbucket_limit_parse(3), whose grammar they
 * follow; what is tbrate's own is the messages and the rate shown.
 *
 * The functions write no output; on failure they return a negative errno
 * and a message naming the bad part in err.
 */
#ifndef TBRATE_UNITS_H
#define TBRATE_UNITS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <tokenbucket.h>

/* Room for any message the parsers write. */
#define TBRATE_ERR_SIZE 160

/*
 * A rate: tokens every period_ns in lowest terms ({1, 0}: "unlimited") and
 * burst the amount written, as tokenbucket_limit_parse says; *bytes: the
 * text named a byte or bit unit.  0, -EINVAL, -EDOM or -ERANGE.
 */
int tbrate_parse_rate(const char *s, struct tokenbucket_limit *out, bool *bytes,
		      char err[TBRATE_ERR_SIZE]);
/* A burst: a whole, positive number of tokens no larger than max. */
int tbrate_parse_size(const char *s, uint64_t max, uint64_t *out, char err[TBRATE_ERR_SIZE]);
/* A positive duration, in whole nanoseconds (seconds by default). */
int tbrate_parse_duration(const char *s, int64_t *out_ns, char err[TBRATE_ERR_SIZE]);
/* The rate in tokens per second (a double: for display and comparison only). */
double tbrate_rate_per_second(const struct tokenbucket_limit *r);
/* Writes the rate as "N/s" in plain decimal, or "unlimited"; returns buf. */
const char *tbrate_rate_format(const struct tokenbucket_limit *r, char *buf, size_t size);

#endif
