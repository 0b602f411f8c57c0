/* SPDX-License-Identifier: MIT */
/*
 * The rover core both faces share: the clock, the production claim, and the
 * moves of head and ceil.  Every function here is lock-free and may run in
 * any number of threads at once; each retry of a loop means another thread
 * changed the word first, so some thread always makes progress.
 *
 * Read-modify-writes are sequentially consistent (on x86-64 every locked
 * instruction is anyway); loads that only pick a starting value for a CAS
 * are relaxed, since the CAS checks them.
 */
#include "internal.h"

void tb__load_slot(const struct tb__slot *s, struct tb__rate *r)
{
	r->origin = atomic_load_explicit(&s->origin, memory_order_relaxed);
	r->p = atomic_load_explicit(&s->p, memory_order_relaxed);
	r->q = atomic_load_explicit(&s->q, memory_order_relaxed);
	r->kind = (enum tb__kind)atomic_load_explicit(&s->kind, memory_order_relaxed);
	/* A slot read while a writer refills it may mix two regimes; make it inert. */
	if (r->kind == TB__FINITE && (r->p == 0 || r->q == 0))
		r->kind = TB__ZERO;
}

void tb__publish_hint(struct tokenbucket *tb, int64_t next, uint64_t regime)
{
	atomic_store(&tb->next_hint, next);
	/*
	 * A writer that switched regimes after our claim stores its own hint
	 * after publishing the regime; if we might have overwritten it with a
	 * value of the old regime, fall back to "always look" (TB__NO_TIME).
	 */
	if (atomic_load(&tb->regime) != regime)
		atomic_store(&tb->next_hint, TB__NO_TIME);
}

/* The first caller that passes a time fixes the origin of regime 0. */
static void fix_origin(struct tokenbucket *tb, int64_t now)
{
	struct tb__slot *s = &tb->slot[0];
	int64_t unset = TB__NO_TIME;
	if (!atomic_compare_exchange_strong(&s->origin, &unset, now))
		return; /* a writer started a regime of its own first */
	struct tb__rate r;
	tb__load_slot(s, &r);
	struct tb__marker m = { TB__NO_TIME, 0 };
	struct tb__marker n = { tb__time_of(&r, now, 1), 0 };
	if (atomic_compare_exchange_strong(&tb->marker, &m, n))
		tb__publish_hint(tb, n.next, 0);
}

int64_t tb__observe(struct tokenbucket *tb, int64_t now)
{
	if (now == TB__NO_TIME)
		now = TB__NO_TIME + 1;
	int64_t seen = atomic_load_explicit(&tb->clock, memory_order_relaxed);
	while (now > seen) {
		if (atomic_compare_exchange_weak(&tb->clock, &seen, now)) {
			if (seen == TB__NO_TIME)
				fix_origin(tb, now);
			return now;
		}
	}
	return seen;
}

void tb__view(const struct tokenbucket *tb, struct tb__rate *r, struct tb__marker *m)
{
	/* libatomic's 16-byte load may be a CAS writing back what it read: hence the cast. */
	struct tokenbucket *w = (struct tokenbucket *)tb;
	for (;;) {
		*m = atomic_load(&w->marker);
		tb__load_slot(&tb->slot[m->regime & 1], r);
		/*
		 * The slot of regime e is rewritten only for regime e + 2, after
		 * the mirror showed e + 1.  If it still shows at most e after our
		 * reads, they were of regime e.
		 */
		atomic_thread_fence(memory_order_acquire);
		if (atomic_load_explicit(&tb->regime, memory_order_relaxed) <= m->regime)
			return;
	}
}

uint64_t tb__credit(struct tokenbucket *tb, uint64_t k, uint64_t tail_before)
{
	uint64_t burst = atomic_load_explicit(&tb->burst, memory_order_relaxed);
	bool capped = tb->flags & TOKENBUCKET_CAPPED_RELEASE;
	uint64_t head = atomic_load_explicit(&tb->head, memory_order_relaxed);
	for (;;) {
		/*
		 * Room is measured against the tail as it was before the claim:
		 * tokens taken since were decided without this credit, so they must
		 * not make room for it.  Under a race this loses tokens, never
		 * invents them.
		 */
		int64_t room = (int64_t)burst - tb__level(head, tail_before);
		if (capped) {
			int64_t to_ceil = tb__level(atomic_load(&tb->ceil), head);
			if (to_ceil < room)
				room = to_ceil;
		}
		if (room <= 0)
			return 0;
		uint64_t add = k < (uint64_t)room ? k : (uint64_t)room;
		if (atomic_compare_exchange_weak(&tb->head, &head, head + add))
			return add;
	}
}

uint64_t tb__produce(struct tokenbucket *tb, int64_t now, uint64_t threshold)
{
	for (;;) {
		struct tb__marker m = atomic_load(&tb->marker);
		if (m.next == TB__NO_TIME || now < m.next)
			return 0;
		struct tb__rate r;
		tb__load_slot(&tb->slot[m.regime & 1], &r);
		uint64_t k = tb__produced(&r, m.next - 1, now);
		if (k == 0 || k < threshold)
			return 0;
		struct tb__marker n = { tb__time_of(&r, now, 1), m.regime };
		/* A claim up to now must follow the clock's record of now (see set_rate). */
		tb__observe(tb, now);
		uint64_t tail = atomic_load(&tb->tail);
		if (!atomic_compare_exchange_strong(&tb->marker, &m, n))
			continue; /* another claim, or a new regime: look again */
		tb__credit(tb, k, tail);
		tb__publish_hint(tb, n.next, m.regime);
		return k;
	}
}

/* Raises ceil by up to n, never past tail + burst (nothing can be in flight beyond that). */
uint64_t tb__raise_ceil(struct tokenbucket *tb, uint64_t n)
{
	uint64_t burst = atomic_load_explicit(&tb->burst, memory_order_relaxed);
	uint64_t ceil = atomic_load_explicit(&tb->ceil, memory_order_relaxed);
	for (;;) {
		uint64_t limit = atomic_load(&tb->tail) + burst;
		int64_t room = tb__level(limit, ceil);
		if (room <= 0)
			return 0;
		uint64_t add = n < (uint64_t)room ? n : (uint64_t)room;
		if (atomic_compare_exchange_weak(&tb->ceil, &ceil, ceil + add))
			return add;
	}
}

uint64_t tb__give_back(struct tokenbucket *tb, uint64_t n)
{
	uint64_t burst = atomic_load_explicit(&tb->burst, memory_order_relaxed);
	uint64_t head = atomic_load_explicit(&tb->head, memory_order_relaxed);
	uint64_t add;
	for (;;) {
		int64_t room = (int64_t)burst - tb__level(head, atomic_load(&tb->tail));
		if (room <= 0 || n == 0)
			return 0;
		add = n < (uint64_t)room ? n : (uint64_t)room;
		if (atomic_compare_exchange_weak(&tb->head, &head, head + add))
			break;
	}
	/* Given-back tokens are no longer in flight: keep head <= ceil. */
	if (tb->flags & TOKENBUCKET_CAPPED_RELEASE)
		tb__raise_ceil(tb, add);
	return add;
}
