/* SPDX-License-Identifier: MIT */
/*
 * Differential fuzzing: the bytes of an input become a bucket configuration
 * and a sequence of calls with explicit times; each call runs on the library
 * and on the reference model (model.c), and the first difference in a result,
 * an output parameter or the observable state traps.  See tests/fuzz/README
 * for the encoding.
 *
 * Built with -DFUZZ_REPLAY_MAIN it gets a main() that replays files and
 * directories without libFuzzer, and writes the seed corpus (--make-seeds).
 * FUZZ_TRACE=1 in the environment prints every call.
 */
#include <errno.h>
#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <tokenbucket.h>

#include "model.h"
#ifdef FUZZ_REPLAY_MAIN
#include "replay.h"
#endif

#define MAX_STEPS 256
#define SLOTS 8

/*
 * The input.  In generator mode the bytes come from a fixed PRNG instead and
 * are recorded, except the config and op bytes, which follow a plan: the
 * seeds are whatever the decoder read, so they always decode as planned.
 */
struct input {
	const uint8_t *p;
	size_t n;
	bool gen;
	uint64_t rng;
	const uint8_t *plan;
	size_t nplan;
	uint8_t *out;
	size_t len, cap;
};

static void record(struct input *in, uint8_t b)
{
	if (in->len == in->cap) {
		in->cap = in->cap ? 2 * in->cap : 256;
		in->out = realloc(in->out, in->cap);
		if (in->out == NULL)
			abort();
	}
	in->out[in->len++] = b;
}

static uint8_t u8(struct input *in)
{
	if (in->gen) {
		in->rng = in->rng * 6364136223846793005u + 1442695040888963407u;
		uint8_t b = (uint8_t)(in->rng >> 56);
		record(in, b);
		return b;
	}
	if (in->n == 0)
		return 0;
	in->n--;
	return *in->p++;
}

/* A byte that steers decoding: the next op, or -1 at the end of the input. */
static int steer(struct input *in)
{
	if (in->gen) {
		if (in->nplan == 0)
			return -1;
		in->nplan--;
		record(in, *in->plan);
		return *in->plan++;
	}
	if (in->n == 0)
		return -1;
	in->n--;
	return *in->p++;
}

static uint64_t bytes(struct input *in, int k)
{
	uint64_t v = 0;
	for (int i = 0; i < k; i++)
		v |= (uint64_t)u8(in) << (8 * i);
	return v;
}

static const int64_t pow10s[10] = {
	1, 10, 100, 1000, 10000, 100000, 1000000, 10000000, 100000000, 1000000000,
};

static int64_t sat_add(int64_t a, int64_t b)
{
	int64_t r;
	if (__builtin_add_overflow(a, b, &r))
		return b > 0 ? INT64_MAX : INT64_MIN;
	return r;
}

/* Token counts: small, near the burst, and the extremes. */
static uint64_t pick_count(struct input *in, uint64_t burst)
{
	uint8_t mode = u8(in) % 12;
	switch (mode) {
	case 0: case 1: case 2: case 3: case 4:
		return u8(in) & 15;
	case 5:
		return burst + (uint64_t)(u8(in) % 5) - 2;
	case 6:
		return 0;
	case 7:
		return UINT64_MAX;
	case 8:
		return bytes(in, 8);
	case 9:
		return bytes(in, 2);
	case 10:
		return TOKENBUCKET_DEBT_MAX + (uint64_t)(u8(in) % 5) - 2;
	default:
		return TOKENBUCKET_BURST_MAX + (uint64_t)(u8(in) % 3) - 1;
	}
}

static uint64_t pick_burst(struct input *in)
{
	switch (u8(in) % 8) {
	case 0: case 1: case 2: case 3:
		return u8(in) & 31;
	case 4:
		return bytes(in, 2);
	case 5:
		return TOKENBUCKET_BURST_MAX + (uint64_t)(u8(in) % 3) - 1;
	case 6:
		return u8(in) & 1 ? UINT64_MAX : TOKENBUCKET_DEBT_MAX;
	default:
		return bytes(in, 8) & (TOKENBUCKET_BURST_MAX - 1);
	}
}

static uint64_t pick_tokens(struct input *in)
{
	switch (u8(in) % 8) {
	case 0: case 1: case 2: case 3:
		return 1 + (u8(in) & 15);
	case 4:
		return 0;
	case 5:
		return UINT64_MAX - (u8(in) & 3);
	case 6:
		return bytes(in, 8);
	default:
		return bytes(in, 4);
	}
}

static int64_t pick_period(struct input *in)
{
	switch (u8(in) % 8) {
	case 0: case 1: case 2:
		return 1 + (int64_t)bytes(in, 2);
	case 3: {
		int64_t m = 1 + u8(in);
		return m * pow10s[u8(in) % 10];
	}
	case 4:
		return INT64_MAX - (u8(in) & 3);
	case 5:
		return -(int64_t)u8(in); /* 0 or negative */
	case 6:
		return INT64_C(1) << (u8(in) % 63);
	default:
		return (int64_t)bytes(in, 8);
	}
}

/*
 * Double rates: the special values, whole tokens per second, and short
 * decimals; the conversion of arbitrary doubles is checked on its own
 * (rates_test.c), and exact ratios come through create_every and
 * set_rate_every_at.  Kept as it is so that the corpus keeps its meaning.
 */
static double pick_rate(struct input *in)
{
	static const double nice[] = {
		0.1, 0.5, 3, 300, 1e9 / 3, 1e9, 2e9, 1.5, 1e6, 12.5, 1e-3, 50, 7e12, 1e18,
	};
	switch (u8(in) % 12) {
	case 0:
		return 0.0;
	case 1:
		return -0.0;
	case 2:
		return INFINITY;
	case 3:
		return u8(in) & 1 ? DBL_MAX : 1e300;
	case 4:
		return 1e-12; /* slower than 1 per INT64_MAX ns */
	case 5:
		return 1e30; /* faster than UINT64_MAX per ns */
	case 6:
		return u8(in) & 1 ? -1.0 : -INFINITY;
	case 7:
		return NAN;
	case 8: case 9:
		return 1 + (double)bytes(in, 2);
	case 10:
		return (1 + (double)bytes(in, 2)) / (double)pow10s[1 + u8(in) % 3];
	default:
		return nice[u8(in) % (sizeof(nice) / sizeof(nice[0]))];
	}
}

/* Times: mostly forward by decoded deltas, sometimes back, sometimes the extremes. */
static int64_t pick_time(struct input *in, int64_t *cursor)
{
	static const int64_t extremes[] = {
		INT64_MIN, INT64_MIN + 1, INT64_MAX, INT64_MAX - 1, 0, -1,
	};
	uint8_t mode = u8(in) % 16;
	switch (mode) {
	case 8: case 9:
		*cursor = sat_add(*cursor, (int64_t)bytes(in, 4));
		return *cursor;
	case 10: { /* an earlier time; the cursor stays */
		int64_t d = u8(in);
		return sat_add(*cursor, -d * pow10s[u8(in) % 10]);
	}
	case 11:
		*cursor = extremes[u8(in) % 6];
		return *cursor;
	case 12:
		return *cursor;
	case 13:
		*cursor = (int64_t)bytes(in, 8);
		return *cursor;
	case 14: case 15:
		*cursor = sat_add(*cursor, 1 + (u8(in) & 15));
		return *cursor;
	default: {
		int64_t d = u8(in);
		*cursor = sat_add(*cursor, d * pow10s[u8(in) % 10]);
		return *cursor;
	}
	}
}

static int64_t pick_wait(struct input *in)
{
	switch (u8(in) % 8) {
	case 0:
		return TOKENBUCKET_NEVER;
	case 1:
		return 0;
	case 2:
		return -1;
	case 3:
		return (int64_t)bytes(in, 4);
	case 4: {
		int64_t d = u8(in);
		return d * pow10s[u8(in) % 10];
	}
	case 5:
		return (int64_t)bytes(in, 8);
	case 6:
		return INT64_MIN;
	default:
		return TOKENBUCKET_NEVER - 1;
	}
}

/* ---- Comparison ----------------------------------------------------------- */

static bool tracing;
static int step;
static const char *opname;

static void diverge(const char *fmt, ...)
{
	va_list ap;
	fprintf(stderr, "tokenbucket fuzz: divergence at step %d (%s): ", step, opname);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
	__builtin_trap();
}

static void trace(const char *fmt, ...)
{
	if (!tracing)
		return;
	va_list ap;
	fprintf(stderr, "%3d ", step);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
}

static void same_u64(const char *what, uint64_t lib, uint64_t mod)
{
	if (lib != mod)
		diverge("%s: library %" PRIu64 ", model %" PRIu64, what, lib, mod);
}

static void same_i64(const char *what, int64_t lib, int64_t mod)
{
	if (lib != mod)
		diverge("%s: library %" PRId64 ", model %" PRId64, what, lib, mod);
}

static void same_double(const char *what, double lib, double mod)
{
	if (lib == mod || (isnan(lib) && isnan(mod)))
		return;
	diverge("%s: library %.17g, model %.17g", what, lib, mod);
}

/*
 * tokens_at: the model rounds the exact level + rem/q to double once (via
 * long double); the library adds the level and a separately rounded fraction.
 * Each is within about half an ulp of the exact value, plus the fraction's
 * own rounding (at most 2^-54 absolute, which matters only when a debt of -1
 * and a fraction near 1 cancel).  So two ulps of the larger, and never less
 * than 2^-52 absolute, separates rounding from a wrong token or fraction.
 */
static void close_tokens(double lib, double mod)
{
	if (lib == mod)
		return;
	if (!isnan(lib) && !isnan(mod)) {
		double big = fmax(fabs(lib), fabs(mod));
		double tol = fmax(2 * (nextafter(big, INFINITY) - big), 0x1p-52);
		if (fabs(lib - mod) <= tol)
			return;
	}
	diverge("tokens_at: library %.17g, model %.17g", lib, mod);
}

static void same_reservation(const char *what, const struct tokenbucket_reservation *a,
			     const struct tokenbucket_reservation *b)
{
	if (a->time_to_act != b->time_to_act || a->tokens != b->tokens || a->ticket != b->ticket ||
	    a->reserved != b->reserved)
		diverge("%s: library {%" PRId64 ", %" PRIu64 ", %" PRIu64 ", %" PRIu64
			"}, model {%" PRId64 ", %" PRIu64 ", %" PRIu64 ", %" PRIu64 "}",
			what, a->time_to_act, a->tokens, a->ticket, a->reserved, b->time_to_act,
			b->tokens, b->ticket, b->reserved);
}

/* ---- The run -------------------------------------------------------------- */

struct slot {
	bool used;
	struct tokenbucket_reservation lib, mod;
};

struct run {
	struct tokenbucket *tb;
	struct model *m;
	int64_t cursor;
	struct slot res[SLOTS];
	bool has_ticket[SLOTS];
	uint64_t ticket[SLOTS];
	int next_ticket;
};

static void keep_ticket(struct run *r, uint64_t t)
{
	r->has_ticket[r->next_ticket] = true;
	r->ticket[r->next_ticket] = t;
	r->next_ticket = (r->next_ticket + 1) % SLOTS;
}

/* The state both can show without changing it. */
static void compare_state(struct run *r)
{
	same_u64("burst()", tokenbucket_burst(r->tb), model_burst(r->m));
	same_double("rate()", tokenbucket_rate(r->tb), model_rate(r->m));
	same_i64("duration_for(1)", tokenbucket_duration_for(r->tb, 1), model_duration_for(r->m, 1));
	same_i64("duration_for(UINT64_MAX)", tokenbucket_duration_for(r->tb, UINT64_MAX),
		 model_duration_for(r->m, UINT64_MAX));
	for (int i = 0; i < SLOTS; i++) {
		if (r->has_ticket[i])
			same_u64("deficiency(ticket)", tokenbucket_deficiency(r->tb, r->ticket[i]),
				 model_deficiency(r->m, r->ticket[i]));
		if (r->res[i].used)
			same_u64("deficiency(reservation)",
				 tokenbucket_deficiency(r->tb, r->res[i].lib.ticket),
				 model_deficiency(r->m, r->res[i].mod.ticket));
	}
}

static void do_op(struct run *r, struct input *in, int op)
{
	uint64_t burst = model_burst(r->m);
	switch (op % 16) {
	case 0: {
		opname = "allow_at";
		int64_t now = pick_time(in, &r->cursor);
		uint64_t n = pick_count(in, burst);
		trace("allow_at(%" PRId64 ", %" PRIu64 ")", now, n);
		bool a = tokenbucket_allow_at(r->tb, now, n), b = model_allow_at(r->m, now, n);
		same_u64("result", a, b);
		break;
	}
	case 1:
	case 14: {
		opname = "reserve_at";
		int64_t now = pick_time(in, &r->cursor);
		uint64_t n = op % 16 == 1 ? pick_count(in, burst) : u8(in) & 7;
		int64_t wait = op % 16 == 1 ? pick_wait(in) : TOKENBUCKET_NEVER;
		struct slot *s = &r->res[u8(in) % SLOTS];
		trace("reserve_at(%" PRId64 ", %" PRIu64 ", %" PRId64 ")", now, n, wait);
		/* On failure *r is untouched: start both from the same garbage. */
		struct tokenbucket_reservation a, b;
		memset(&a, 0xa5, sizeof(a));
		memset(&b, 0xa5, sizeof(b));
		int ea = tokenbucket_reserve_at(r->tb, now, n, wait, &a);
		int eb = model_reserve_at(r->m, now, n, wait, &b);
		same_i64("error", ea, eb);
		same_reservation("reservation", &a, &b);
		if (ea == 0) {
			s->used = true;
			s->lib = a;
			s->mod = b;
		}
		break;
	}
	case 2: {
		opname = "cancel_at";
		int64_t now = pick_time(in, &r->cursor);
		struct slot *s = &r->res[u8(in) % SLOTS];
		trace("cancel_at(%" PRId64 ") of {%" PRId64 ", %" PRIu64 "}", now,
		      s->mod.time_to_act, s->mod.tokens);
		tokenbucket_cancel_at(r->tb, &s->lib, now);
		model_cancel_at(r->m, &s->mod, now);
		same_reservation("reservation after cancel", &s->lib, &s->mod);
		break;
	}
	case 3: {
		opname = "tokens_at";
		int64_t now = pick_time(in, &r->cursor);
		trace("tokens_at(%" PRId64 ")", now);
		close_tokens(tokenbucket_tokens_at(r->tb, now), model_tokens_at(r->m, now));
		break;
	}
	case 4: {
		opname = "set_rate_at";
		int64_t now = pick_time(in, &r->cursor);
		double rate = pick_rate(in);
		trace("set_rate_at(%" PRId64 ", %.17g)", now, rate);
		same_i64("error", tokenbucket_set_rate_at(r->tb, now, rate),
			 model_set_rate_at(r->m, now, rate));
		break;
	}
	case 5: {
		opname = "set_rate_every_at";
		int64_t now = pick_time(in, &r->cursor);
		uint64_t tokens = pick_tokens(in);
		int64_t period = pick_period(in);
		trace("set_rate_every_at(%" PRId64 ", %" PRIu64 ", %" PRId64 ")", now, tokens, period);
		same_i64("error", tokenbucket_set_rate_every_at(r->tb, now, tokens, period),
			 model_set_rate_every_at(r->m, now, tokens, period));
		break;
	}
	case 6: {
		opname = "set_burst_at";
		int64_t now = pick_time(in, &r->cursor);
		uint64_t b = pick_burst(in);
		trace("set_burst_at(%" PRId64 ", %" PRIu64 ")", now, b);
		same_i64("error", tokenbucket_set_burst_at(r->tb, now, b),
			 model_set_burst_at(r->m, now, b));
		break;
	}
	case 7: {
		opname = "reset_at";
		int64_t now = pick_time(in, &r->cursor);
		uint64_t n = pick_count(in, burst);
		trace("reset_at(%" PRId64 ", %" PRIu64 ")", now, n);
		same_i64("error", tokenbucket_reset_at(r->tb, now, n), model_reset_at(r->m, now, n));
		break;
	}
	case 8:
	case 15: {
		opname = "replenish";
		int64_t now = pick_time(in, &r->cursor);
		trace("replenish(%" PRId64 ")", now);
		tokenbucket_replenish(r->tb, now);
		model_replenish(r->m, now);
		break;
	}
	case 9: {
		opname = "grab";
		uint64_t n = pick_count(in, burst);
		trace("grab(%" PRIu64 ")", n);
		uint64_t a = tokenbucket_grab(r->tb, n), b = model_grab(r->m, n);
		same_u64("ticket", a, b);
		keep_ticket(r, a);
		break;
	}
	case 10: {
		opname = "release";
		uint64_t n = pick_count(in, burst);
		trace("release(%" PRIu64 ")", n);
		same_i64("error", tokenbucket_release(r->tb, n), model_release(r->m, n));
		break;
	}
	case 11: {
		opname = "refund";
		uint64_t n = pick_count(in, burst);
		trace("refund(%" PRIu64 ")", n);
		tokenbucket_refund(r->tb, n);
		model_refund(r->m, n);
		break;
	}
	case 12: {
		opname = "set_threshold";
		uint64_t n = pick_count(in, burst);
		trace("set_threshold(%" PRIu64 ")", n);
		same_i64("error", tokenbucket_set_threshold(r->tb, n), model_set_threshold(r->m, n));
		break;
	}
	default: {
		opname = "duration_for";
		uint64_t n = pick_count(in, burst);
		trace("duration_for(%" PRIu64 ")", n);
		same_i64("result", tokenbucket_duration_for(r->tb, n), model_duration_for(r->m, n));
		break;
	}
	}
}

/* ---- Per-key tables: a table against one model bucket per key ------------- */

#define TABLE_KEYS 8

/*
 * A table of 64 slots with TABLE_KEYS one-byte keys (never short of a
 * slot: a key's eight candidates cannot all hold other keys), each key
 * against a model bucket whose clock starts at the table's first call.
 * Times run forward, and backwards only for keys that hold a slot (a key
 * without one has seen no time, docs/table.md).
 */
static void run_table(struct input *in)
{
	struct tokenbucket_table *t = NULL;
	struct model *m[TABLE_KEYS];
	struct tokenbucket_reservation ra[TABLE_KEYS], rb[TABLE_KEYS];
	bool has[TABLE_KEYS] = { false };
	uint64_t tokens = 1 + (u8(in) & 7);
	int64_t period = 1 + (int64_t)bytes(in, 3);
	uint64_t burst = 1 + u8(in) % 16;
	opname = "table_create";
	trace("table_create(%" PRIu64 ", %" PRId64 ", %" PRIu64 ")", tokens, period, burst);
	same_i64("table create error", tokenbucket_table_create(&t, tokens, period, burst, 64, 0), 0);
	int64_t now = INT64_C(1000000000) + (int64_t)bytes(in, 4);
	same_double("first tokens_at", tokenbucket_table_tokens_at(t, now, "", 0), (double)burst);
	for (int k = 0; k < TABLE_KEYS; k++) {
		if (model_create_every(&m[k], tokens, period, burst, 0))
			abort();
		model_tokens_at(m[k], now);
	}
	memset(ra, 0, sizeof(ra));
	memset(rb, 0, sizeof(rb));
	for (step = 1; step <= MAX_STEPS; step++) {
		int op = steer(in);
		if (op < 0)
			break;
		uint8_t key = (uint8_t)(u8(in) % TABLE_KEYS);
		now += (int64_t)u8(in) * pow10s[u8(in) % 7];
		int64_t at = now;
		if (has[key] && u8(in) % 4 == 0)
			at -= (int64_t)u8(in) * pow10s[u8(in) % 7];
		uint64_t n = u8(in) % (burst + 2);
		switch (op % 5) {
		case 0: {
			opname = "table_allow_at";
			trace("table_allow_at(%" PRId64 ", key %u, %" PRIu64 ")", at, key, n);
			bool a = tokenbucket_table_allow_at(t, at, &key, 1, n);
			same_u64("result", a, model_allow_at(m[key], at, n));
			has[key] |= a && n > 0;
			break;
		}
		case 1: {
			opname = "table_allow_result_at";
			trace("table_allow_result_at(%" PRId64 ", key %u, %" PRIu64 ")", at, key, n);
			struct tokenbucket_result res;
			same_i64("error", tokenbucket_table_allow_result_at(t, at, &key, 1, n, &res), 0);
			same_u64("allowed", res.allowed, model_allow_at(m[key], at, n));
			double left = model_tokens_at(m[key], at);
			same_u64("remaining", res.remaining, left > 0 ? (uint64_t)left : 0);
			same_u64("limit", res.limit, burst);
			has[key] |= res.allowed && n > 0;
			break;
		}
		case 2: {
			opname = "table_reserve_at";
			int64_t wait = pick_wait(in);
			trace("table_reserve_at(%" PRId64 ", key %u, %" PRIu64 ", %" PRId64 ")", at,
			      key, n, wait);
			struct tokenbucket_reservation a, b;
			int ea = tokenbucket_table_reserve_at(t, at, &key, 1, n, wait, &a);
			int eb = model_reserve_at(m[key], at, n, wait, &b);
			same_i64("error", ea, eb);
			if (ea == 0) {
				same_i64("time_to_act", a.time_to_act, b.time_to_act);
				same_u64("tokens", a.tokens, b.tokens);
				ra[key] = a;
				rb[key] = b;
				has[key] |= n > 0;
			}
			break;
		}
		case 3:
			if ((op / 5) & 1) {
				/* A refund of the key's stored reservation, or of n: exact at any time. */
				uint64_t back = ra[key].tokens ? ra[key].tokens : n;
				opname = "table_refund_at";
				trace("table_refund_at(%" PRId64 ", key %u, %" PRIu64 ")", at, key, back);
				same_i64("error", tokenbucket_table_refund_at(t, at, &key, 1, back), 0);
				model_refund_at(m[key], at, back);
				ra[key].tokens = rb[key].tokens = 0;
				break;
			}
			opname = "table_cancel_at";
			trace("table_cancel_at(key %u, %" PRId64 ")", key, at);
			tokenbucket_table_cancel_at(t, &key, 1, &ra[key], at);
			model_cancel_at(m[key], &rb[key], at);
			same_u64("tokens after cancel", ra[key].tokens, rb[key].tokens);
			break;
		default:
			opname = "table_tokens_at";
			trace("table_tokens_at(%" PRId64 ", key %u)", at, key);
			close_tokens(tokenbucket_table_tokens_at(t, at, &key, 1),
				     model_tokens_at(m[key], at));
			break;
		}
	}
	struct tokenbucket_table_stats st;
	same_i64("stats", tokenbucket_table_stats(t, &st), 0);
	same_u64("refused", st.refused, 0);
	for (int k = 0; k < TABLE_KEYS; k++)
		model_free(m[k]);
	tokenbucket_table_free(t);
}

#define SET_BUCKETS 3

/*
 * A set of SET_BUCKETS buckets (1.2), each against its own model bucket;
 * the model of a set call is the single-bucket calls it is made of, on
 * the models: allow_all allows when every model holds n (then takes n from
 * each), reporting the first bucket short among those after the first,
 * else the first; reserve_all reserves from each in order and refunds the
 * earlier ones at the same time when one refuses, acting at the latest
 * time_to_act; a reserve_all cancelled at once leaves every model as it
 * was.  Times only grow.  Every level is compared after every call.
 */
static void run_set(struct input *in)
{
	struct tokenbucket *set[SET_BUCKETS];
	struct model *m[SET_BUCKETS];
	uint64_t burst[SET_BUCKETS];
	int64_t now = INT64_C(1000000000) + (int64_t)bytes(in, 4);
	opname = "set_create";
	for (int i = 0; i < SET_BUCKETS; i++) {
		uint64_t tokens = u8(in) & 7; /* 0: rate 0 */
		int64_t period = 1 + (int64_t)bytes(in, 3);
		burst[i] = 1 + u8(in) % 16;
		trace("set[%d] = create_every(%" PRIu64 ", %" PRId64 ", %" PRIu64 ")", i, tokens,
		      period, burst[i]);
		same_i64("create error", tokenbucket_create_every(&set[i], tokens, period, burst[i], 0),
			 0);
		if (model_create_every(&m[i], tokens, period, burst[i], 0))
			abort();
		close_tokens(tokenbucket_tokens_at(set[i], now), model_tokens_at(m[i], now));
	}
	for (step = 1; step <= MAX_STEPS; step++) {
		int op = steer(in);
		if (op < 0)
			break;
		now += (int64_t)u8(in) * pow10s[u8(in) % 7];
		uint64_t n = u8(in) % 18;
		switch (op % 4) {
		case 0: {
			opname = "allow_all_at";
			trace("allow_all_at(%" PRId64 ", %" PRIu64 ")", now, n);
			struct tokenbucket_set_result res;
			int err = tokenbucket_allow_all_at(set, SET_BUCKETS, now, n, &res);
			int want = 0;
			for (int i = 0; i < SET_BUCKETS; i++)
				if (n > burst[i])
					want = -E2BIG;
			same_i64("error", err, want);
			if (err)
				break;
			int first = -1;
			for (int i = 1; i < SET_BUCKETS + 1 && first < 0; i++)
				if (model_tokens_at(m[i % SET_BUCKETS], now) < (double)n)
					first = i % SET_BUCKETS;
			same_u64("allowed", res.allowed, first < 0);
			uint64_t fewest = UINT64_MAX, index = 0;
			for (int i = 0; i < SET_BUCKETS; i++) {
				if (first < 0 && !model_allow_at(m[i], now, n))
					diverge("model refused a take it had checked");
				double left = model_tokens_at(m[i], now);
				uint64_t whole = left > 0 ? (uint64_t)left : 0;
				if (first < 0 ? whole < fewest : i == first) {
					fewest = whole;
					index = (uint64_t)i;
				}
			}
			same_u64("index", res.index, index);
			same_u64("remaining", res.remaining, fewest);
			same_u64("limit", res.limit, burst[res.index]);
			break;
		}
		case 1:
		case 2: {
			opname = op % 4 == 1 ? "reserve_all_at" : "reserve_all_at+cancel_all_at";
			int64_t wait = pick_wait(in);
			trace("%s(%" PRId64 ", %" PRIu64 ", %" PRId64 ")", opname, now, n, wait);
			struct tokenbucket_reservation a[SET_BUCKETS], b[SET_BUCKETS];
			int ea = tokenbucket_reserve_all_at(set, SET_BUCKETS, now, n, wait, a);
			int eb = 0;
			for (int i = 0; i < SET_BUCKETS && eb == 0; i++)
				if (n > burst[i])
					eb = -E2BIG;
			int64_t act = INT64_MIN;
			for (int i = 0; i < SET_BUCKETS && eb == 0; i++) {
				eb = model_reserve_at(m[i], now, n, wait, &b[i]);
				if (eb) {
					/* The set's give-back is the refund rule. */
					while (i-- > 0)
						model_refund_at(m[i], now, b[i].tokens);
				} else if (b[i].time_to_act > act) {
					act = b[i].time_to_act;
				}
			}
			same_i64("error", ea, eb);
			if (ea)
				break;
			for (int i = 0; i < SET_BUCKETS; i++) {
				same_i64("time_to_act", a[i].time_to_act, act);
				same_u64("tokens", a[i].tokens, b[i].tokens);
			}
			if (op % 4 == 2) {
				same_i64("cancel", tokenbucket_cancel_all_at(set, SET_BUCKETS, now, a), 0);
				for (int i = 0; i < SET_BUCKETS; i++) {
					model_cancel_at(m[i], &b[i], now);
					same_u64("tokens after cancel", a[i].tokens, 0);
				}
			}
			break;
		}
		default: {
			int k = u8(in) % SET_BUCKETS;
			opname = "allow_at";
			trace("set[%d] allow_at(%" PRId64 ", %" PRIu64 ")", k, now, n);
			same_u64("result", tokenbucket_allow_at(set[k], now, n),
				 model_allow_at(m[k], now, n));
			break;
		}
		}
		for (int i = 0; i < SET_BUCKETS; i++)
			close_tokens(tokenbucket_tokens_at(set[i], now), model_tokens_at(m[i], now));
	}
	for (int i = 0; i < SET_BUCKETS; i++) {
		model_free(m[i]);
		tokenbucket_free(set[i]);
	}
}

static void run_input(struct input *in)
{
	struct run r = { 0 };
	step = 0;
	opname = "create";
	int cfg = steer(in);
	if (cfg < 0)
		return;
	if ((cfg & 0xe3) == 0xc3) {
		run_table(in);
		return;
	}
	if ((cfg & 0xe3) == 0x83) {
		run_set(in);
		return;
	}
	unsigned flags = (cfg & 0x10) ? TOKENBUCKET_CAPPED_RELEASE : 0;
	if ((cfg & 0xe0) == 0xe0)
		flags |= 1u << (1 + u8(in) % 31); /* an unknown flag */
	uint64_t burst = pick_burst(in);
	int ea, eb;
	if (cfg % 4 == 2) {
		double rate = pick_rate(in);
		trace("create(%.17g, %" PRIu64 ", %#x)", rate, burst, flags);
		ea = tokenbucket_create(&r.tb, rate, burst, flags);
		eb = model_create(&r.m, rate, burst, flags);
	} else {
		uint64_t tokens = cfg % 4 == 3 ? 1 + (uint64_t)(u8(in) & 7) : pick_tokens(in);
		int64_t period = cfg % 4 == 3 ? 1 + (int64_t)bytes(in, 3) : pick_period(in);
		trace("create_every(%" PRIu64 ", %" PRId64 ", %" PRIu64 ", %#x)", tokens, period,
		      burst, flags);
		ea = tokenbucket_create_every(&r.tb, tokens, period, burst, flags);
		eb = model_create_every(&r.m, tokens, period, burst, flags);
	}
	same_i64("create error", ea, eb);
	if (ea != 0)
		return;
	switch (u8(in) % 4) {
	case 0:
		r.cursor = 0;
		break;
	case 1:
		r.cursor = (int64_t)bytes(in, 8);
		break;
	case 2:
		r.cursor = INT64_MIN + (int64_t)bytes(in, 2);
		break;
	default:
		r.cursor = INT64_MAX - (int64_t)bytes(in, 4);
		break;
	}
	compare_state(&r);
	for (step = 1; step <= MAX_STEPS; step++) {
		int op = steer(in);
		if (op < 0)
			break;
		do_op(&r, in, op);
		compare_state(&r);
	}
	tokenbucket_free(r.tb);
	model_free(r.m);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv);

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
	(void)argc;
	(void)argv;
	const char *t = getenv("FUZZ_TRACE");
	tracing = t != NULL && *t != '\0' && *t != '0';
	return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct input in = { .p = data, .n = size };
	run_input(&in);
	return 0;
}

#ifdef FUZZ_REPLAY_MAIN
/* ---- Replay and seed generation without libFuzzer ------------------------ */

/*
 * The seed corpus: for each op, a run that repeats it among the others, on
 * each kind of configuration; then a few long mixed runs.  Config bytes:
 * low 2 bits 0/1 every(tokens, period), 2 double rate, 3 every(small, short);
 * 0x10 capped release; 0xe0 all set, an unknown flag.
 */
static int make_seeds(const char *dir)
{
	static const uint8_t configs[] = { 0x03, 0x13, 0x02, 0x12, 0x00, 0x11, 0x07, 0xf3 };
	int written = 0;
	for (int s = 0; s < 52; s++) {
		uint8_t plan[64];
		size_t n = 0;
		/* 40-43: tables; 44-51: sets of buckets. */
		plan[n++] = s < 40 ? configs[s % sizeof(configs)] : s < 44 ? 0xc3 : 0x83;
		if (s >= 44) {
			for (int i = 0; i < 60; i++)
				plan[n++] = (uint8_t)((i * 5 + s) % 4);
		} else if (s >= 40) {
			for (int i = 0; i < 48; i++)
				plan[n++] = (uint8_t)((i * 3 + s) % 5);
		} else if (s < 32) {
			int op = s % 16;
			static const uint8_t others[] = { 3, 8, 9, 1, 2, 3, 0, 15, 14, 3 };
			for (size_t i = 0; i < sizeof(others); i++) {
				plan[n++] = (uint8_t)op;
				plan[n++] = others[i];
			}
		} else {
			for (int i = 0; i < 48; i++)
				plan[n++] = (uint8_t)((i * 7 + s * 13) % 16);
		}
		/* Generated and checked as it goes, then replayed: a divergence traps. */
		struct input in = { .gen = true, .plan = plan, .nplan = n,
				    .rng = 0x746f6b656e + (uint64_t)s * 0x9e3779b97f4a7c15u };
		run_input(&in);
		LLVMFuzzerTestOneInput(in.out, in.len);
		char path[4096];
		snprintf(path, sizeof(path), "%s/seed-%02d", dir, s);
		FILE *f = fopen(path, "wb");
		if (f == NULL || fwrite(in.out, 1, in.len, f) != in.len || fclose(f) != 0) {
			fprintf(stderr, "%s: %s\n", path, strerror(errno));
			return 1;
		}
		free(in.out);
		written++;
	}
	printf("%d seeds written to %s\n", written, dir);
	return 0;
}

int main(int argc, char **argv)
{
	LLVMFuzzerInitialize(&argc, &argv);
	return fuzz_replay_main(argc, argv, make_seeds, tracing, " without divergence");
}
#endif
