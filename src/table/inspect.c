/* SPDX-License-Identifier: MIT */
/*
 * A table's inspection: its keys one by one (tokenbucket_table_next) and
 * its counters.  docs/table.md has the model.
 */
#include "table_internal.h"

/* ---- Inspection ------------------------------------------------------------- */

int tokenbucket_table_next(struct tokenbucket_table *t, uint64_t *cursor, int64_t now,
			   struct tokenbucket_table_entry *e)
{
	if (t == NULL || cursor == NULL || e == NULL)
		return -EINVAL;
	struct tbt_call c = {.now = tb__time(now)};
	if (!read_regime(t, &c, UINT64_MAX))
		return -EBADMSG;
	for (uint64_t i = *cursor; i < t->lines * 2; i++) {
		struct tbt_slot *s = &t->line[i / 2].slot[i % 2];
		uint64_t st = atomic_load_explicit(&s->state, memory_order_acquire);
		if (st_claimed(st) || st_empty(st))
			continue;
		uint64_t f = atomic_load_explicit(&s->fp, memory_order_acquire);
		int64_t clock = atomic_load(&s->clock);
		if (atomic_load(&s->state) != st || (f & TBT_TAG_MASK) != ((st_ver(st) - 1) & 0xff))
			continue;
		int64_t at = c.at < clock ? clock : c.at;
		double tokens = (double)c.burst;
		if (c.v.origin != TB__NO_TIME)
			tokens = tb__table_tokens_of(&c, at, st_tail(st));
		*e = (struct tokenbucket_table_entry){
			.fingerprint = f >> 8,
			.clock = clock,
			.tokens = tokens,
		};
		*cursor = i + 1;
		return 0;
	}
	*cursor = t->lines * 2;
	return -ENOENT;
}

int tokenbucket_table_stats(struct tokenbucket_table *t, struct tokenbucket_table_stats *s)
{
	if (t == NULL || s == NULL)
		return -EINVAL;
	struct tbt_counters *k = &t->mem->counters;
	*s = (struct tokenbucket_table_stats){
		.capacity = t->lines * 2,
		.in_use = atomic_load(&k->in_use),
		.lossless = atomic_load(&k->lossless),
		.lossy = atomic_load(&k->lossy),
		.refused = atomic_load(&k->refused),
	};
	return 0;
}
