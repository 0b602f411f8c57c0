/* SPDX-License-Identifier: MIT */
/*
 * usage: tb-interval-check --rate TOKENS_PER_S --burst B [--from NS]
 *                          [--max-excess X] [--max-first-excess X] [FILE]
 *
 * Reads grants, one per line, "NS [TOKENS]" (a timestamp in nanoseconds on
 * one clock, tokens 1 when left out), in non-decreasing order of NS, from
 * FILE or standard input, and checks the limit of docs/leases.md's
 * "Safety": over every interval [t, t + d], the tokens granted are at most
 * burst + rate × d.  Prints
 *
 *   grants N tokens T span S worst_excess E worst_at A worst_d D first_excess F
 *
 * E: the largest, over every pair of grants i <= j, of the tokens of
 * grants i..j minus burst + rate × (t_j - t_i) (0 or less: the bound held
 * over every interval; -burst + tokens of one grant when there is one),
 * A and D its interval's start (ns) and length (s).  F: the same from
 * --from (the key's first call; default the first grant) to every grant.
 * Exits 1 when E exceeds --max-excess or F exceeds --max-first-excess,
 * 2 on bad input.  One pass: E is the largest (P_j - r t_j) - (P_{i-1} - r t_i)
 * with P the running sum of tokens, a running minimum of the second term.
 */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static double number(const char *s, const char *what)
{
	char *end;
	errno = 0;
	double v = strtod(s, &end);
	if (errno != 0 || *end != '\0' || !isfinite(v)) {
		fprintf(stderr, "tb-interval-check: bad %s: %s\n", what, s);
		exit(2);
	}
	return v;
}

int main(int argc, char **argv)
{
	double rate = -1, burst = -1, max_excess = INFINITY, max_first = INFINITY;
	const char *from_arg = NULL, *path = NULL;
	for (int i = 1; i < argc; i++) {
		const char *v = argv[i + 1 < argc ? i + 1 : i];
		if (strcmp(argv[i], "--rate") == 0 && i + 1 < argc)
			rate = number(v, "rate"), i++;
		else if (strcmp(argv[i], "--burst") == 0 && i + 1 < argc)
			burst = number(v, "burst"), i++;
		else if (strcmp(argv[i], "--from") == 0 && i + 1 < argc)
			from_arg = v, i++;
		else if (strcmp(argv[i], "--max-excess") == 0 && i + 1 < argc)
			max_excess = number(v, "excess"), i++;
		else if (strcmp(argv[i], "--max-first-excess") == 0 && i + 1 < argc)
			max_first = number(v, "excess"), i++;
		else if (argv[i][0] != '-' && path == NULL)
			path = argv[i];
		else
			rate = -1, i = argc;
	}
	if (!(rate >= 0) || !(burst >= 0)) {
		fprintf(stderr, "usage: %s --rate TOKENS_PER_S --burst B [--from NS] "
				"[--max-excess X] [--max-first-excess X] [FILE]\n", argv[0]);
		return 2;
	}
	FILE *in = path != NULL ? fopen(path, "r") : stdin;
	if (in == NULL) {
		perror(path);
		return 2;
	}
	const double r = rate / 1e9; /* tokens per ns */
	/* Times relative to the first grant (or --from): doubles stay exact to the ns. */
	int64_t origin = 0, prev = INT64_MIN, from = 0;
	double sum = 0;               /* P_j */
	double lowest = INFINITY;     /* min over i of P_{i-1} - r t_i */
	double lowest_t = 0;
	double worst = -INFINITY, worst_at = 0, worst_d = 0, first = -INFINITY;
	long n = 0;
	char line[128];
	while (fgets(line, sizeof(line), in) != NULL) {
		char *end;
		errno = 0;
		long long t = strtoll(line, &end, 10);
		double tokens = 1;
		if (*end == ' ' || *end == '\t')
			tokens = strtod(end, &end);
		if (errno != 0 || end == line || (*end != '\n' && *end != '\0') || !(tokens >= 0) ||
		    t < prev) {
			fprintf(stderr, "tb-interval-check: line %ld: not \"NS [TOKENS]\" in order: %s",
				n + 1, line);
			return 2;
		}
		if (n == 0) {
			origin = t;
			from = from_arg != NULL ? (int64_t)number(from_arg, "--from") : t;
		}
		prev = t;
		n++;
		double x = (double)(t - origin);
		double start_term = sum - r * x;
		if (start_term < lowest) {
			lowest = start_term;
			lowest_t = x;
		}
		sum += tokens;
		double e = sum - r * x - lowest - burst;
		if (e > worst) {
			worst = e;
			worst_at = lowest_t;
			worst_d = (x - lowest_t) / 1e9;
		}
		double f = sum - burst - r * (double)(t - from);
		if (f > first)
			first = f;
	}
	if (path != NULL)
		fclose(in);
	if (n == 0) {
		worst = first = 0;
		worst_at = 0;
	}
	printf("grants %ld tokens %.0f span %.6f worst_excess %.3f worst_at %" PRId64
	       " worst_d %.6f first_excess %.3f\n",
	       n, sum, (double)(prev - origin) / 1e9 * (n > 0), worst,
	       origin + (int64_t)worst_at, worst_d, first);
	return worst > max_excess || first > max_first ? 1 : 0;
}
