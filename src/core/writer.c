/* SPDX-License-Identifier: MIT */
/*
 * The writers' side of every bucket, private or shared: the writer lock,
 * the repair of what a writer that died holding it left half done, and the
 * two steps of a write that repair redoes (publishing a regime, filling an
 * unlimited bucket).  Below the rovers and the regimes, which call it; it
 * calls nothing of theirs, so the repair needs no call back up.
 *
 * The lock is tb->writer: a plain mutex in a private bucket, process-shared
 * and robust in a shared one (src/shm), so EOWNERDEAD reaches only the
 * latter.  tb__publish and tb__fill are for a caller that holds the lock.
 */
#include <errno.h>
#include <time.h>

#include "core.h"

/* ---- What writers publish ------------------------------------------------ */

void tb__publish(struct tokenbucket *tb, const struct tb__view *n)
{
	uint64_t gen = atomic_load_explicit(&tb->gen, memory_order_relaxed);
	uint64_t next = (gen | 1) + 1; /* the next even gen: a new regime */
	struct tb__slot *s = &tb->slot[(next >> 1) & 1];
	/* The slot held the regime two back; its readers validate against gen. */
	atomic_store_explicit(&s->origin, n->origin, memory_order_relaxed);
	atomic_store_explicit(&s->fine0, n->fine0, memory_order_relaxed);
	atomic_store_explicit(&s->p, n->p, memory_order_relaxed);
	atomic_store_explicit(&s->q, n->q, memory_order_relaxed);
	atomic_store_explicit(&s->hoff, n->hoff, memory_order_relaxed);
	atomic_store_explicit(&s->limit, n->limit, memory_order_relaxed);
	atomic_store_explicit(&s->kind, n->kind, memory_order_relaxed);
	/*
	 * The kind mirror goes first, while gen is still odd (a rate change or
	 * reset froze the regime): a writer killed between the two stores
	 * leaves gen odd, which the next call repairs (tb__writer_help).  In
	 * the other order a dead writer could leave a finite regime in force
	 * with the mirror still saying unlimited, and nothing would notice.
	 */
	atomic_store_explicit(&tb->kind, n->kind, memory_order_relaxed);
	atomic_store(&tb->gen, next);
}

/*
 * An unlimited rate means full: head rises to burst, and with capped release
 * no further than ceil.
 */
void tb__fill(struct tokenbucket *tb, const struct tb__view *v, int64_t at)
{
	uint64_t burst = atomic_load(&tb->burst);
	uint64_t head = atomic_load(&tb->head);
	for (;;) {
		TB__ROUND();
		tb__i128 raw = tb__raw_level(v, head, atomic_load(&tb->tail), at);
		tb__i128 room = (tb__i128)burst - raw;
		if (tb__capped(tb)) {
			uint64_t now_head = head + v->hoff + (uint64_t)tb__production(v, at);
			tb__i128 to_ceil = tb__level(atomic_load(&tb->ceil), now_head);
			if (to_ceil < room)
				room = to_ceil;
		}
		if (room <= 0 || atomic_compare_exchange_weak(&tb->head, &head, head + (uint64_t)room))
			return;
	}
}

/* ---- The lock and its repair --------------------------------------------- */

/*
 * A writer died holding the lock.  What it can have left half done
 * (docs/shm.md, "Crashes"):
 *  - a rate change or reset that froze the regime (gen odd) and did not
 *    publish the next: roll back by publishing the frozen regime again,
 *    unfrozen (the next even gen, the same slot content).  Production
 *    between frozen_at and now, which takes did not count while it was
 *    frozen, is counted again, once;
 *  - a publish that stored gen but not the kind mirror: copy it;
 *  - a switch to an unlimited rate that did not fill the bucket: fill it;
 *  - a burst change that did not lower the threshold: lower it.
 * Everything else a writer does is single compare-and-swaps that a take
 * could have done as well, and needs no repair.
 */
static void recover(struct tokenbucket *tb)
{
	/* The lock is held and its last holder is dead: nothing changes the regime. */
	struct tb__view v;
	bool frozen = !tb__load_regime(tb, &v);
	v.until = TOKENBUCKET_NEVER;
	if (frozen)
		tb__publish(tb, &v);
	else
		atomic_store(&tb->kind, v.kind);
	uint64_t burst = atomic_load(&tb->burst);
	uint64_t max_threshold = burst ? burst : 1;
	if (atomic_load(&tb->threshold) > max_threshold)
		atomic_store(&tb->threshold, max_threshold);
	if (v.kind == TB__INF)
		tb__fill(tb, &v, atomic_load(&tb->clock));
}

/*
 * ThreadSanitizer's pthread_mutex_timedlock records a lock only when it
 * returns 0; EOWNERDEAD locks as well (its pthread_mutex_lock and trylock
 * know that).  Without this, the unlock after a repair is reported as an
 * unlock of an unlocked mutex.
 */
#if defined(__SANITIZE_THREAD__)
#define TB__TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define TB__TSAN 1
#endif
#endif
#ifdef TB__TSAN
#include <sanitizer/tsan_interface.h>
static void tsan_owner_dead_locked(pthread_mutex_t *m)
{
	/* The pair as an annotated lock that did not block: pre_lock opens what post_lock closes. */
	__tsan_mutex_pre_lock(m, __tsan_mutex_try_lock);
	__tsan_mutex_post_lock(m, __tsan_mutex_try_lock, 0);
}
#else
static void tsan_owner_dead_locked(pthread_mutex_t *m)
{
	(void)m;
}
#endif

/*
 * Locks m, waiting at most TB__LOCK_WAIT_NS: 0, EOWNERDEAD, or the error.
 * A lock word holding a thread id that no live holder wrote would make
 * pthread_mutex_lock wait for ever.  pthread_mutex_timedlock measures the
 * wait on CLOCK_REALTIME (a step of the wall clock lengthens or shortens
 * it by as much); pthread_mutex_clocklock would take CLOCK_MONOTONIC, but
 * it is newer (glibc 2.30) and ThreadSanitizer does not see it lock.
 */
int tb__lock_bounded(pthread_mutex_t *m)
{
	int err = pthread_mutex_trylock(m);
	if (err != EBUSY)
		return err;
	struct timespec until;
	clock_gettime(CLOCK_REALTIME, &until);
	int64_t ns = until.tv_nsec + TB__LOCK_WAIT_NS % 1000000000;
	until.tv_sec += TB__LOCK_WAIT_NS / 1000000000 + ns / 1000000000;
	until.tv_nsec = ns % 1000000000;
	err = pthread_mutex_timedlock(m, &until);
	if (err == EOWNERDEAD)
		tsan_owner_dead_locked(m);
	return err;
}

int tb__writer_lock(struct tokenbucket *tb)
{
	if (tb__is_corrupt(tb))
		return -EBADMSG;
	int err = tb__lock_bounded(&tb->writer);
	if (err == EOWNERDEAD) {
		recover(tb);
		err = pthread_mutex_consistent(&tb->writer);
		if (err) {
			pthread_mutex_unlock(&tb->writer);
			tb__give_up(tb);
			return -EBADMSG;
		}
		return 0;
	}
	if (err == ETIMEDOUT)
		return -EDEADLK;
	if (err) {
		/* ENOTRECOVERABLE, EINVAL, EDEADLK: not a lock this library left. */
		tb__give_up(tb);
		return -EBADMSG;
	}
	/* Only a writer holding the lock freezes the regime: this freeze has none. */
	if (atomic_load(&tb->gen) & 1)
		recover(tb);
	return 0;
}

void tb__writer_help(struct tokenbucket *tb)
{
	int err = pthread_mutex_trylock(&tb->writer);
	if (err == EOWNERDEAD) {
		recover(tb);
		pthread_mutex_consistent(&tb->writer);
	} else if (err) {
		return; /* a live writer holds it: the freeze ends when it publishes */
	} else if (atomic_load(&tb->gen) & 1) {
		recover(tb); /* frozen, but no writer holds the lock */
	}
	pthread_mutex_unlock(&tb->writer);
}
