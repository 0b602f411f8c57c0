/* SPDX-License-Identifier: MIT */
/*
 * Bad input, exhaustively: every public function with its extreme and
 * invalid arguments, on buckets in several states.  Each row names the
 * documented result and what the call may change: nothing after a refusal
 * (the whole state, read through src/core/core.h), only "having seen now"
 * after a refusal for lack of tokens.  Output parameters hold a sentinel
 * pattern before each call and must keep it on failure.
 */
#include <ctype.h>
#include <fcntl.h>
#include <stddef.h>
#include <float.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "core.h"
#include "check_tb.h"

#define SENTINEL ((struct tokenbucket *)0x5)
#define T0 MS			 /* when the fixtures were built; before tokenbucket_now() */
#define T1 (T0 + SEC)		 /* a later time */
#define TE INT64_MIN		 /* earliest */
#define TL INT64_MAX		 /* latest */
#define SLOWEST ((double)(1e9L / (long double)INT64_MAX)) /* 1 token per INT64_MAX ns */
#define FASTEST ((double)((long double)UINT64_MAX * 1e9L)) /* UINT64_MAX tokens per ns */

/* ---- The whole state ----------------------------------------------------- */

/*
 * Every byte of the state (cache lines 0 and 1, up to the writers' mutex),
 * and the fields decoded for messages and for the checks of an effect.
 * Padding is zeroed at create and never written, so bytes compare exactly.
 */
struct snap {
	unsigned char raw[offsetof(struct tokenbucket, writer)];
	uint64_t tail, head, ceil, burst, threshold, gen;
	int64_t clock;
	uint32_t kind, flags;
};

static void snap_take(struct tokenbucket *tb, struct snap *s)
{
	memset(s, 0, sizeof(*s));
	memcpy(s->raw, tb, sizeof(s->raw)); /* no other thread runs */
	s->tail = atomic_load(&tb->tail);
	s->ceil = atomic_load(&tb->ceil);
	s->burst = atomic_load(&tb->burst);
	s->threshold = atomic_load(&tb->threshold);
	s->gen = atomic_load(&tb->gen);
	s->clock = atomic_load(&tb->clock);
	s->kind = atomic_load(&tb->kind);
	s->flags = tb->flags;
	/* The head as the rovers' model has it: what is credited up to the clock. */
	struct tb__view v;
	tb__view(tb, &v);
	s->head = atomic_load(&tb->head) + v.hoff + (uint64_t)tb__production(&v, s->clock);
}

#define SAME_FIELD(a, b, f, what)                                                   \
	ck_assert_msg((a)->f == (b)->f, "%s: %s was %lld, is %lld", (what), #f,     \
		      (long long)(a)->f, (long long)(b)->f)

static void snap_eq(const struct snap *a, const struct snap *b, const char *what)
{
	SAME_FIELD(a, b, tail, what);
	SAME_FIELD(a, b, head, what);
	SAME_FIELD(a, b, ceil, what);
	SAME_FIELD(a, b, burst, what);
	SAME_FIELD(a, b, threshold, what);
	SAME_FIELD(a, b, gen, what);
	SAME_FIELD(a, b, clock, what);
	SAME_FIELD(a, b, kind, what);
	SAME_FIELD(a, b, flags, what);
	/* And everything else: the regimes' slots, what comes next. */
	for (size_t i = 0; i < sizeof(a->raw); i++)
		ck_assert_msg(a->raw[i] == b->raw[i], "%s: state byte %zu was %#x, is %#x", what,
			      i, a->raw[i], b->raw[i]);
}

/* The level as reported: what lies above burst is dropped by the next take. */
static int64_t level(const struct snap *s)
{
	int64_t raw = (int64_t)(s->head - s->tail);
	return raw > (int64_t)s->burst ? (int64_t)s->burst : raw;
}

/*
 * What every state keeps (docs/core.md, invariants 1 and 3).  head <= ceil
 * does not hold once set_burst lowers burst below what is in flight: ceil
 * then falls behind head (ceil - tail = burst - in flight < 0), and nothing
 * is credited until releases make up for it.
 */
static void check_invariants(const struct snap *s, bool head_under_ceil, const char *what)
{
	ck_assert_msg(level(s) >= -(int64_t)TOKENBUCKET_DEBT_MAX, "%s: level %lld", what,
		      (long long)level(s));
	ck_assert_msg(level(s) <= (int64_t)s->burst, "%s: level %lld above burst %llu", what,
		      (long long)level(s), (unsigned long long)s->burst);
	ck_assert_msg(s->burst <= TOKENBUCKET_BURST_MAX, "%s: burst", what);
	ck_assert_msg(s->kind <= TB__INF, "%s: kind %u", what, s->kind);
	if (s->flags & TOKENBUCKET_CAPPED_RELEASE) {
		if (head_under_ceil)
			ck_assert_msg((int64_t)(s->ceil - s->head) >= 0, "%s: head above ceil", what);
		ck_assert_msg((int64_t)(s->ceil - s->tail) <= (int64_t)s->burst,
			      "%s: ceil more than burst ahead of tail", what);
	}
}

/* ---- Buckets in several states, built deterministically ------------------ */

enum fixture { FRESH, PARTIAL, DEBT, ZERO, INF, CAPPED, EMPTY0, DEEP, FIXTURES };

#define F(x) (1u << (x))
#define ALL ((1u << FIXTURES) - 1)
#define LIMITED (ALL & ~F(INF))

static const char *const fixture_names[FIXTURES] = {
	"fresh", "partial", "debt", "zero", "inf", "capped", "burst0", "deep",
};

static struct tokenbucket *make(enum fixture f)
{
	struct tokenbucket *tb = NULL;
	struct tokenbucket_reservation r;
	switch (f) {
	case FRESH: /* full, no time seen */
		tb = bucket_every(1, MS, 5, 0);
		break;
	case PARTIAL: /* 3 tokens and a fraction */
		tb = bucket_empty_at(3, 7 * MS, 5, 0, T0 - 10 * MS);
		ck_assert(tokenbucket_allow_at(tb, T0, 1));
		break;
	case DEBT: /* 3 tokens owed */
		tb = bucket_every(1, MS, 5, 0);
		ck_assert(tokenbucket_allow_at(tb, T0, 5));
		ck_assert_int_eq(tokenbucket_reserve_at(tb, T0, 3, TOKENBUCKET_NEVER, &r), 0);
		break;
	case ZERO: /* rate 0, 3 of 5 left */
		tb = bucket_rate(0, 5, 0);
		ck_assert(tokenbucket_allow_at(tb, T0, 2));
		break;
	case INF:
		tb = bucket_rate(TOKENBUCKET_INF, 5, 0);
		ck_assert_tokens(tokenbucket_tokens_at(tb, T0), 5);
		break;
	case CAPPED: /* 3 in flight, 1 released and credited: 3 tokens, room for 0 */
		tb = bucket_every(1, MS, 5, TOKENBUCKET_CAPPED_RELEASE);
		tokenbucket_grab(tb, 3);
		tokenbucket_replenish(tb, T0 - 2 * MS);
		ck_assert_int_eq(tokenbucket_release(tb, 1), 0);
		tokenbucket_replenish(tb, T0);
		break;
	case EMPTY0: /* burst 0, 2 owed */
		tb = bucket_every(1, MS, 0, 0);
		tokenbucket_replenish(tb, T0);
		tokenbucket_grab(tb, 2);
		break;
	case DEEP: /* rate 0, the largest burst, one token short of the largest debt */
		tb = bucket_rate(0, TOKENBUCKET_BURST_MAX, 0);
		ck_assert_int_eq(tokenbucket_reserve_at(tb, T0, TOKENBUCKET_BURST_MAX, 0, &r), 0);
		ck_assert_int_eq(tokenbucket_reserve_at(tb, T0, TOKENBUCKET_DEBT_MAX - 1,
							TOKENBUCKET_NEVER, &r),
				 0);
		break;
	default:
		ck_abort();
	}
	return tb;
}

/* ---- The rows ------------------------------------------------------------ */

enum op {
	GRAB, REPLENISH, RELEASE, REFUND, DEFICIENCY, DURATION_FOR, SET_THRESHOLD,
	ALLOW, ALLOW_AT, RESERVE, RESERVE_AT, CANCEL_AT, WAIT, TOKENS_AT, RATE, BURST,
	SET_RATE, SET_RATE_AT, SET_RATE_EVERY_AT, SET_BURST, SET_BURST_AT, RESET_AT,
};

/* How the result is checked. */
enum how {
	EQ,	   /* == want */
	TAIL,	   /* == the tail before */
	NEW_TAIL,  /* == the tail after */
	DEFICIT,   /* == what the bucket owed before */
	LE_BURST,  /* a token count, not NaN, at most burst */
	RATE_IS,   /* 0, and tokenbucket_rate() is then want_rate */
	BURST_IS,  /* 0, and tokenbucket_burst() is then n */
	NO_CHECK,
};

/* What the call may change. */
enum effect {
	SAME,	    /* nothing at all */
	SEEN,	    /* exactly what seeing now does: as tokens_at(clock after) on a twin */
	FULL,	    /* head moved up to burst; tail untouched */
	DEBT_MAXED, /* tail moved to the largest debt; head untouched */
	LEVEL,	    /* reset: clock is now, level is n */
	ANY,	    /* accepted: only the invariants */
};

/* Descriptors made when a row runs. */
enum { FD_CLOSED = -1000, FD_READABLE, FD_HUNG_UP, FD_QUIET };

struct row {
	const char *name;
	unsigned fixtures;
	enum op op;
	int64_t now;
	uint64_t n;	/* n, tokens, burst, threshold or ticket; r->tokens for cancel */
	bool over;	/* n is added to the fixture's burst */
	int64_t t;	/* max_wait, deadline, period_ns; r->time_to_act for cancel */
	double rate;
	int fd;
	bool null_r;
	enum how how;
	int64_t want;
	double want_rate;
	enum effect effect;
};

static const struct row rows[] = {
	/* The Seastar face. */
	{ "grab 0", ALL, GRAB, .n = 0, .how = TAIL, .effect = SAME },
	{ "grab max at inf", F(INF), GRAB, .n = UINT64_MAX, .how = TAIL, .effect = SAME },
	{ "grab max", LIMITED, GRAB, .n = UINT64_MAX, .how = NEW_TAIL, .effect = DEBT_MAXED },
	{ "replenish earliest", ALL & ~F(FRESH), REPLENISH, .now = TE, .how = NO_CHECK,
	  .effect = SAME },
	{ "replenish earliest, fresh", F(FRESH), REPLENISH, .now = TE, .how = NO_CHECK,
	  .effect = SEEN },
	{ "replenish latest", ALL, REPLENISH, .now = TL, .how = NO_CHECK, .effect = ANY },
	{ "release uncapped", ALL & ~F(CAPPED), RELEASE, .n = 1, .want = -ENOTSUP },
	{ "release max uncapped", ALL & ~F(CAPPED), RELEASE, .n = UINT64_MAX, .want = -ENOTSUP },
	{ "release burst+1", F(CAPPED), RELEASE, .n = 1, .over = true, .want = -EINVAL },
	{ "release max", F(CAPPED), RELEASE, .n = UINT64_MAX, .want = -EINVAL },
	{ "release 0", F(CAPPED), RELEASE, .n = 0, .want = 0 },
	{ "refund 0", ALL, REFUND, .n = 0, .how = NO_CHECK },
	{ "refund max at inf", F(INF), REFUND, .n = UINT64_MAX, .how = NO_CHECK },
	{ "refund max", LIMITED, REFUND, .n = UINT64_MAX, .how = NO_CHECK, .effect = FULL },
	{ "deficiency 0", ALL, DEFICIENCY, .n = 0, .how = NO_CHECK },
	{ "deficiency max", ALL, DEFICIENCY, .n = UINT64_MAX, .how = NO_CHECK },
	{ "deficiency INT64_MAX", ALL, DEFICIENCY, .n = INT64_MAX, .how = NO_CHECK },
	{ "duration_for 0", ALL, DURATION_FOR, .n = 0, .want = 0 },
	{ "duration_for max", LIMITED, DURATION_FOR, .n = UINT64_MAX, .want = TOKENBUCKET_NEVER },
	{ "duration_for max at inf", F(INF), DURATION_FOR, .n = UINT64_MAX, .want = 0 },
	{ "set_threshold 0", ALL, SET_THRESHOLD, .n = 0, .want = -EINVAL },
	{ "set_threshold burst+1", ALL, SET_THRESHOLD, .n = 1, .over = true, .want = -EINVAL },
	{ "set_threshold max", ALL, SET_THRESHOLD, .n = UINT64_MAX, .want = -EINVAL },

	/* allow: n > burst is false before looking at now. */
	{ "allow_at burst+1", LIMITED, ALLOW_AT, .now = T1, .n = 1, .over = true, .want = false },
	{ "allow_at max, latest", LIMITED, ALLOW_AT, .now = TL, .n = UINT64_MAX, .want = false },
	{ "allow max", LIMITED, ALLOW, .n = UINT64_MAX, .want = false },
	{ "allow_at max at inf", F(INF), ALLOW_AT, .now = TE, .n = UINT64_MAX, .want = true,
	  .effect = SEEN },
	{ "allow_at 0 in debt", F(DEBT) | F(EMPTY0) | F(DEEP), ALLOW_AT, .now = TE, .n = 0,
	  .want = false, .effect = SEEN },
	{ "allow_at 0", F(FRESH) | F(PARTIAL) | F(ZERO) | F(INF) | F(CAPPED), ALLOW_AT, .now = TE,
	  .n = 0, .want = true, .effect = SEEN },
	{ "allow_at burst, short", F(PARTIAL) | F(DEBT) | F(ZERO) | F(CAPPED) | F(DEEP), ALLOW_AT,
	  .now = TE, .n = 0, .over = true, .want = false, .effect = SEEN },
	{ "allow_at burst, rate 0", F(ZERO), ALLOW_AT, .now = T1, .n = 0, .over = true,
	  .want = false, .effect = SEEN },
	{ "allow_at 1, latest", ALL & ~F(EMPTY0), ALLOW_AT, .now = TL, .n = 1, .how = NO_CHECK, .effect = ANY },

	/* reserve */
	{ "reserve_at burst+1", LIMITED, RESERVE_AT, .now = T1, .n = 1, .over = true,
	  .t = TOKENBUCKET_NEVER, .want = -E2BIG },
	{ "reserve_at max", LIMITED, RESERVE_AT, .now = TL, .n = UINT64_MAX, .t = TOKENBUCKET_NEVER,
	  .want = -E2BIG },
	{ "reserve max", LIMITED, RESERVE, .n = UINT64_MAX, .t = INT64_MIN, .want = -E2BIG },
	{ "reserve_at r NULL", ALL, RESERVE_AT, .now = T1, .n = 1, .t = TOKENBUCKET_NEVER,
	  .null_r = true, .want = -EINVAL },
	{ "reserve_at max_wait -1", LIMITED, RESERVE_AT, .now = T1, .n = 0, .t = -1,
	  .want = -ETIMEDOUT, .effect = SEEN },
	{ "reserve_at 0, max_wait INT64_MIN", LIMITED, RESERVE_AT, .now = TE, .n = 0,
	  .t = INT64_MIN, .want = -ETIMEDOUT, .effect = SEEN },
	{ "reserve_at max_wait 0 in debt", F(DEBT) | F(EMPTY0), RESERVE_AT, .now = TE, .n = 0,
	  .t = 0, .want = -ETIMEDOUT, .effect = SEEN },
	{ "reserve_at burst at rate 0", F(ZERO), RESERVE_AT, .now = T1, .n = 0, .over = true,
	  .t = 1000 * SEC, .want = -ETIMEDOUT, .effect = SEEN },
	{ "reserve_at past the debt bound", F(DEEP), RESERVE_AT, .now = T1, .n = 2,
	  .t = TOKENBUCKET_NEVER, .want = -EOVERFLOW, .effect = SEEN },
	{ "reserve_at burst past the debt bound", F(DEEP), RESERVE_AT, .now = TE, .n = 0,
	  .over = true, .t = TOKENBUCKET_NEVER, .want = -EOVERFLOW, .effect = SEEN },
	{ "reserve_at max at inf", F(INF), RESERVE_AT, .now = TE, .n = UINT64_MAX, .t = INT64_MIN,
	  .want = 0, .effect = SEEN },
	{ "reserve_at 1, latest", ALL & ~F(EMPTY0), RESERVE_AT, .now = TL, .n = 1, .t = TOKENBUCKET_NEVER,
	  .want = 0, .effect = ANY },

	/* cancel: r->tokens from n, r->time_to_act from t. */
	{ "cancel_at r NULL", ALL, CANCEL_AT, .now = T1, .null_r = true, .how = NO_CHECK },
	{ "cancel_at nothing reserved", ALL, CANCEL_AT, .now = TL, .n = 0, .t = TOKENBUCKET_NEVER,
	  .how = NO_CHECK },
	{ "cancel_at too late", LIMITED, CANCEL_AT, .now = T1, .n = 3, .t = INT64_MIN,
	  .how = NO_CHECK, .effect = SEEN },
	{ "cancel_at max", LIMITED, CANCEL_AT, .now = TE, .n = UINT64_MAX, .t = TOKENBUCKET_NEVER,
	  .how = NO_CHECK, .effect = FULL },
	{ "cancel_at at inf", F(INF), CANCEL_AT, .now = TE, .n = 5, .t = TOKENBUCKET_NEVER,
	  .how = NO_CHECK },

	/* wait: the checks come in the order of the ERRORS list; none of these sleeps. */
	{ "wait burst+1", LIMITED, WAIT, .n = 1, .over = true, .t = TOKENBUCKET_NEVER, .fd = -1,
	  .want = -E2BIG },
	{ "wait max, closed fd, past", LIMITED, WAIT, .n = UINT64_MAX, .t = INT64_MIN,
	  .fd = FD_CLOSED, .want = -E2BIG },
	{ "wait fd -2", ALL, WAIT, .n = 0, .t = TOKENBUCKET_NEVER, .fd = -2, .want = -EBADF },
	{ "wait fd INT_MIN", ALL, WAIT, .n = 0, .t = TOKENBUCKET_NEVER, .fd = INT_MIN,
	  .want = -EBADF },
	{ "wait fd INT_MAX", ALL, WAIT, .n = 0, .t = TOKENBUCKET_NEVER, .fd = INT_MAX,
	  .want = -EBADF },
	{ "wait fd 1 << 20", ALL, WAIT, .n = 0, .t = TOKENBUCKET_NEVER, .fd = 1 << 20,
	  .want = -EBADF },
	{ "wait closed fd", ALL, WAIT, .n = 0, .t = INT64_MIN, .fd = FD_CLOSED, .want = -EBADF },
	{ "wait readable fd, past", ALL, WAIT, .n = 0, .t = INT64_MIN, .fd = FD_READABLE,
	  .want = -ECANCELED },
	{ "wait hung-up fd, past", ALL, WAIT, .n = 0, .t = INT64_MIN, .fd = FD_HUNG_UP,
	  .want = -ECANCELED },
	{ "wait past deadline", LIMITED, WAIT, .n = 0, .t = INT64_MIN, .fd = -1,
	  .want = -ETIMEDOUT, .effect = SEEN },
	{ "wait past deadline, quiet fd", LIMITED, WAIT, .n = 0, .t = -1, .fd = FD_QUIET,
	  .want = -ETIMEDOUT, .effect = SEEN },
	{ "wait past deadline at inf", F(INF), WAIT, .n = 1, .t = INT64_MIN, .fd = -1, .want = 0,
	  .effect = SEEN },
	{ "wait max at inf", F(INF), WAIT, .n = UINT64_MAX, .t = TOKENBUCKET_NEVER, .fd = FD_QUIET,
	  .want = 0, .effect = SEEN },
	{ "wait burst at rate 0", F(ZERO), WAIT, .n = 0, .over = true, .t = TOKENBUCKET_NEVER,
	  .fd = -1, .want = -ETIMEDOUT, .effect = SEEN },
	{ "wait past the debt bound", F(DEEP), WAIT, .n = 2, .t = TOKENBUCKET_NEVER, .fd = -1,
	  .want = -EOVERFLOW, .effect = SEEN },

	/* Readers. */
	{ "tokens_at earliest", ALL, TOKENS_AT, .now = TE, .how = LE_BURST, .effect = SEEN },
	{ "tokens_at latest", ALL, TOKENS_AT, .now = TL, .how = LE_BURST, .effect = ANY },
	{ "rate", ALL, RATE, .how = NO_CHECK },
	{ "burst", ALL, BURST, .how = NO_CHECK },

	/* Writers: a refusal passes no time. */
	{ "set_rate_at NaN", ALL, SET_RATE_AT, .now = T1, .rate = NAN, .want = -EINVAL },
	{ "set_rate_at -NaN", ALL, SET_RATE_AT, .now = T1, .rate = -NAN, .want = -EINVAL },
	{ "set_rate_at -1", ALL, SET_RATE_AT, .now = T1, .rate = -1, .want = -EINVAL },
	{ "set_rate_at -inf", ALL, SET_RATE_AT, .now = TL, .rate = -TOKENBUCKET_INF,
	  .want = -EINVAL },
	{ "set_rate_at -DBL_TRUE_MIN", ALL, SET_RATE_AT, .now = TE, .rate = -DBL_TRUE_MIN,
	  .want = -EINVAL },
	{ "set_rate_at -DBL_MAX", ALL, SET_RATE_AT, .now = T1, .rate = -DBL_MAX, .want = -EINVAL },
	{ "set_rate NaN", ALL, SET_RATE, .rate = NAN, .want = -EINVAL },
	{ "set_rate_at +0", ALL, SET_RATE_AT, .now = T1, .rate = 0.0, .how = RATE_IS,
	  .want_rate = 0, .effect = ANY },
	{ "set_rate_at -0", ALL, SET_RATE_AT, .now = T1, .rate = -0.0, .how = RATE_IS,
	  .want_rate = 0, .effect = ANY },
	{ "set_rate_at DBL_TRUE_MIN", ALL, SET_RATE_AT, .now = T1, .rate = DBL_TRUE_MIN,
	  .how = RATE_IS, .want_rate = SLOWEST, .effect = ANY },
	{ "set_rate_at DBL_MIN/2", ALL, SET_RATE_AT, .now = TE, .rate = DBL_MIN / 2,
	  .how = RATE_IS, .want_rate = SLOWEST, .effect = ANY },
	{ "set_rate_at 1e-300", ALL, SET_RATE_AT, .now = TL, .rate = 1e-300, .how = RATE_IS,
	  .want_rate = SLOWEST, .effect = ANY },
	{ "set_rate_at 1e300", ALL, SET_RATE_AT, .now = T1, .rate = 1e300, .how = RATE_IS,
	  .want_rate = FASTEST, .effect = ANY },
	{ "set_rate_at DBL_MAX", ALL, SET_RATE_AT, .now = T1, .rate = DBL_MAX, .how = RATE_IS,
	  .want_rate = TOKENBUCKET_INF, .effect = ANY },
	{ "set_rate_at inf", ALL, SET_RATE_AT, .now = TE, .rate = TOKENBUCKET_INF, .how = RATE_IS,
	  .want_rate = TOKENBUCKET_INF, .effect = ANY },
	{ "set_rate_every_at period 0", ALL, SET_RATE_EVERY_AT, .now = T1, .n = 1, .t = 0,
	  .want = -EINVAL },
	{ "set_rate_every_at period -1", ALL, SET_RATE_EVERY_AT, .now = T1, .n = 1, .t = -1,
	  .want = -EINVAL },
	{ "set_rate_every_at period INT64_MIN", ALL, SET_RATE_EVERY_AT, .now = TL,
	  .n = UINT64_MAX, .t = INT64_MIN, .want = -EINVAL },
	{ "set_rate_every_at 0 tokens, period INT64_MIN", ALL, SET_RATE_EVERY_AT, .now = T1,
	  .n = 0, .t = INT64_MIN, .how = RATE_IS, .want_rate = 0, .effect = ANY },
	{ "set_rate_every_at max per ns", ALL, SET_RATE_EVERY_AT, .now = T1, .n = UINT64_MAX,
	  .t = 1, .how = RATE_IS, .want_rate = FASTEST, .effect = ANY },
	{ "set_rate_every_at 1 per INT64_MAX", ALL, SET_RATE_EVERY_AT, .now = T1, .n = 1,
	  .t = INT64_MAX, .how = RATE_IS, .want_rate = SLOWEST, .effect = ANY },
	{ "set_burst_at BURST_MAX+1", ALL, SET_BURST_AT, .now = T1, .n = TOKENBUCKET_BURST_MAX + 1,
	  .want = -ERANGE },
	{ "set_burst_at max", ALL, SET_BURST_AT, .now = TL, .n = UINT64_MAX, .want = -ERANGE },
	{ "set_burst max", ALL, SET_BURST, .n = UINT64_MAX, .want = -ERANGE },
	{ "set_burst_at 0", ALL, SET_BURST_AT, .now = T1, .n = 0, .how = BURST_IS, .effect = ANY },
	{ "set_burst_at BURST_MAX", ALL, SET_BURST_AT, .now = TE, .n = TOKENBUCKET_BURST_MAX,
	  .how = BURST_IS, .effect = ANY },
	{ "reset_at burst+1", ALL, RESET_AT, .now = T1, .n = 1, .over = true, .want = -EINVAL },
	{ "reset_at max", ALL, RESET_AT, .now = TE, .n = UINT64_MAX, .want = -EINVAL },
	{ "reset_at earliest, 0", LIMITED, RESET_AT, .now = TE, .n = 0, .want = 0, .effect = LEVEL },
	{ "reset_at latest, burst", LIMITED, RESET_AT, .now = TL, .n = 0, .over = true, .want = 0,
	  .effect = LEVEL },
	{ "reset_at at inf", F(INF), RESET_AT, .now = TE, .n = 0, .want = 0, .effect = ANY },
};

static bool takes_now(enum op op)
{
	return op == ALLOW_AT || op == RESERVE_AT || op == CANCEL_AT || op == TOKENS_AT ||
	       op == SET_RATE_AT || op == SET_RATE_EVERY_AT || op == SET_BURST_AT;
}

static int64_t effective(int64_t now)
{
	return now == INT64_MIN ? INT64_MIN + 1 : now == INT64_MAX ? INT64_MAX - 1 : now;
}

static int64_t later(int64_t a, int64_t b)
{
	return a > b ? a : b;
}

/* The descriptor a wait row names. */
static int open_fd(int code)
{
	int fds[2];
	switch (code) {
	case FD_CLOSED:
		ck_assert_int_eq(pipe(fds), 0);
		close(fds[0]);
		close(fds[1]);
		return fds[0];
	case FD_READABLE:
		return eventfd(1, EFD_CLOEXEC);
	case FD_QUIET:
		return eventfd(0, EFD_CLOEXEC);
	case FD_HUNG_UP:
		ck_assert_int_eq(pipe(fds), 0);
		close(fds[1]);
		return fds[0];
	default:
		return code;
	}
}

static int64_t call(const struct row *w, struct tokenbucket *tb, uint64_t n, int fd,
		    struct tokenbucket_reservation *r, double *d)
{
	struct tokenbucket_reservation *rp = w->null_r ? NULL : r;
	switch (w->op) {
	case GRAB:
		return (int64_t)tokenbucket_grab(tb, n);
	case REPLENISH:
		tokenbucket_replenish(tb, w->now);
		return 0;
	case RELEASE:
		return tokenbucket_release(tb, n);
	case REFUND:
		tokenbucket_refund(tb, n);
		return 0;
	case DEFICIENCY:
		return (int64_t)tokenbucket_deficiency(tb, n);
	case DURATION_FOR:
		return tokenbucket_duration_for(tb, n);
	case SET_THRESHOLD:
		return tokenbucket_set_threshold(tb, n);
	case ALLOW:
		return tokenbucket_allow(tb, n);
	case ALLOW_AT:
		return tokenbucket_allow_at(tb, w->now, n);
	case RESERVE:
		return tokenbucket_reserve(tb, n, w->t, rp);
	case RESERVE_AT:
		return tokenbucket_reserve_at(tb, w->now, n, w->t, rp);
	case CANCEL_AT:
		tokenbucket_cancel_at(tb, rp, w->now);
		return 0;
	case WAIT:
		return tokenbucket_wait(tb, n, w->t, fd);
	case TOKENS_AT:
		*d = tokenbucket_tokens_at(tb, w->now);
		return 0;
	case RATE:
		*d = tokenbucket_rate(tb);
		return 0;
	case BURST:
		return (int64_t)tokenbucket_burst(tb);
	case SET_RATE:
		return tokenbucket_set_rate(tb, w->rate);
	case SET_RATE_AT:
		return tokenbucket_set_rate_at(tb, w->now, w->rate);
	case SET_RATE_EVERY_AT:
		return tokenbucket_set_rate_every_at(tb, w->now, n, w->t);
	case SET_BURST:
		return tokenbucket_set_burst(tb, n);
	case SET_BURST_AT:
		return tokenbucket_set_burst_at(tb, w->now, n);
	case RESET_AT:
		return tokenbucket_reset_at(tb, w->now, n);
	}
	ck_abort();
	return 0;
}

static void check_reservation(const struct row *w, enum fixture f, uint64_t n, int64_t got,
			      const struct tokenbucket_reservation *r,
			      const struct tokenbucket_reservation *sentinel, const struct snap *after,
			      const char *what)
{
	if (w->op == CANCEL_AT) {
		/* Only r->tokens may change: to 0, unless r was never looked at. */
		struct tokenbucket_reservation want = *sentinel;
		if (!w->null_r)
			want.tokens = 0;
		ck_assert_msg(memcmp(r, &want, sizeof(*r)) == 0, "%s: *r", what);
		return;
	}
	if (got != 0 || w->null_r) {
		ck_assert_msg(memcmp(r, sentinel, sizeof(*r)) == 0, "%s: *r written on failure", what);
		return;
	}
	ck_assert_msg(r->reserved == 0, "%s: reserved", what);
	ck_assert_msg(r->ticket == after->tail, "%s: ticket", what);
	ck_assert_msg(r->tokens == (f == INF ? 0 : n), "%s: tokens %llu", what,
		      (unsigned long long)r->tokens);
	ck_assert_msg(r->tokens <= after->burst, "%s: more than burst reserved", what);
	if (f == INF)
		ck_assert_msg(r->time_to_act == after->clock, "%s: time_to_act at inf", what);
	else
		ck_assert_msg(r->time_to_act >= after->clock, "%s: time_to_act early", what);
}

static void run_row(const struct row *w, enum fixture f)
{
	char what[160];
	snprintf(what, sizeof(what), "%s [%s]", w->name, fixture_names[f]);
	struct tokenbucket *tb = make(f);
	struct snap before, after;
	snap_take(tb, &before);
	uint64_t n = w->over ? before.burst + w->n : w->n;
	int fd = w->op == WAIT ? open_fd(w->fd) : -1;
	struct tokenbucket_reservation r, sentinel;
	memset(&sentinel, 0xa5, sizeof(sentinel));
	if (w->op == CANCEL_AT) {
		sentinel.tokens = n;
		sentinel.time_to_act = w->t;
	}
	r = sentinel;
	double d = -1;

	int64_t got = call(w, tb, n, fd, &r, &d);
	snap_take(tb, &after);
	if (w->fd > FD_CLOSED && w->fd <= FD_QUIET)
		close(fd); /* one this row opened */

	switch (w->how) {
	case EQ:
		ck_assert_msg(got == w->want, "%s: got %lld, want %lld", what, (long long)got,
			      (long long)w->want);
		break;
	case TAIL:
		ck_assert_msg((uint64_t)got == before.tail, "%s: not the tail", what);
		break;
	case NEW_TAIL:
		ck_assert_msg((uint64_t)got == after.tail, "%s: not the new tail", what);
		break;
	case DEFICIT:
		ck_assert_msg(got == (level(&before) < 0 ? -level(&before) : 0), "%s: deficit", what);
		break;
	case LE_BURST:
		ck_assert_msg(!isnan(d) && d <= (double)after.burst, "%s: %g tokens", what, d);
		break;
	case RATE_IS:
		ck_assert_msg(got == 0, "%s: got %lld", what, (long long)got);
		d = tokenbucket_rate(tb);
		ck_assert_msg(d == w->want_rate && !signbit(d), "%s: rate %a, want %a", what, d,
			      w->want_rate);
		break;
	case BURST_IS:
		ck_assert_msg(got == 0, "%s: got %lld", what, (long long)got);
		ck_assert_msg(tokenbucket_burst(tb) == n, "%s: burst", what);
		break;
	case NO_CHECK:
		break;
	}
	if (w->op == RESERVE || w->op == RESERVE_AT || w->op == CANCEL_AT)
		check_reservation(w, f, n, got, &r, &sentinel, &after, what);

	check_invariants(&after, w->op != SET_BURST && w->op != SET_BURST_AT, what);
	if (w->op != RESET_AT)
		ck_assert_msg(after.clock >= before.clock, "%s: clock went back", what);
	if (takes_now(w->op) && w->effect != SAME)
		ck_assert_msg(after.clock == later(before.clock, effective(w->now)),
			      "%s: clock %lld", what, (long long)after.clock);

	struct snap want = before;
	switch (w->effect) {
	case SAME:
		snap_eq(&before, &after, what);
		break;
	case SEEN: {
		/* Seeing now is what tokens_at does and all it does. */
		struct tokenbucket *twin = make(f);
		tokenbucket_tokens_at(twin, after.clock);
		snap_take(twin, &want);
		tokenbucket_free(twin);
		snap_eq(&want, &after, what);
		break;
	}
	case FULL:
		ck_assert_msg(after.tail == before.tail, "%s: tail moved", what);
		ck_assert_msg(level(&after) == (int64_t)after.burst, "%s: not full", what);
		break;
	case DEBT_MAXED:
		ck_assert_msg(after.head == before.head, "%s: head moved", what);
		ck_assert_msg(level(&after) == -(int64_t)TOKENBUCKET_DEBT_MAX, "%s: level %lld", what,
			      (long long)level(&after));
		want.tail = after.tail;
		memcpy(want.raw + offsetof(struct tokenbucket, tail), &after.tail, sizeof(after.tail));
		snap_eq(&want, &after, what);
		break;
	case LEVEL:
		ck_assert_msg(after.clock == effective(w->now), "%s: clock", what);
		ck_assert_msg(level(&after) == (int64_t)n, "%s: level %lld", what,
			      (long long)level(&after));
		break;
	case ANY:
		break;
	}

	/* Whatever the row did, the bucket still works at the extremes. */
	double tokens = tokenbucket_tokens_at(tb, TL);
	ck_assert_msg(!isnan(tokens) && tokens <= (double)tokenbucket_burst(tb), "%s: then %g", what,
		      tokens);
	tokenbucket_free(tb);
}

START_TEST(every_row_on_every_bucket)
{
	const struct row *w = &rows[_i];
	int ran = 0;
	for (int f = 0; f < FIXTURES; f++) {
		if (!(w->fixtures & F(f)))
			continue;
		run_row(w, (enum fixture)f);
		ran++;
	}
	ck_assert_int_gt(ran, 0);
}
END_TEST

/* ---- NULL for every pointer -------------------------------------------- */

START_TEST(null_with_extreme_arguments)
{
	struct tokenbucket_reservation r, sentinel;
	memset(&sentinel, 0xa5, sizeof(sentinel));
	r = sentinel;
	/* Where two errors apply, the documented order puts tb NULL (EINVAL) first. */
	ck_assert_int_eq(tokenbucket_reset_at(NULL, INT64_MIN, UINT64_MAX), -EINVAL);
	ck_assert_uint_eq(tokenbucket_grab(NULL, UINT64_MAX), 0);
	tokenbucket_replenish(NULL, INT64_MIN);
	tokenbucket_replenish(NULL, INT64_MAX);
	ck_assert_int_eq(tokenbucket_release(NULL, UINT64_MAX), -EINVAL);
	tokenbucket_refund(NULL, UINT64_MAX);
	ck_assert_uint_eq(tokenbucket_deficiency(NULL, UINT64_MAX), 0);
	ck_assert_int_eq(tokenbucket_duration_for(NULL, 0), TOKENBUCKET_NEVER);
	ck_assert_int_eq(tokenbucket_set_threshold(NULL, 0), -EINVAL);
	ck_assert(!tokenbucket_allow(NULL, 0));
	ck_assert(!tokenbucket_allow_at(NULL, INT64_MIN, UINT64_MAX));
	ck_assert_int_eq(tokenbucket_reserve(NULL, UINT64_MAX, INT64_MIN, &r), -EINVAL);
	ck_assert_int_eq(tokenbucket_reserve_at(NULL, INT64_MAX, 0, TOKENBUCKET_NEVER, &r),
			 -EINVAL);
	ck_assert_int_eq(tokenbucket_reserve_at(NULL, 0, 1, 0, NULL), -EINVAL);
	ck_assert(memcmp(&r, &sentinel, sizeof(r)) == 0);
	ck_assert_int_eq(tokenbucket_reservation_delay(NULL, INT64_MIN), TOKENBUCKET_NEVER);
	tokenbucket_cancel(NULL, &r);
	tokenbucket_cancel_at(NULL, &r, INT64_MAX);
	tokenbucket_cancel(NULL, NULL);
	tokenbucket_cancel_at(NULL, NULL, INT64_MIN);
	ck_assert(memcmp(&r, &sentinel, sizeof(r)) == 0);
	ck_assert_int_eq(tokenbucket_wait(NULL, UINT64_MAX, INT64_MIN, INT_MIN), -EINVAL);
	ck_assert(isnan(tokenbucket_rate(NULL)));
	ck_assert_uint_eq(tokenbucket_burst(NULL), 0);
	ck_assert(isnan(tokenbucket_tokens(NULL)));
	ck_assert(isnan(tokenbucket_tokens_at(NULL, INT64_MIN)));
	ck_assert_int_eq(tokenbucket_set_rate(NULL, NAN), -EINVAL);
	ck_assert_int_eq(tokenbucket_set_rate_at(NULL, INT64_MAX, -1), -EINVAL);
	ck_assert_int_eq(tokenbucket_set_rate_every_at(NULL, 0, 1, 0), -EINVAL);
	/* A NULL pointer's -EINVAL comes before any other error. */
	ck_assert_int_eq(tokenbucket_set_burst(NULL, UINT64_MAX), -EINVAL);
	ck_assert_int_eq(tokenbucket_set_burst_at(NULL, 0, 1), -EINVAL);
	tokenbucket_free(NULL);
}
END_TEST

/* ---- create and create_every ------------------------------------------- */

enum rate_class { BAD, RZERO, RSLOW, RFAST, RINF, REXACT };

static const struct {
	double rate;
	enum rate_class cls;
	uint64_t p, q; /* REXACT */
} create_rates[] = {
	{ NAN, BAD, 0, 0 }, { -NAN, BAD, 0, 0 }, { -1, BAD, 0, 0 },
	{ -TOKENBUCKET_INF, BAD, 0, 0 }, { -DBL_TRUE_MIN, BAD, 0, 0 }, { -DBL_MIN, BAD, 0, 0 },
	{ -DBL_MAX, BAD, 0, 0 },
	{ 0.0, RZERO, 0, 0 }, { -0.0, RZERO, 0, 0 },
	{ DBL_TRUE_MIN, RSLOW, 0, 0 }, { DBL_MIN / 2, RSLOW, 0, 0 }, { DBL_MIN, RSLOW, 0, 0 },
	{ 1e-300, RSLOW, 0, 0 },
	{ 1e-10, RSLOW, 0, 0 }, /* one token per 1e19 ns: slower than INT64_MAX ns */
	{ 1e29, RFAST, 0, 0 }, { 1e300, RFAST, 0, 0 },
	{ DBL_MAX, RINF, 0, 0 }, { TOKENBUCKET_INF, RINF, 0, 0 },
	{ 1, REXACT, 1, 1000000000 }, { 0.1, REXACT, 1, 10000000000 }, { 300, REXACT, 3, 10000000 },
};

static const uint64_t create_bursts[] = {
	0, 1, TOKENBUCKET_BURST_MAX, TOKENBUCKET_BURST_MAX + 1, UINT64_MAX,
};

static const unsigned create_flags[] = {
	0, TOKENBUCKET_CAPPED_RELEASE, 1u << 1, TOKENBUCKET_CAPPED_RELEASE | 1u << 1, 1u << 31, ~0u,
};

/* A new bucket: full, no time seen, the regime asked for, and usable at the extremes. */
static void check_new_bucket(struct tokenbucket *tb, enum rate_class cls, uint64_t p, uint64_t q,
			     uint64_t burst, unsigned flags, const char *what)
{
	struct snap s;
	snap_take(tb, &s);
	ck_assert_msg(s.tail == 0 && s.head == burst && s.ceil == burst, "%s: rovers", what);
	ck_assert_msg(s.burst == burst && s.threshold == 1 && s.flags == flags, "%s: fields", what);
	ck_assert_msg(s.clock == TB__NO_TIME, "%s: time", what);
	ck_assert_msg(s.gen == 0, "%s: gen", what);
	uint32_t kind = cls == RZERO ? TB__ZERO : cls == RINF ? TB__INF : TB__FINITE;
	ck_assert_msg(s.kind == kind, "%s: kind %u", what, s.kind);
	for (int i = 0; i < 2; i++) {
		struct tb__slot *sl = &tb->slot[i];
		ck_assert_msg(atomic_load(&sl->origin) == TB__NO_TIME &&
				      atomic_load(&sl->kind) == kind,
			      "%s: slot %d", what, i);
		if (kind == TB__FINITE)
			ck_assert_msg(atomic_load(&sl->p) == p && atomic_load(&sl->q) == q,
				      "%s: %llu/%llu", what, (unsigned long long)atomic_load(&sl->p),
				      (unsigned long long)atomic_load(&sl->q));
	}
	double rate = tokenbucket_rate(tb);
	switch (cls) {
	case RZERO:
		ck_assert_msg(rate == 0 && !signbit(rate), "%s: rate %a", what, rate);
		ck_assert_int_eq(tokenbucket_duration_for(tb, 1), TOKENBUCKET_NEVER);
		break;
	case RINF:
		ck_assert_msg(isinf(rate) && rate > 0, "%s: rate %a", what, rate);
		ck_assert_int_eq(tokenbucket_duration_for(tb, UINT64_MAX), 0);
		break;
	default:
		ck_assert_msg(rate == (double)((long double)p * 1e9L / (long double)q),
			      "%s: rate %a", what, rate);
		break;
	}
	/* The extremes of time and tokens: no crash, never above burst. */
	ck_assert_msg(tokenbucket_tokens_at(tb, INT64_MIN) <= (double)burst, "%s", what);
	tokenbucket_grab(tb, UINT64_MAX);
	tokenbucket_replenish(tb, INT64_MAX);
	ck_assert_msg(tokenbucket_tokens_at(tb, INT64_MAX) <= (double)burst, "%s", what);
	struct tokenbucket_reservation r;
	tokenbucket_reserve_at(tb, INT64_MAX, burst, TOKENBUCKET_NEVER, &r);
	tokenbucket_refund(tb, UINT64_MAX);
	snap_take(tb, &s);
	check_invariants(&s, true, what);
	ck_assert_msg(level(&s) == (int64_t)burst || kind == TB__INF, "%s: refund", what);
}

START_TEST(create_every_combination)
{
	char what[160];
	for (size_t i = 0; i < sizeof(create_rates) / sizeof(create_rates[0]); i++)
		for (size_t j = 0; j < sizeof(create_bursts) / sizeof(create_bursts[0]); j++)
			for (size_t k = 0; k < sizeof(create_flags) / sizeof(create_flags[0]); k++)
				for (int null = 0; null < 2; null++) {
					double rate = create_rates[i].rate;
					enum rate_class cls = create_rates[i].cls;
					uint64_t burst = create_bursts[j];
					unsigned flags = create_flags[k];
					snprintf(what, sizeof(what), "create(%s, %a, %llu, %#x)",
						 null ? "NULL" : "&tb", rate,
						 (unsigned long long)burst, flags);
					/* -EINVAL before -ERANGE where both apply. */
					bool einval = null || cls == BAD ||
						      (flags & ~TOKENBUCKET_CAPPED_RELEASE);
					bool erange = burst > TOKENBUCKET_BURST_MAX;
					struct tokenbucket *tb = SENTINEL;
					int err = tokenbucket_create(null ? NULL : &tb, rate, burst, flags);
					ck_assert_msg(einval	   ? err == -EINVAL
							      : erange ? err == -ERANGE
								       : err == 0,
						      "%s: %d", what, err);
					if (err) {
						ck_assert_msg(tb == SENTINEL, "%s: *tbp written", what);
						continue;
					}
					uint64_t p = create_rates[i].p, q = create_rates[i].q;
					if (cls == RSLOW)
						p = 1, q = INT64_MAX;
					else if (cls == RFAST)
						p = UINT64_MAX, q = 1;
					check_new_bucket(tb, cls, p, q, burst, flags, what);
					tokenbucket_free(tb);
				}
}
END_TEST

static uint64_t gcd(uint64_t a, uint64_t b)
{
	while (b) {
		uint64_t t = a % b;
		a = b;
		b = t;
	}
	return a;
}

START_TEST(create_every_every_combination)
{
	static const uint64_t tokens[] = { 0, 1, 3, UINT64_MAX };
	static const int64_t periods[] = { INT64_MIN, -1, 0, 1, 7, INT64_MAX };
	char what[160];
	for (size_t i = 0; i < sizeof(tokens) / sizeof(tokens[0]); i++)
		for (size_t h = 0; h < sizeof(periods) / sizeof(periods[0]); h++)
			for (size_t j = 0; j < sizeof(create_bursts) / sizeof(create_bursts[0]); j++)
				for (size_t k = 0; k < sizeof(create_flags) / sizeof(create_flags[0]);
				     k++)
					for (int null = 0; null < 2; null++) {
						uint64_t tk = tokens[i], burst = create_bursts[j];
						int64_t period = periods[h];
						unsigned flags = create_flags[k];
						snprintf(what, sizeof(what),
							 "create_every(%s, %llu, %lld, %llu, %#x)",
							 null ? "NULL" : "&tb", (unsigned long long)tk,
							 (long long)period, (unsigned long long)burst,
							 flags);
						bool einval = null || (tk > 0 && period <= 0) ||
							      (flags & ~TOKENBUCKET_CAPPED_RELEASE);
						bool erange = burst > TOKENBUCKET_BURST_MAX;
						struct tokenbucket *tb = SENTINEL;
						int err = tokenbucket_create_every(null ? NULL : &tb, tk,
										   period, burst, flags);
						ck_assert_msg(einval	   ? err == -EINVAL
								      : erange ? err == -ERANGE
									       : err == 0,
							      "%s: %d", what, err);
						if (err) {
							ck_assert_msg(tb == SENTINEL, "%s: *tbp written",
								      what);
							continue;
						}
						uint64_t g = tk ? gcd(tk, (uint64_t)period) : 1;
						check_new_bucket(tb, tk ? REXACT : RZERO, tk / g,
								 (uint64_t)period / g, burst, flags, what);
						tokenbucket_free(tb);
					}
}
END_TEST

/* ---- The functions without a bucket ------------------------------------ */

START_TEST(every_and_delay_at_the_extremes)
{
	ck_assert(isinf(tokenbucket_every(INT64_MIN)) && tokenbucket_every(INT64_MIN) > 0);
	ck_assert(isinf(tokenbucket_every(-1)));
	ck_assert(isinf(tokenbucket_every(0)));
	ck_assert_double_eq(tokenbucket_every(1), 1e9);
	ck_assert_double_eq(tokenbucket_every(INT64_MAX), 1e9 / (double)INT64_MAX);

	static const struct {
		int64_t time_to_act, now, want;
	} delays[] = {
		{ TOKENBUCKET_NEVER, INT64_MIN, TOKENBUCKET_NEVER },
		{ TOKENBUCKET_NEVER, TOKENBUCKET_NEVER, TOKENBUCKET_NEVER },
		{ TOKENBUCKET_NEVER - 1, INT64_MIN, TOKENBUCKET_NEVER },
		{ TOKENBUCKET_NEVER - 1, -1, TOKENBUCKET_NEVER },
		{ TOKENBUCKET_NEVER - 1, 0, TOKENBUCKET_NEVER - 1 },
		{ 0, INT64_MIN + 1, TOKENBUCKET_NEVER },
		{ 0, INT64_MIN + 2, TOKENBUCKET_NEVER - 1 },
		{ INT64_MIN, INT64_MAX, 0 },
		{ INT64_MIN, INT64_MIN, 0 },
		{ 5, 5, 0 },
		{ 6, 5, 1 },
	};
	for (size_t i = 0; i < sizeof(delays) / sizeof(delays[0]); i++) {
		struct tokenbucket_reservation r, saved;
		memset(&r, 0xa5, sizeof(r));
		r.time_to_act = delays[i].time_to_act;
		saved = r;
		ck_assert_int_eq(tokenbucket_reservation_delay(&r, delays[i].now), delays[i].want);
		ck_assert(memcmp(&r, &saved, sizeof(r)) == 0);
	}
}
END_TEST

/* ---- The manual says what NULL does, for every pointer parameter -------- */

#ifndef TOKENBUCKET_SOURCE_DIR
#error "TOKENBUCKET_SOURCE_DIR must name the source tree"
#endif

static char *slurp(const char *path)
{
	FILE *f = fopen(path, "r");
	ck_assert_msg(f != NULL, "cannot open %s", path);
	ck_assert_int_eq(fseek(f, 0, SEEK_END), 0);
	long size = ftell(f);
	ck_assert_int_ge(size, 0);
	rewind(f);
	char *text = malloc((size_t)size + 1);
	ck_assert_ptr_nonnull(text);
	ck_assert_uint_eq(fread(text, 1, (size_t)size, f), (size_t)size);
	text[size] = '\0';
	fclose(f);
	return text;
}

/* The page of function, following ".so" links. */
static char *man_page(const char *function)
{
	char path[512];
	snprintf(path, sizeof(path), "%s/man/man3/%s.3", TOKENBUCKET_SOURCE_DIR, function);
	char *text = slurp(path);
	for (int hops = 0; strncmp(text, ".so ", 4) == 0 && hops < 4; hops++) {
		char target[256];
		ck_assert_int_eq(sscanf(text + 4, "%255s", target), 1);
		free(text);
		snprintf(path, sizeof(path), "%s/man/%s", TOKENBUCKET_SOURCE_DIR, target);
		text = slurp(path);
	}
	return text;
}

/* True if a line ".I param" lies within 3 lines of a line that says NULL. */
static bool says_what_null_does(const char *page, const char *param)
{
	char want[80];
	snprintf(want, sizeof(want), ".I %s", param);
	int null_line = -100, param_line = -100, line = 0;
	for (const char *p = page; *p; line++) {
		const char *end = strchr(p, '\n');
		size_t len = end ? (size_t)(end - p) : strlen(p);
		bool is_param = len >= strlen(want) && strncmp(p, want, strlen(want)) == 0 &&
				(len == strlen(want) || (!isalnum((unsigned char)p[strlen(want)]) &&
							 p[strlen(want)] != '_'));
		bool is_null = memmem(p, len, "NULL", 4) != NULL;
		if (is_param)
			param_line = line;
		if (is_null)
			null_line = line;
		if ((is_param || is_null) && abs(param_line - null_line) <= 3)
			return true;
		if (!end)
			break;
		p = end + 1;
	}
	return false;
}

START_TEST(man_pages_say_what_null_does)
{
	/* Every pointer parameter of every function the header declares. */
	char *header = slurp(TOKENBUCKET_SOURCE_DIR "/include/tokenbucket.h");
	int checked = 0;
	for (char *d = strstr(header, "TOKENBUCKET_API "); d; d = strstr(d + 1, "TOKENBUCKET_API ")) {
		char *open = strchr(d, '('), *close = open ? strchr(open, ')') : NULL;
		if (d[-1] != '\n' || !open || !close || memchr(d, ';', (size_t)(open - d)))
			continue; /* not a declaration */
		char *name = open;
		while (name > d && (isalnum((unsigned char)name[-1]) || name[-1] == '_'))
			name--;
		char function[64];
		snprintf(function, sizeof(function), "%.*s", (int)(open - name), name);
		char *page = man_page(function);
		for (char *param = open + 1; param < close;) {
			char *comma = memchr(param, ',', (size_t)(close - param));
			char *end = comma ? comma : close;
			if (memchr(param, '*', (size_t)(end - param))) {
				char *id = end;
				while (id > param && (isalnum((unsigned char)id[-1]) || id[-1] == '_'))
					id--;
				char arg[64];
				snprintf(arg, sizeof(arg), "%.*s", (int)(end - id), id);
				ck_assert_msg(says_what_null_does(page, arg),
					      "man page of %s does not say what a NULL %s does",
					      function, arg);
				checked++;
			}
			param = end + 1;
		}
		free(page);
	}
	free(header);
	ck_assert_int_ge(checked, 25);
}
END_TEST

Suite *badinput_suite(void)
{
	Suite *s = suite_create("badinput");
	TCase *tc = tcase_create("rows");
	tcase_set_timeout(tc, 60);
	tcase_add_loop_test(tc, every_row_on_every_bucket, 0, (int)(sizeof(rows) / sizeof(rows[0])));
	tcase_add_test(tc, null_with_extreme_arguments);
	tcase_add_test(tc, create_every_combination);
	tcase_add_test(tc, create_every_every_combination);
	tcase_add_test(tc, every_and_delay_at_the_extremes);
	tcase_add_test(tc, man_pages_say_what_null_does);
	suite_add_tcase(s, tc);
	return s;
}
