/* SPDX-License-Identifier: MIT */
/*
 * Several limits per key (1.2): a key decided on several tables at once.
 * docs/table.md, "Several limits per key".
 */
#include "table_internal.h"

/* ---- Several limits per key (1.2) ------------------------------------------ */

/*
 * A key decided on several tables at once: n from the key's bucket in
 * every table, or from none, as src/core/set.c does it for buckets (the
 * same check, takes in order and give-backs on a refusal, by the rule a
 * refund follows).  docs/table.md, "Several limits per key", has the
 * argument.
 */

/* -EINVAL for tables no set call accepts: NULL, empty, too long, a NULL or repeated table. */
static int check_tables(struct tokenbucket_table *const *tables, size_t count)
{
	if (tables == NULL || count == 0 || count > TOKENBUCKET_SET_MAX)
		return -EINVAL;
	for (size_t i = 0; i < count; i++) {
		if (tables[i] == NULL)
			return -EINVAL;
		/*
		 * Two handles on one table are one limit: the same memory, or the
		 * same 128-bit random secret (one table mapped at two addresses).
		 */
		for (size_t j = 0; j < i; j++)
			if (tables[j]->mem == tables[i]->mem ||
			    (tables[j]->k0 == tables[i]->k0 && tables[j]->k1 == tables[i]->k1))
				return -EINVAL;
	}
	return 0;
}

/*
 * Whether the key surely holds fewer than n tokens, read without taking
 * (its clock moves to the call's time, as any call's): only a level read
 * with the state and clock it was decided on refuses, as take refuses.
 * False when unsure, and for a key without a slot (full): the take decides.
 */
static bool key_short(const struct tokenbucket_table *t, const struct tbt_call *c, uint64_t n)
{
	uint64_t st;
	struct tbt_slot *s = find(c, &st);
	if (s == NULL)
		return false;
	int64_t at = key_time(s, c->at);
	/* decide's test without its division: a level of n or more, capped or not, passes. */
	if (!regime_holds(t, c) || past_horizon(c, at) || level_at_least(c, at, st_tail(st), n))
		return false;
	return atomic_load_explicit(&s->state, memory_order_acquire) == st &&
	       atomic_load(&s->clock) == at;
}

/*
 * Gives back the k->tokens a set's take took from its key, by the one rule
 * (tb__table_give_back_key).  The usual case is an undo: the state is still the one
 * the take wrote, so its tail goes back to where the take found it, which
 * is that rule in one compare-and-swap (a key's level is capped at burst
 * when read, and that tail was no lower than full at the take).
 */
static void give_back(struct tokenbucket_table *t, struct tbt_call *c, struct tbt_taken *k)
{
	uint64_t n = k->tokens, st = k->after;
	k->tokens = 0;
	if (n == 0 || k->slot == NULL ||
	    atomic_compare_exchange_strong(&k->slot->state, &st, st_with_tail(st, k->base)))
		return;
	tb__table_give_back_key(t, c, n, INT64_MAX);
}

/* Gives back k[0] to k[i - 1], the latest first (so that undoing is likelier). */
static void give_back_all(struct tokenbucket_table *const *tables, size_t i, struct tbt_call *c,
			  struct tbt_taken *k)
{
	while (i-- > 0)
		give_back(tables[i], &c[i], &k[i]);
}

int tokenbucket_table_allow_all_at(struct tokenbucket_table *const *tables, size_t count,
				   int64_t now, const void *key, size_t len, uint64_t n,
				   struct tokenbucket_set_result *res)
{
	if (res == NULL || bad_key(key, len))
		return -EINVAL;
	int err = check_tables(tables, count);
	if (err)
		return err;
	struct tbt_call c[TOKENBUCKET_SET_MAX];
	for (size_t i = 0; i < count; i++)
		if (!call_init(tables[i], now, key, len, n, &c[i]))
			return -EBADMSG;
	for (size_t i = 0; i < count; i++)
		if (n > c[i].burst)
			return -E2BIG;
	struct tbt_outcome o[TOKENBUCKET_SET_MAX];
	struct tbt_taken k[TOKENBUCKET_SET_MAX];
	size_t refused = count, decided = 0;
	/* A set that one table refuses is refused before anything is taken. */
	for (size_t i = 1; i < count; i++) {
		if (key_short(tables[i], &c[i], n)) {
			refused = i;
			break;
		}
	}
	for (size_t i = 0; refused == count && i < count; i++) {
		o[i] = (struct tbt_outcome){0};
		k[i] = (struct tbt_taken){0};
		err = past_horizon(&c[i], c[i].at) ? tb__table_reanchor(tables[i], &c[i], c[i].at, n) : 0;
		if (err == 0)
			err = take(tables[i], &c[i], n, true, &o[i], &k[i]);
		if (err || !o[i].allowed) {
			give_back_all(tables, i, c, k);
			/* -EDEADLK, -EBADMSG: nothing taken. */
			if (err)
				return err;
			refused = i;
			decided = i + 1;
			break;
		}
		decided = i + 1;
	}
	bool allowed = refused == count;
	struct tokenbucket_set_result out = {.allowed = allowed, .index = refused};
	uint64_t fewest = UINT64_MAX;
	for (size_t i = 0; i < count; i++) {
		struct tokenbucket_result one;
		/* Allowed, each take saw its level; refused, the others are read as they are now. */
		if ((!allowed && i != refused) || i >= decided) {
			o[i] = (struct tbt_outcome){0};
			tb__table_peek(&c[i], &o[i]);
		}
		report(&c[i], &o[i], n, &one);
		tb__set_fold(&out, i, refused, &one, &fewest);
	}
	*res = out;
	return 0;
}

int tokenbucket_table_allow_all(struct tokenbucket_table *const *tables, size_t count,
				const void *key, size_t len, uint64_t n,
				struct tokenbucket_set_result *res)
{
	return tokenbucket_table_allow_all_at(tables, count, tb__now(), key, len, n, res);
}
