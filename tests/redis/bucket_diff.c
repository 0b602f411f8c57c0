/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "../on_valgrind.h"
#include "bucket.h"
#include "bucket_diff.h"

static const char corrupt[] = "TBCORRUPT the value at this key is not a token bucket";
static const char corrupt_set[] = "TBCORRUPT the value at this key is not a set of token buckets";
static const char *const op_names[] = { "allow", "reserve", "cancel", "tokens", "reset", "refund" };

/* Writes what differed; returns false, so that a check reads: if (bad) return differ(...). */
__attribute__((format(printf, 3, 4))) static bool differ(char *why, size_t size, const char *fmt,
							   ...)
{
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(why, size, fmt, ap);
	va_end(ap);
	return false;
}

/* The arguments of one call, as the client sends them; now "" on the server's clock. */
struct call {
	char text[7][24];
	struct tbm_str arg[7];
};

static void put_call(struct call *c, const char *op, const char *now,
		     const struct tokenbucket_redis_limit *l, uint64_t n, int64_t arg)
{
	snprintf(c->text[0], sizeof(c->text[0]), "%s", op);
	snprintf(c->text[1], sizeof(c->text[1]), "%s", now);
	snprintf(c->text[2], sizeof(c->text[2]), "%" PRIu64, l->tokens);
	snprintf(c->text[3], sizeof(c->text[3]), "%" PRId64, l->tokens ? l->period_ns : 1);
	snprintf(c->text[4], sizeof(c->text[4]), "%" PRIu64, l->burst);
	snprintf(c->text[5], sizeof(c->text[5]), "%" PRIu64, n);
	snprintf(c->text[6], sizeof(c->text[6]), "%" PRId64, arg);
	for (int i = 0; i < 7; i++)
		c->arg[i] = (struct tbm_str){ c->text[i], strlen(c->text[i]) };
}

static void put_call_at(struct call *c, enum tokenbucket_redis_op op, int64_t now,
			const struct tokenbucket_redis_limit *l, uint64_t n, int64_t arg)
{
	char t[24];
	snprintf(t, sizeof(t), "%" PRId64, now);
	put_call(c, op_names[op], t, l, n, arg);
}

/* A reply field as a number; false if it is not one (a decimal int64, as the client reads it). */
static bool field(const struct tbm_out *o, int i, int64_t *v)
{
	size_t n = o->field_len[i];
	const char *p = o->field[i];
	if (n == 0 || n > 20)
		return false;
	bool neg = p[0] == '-';
	uint64_t x = 0;
	for (size_t k = neg; k < n; k++) {
		if (p[k] < '0' || p[k] > '9' || x > (UINT64_MAX - 9) / 10)
			return false;
		x = x * 10 + (uint64_t)(p[k] - '0');
	}
	if (n == (size_t)neg || x > (uint64_t)INT64_MAX + neg)
		return false;
	*v = neg ? (int64_t)(0 - x) : (int64_t)x;
	return true;
}

static int64_t field_i64(const struct tbm_out *o, int i)
{
	int64_t v = 0;
	(void)field(o, i, &v);
	return v;
}

/* The client's reading of a tokens reply (codec.c): level + rem/q in long double, rounded once, within burst. */
static double reply_tokens(const struct tbm_out *o, uint64_t burst)
{
	double v = (double)((long double)field_i64(o, 1) +
			    (long double)field_i64(o, 2) / (long double)field_i64(o, 3));
	return v > (double)burst ? (double)burst : v;
}

/* Bit for bit; memcheck emulates long double with a 64-bit mantissa, so under it one ulp. */
static bool same_double(double a, double b)
{
	return memcmp(&a, &b, sizeof(a)) == 0 || (TBT_ON_VALGRIND && nextafter(a, b) == b);
}

/* The key: what the module last wrote. */
struct key {
	bool held;
	char value[TBM_VALUE_MAX];
	size_t len;
};

static const struct tbm_str *stored_of(const struct key *k, struct tbm_str *s)
{
	*s = (struct tbm_str){ k->value, k->len };
	return k->held ? s : NULL;
}

static void keep(struct key *k, const struct tbm_out *o)
{
	if (!o->write)
		return;
	memcpy(k->value, o->value, o->value_len);
	k->len = o->value_len;
	k->held = true;
}

/*
 * After a step: the key and the local bucket read at now, with the
 * configuration the local bucket has, must hold the same.  The read is
 * kept on both sides (both have then seen now).
 */
static bool same_state(struct seq *s, struct key *k, int64_t now, int step, char *why, size_t size)
{
	struct call c;
	struct tbm_out o;
	struct tbm_str v;
	put_call_at(&c, TOKENBUCKET_REDIS_TOKENS, now, &s->made, 0, 0);
	tbm_call(c.arg, stored_of(k, &v), 0, &o);
	if (o.error != NULL)
		return differ(why, size, "step %d: tokens: %s", step, o.error);
	keep(k, &o);
	double local = tokenbucket_tokens_at(s->tb, now);
	struct tokenbucket_result res;
	if (tokenbucket_allow_result_at(s->tb, now, 0, &res) != 0)
		return differ(why, size, "step %d: the library refused allow_result_at", step);
	double mine = reply_tokens(&o, s->made.burst);
	int64_t level = field_i64(&o, 1), clock = field_i64(&o, 0);
	int64_t full = seq_until(field_i64(&o, 5), clock);
	if (!same_double(mine, local) || res.remaining != (uint64_t)(level > 0 ? level : 0) ||
	    full != res.reset_after_ns)
		return differ(why, size,
			      "step %d: tokens %a level %" PRId64 " full in %" PRId64
			      ", local %a %" PRIu64 " %" PRId64 " (%.*s)",
			      step, mine, level, full, local, res.remaining, res.reset_after_ns,
			      (int)k->len, k->value);
	return true;
}

bool bd_sequence(uint64_t seed, int steps, const struct tokenbucket_redis_limit *first, char *why,
		 size_t size)
{
	struct seq s;
	struct seq_step st;
	struct seq_expect ex;
	seq_start(&s, seed, steps);
	if (first != NULL)
		s.lim = *first;
	struct key k = { 0 };
	bool ok = true;
	for (int step = 0; ok && seq_next(&s, &st, &ex); step++) {
		if (ex.err == -EFAULT) {
			ok = differ(why, size, "step %d: the library refused", step);
			break;
		}
		struct call c;
		struct tbm_out o;
		struct tbm_str v;
		put_call_at(&c, st.op, st.now, &st.lim, st.n, st.arg);
		tbm_call(c.arg, stored_of(&k, &v), 0, &o);
		if (ex.code < 0) {
			if (o.error == NULL || strcmp(o.error, "ERR tokenbucket: bad reset level") != 0 ||
			    o.write)
				ok = differ(why, size, "step %d: reset above burst: %s", step,
					    o.error ? o.error : "decided");
		} else if (o.error != NULL) {
			ok = differ(why, size, "step %d: %s: %s", step, op_names[st.op], o.error);
		} else if (o.code != ex.code) {
			ok = differ(why, size, "step %d: %s code %lld, local %d", step,
				    op_names[st.op], o.code, ex.code);
		} else if (st.op == TOKENBUCKET_REDIS_RESERVE && ex.code == 1 &&
			   field_i64(&o, 4) != ex.act) {
			ok = differ(why, size, "step %d: time_to_act %" PRId64 ", local %" PRId64, step,
				    field_i64(&o, 4), ex.act);
		} else if (st.op == TOKENBUCKET_REDIS_TOKENS &&
			   !same_double(reply_tokens(&o, st.lim.burst), ex.tokens)) {
			ok = differ(why, size, "step %d: tokens %a, local %a", step,
				    reply_tokens(&o, st.lim.burst), ex.tokens);
		}
		keep(&k, &o);
		if (ok && k.held != s.seen)
			ok = differ(why, size, "step %d: key held %d, local bucket seen %d", step,
				    k.held, s.seen);
		if (ok && s.seen)
			ok = same_state(&s, &k, st.now, step, why, size);
	}
	seq_end(&s);
	return ok;
}

bool bd_set_sequence(uint64_t seed, int steps, size_t max_count, char *why, size_t size)
{
	struct seq_set s;
	struct seq_set_step st;
	struct seq_set_expect ex;
	seq_set_start(&s, seed, steps, max_count);
	struct key k = { 0 };
	bool ok = true;
	for (int step = 0; ok && seq_set_next(&s, &st, &ex); step++) {
		if (ex.err == -EFAULT) {
			ok = differ(why, size, "step %d: the library refused", step);
			break;
		}
		char text[3 + 3 * TBM_SET_MAX][24];
		struct tbm_str arg[3 + 3 * TBM_SET_MAX];
		size_t nargs = 3 + 3 * st.count;
		snprintf(text[0], sizeof(text[0]), "allow_all");
		snprintf(text[1], sizeof(text[1]), "%" PRId64, st.now);
		snprintf(text[2], sizeof(text[2]), "%" PRIu64, st.n);
		for (size_t j = 0; j < st.count; j++) {
			const struct tokenbucket_redis_limit *l = &st.lim[j];
			snprintf(text[3 + 3 * j], sizeof(text[0]), "%" PRIu64, l->tokens);
			snprintf(text[4 + 3 * j], sizeof(text[0]), "%" PRId64,
				 l->tokens ? l->period_ns : 1);
			snprintf(text[5 + 3 * j], sizeof(text[0]), "%" PRIu64, l->burst);
		}
		for (size_t j = 0; j < nargs; j++)
			arg[j] = (struct tbm_str){ text[j], strlen(text[j]) };
		struct tbm_out o;
		struct tbm_str v;
		tbm_call_all(arg, nargs, stored_of(&k, &v), 0, &o);
		const struct tokenbucket_set_result *e = &ex.res;
		int64_t clock = field_i64(&o, 0);
		int64_t retry = seq_until(field_i64(&o, 4), clock);
		int64_t reset = seq_until(field_i64(&o, 5), clock);
		if (o.error != NULL)
			ok = differ(why, size, "step %d: %s", step, o.error);
		else if (ex.err == -E2BIG && (o.code != 2 || o.write))
			ok = differ(why, size, "step %d: n above a burst: code %lld", step, o.code);
		else if (ex.err == 0 &&
			 (o.code != e->allowed || (size_t)o.index != e->index ||
			  field_i64(&o, 1) != (int64_t)e->remaining ||
			  (e->allowed ? 0 : retry) != e->retry_after_ns || reset != e->reset_after_ns))
			ok = differ(why, size,
				    "step %d: code %lld index %lld level %" PRId64 " retry %" PRId64
				    " reset %" PRId64 ", local %d %zu %" PRIu64 " %" PRId64 " %" PRId64,
				    step, o.code, o.index, field_i64(&o, 1), retry, reset, e->allowed,
				    e->index, e->remaining, e->retry_after_ns, e->reset_after_ns);
		keep(&k, &o);
	}
	seq_set_end(&s);
	return ok;
}

/* The codes each op answers with (tokenbucket-redis(7)). */
static bool documented_code(int op, long long code)
{
	static const unsigned codes[7] = { 07, 017, 02, 02, 02, 06, 07 }; /* bit c: code c */
	return code >= 0 && code < 4 && (codes[op] >> code & 1) != 0;
}

/* Fields 0 to 3 of a reply as the client checks them: numbers, level within burst and the debt's bound, rem < q. */
static bool sane_fields(const struct tbm_out *o, uint64_t burst)
{
	int64_t f[6];
	for (int i = 0; i < 6; i++)
		if ((i != 2 && i != 3) || !o->several)
			if (!field(o, i, &f[i]))
				return false;
	if (o->several)
		return f[1] >= 0 && (uint64_t)f[1] <= burst;
	return f[1] >= -(int64_t)TOKENBUCKET_DEBT_MAX && (f[1] <= 0 || (uint64_t)f[1] <= burst) &&
	       f[2] >= 0 && f[3] >= 1 && f[2] < f[3];
}

bool bd_any_value(const char *v, size_t len, int op, int64_t now, bool server_clock,
		  const struct tokenbucket_redis_limit *l, uint64_t n, int64_t arg, char *why,
		  size_t size)
{
	struct tbm_str s = { v, len };
	struct tbm_out o;
	/* The server's clock is a time: never INT64_MIN or INT64_MAX. */
	if (server_clock && (now == INT64_MIN || now == INT64_MAX))
		now = now == INT64_MIN ? INT64_MIN + 1 : INT64_MAX - 1;
	char t[24] = "";
	if (!server_clock)
		snprintf(t, sizeof(t), "%" PRId64, now);
	if (op == 6) {
		struct call c;
		put_call(&c, "allow_all", t, l, n, arg);
		/* allow_all now n tokens period burst */
		const struct tbm_str all[6] = { c.arg[0], c.arg[1], c.arg[5], c.arg[2], c.arg[3], c.arg[4] };
		tbm_call_all(all, 6, &s, now, &o);
		if (o.error != NULL) {
			if (strcmp(o.error, corrupt_set) != 0 || o.write || n > l->burst)
				return differ(why, size, "allow_all: %s", o.error);
			return true;
		}
		if (!documented_code(op, o.code) || o.index != 0 || (o.code == 2) != (n > l->burst) ||
		    (o.code == 2 && o.write) || (o.code != 2 && !sane_fields(&o, l->burst)))
			return differ(why, size, "allow_all: code %lld index %lld", o.code, o.index);
		if (o.write) {
			struct tbm_str w = { o.value, o.value_len };
			struct tbm_out again;
			tbm_call_all(all, 6, &w, now, &again);
			if (again.error != NULL)
				return differ(why, size, "allow_all wrote \"%.*s\": %s",
					      (int)o.value_len, o.value, again.error);
		}
		return true;
	}
	struct call c;
	put_call(&c, op_names[op], t, l, n, arg);
	tbm_call(c.arg, &s, now, &o);
	bool reset_refused = op == TOKENBUCKET_REDIS_RESET && n > l->burst;
	if (o.error != NULL) {
		if (o.write || strcmp(o.error, reset_refused ? "ERR tokenbucket: bad reset level"
							     : corrupt) != 0)
			return differ(why, size, "%s: %s", op_names[op], o.error);
		return true;
	}
	if (reset_refused || !documented_code(op, o.code) || !sane_fields(&o, l->burst))
		return differ(why, size, "%s: code %lld", op_names[op], o.code);
	/* On the server's clock a refusal for want of tokens writes nothing
	 * unless the configuration changed (a reservation refused only for its
	 * deadline may write the time it credited). */
	char cfg[80];
	int m = snprintf(cfg, sizeof(cfg), " %s %s %s", c.text[2], c.text[3], c.text[4]);
	bool same_cfg = len > (size_t)m && memcmp(v + len - (size_t)m, cfg, (size_t)m) == 0;
	bool short_of_tokens = (op == TOKENBUCKET_REDIS_ALLOW && o.code == 0) ||
			       (op == TOKENBUCKET_REDIS_RESERVE && o.code == 3);
	if (server_clock && same_cfg && short_of_tokens && o.write)
		return differ(why, size, "%s refused on the server's clock wrote \"%.*s\"",
			      op_names[op], (int)o.value_len, o.value);
	if (o.write) {
		/* The value written is read back as the state the reply reported. */
		struct tbm_str w = { o.value, o.value_len };
		struct tbm_out again;
		put_call(&c, "tokens", t, l, 0, 0);
		tbm_call(c.arg, &w, now, &again);
		if (again.error != NULL)
			return differ(why, size, "%s wrote \"%.*s\": %s", op_names[op],
				      (int)o.value_len, o.value, again.error);
		for (int i = 1; i < 4; i++)
			if (again.field_len[i] != o.field_len[i] ||
			    memcmp(again.field[i], o.field[i], o.field_len[i]) != 0)
				return differ(why, size, "%s wrote \"%.*s\", replied field %d \"%.*s\"",
					      op_names[op], (int)o.value_len, o.value, i,
					      (int)o.field_len[i], o.field[i]);
	}
	return true;
}
