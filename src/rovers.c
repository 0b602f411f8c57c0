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
	tb__marker_cas(tb, &m, (struct tb__marker){ tb__time_of(&r, now, 1), 0 });
}

int64_t tb__observe_later(struct tokenbucket *tb, int64_t now, int64_t seen)
{
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
	for (;;) {
		*m = tb__marker_load(tb);
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
	/*
	 * Seeded from two half-loads rather than a 16-byte load (which is itself
	 * a locked CAS).  next is read again after regime: if it did not move,
	 * the pair was the marker's value at the second read of next, so a
	 * "nothing to claim" below is an answer about a real state.  A failed CAS
	 * hands back the current marker, read atomically.
	 */
	struct tb__marker m = tb__marker_peek(tb);
	while (m.next != tb__marker_next(tb))
		m = tb__marker_peek(tb);
	for (;;) {
		if (m.next == TB__NO_TIME || now < m.next)
			return 0;
		struct tb__rate r;
		tb__load_slot(&tb->slot[m.regime & 1], &r);
		struct tb__marker n = { .regime = m.regime };
		uint64_t k = tb__claimable(&r, m.next - 1, now, &n.next);
		if (k == 0 || k < threshold)
			return 0;
		/* A claim up to now must follow the clock's record of now (see set_rate). */
		tb__observe(tb, now);
		uint64_t tail = atomic_load(&tb->tail);
		if (!tb__marker_cas(tb, &m, n))
			continue; /* another claim, or a new regime: look again from m */
		tb__credit(tb, k, tail);
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
