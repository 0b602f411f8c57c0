/* SPDX-License-Identifier: MIT */
/*
 * The script's general path (src/redis/script-2-general.lua, "the general path")
 * in 128-bit integers.  The script does the same arithmetic in doubles and
 * base-2^24 limbs, exact over the same ranges; every product here stays
 * below 2^128 (the bounds are noted where they are not plain): t - clock <
 * 2^64 ns, rates below 2^64, periods below 2^63, levels and debts below
 * 2^62 + 1.  The script's common case decides like its general path, so
 * one path here answers as both do.
 */
#include "bucket.h"
#include "decimal.h"
#include "span.h"

#include <string.h>

typedef unsigned __int128 u128;

#define NEVER INT64_MAX
#define U64MAX UINT64_MAX
#define Q_MAX ((uint64_t)INT64_MAX)
#define T62 ((uint64_t)1 << 62)
#define DEBT_MAX (T62 - 1)

static bool is_digit(char c)
{
	return c >= '0' && c <= '9';
}


/* Up to 19 digits into v (below 10^19 < 2^64), checked and read in one
 * pass; false at any other byte. */
static bool digits(const char *p, size_t n, uint64_t *v)
{
	uint64_t x = 0;
	for (size_t i = 0; i < n; i++) {
		unsigned d = (unsigned)(unsigned char)p[i] - '0';
		if (d > 9)
			return false;
		x = x * 10 + d;
	}
	*v = x;
	return true;
}

/* A decimal int64 (readint): an optional '-', 1 to 19 digits. */
static bool read_int(const char *p, size_t n, int64_t *out)
{
	bool neg = n > 0 && p[0] == '-';
	if (neg)
		p++, n--;
	uint64_t v;
	if (n == 0 || n > 19 || !digits(p, n, &v))
		return false;
	if (neg) {
		if (v > (uint64_t)INT64_MAX + 1)
			return false;
		*out = (int64_t)(0 - v);
	} else {
		if (v > (uint64_t)INT64_MAX)
			return false;
		*out = (int64_t)v;
	}
	return true;
}

/* 1 to 20 digits, at most hi (unsigned). */
static bool read_uint(const char *p, size_t n, uint64_t hi, uint64_t *out)
{
	uint64_t v;
	if (n == 0 || n > 20 || !digits(p, n < 19 ? n : 19, &v))
		return false;
	if (n == 20) {
		unsigned d = (unsigned)(unsigned char)p[19] - '0';
		if (d > 9 || v > (UINT64_MAX - d) / 10)
			return false;
		v = v * 10 + d;
	}
	if (v > hi)
		return false;
	*out = v;
	return true;
}

/* x / d and its remainder; one 64-bit division when x fits, as it does
 * for every rate and time but the extremes. */
static u128 div_rem(u128 x, uint64_t d, uint64_t *r)
{
	if ((x >> 64) == 0) {
		uint64_t lo = (uint64_t)x;
		*r = lo % d;
		return lo / d;
	}
	*r = (uint64_t)(x % d);
	return x / d;
}

/* The most lease groups a "tbl1" value holds. */
#define GROUPS 4

struct bucket {
	int64_t clock;
	uint64_t tok, debt, rem, sp, sq, sb;
	/* Lease groups, expiry ascending, each after clock, count >= 1:
	 * tokens leases took that stay usable until the expiry. */
	int ng;
	int64_t ge[GROUPS];
	uint64_t gc[GROUPS];
};

/* What production may fill the level to: burst less the tokens live
 * leases hold (docs/leases.md, "Safety"). */
static uint64_t top(const struct bucket *b)
{
	u128 o = 0;
	for (int i = 0; i < b->ng; i++)
		o += b->gc[i];
	return o >= b->sb ? 0 : b->sb - (uint64_t)o;
}

/* Adds k tokens, paying debt first, within burst less what leases hold;
 * a level already above that is not cut, only not filled. */
static void credit(struct bucket *b, u128 k)
{
	if (b->debt != 0) {
		if (k <= b->debt) {
			b->debt -= (uint64_t)k;
			return;
		}
		k -= b->debt;
		b->debt = 0;
	}
	uint64_t cap = top(b);
	if (b->tok >= cap)
		return;
	if (k < cap - b->tok)
		b->tok += (uint64_t)k;
	else
		b->tok = cap;
}

/* Credits what the rate produced from clock to t, the remainder carried. */
static void produce(struct bucket *b, int64_t t)
{
	if (t <= b->clock)
		return;
	if (b->sp != 0) {
		/* < (2^64 - 1)^2 + 2^64 */
		u128 x = (u128)tb__span(t, b->clock) * b->sp + b->rem;
		u128 k = div_rem(x, b->sq, &b->rem);
		if (k != 0)
			credit(b, k);
	}
	b->clock = t;
}

/* produce() in pieces: up to each lease group's expiry under the cap in
 * force, the group dropped there.  The pieces produce what one span
 * would; only the cap differs. */
static void advance(struct bucket *b, int64_t t)
{
	while (b->ng > 0 && b->ge[0] <= t) {
		produce(b, b->ge[0]);
		b->ng--;
		memmove(b->ge, b->ge + 1, (size_t)b->ng * sizeof(b->ge[0]));
		memmove(b->gc, b->gc + 1, (size_t)b->ng * sizeof(b->gc[0]));
	}
	produce(b, t);
}

/* The first time >= clock when d more tokens are produced (d >= 1, d <
 * 2^64), or NEVER: clock + the least w with w p >= d q - rem. */
static int64_t covered(const struct bucket *b, uint64_t d)
{
	if (b->sp == 0)
		return NEVER;
	u128 x = (u128)d * b->sq - b->rem; /* d q > rem, as rem < q */
	uint64_t r;
	u128 w = div_rem(x, b->sp, &r);
	w += r != 0;
	if (w >= (u128)1 << 64)
		return NEVER;
	__int128 t = (__int128)b->clock + (__int128)w;
	return t >= NEVER ? NEVER : (int64_t)t;
}

/* The level: whole tokens, or the debt with a minus sign. */
static size_t put_level(char *d, const struct bucket *b)
{
	if (b->debt == 0)
		return put_u64(d, b->tok);
	d[0] = '-';
	return 1 + put_u64(d + 1, b->debt);
}

/* Another configuration: set_rate_every_at, then set_burst_at, at now;
 * true if anything changed. */
static bool reconfigure(struct bucket *b, int64_t now, uint64_t p, uint64_t q, uint64_t burst)
{
	bool reconf = false;
	if ((u128)p * b->sq != (u128)b->sp * q) {
		advance(b, now);
		if (p != 0 && b->sp != 0) {
			/* The old fraction carries, rounded down to a ns of the new
			 * rate, no further back than INT64_MIN + 1; carry * p < q. */
			u128 carry = (u128)b->rem * q / ((u128)b->sq * p);
			uint64_t room = tb__span(b->clock, INT64_MIN + 1);
			if (carry > room)
				carry = room;
			b->rem = (uint64_t)(carry * p);
		} else {
			b->rem = 0;
		}
		b->sp = p, b->sq = q, reconf = true;
	}
	if (burst != b->sb) {
		advance(b, now);
		b->sb = burst, reconf = true;
		if (b->tok > b->sb)
			b->tok = b->sb;
	}
	return reconf;
}

static bool eq(const struct tbm_str *s, const char *lit)
{
	size_t n = strlen(lit);
	return s->n == n && memcmp(s->p, lit, n) == 0;
}

/* Splits "tb1 c l r a b u" as the script's pattern
 * ^(tbl?1) (%-?%d+) (%-?)(%d+) (%d+) (%d+) (%d+)(.*)$ does, then for
 * "tbl1" the rest as 1 to GROUPS pairs " (%-?%d+) (%d+)" and for "tb1"
 * nothing; false if it does not match.  f[0] is the clock with its sign,
 * neg the level's sign, g[0..2 * *ng - 1] the groups' expiries and counts. */
static bool split(const char *p, size_t n, struct tbm_str f[6], bool *neg,
		  struct tbm_str g[2 * GROUPS], int *ng)
{
	size_t i;
	bool leased = n >= 5 && memcmp(p, "tbl1 ", 5) == 0;
	if (leased)
		i = 5;
	else if (n >= 4 && memcmp(p, "tb1 ", 4) == 0)
		i = 4;
	else
		return false;
	*ng = 0;
	for (int k = 0; k < 6 + 2 * GROUPS; k++) {
		if (k >= 6 && (!leased || i == n) && k % 2 == 0)
			break;
		if (k > 0) {
			if (i >= n || p[i] != ' ')
				return false;
			i++;
		}
		size_t start = i;
		/* signs: the clock, the level, and each group's expiry */
		bool sign = (k == 0 || k == 1 || (k >= 6 && k % 2 == 0)) && i < n && p[i] == '-';
		if (k == 1)
			*neg = sign;
		if (sign) {
			i++;
			if (k == 1)
				start = i;
		}
		size_t d = i;
		while (i < n && is_digit(p[i]))
			i++;
		if (i == d)
			return false;
		struct tbm_str t = { p + start, i - start };
		if (k < 6)
			f[k] = t;
		else
			g[k - 6] = t, *ng = (k - 6) / 2 + 1;
	}
	return i == n && (!leased || *ng > 0);
}

static void fail(struct tbm_out *o, const char *e)
{
	o->error = e;
}

/* The expiry of a value written at the server's clock: a second after full. */
static void expire_after(struct tbm_out *o, bool tm, int64_t full, int64_t clock)
{
	if (tm && full != NEVER) {
		uint64_t w = tb__span(full, clock);
		o->expire = true;
		o->expire_ms = (int64_t)(w / 1000000 + (w % 1000000 != 0)) + 1000;
	}
}

/* The call's time: the server's (now "") or the caller's, as the script reads it. */
static bool read_now(const struct tbm_str *a, int64_t server_ns, int64_t *now)
{
	*now = server_ns;
	if (a->n == 0)
		return true;
	if (!read_int(a->p, a->n, now))
		return false;
	/* INT64_MIN and INT64_MAX are no times: they read as their neighbours. */
	if (*now == INT64_MIN)
		(*now)++;
	else if (*now == INT64_MAX)
		(*now)--;
	return true;
}

/* The groups of a "tbl1" value, checked: expiries strictly ascending and
 * neither INT64_MIN nor INT64_MAX, counts 1 to 2^62; those at or before
 * the clock have expired and are dropped. */
static bool read_groups(struct bucket *b, const struct tbm_str g[2 * GROUPS])
{
	int live = 0;
	int64_t prev = INT64_MIN;
	for (int i = 0; i < b->ng; i++) {
		int64_t e;
		uint64_t c;
		if (!read_int(g[2 * i].p, g[2 * i].n, &e) || e == INT64_MIN || e == INT64_MAX || e <= prev
		    || !read_uint(g[2 * i + 1].p, g[2 * i + 1].n, T62, &c) || c == 0)
			return false;
		prev = e;
		if (e > b->clock) {
			b->ge[live] = e, b->gc[live] = c;
			live++;
		}
	}
	b->ng = live;
	return true;
}

/* Removes the groups a give-back emptied. */
static void drop_empty(struct bucket *b)
{
	int k = 0;
	for (int i = 0; i < b->ng; i++)
		if (b->gc[i] != 0)
			b->ge[k] = b->ge[i], b->gc[k] = b->gc[i], k++;
	b->ng = k;
}

/*
 * A lease's grant of n (taken from the level already) into a group: the
 * latest, if it lives at least half a window more; else a new one that
 * lives a window (the latest then, as every other ends sooner); else,
 * with every slot taken, the latest.  Groups never move, so each chunk
 * stays in the group it was told.  Returns the group's expiry.
 */
static int64_t lease_take(struct bucket *b, uint64_t n, int64_t window)
{
	/* Past INT64_MAX, as the script's tadd: the last time, INT64_MAX - 1. */
	int64_t half = b->clock < INT64_MAX - window / 2 ? b->clock + window / 2 : INT64_MAX - 1;
	int64_t end = b->clock < INT64_MAX - window ? b->clock + window : INT64_MAX - 1;
	if (b->ng == 0 || (b->ge[b->ng - 1] < half && b->ng < GROUPS)) {
		b->ge[b->ng] = end, b->gc[b->ng] = 0;
		b->ng++;
	}
	b->gc[b->ng - 1] += n;
	return b->ge[b->ng - 1];
}

/* When the bucket is full again: its level filled to burst once every
 * group has expired (production under the groups' caps on the way). */
static int64_t full_at(const struct bucket *b)
{
	struct bucket f = *b;
	if (f.ng > 0)
		advance(&f, f.ge[f.ng - 1]);
	uint64_t missing = f.sb - f.tok + f.debt;
	return missing == 0 ? f.clock : covered(&f, missing);
}

void tbm_call(const struct tbm_str arg[7], const struct tbm_str *stored, int64_t server_ns,
	      struct tbm_out *o)
{
	o->error = NULL;
	o->write = o->expire = o->several = o->lease = false;
	enum { ALLOW, RESERVE, CANCEL, REFUND, TOKENS, RESET, LEASE, GIVE } op;
	if (eq(&arg[0], "allow"))
		op = ALLOW;
	else if (eq(&arg[0], "reserve"))
		op = RESERVE;
	else if (eq(&arg[0], "cancel"))
		op = CANCEL;
	else if (eq(&arg[0], "refund"))
		op = REFUND;
	else if (eq(&arg[0], "tokens"))
		op = TOKENS;
	else if (eq(&arg[0], "reset"))
		op = RESET;
	else if (eq(&arg[0], "lease"))
		op = LEASE;
	else if (eq(&arg[0], "giveback"))
		op = GIVE;
	else
		return fail(o, "ERR tokenbucket: bad op");

	bool tm = arg[1].n == 0;
	int64_t now;
	if (!read_now(&arg[1], server_ns, &now))
		return fail(o, "ERR tokenbucket: bad now");
	uint64_t p, q, burst, n;
	if (!read_uint(arg[2].p, arg[2].n, U64MAX, &p) || !read_uint(arg[3].p, arg[3].n, Q_MAX, &q)
	    || (p != 0 && q == 0))
		return fail(o, "ERR tokenbucket: bad rate");
	if (p == 0)
		q = 1;
	if (!read_uint(arg[4].p, arg[4].n, T62, &burst) || !read_uint(arg[5].p, arg[5].n, U64MAX, &n))
		return fail(o, "ERR tokenbucket: bad burst or n");
	int64_t xarg = 0;
	if ((op == RESERVE || op == CANCEL) && !read_int(arg[6].p, arg[6].n, &xarg))
		return fail(o, op == RESERVE ? "ERR tokenbucket: bad max_wait"
					     : "ERR tokenbucket: bad time_to_act");
	if (op == RESET && n > burst)
		return fail(o, "ERR tokenbucket: bad reset level");
	/* lease: the window in ns, 1 to LEASE_WINDOW_CAP; giveback: the
	 * group's expiry the lease was told. */
	if (op == LEASE && (!read_int(arg[6].p, arg[6].n, &xarg) || xarg < 1 || xarg > LEASE_WINDOW_CAP))
		return fail(o, "ERR tokenbucket: bad window");
	if (op == GIVE && !read_int(arg[6].p, arg[6].n, &xarg))
		return fail(o, "ERR tokenbucket: bad group");

	struct bucket b;
	if (stored) {
		static const char corrupt[] = "TBCORRUPT the value at this key is not a token bucket";
		struct tbm_str f[6], g[2 * GROUPS];
		bool neg = false;
		if (!split(stored->p, stored->n, f, &neg, g, &b.ng) || !read_int(f[0].p, f[0].n, &b.clock)
		    || !read_uint(f[2].p, f[2].n, U64MAX, &b.rem)
		    || !read_uint(f[3].p, f[3].n, U64MAX, &b.sp)
		    || !read_uint(f[4].p, f[4].n, Q_MAX, &b.sq)
		    || !read_uint(f[5].p, f[5].n, T62, &b.sb))
			return fail(o, corrupt);
		b.tok = b.debt = 0;
		if (neg ? !read_uint(f[1].p, f[1].n, DEBT_MAX, &b.debt)
			: !read_uint(f[1].p, f[1].n, T62, &b.tok))
			return fail(o, corrupt);
		if (b.clock == INT64_MIN || b.clock == INT64_MAX || b.sq == 0
		    || (b.sp == 0 && b.sq != 1) || b.rem >= b.sq || b.tok > b.sb)
			return fail(o, corrupt);
		if (!read_groups(&b, g))
			return fail(o, corrupt);
	} else {
		/* A new bucket is full and sees its first time now. */
		b = (struct bucket){ .clock = now, .tok = burst, .sp = p, .sq = q, .sb = burst };
	}

	bool reconf = reconfigure(&b, now, p, q, burst), changed = reconf;

	long long code = 1;
	int64_t act = NEVER;
	bool enough = false;
	int64_t gexp = INT64_MIN; /* a lease's group, the clock when none */
	if (op == ALLOW || op == RESERVE || op == LEASE) {
		if (n > b.sb) {
			code = 2;
		} else {
			advance(&b, now);
			changed = true;
			enough = b.debt == 0 && b.tok >= n;
			/* Not enough: the debt after taking n, below 2^63. */
			uint64_t d = enough ? 0 : n - b.tok + b.debt;
			if (op != RESERVE) {
				if (enough)
					b.tok -= n, act = b.clock;
				else
					code = 0, act = covered(&b, d);
				gexp = b.clock;
				if (op == LEASE && enough && n != 0)
					gexp = lease_take(&b, n, xarg);
			} else if (d > DEBT_MAX) {
				code = 3;
			} else {
				act = d != 0 ? covered(&b, d) : b.clock;
				/* max_wait INT64_MAX is no limit; no wait is short
				 * enough for a negative one. */
				bool ok = xarg == INT64_MAX;
				if (!ok && act != NEVER && xarg >= 0)
					ok = tb__span(act, b.clock) <= (uint64_t)xarg;
				if (!ok)
					code = 0;
				else if (enough)
					b.tok -= n;
				else
					b.tok = 0, b.debt = d;
			}
		}
	} else if (op == CANCEL) {
		if (n != 0) {
			advance(&b, now);
			changed = true;
			if (b.clock <= xarg)
				credit(&b, n);
		}
	} else if (op == REFUND) {
		/* A lease's unused tokens back, within burst; more than a burst,
		 * which no lease exceeds, is refused and changes nothing. */
		if (n > b.sb) {
			code = 2;
		} else {
			advance(&b, now);
			changed = true;
			credit(&b, n);
		}
	} else if (op == GIVE) {
		/* As refund, the named group first lowered by what comes back. */
		if (n > b.sb) {
			code = 2;
		} else {
			advance(&b, now);
			changed = true;
			for (int i = 0; i < b.ng; i++)
				if (b.ge[i] == xarg)
					b.gc[i] -= n < b.gc[i] ? n : b.gc[i];
			drop_empty(&b);
			credit(&b, n);
		}
	} else if (op == TOKENS) {
		advance(&b, now);
		changed = true;
	} else {
		/* A reset sets the level whatever leases hold: their groups go too. */
		b.clock = now, b.rem = 0, b.tok = n, b.debt = 0, b.ng = 0, changed = true;
	}

	/* Full again at full; see the script's end for the expiry and for why
	 * a refusal on the server's clock writes nothing. */
	int64_t full = full_at(&b);
	if (tm && stored && !reconf && (code == 3 || (code == 0 && !enough)))
		changed = false;

	if (changed) {
		/* "tb1 clock level rem p q burst": 4 + 6 * 21 characters at most;
		 * "tbl1", the same and each group's two numbers, while a lease
		 * group lives. */
		char *d = o->value;
		if (b.ng > 0) {
			memcpy(d, "tbl1 ", 5);
			d += 5;
		} else {
			memcpy(d, "tb1 ", 4);
			d += 4;
		}
		d += put_i64(d, b.clock);
		*d++ = ' ';
		d += put_level(d, &b);
		const uint64_t rest[4] = { b.rem, b.sp, b.sq, b.sb };
		for (int i = 0; i < 4; i++) {
			*d++ = ' ';
			d += put_u64(d, rest[i]);
		}
		for (int i = 0; i < b.ng; i++) {
			*d++ = ' ';
			d += put_i64(d, b.ge[i]);
			*d++ = ' ';
			d += put_u64(d, b.gc[i]);
		}
		o->value_len = (size_t)(d - o->value);
		o->write = true;
		expire_after(o, tm, full, b.clock);
	}
	o->code = code;
	o->field_len[0] = put_i64(o->field[0], b.clock);
	o->field_len[1] = put_level(o->field[1], &b);
	o->field_len[2] = put_u64(o->field[2], b.rem);
	o->field_len[3] = put_u64(o->field[3], b.sq);
	o->field_len[4] = put_i64(o->field[4], act);
	o->field_len[5] = put_i64(o->field[5], full);
	o->lease = op == LEASE;
	if (o->lease)
		o->field_len[6] = put_i64(o->field[6], gexp == INT64_MIN ? b.clock : gexp);
}

/* Reads "tbs1 clock" and five fields per limit (the script's allow_all),
 * into b[0..*m - 1]; false for anything else. */
static bool read_set(const struct tbm_str *v, struct bucket b[TBM_SET_MAX], size_t *m)
{
	const char *p = v->p, *end = v->p + v->n;
	if (v->n < 5 || memcmp(p, "tbs1 ", 5) != 0)
		return false;
	p += 5;
	struct tbm_str f[1 + 5 * TBM_SET_MAX];
	size_t k = 0;
	for (;;) {
		const char *start = p;
		if (p < end && *p == '-')
			p++;
		const char *d = p;
		while (p < end && is_digit(*p))
			p++;
		if (p == d || k == sizeof(f) / sizeof(f[0]))
			return false;
		f[k++] = (struct tbm_str){ start, (size_t)(p - start) };
		if (p == end)
			break;
		if (*p != ' ')
			return false;
		p++;
	}
	int64_t clock;
	if (k < 6 || (k - 1) % 5 != 0 || !read_int(f[0].p, f[0].n, &clock) || clock == INT64_MIN
	    || clock == INT64_MAX)
		return false;
	*m = (k - 1) / 5;
	for (size_t i = 0; i < *m; i++) {
		const struct tbm_str *g = &f[1 + 5 * i];
		struct bucket *x = &b[i];
		x->clock = clock, x->debt = 0, x->ng = 0;
		/* A '-' on a level reads as no number: sets hold no debt. */
		if (!read_uint(g[0].p, g[0].n, T62, &x->tok) || !read_uint(g[1].p, g[1].n, U64MAX, &x->rem)
		    || !read_uint(g[2].p, g[2].n, U64MAX, &x->sp)
		    || !read_uint(g[3].p, g[3].n, Q_MAX, &x->sq)
		    || !read_uint(g[4].p, g[4].n, T62, &x->sb) || x->sq == 0
		    || (x->sp == 0 && x->sq != 1) || x->rem >= x->sq || x->tok > x->sb)
			return false;
	}
	return true;
}

void tbm_call_all(const struct tbm_str *arg, size_t nargs, const struct tbm_str *stored,
		  int64_t server_ns, struct tbm_out *o)
{
	o->error = NULL;
	o->write = o->expire = o->lease = false;
	o->several = true;
	size_t count = (nargs - 3) / 3;
	if (nargs < 6 || nargs % 3 != 0 || count > TBM_SET_MAX)
		return fail(o, "ERR tokenbucket: bad argument count");
	bool tm = arg[1].n == 0;
	int64_t now;
	if (!read_now(&arg[1], server_ns, &now))
		return fail(o, "ERR tokenbucket: bad now");
	uint64_t n;
	if (!read_uint(arg[2].p, arg[2].n, U64MAX, &n))
		return fail(o, "ERR tokenbucket: bad n");
	uint64_t cfg[TBM_SET_MAX][3];
	for (size_t i = 0; i < count; i++) {
		const struct tbm_str *a = &arg[3 + 3 * i];
		uint64_t *c = cfg[i];
		if (!read_uint(a[0].p, a[0].n, U64MAX, &c[0]) || !read_uint(a[1].p, a[1].n, Q_MAX, &c[1])
		    || (c[0] != 0 && c[1] == 0))
			return fail(o, "ERR tokenbucket: bad rate");
		if (c[0] == 0)
			c[1] = 1;
		if (!read_uint(a[2].p, a[2].n, T62, &c[2]))
			return fail(o, "ERR tokenbucket: bad burst or n");
	}
	for (size_t i = 0; i < count; i++) {
		if (n > cfg[i][2]) {
			o->code = 2, o->index = (long long)i;
			o->field_len[0] = put_i64(o->field[0], now);
			o->field_len[1] = put_u64(o->field[1], 0);
			o->field_len[4] = put_i64(o->field[4], NEVER);
			o->field_len[5] = put_i64(o->field[5], NEVER);
			return;
		}
	}
	struct bucket b[TBM_SET_MAX];
	size_t m = 0;
	if (stored && !read_set(stored, b, &m))
		return fail(o, "TBCORRUPT the value at this key is not a set of token buckets");
	/* Each limit at max(now, clock), reconfigured as the call says; one
	 * not stored yet is full. */
	bool reconf = !stored || m != count;
	int64_t clock = stored ? b[0].clock : now;
	size_t shortest = count;
	for (size_t i = 0; i < count; i++) {
		if (i >= m)
			b[i] = (struct bucket){ .clock = clock, .tok = cfg[i][2], .sp = cfg[i][0],
						.sq = cfg[i][1], .sb = cfg[i][2] };
		reconf |= reconfigure(&b[i], now, cfg[i][0], cfg[i][1], cfg[i][2]);
		advance(&b[i], now);
		if (shortest == count && b[i].tok < n)
			shortest = i;
	}
	/* From all or from none; then the report, as the script makes it. */
	bool taken = shortest == count;
	size_t index = shortest;
	int64_t act = b[0].clock, full = b[0].clock;
	for (size_t i = 0; i < count; i++) {
		if (taken) {
			b[i].tok -= n;
			if (i == 0 || b[i].tok < b[index].tok)
				index = i;
		} else if (b[i].tok < n) {
			int64_t t = covered(&b[i], n - b[i].tok);
			if (t > act)
				act = t;
		}
		if (b[i].tok < b[i].sb) {
			int64_t t = covered(&b[i], b[i].sb - b[i].tok);
			if (t > full)
				full = t;
		}
	}
	if (taken || !tm || reconf) {
		char *d = o->value;
		memcpy(d, "tbs1 ", 5);
		d += 5;
		d += put_i64(d, b[0].clock);
		for (size_t i = 0; i < count; i++) {
			const uint64_t f[5] = { b[i].tok, b[i].rem, b[i].sp, b[i].sq, b[i].sb };
			for (int k = 0; k < 5; k++) {
				*d++ = ' ';
				d += put_u64(d, f[k]);
			}
		}
		o->value_len = (size_t)(d - o->value);
		o->write = true;
		expire_after(o, tm, full, b[0].clock);
	}
	o->code = taken ? 1 : 0;
	o->index = (long long)index;
	o->field_len[0] = put_i64(o->field[0], b[0].clock);
	o->field_len[1] = put_u64(o->field[1], b[index].tok);
	o->field_len[4] = put_i64(o->field[4], act);
	o->field_len[5] = put_i64(o->field[5], full);
}
