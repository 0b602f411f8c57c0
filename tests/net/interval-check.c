/* SPDX-License-Identifier: MIT */
/*
 * usage: tb-interval-check --rate TOKENS_PER_S --burst B [--spans] [--from NS]
 *                          [--max-excess X] [--max-first-excess X] [FILE]
 *
 * Reads grants from FILE or standard input, in any order, one per line:
 * "NS [TOKENS]" (when it was granted, in nanoseconds on one clock), or
 * with --spans "FROM TO [TOKENS]" (granted at some moment of [FROM, TO],
 * as a caller that read the clock before and after the call knows it);
 * tokens 1 when left out.  It checks the limit of docs/leases.md's
 * "Safety": over every interval [a, b], the tokens granted are at most
 * burst + rate × (b - a).  Prints
 *
 *   grants N tokens T span S worst_excess E worst_at A worst_d D first_excess F
 *
 * E: the largest, over every interval [a, b], of the tokens of the grants
 * surely inside it (FROM >= a, TO <= b) minus burst + rate × (b - a):
 * 0 or less when the bound held over every interval; a grant's place
 * within its span never makes E larger than it was.  (One grant alone:
 * its tokens minus burst.)  A and D: that interval's start (ns) and
 * length (s).  F: the same over the intervals [--from, b] (the key's
 * first call; default the earliest grant).  Exits 1 when E exceeds
 * --max-excess or F exceeds --max-first-excess, 2 on bad input.
 *
 * In the order of TO (b), each grant adds its tokens to every start a at
 * or before its FROM; a segment tree over the FROMs (the only starts that
 * can be worst) keeps tokens(a, b) + rate × a, and its largest over a <= b
 * gives E at b: O(n log n).
 */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct grant {
	int64_t from, to;
	double tokens;
};

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

static int by_to(const void *a, const void *b)
{
	const struct grant *x = a, *y = b;
	return x->to < y->to ? -1 : x->to > y->to;
}

static int by_value(const void *a, const void *b)
{
	int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
	return x < y ? -1 : x > y;
}

/* Range add, range max over [0, size): max[] at the nodes, add[] pending below. */
static double *tmax, *tadd;
static size_t tsize;

static void tree_add(size_t node, size_t lo, size_t hi, size_t upto, double v)
{
	if (lo > upto)
		return;
	if (hi <= upto) {
		tmax[node] += v;
		tadd[node] += v;
		return;
	}
	size_t mid = lo + (hi - lo) / 2;
	tree_add(2 * node, lo, mid, upto, v);
	tree_add(2 * node + 1, mid + 1, hi, upto, v);
	tmax[node] = tadd[node] + fmax(tmax[2 * node], tmax[2 * node + 1]);
}

/* The largest over [0, upto] and where it is. */
static double tree_max(size_t node, size_t lo, size_t hi, size_t upto, size_t *at)
{
	if (hi <= upto) {
		/* Down to the leaf that gives it. */
		double pending = 0;
		while (lo < hi) {
			pending += tadd[node];
			size_t mid = lo + (hi - lo) / 2;
			if (tmax[2 * node] >= tmax[2 * node + 1])
				node = 2 * node, hi = mid;
			else
				node = 2 * node + 1, lo = mid + 1;
		}
		*at = lo;
		return tmax[node] + pending;
	}
	size_t mid = lo + (hi - lo) / 2;
	size_t a1, a2;
	double m = tree_max(2 * node, lo, mid, upto, &a1);
	*at = a1;
	if (upto > mid) {
		double m2 = tree_max(2 * node + 1, mid + 1, hi, upto, &a2);
		if (m2 > m)
			m = m2, *at = a2;
	}
	return m + tadd[node];
}

static void tree_build(size_t node, size_t lo, size_t hi, const double *leaf)
{
	tadd[node] = 0;
	if (lo == hi) {
		tmax[node] = leaf[lo];
		return;
	}
	size_t mid = lo + (hi - lo) / 2;
	tree_build(2 * node, lo, mid, leaf);
	tree_build(2 * node + 1, mid + 1, hi, leaf);
	tmax[node] = fmax(tmax[2 * node], tmax[2 * node + 1]);
}

int main(int argc, char **argv)
{
	double rate = -1, burst = -1, max_excess = INFINITY, max_first = INFINITY;
	const char *from_arg = NULL, *path = NULL;
	bool spans = false;
	for (int i = 1; i < argc;) {
		const char *o = argv[i++];
		const char *v = i < argc ? argv[i] : NULL;
		if (strcmp(o, "--spans") == 0)
			spans = true;
		else if (o[0] != '-' && path == NULL)
			path = o;
		else if (v == NULL)
			rate = -1, i = argc;
		else if (strcmp(o, "--rate") == 0)
			rate = number(argv[i++], "rate");
		else if (strcmp(o, "--burst") == 0)
			burst = number(argv[i++], "burst");
		else if (strcmp(o, "--from") == 0)
			from_arg = argv[i++];
		else if (strcmp(o, "--max-excess") == 0)
			max_excess = number(argv[i++], "excess");
		else if (strcmp(o, "--max-first-excess") == 0)
			max_first = number(argv[i++], "excess");
		else
			rate = -1, i = argc;
	}
	if (!(rate >= 0) || !(burst >= 0)) {
		fprintf(stderr, "usage: %s --rate TOKENS_PER_S --burst B [--spans] [--from NS] "
				"[--max-excess X] [--max-first-excess X] [FILE]\n", argv[0]);
		return 2;
	}
	FILE *in = path != NULL ? fopen(path, "r") : stdin;
	if (in == NULL) {
		perror(path);
		return 2;
	}
	struct grant *g = NULL;
	size_t n = 0, cap = 0;
	char line[160];
	while (fgets(line, sizeof(line), in) != NULL) {
		char *p = line, *end;
		struct grant x = { .tokens = 1 };
		errno = 0;
		x.from = x.to = strtoll(p, &end, 10);
		bool ok = end != p;
		if (ok && spans) {
			p = end;
			x.to = strtoll(p, &end, 10);
			ok = end != p && x.to >= x.from;
		}
		if (ok && (*end == ' ' || *end == '\t')) {
			p = end;
			x.tokens = strtod(p, &end);
			ok = end != p && x.tokens >= 0 && isfinite(x.tokens);
		}
		if (!ok || errno != 0 || (*end != '\n' && *end != '\0')) {
			fprintf(stderr, "tb-interval-check: line %zu: not \"%s\": %s", n + 1,
				spans ? "FROM TO [TOKENS]" : "NS [TOKENS]", line);
			return 2;
		}
		if (n == cap) {
			cap = cap ? 2 * cap : 65536;
			g = realloc(g, cap * sizeof(*g));
			if (g == NULL) {
				fprintf(stderr, "tb-interval-check: out of memory\n");
				return 2;
			}
		}
		g[n++] = x;
	}
	if (path != NULL)
		fclose(in);
	if (n == 0) {
		printf("grants 0 tokens 0 span 0 worst_excess 0 worst_at 0 worst_d 0 first_excess 0\n");
		return 0;
	}
	qsort(g, n, sizeof(*g), by_to);

	/* The starts: every FROM, once, in order; rate × a relative to the earliest. */
	int64_t *starts = malloc(n * sizeof(*starts));
	double *leaf = malloc(n * sizeof(*leaf));
	tmax = malloc(4 * n * sizeof(*tmax));
	tadd = malloc(4 * n * sizeof(*tadd));
	if (starts == NULL || leaf == NULL || tmax == NULL || tadd == NULL) {
		fprintf(stderr, "tb-interval-check: out of memory\n");
		return 2;
	}
	for (size_t i = 0; i < n; i++)
		starts[i] = g[i].from;
	qsort(starts, n, sizeof(*starts), by_value);
	size_t m = 0;
	for (size_t i = 0; i < n; i++)
		if (m == 0 || starts[i] != starts[m - 1])
			starts[m++] = starts[i];
	const int64_t origin = starts[0];
	const double r = rate / 1e9; /* tokens per ns */
	for (size_t i = 0; i < m; i++)
		leaf[i] = r * (double)(starts[i] - origin);
	tsize = m;
	tree_build(1, 0, tsize - 1, leaf);

	const int64_t from = from_arg != NULL ? (int64_t)number(from_arg, "--from") : origin;
	double worst = -INFINITY, first = -INFINITY, sum = 0;
	int64_t worst_a = 0, worst_b = 0;
	for (size_t i = 0; i < n; i++) {
		/* The starts at or before this grant's FROM now cover it. */
		size_t lo = 0, hi = m;
		while (lo < hi) {
			size_t mid = lo + (hi - lo) / 2;
			if (starts[mid] <= g[i].from)
				lo = mid + 1;
			else
				hi = mid;
		}
		tree_add(1, 0, tsize - 1, lo - 1, g[i].tokens);
		sum += g[i].tokens;
		/* Only where the next grant ends later: grants ending together all count. */
		if (i + 1 < n && g[i + 1].to == g[i].to)
			continue;
		const int64_t b = g[i].to;
		lo = 0, hi = m;
		while (lo < hi) {
			size_t mid = lo + (hi - lo) / 2;
			if (starts[mid] <= b)
				lo = mid + 1;
			else
				hi = mid;
		}
		size_t at;
		double e = tree_max(1, 0, tsize - 1, lo - 1, &at) - r * (double)(b - origin) - burst;
		if (e > worst) {
			worst = e;
			worst_a = starts[at];
			worst_b = b;
		}
		double f = sum - burst - r * (double)(b - from);
		if (f > first)
			first = f;
	}
	printf("grants %zu tokens %.0f span %.6f worst_excess %.3f worst_at %" PRId64
	       " worst_d %.6f first_excess %.3f\n",
	       n, sum, (double)(g[n - 1].to - origin) / 1e9, worst, worst_a,
	       (double)(worst_b - worst_a) / 1e9, first);
	free(g);
	free(starts);
	free(leaf);
	free(tmax);
	free(tadd);
	return worst > max_excess || first > max_first ? 1 : 0;
}
