/* SPDX-License-Identifier: MIT */
/*
 * A table's life cycle: its size, the checks of a configuration and of
 * memory found, initialisation, handles on the heap, on caller memory and
 * on named shared memory, and free.  docs/table.md has the model,
 * docs/shm.md what a mapping's words may hold.
 */
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>

#include "table_internal.h"

/* ---- Life cycle --------------------------------------------------------------- */

size_t tokenbucket_table_size(uint64_t capacity)
{
	if (capacity == 0 || capacity > TOKENBUCKET_TABLE_CAPACITY_MAX)
		return 0;
	return offsetof(struct tbt_mem, line) + (size_t)tbt_lines(capacity) * sizeof(struct tbt_line);
}

/* The table's configuration, checked. */
struct tbt_config {
	uint64_t p, q, burst, capacity;
	unsigned flags;
};

static int config_check(struct tbt_config *k, uint64_t tokens, int64_t period_ns, uint64_t burst,
			uint64_t capacity, unsigned flags)
{
	if (capacity == 0 || (tokens > 0 && period_ns <= 0) ||
	    (flags & ~(TOKENBUCKET_TABLE_FAIL_OPEN | TOKENBUCKET_TABLE_EVICT)) ||
	    flags == (TOKENBUCKET_TABLE_FAIL_OPEN | TOKENBUCKET_TABLE_EVICT))
		return -EINVAL;
	if (capacity > TOKENBUCKET_TABLE_CAPACITY_MAX)
		return -ERANGE;
	int err = tb__table_rate_check(tokens, period_ns, burst, &k->p, &k->q);
	if (err)
		return err;
	k->burst = burst;
	k->capacity = capacity;
	k->flags = flags;
	return 0;
}

static int secret(uint64_t key[2])
{
	size_t got = 0;
	while (got < 2 * sizeof(uint64_t)) {
		ssize_t r = getrandom((char *)key + got, 2 * sizeof(uint64_t) - got, 0);
		if (r < 0) {
			if (errno == EINTR)
				continue;
			return -errno;
		}
		got += (size_t)r;
	}
	return 0;
}

/* Initialises a table in mem (size checked by the caller); ready is stored last. */
static int table_init(struct tbt_mem *m, const struct tbt_config *k)
{
	uint64_t key[2];
	int err = secret(key);
	if (err)
		return err;
	pthread_mutexattr_t attr;
	err = tb__shared_mutexattr(&attr);
	if (err)
		return err;
	atomic_store_explicit(&m->header.h.ready, 0, memory_order_relaxed);
	memset(&m->lock, 0, sizeof(m->lock));
	err = pthread_mutex_init(&m->lock.writer, &attr);
	pthread_mutexattr_destroy(&attr);
	if (err)
		return -err;
	uint64_t lines = tbt_lines(k->capacity);
	struct tbt_regimes *g = &m->regimes;
	atomic_store_explicit(&g->gen, 0, memory_order_relaxed);
	atomic_store_explicit(&g->frozen_at, 0, memory_order_relaxed);
	for (int i = 0; i < 2; i++) {
		struct tbt_regime *r = &g->slot[i];
		/* Q starts at the largest burst: a tail Q - burst is never below 0. */
		atomic_store_explicit(&r->origin, TB__NO_TIME, memory_order_relaxed);
		atomic_store_explicit(&r->fine0, 0, memory_order_relaxed);
		atomic_store_explicit(&r->p, k->p, memory_order_relaxed);
		atomic_store_explicit(&r->q, k->q, memory_order_relaxed);
		atomic_store_explicit(&r->hoff, TOKENBUCKET_TABLE_BURST_MAX, memory_order_relaxed);
		atomic_store_explicit(&r->burst, k->burst, memory_order_relaxed);
		atomic_store_explicit(&r->hspan, tb__table_regime_hspan(k->p, k->q), memory_order_relaxed);
	}
	memset(&m->counters, 0, sizeof(m->counters));
	for (uint64_t i = 0; i < lines; i++) {
		for (int j = 0; j < 2; j++) {
			struct tbt_slot *s = &m->line[i].slot[j];
			atomic_store_explicit(&s->fp, 0, memory_order_relaxed);
			atomic_store_explicit(&s->state, TBT_EMPTY, memory_order_relaxed);
			atomic_store_explicit(&s->clock, TB__NO_TIME, memory_order_relaxed);
			atomic_store_explicit(&s->spare, 0, memory_order_relaxed);
		}
	}
	struct tbt_header *h = &m->header.h;
	h->magic = TBT_MAGIC;
	h->layout = TBT_LAYOUT;
	h->major = TOKENBUCKET_VERSION_MAJOR;
	h->header_size = offsetof(struct tbt_mem, line);
	h->line_size = sizeof(struct tbt_line);
	h->flags = k->flags;
	h->lines = lines;
	h->capacity = k->capacity;
	h->k0 = key[0];
	h->k1 = key[1];
	atomic_store_explicit(&h->origin, TB__NO_TIME, memory_order_relaxed);
	atomic_store_explicit(&h->corrupt, 0, memory_order_relaxed);
	atomic_store_explicit(&h->exact_carry, 0, memory_order_relaxed);
	atomic_store_explicit(&h->ready, TBT_READY, memory_order_release);
	return 0;
}

/*
 * The header's checks: what is not a table, another layout (a table of
 * 1.1 has layout 2: -EPROTO), a table not initialised yet, then a
 * configuration no table can have: the regime in force, and while a
 * change freezes it the next one, which a repair would publish, and the
 * writer mutex's kind.  Slots need no check: any word there yields a
 * defined state (docs/shm.md, "Corrupt mappings").
 */
static int table_check(const struct tbt_mem *m, size_t size)
{
	const struct tbt_header *h = &m->header.h;
	if (size < sizeof(struct tbt_header) || h->magic != TBT_MAGIC)
		return -EBADMSG;
	if (h->layout != TBT_LAYOUT || h->major != TOKENBUCKET_VERSION_MAJOR ||
	    h->header_size != offsetof(struct tbt_mem, line) ||
	    h->line_size != sizeof(struct tbt_line))
		return -EPROTO;
	if (atomic_load_explicit(&h->ready, memory_order_acquire) != TBT_READY)
		return -EAGAIN;
	if (h->capacity == 0 || h->capacity > TOKENBUCKET_TABLE_CAPACITY_MAX ||
	    h->lines != tbt_lines(h->capacity) || size < tokenbucket_table_size(h->capacity) ||
	    (h->flags & ~(TOKENBUCKET_TABLE_FAIL_OPEN | TOKENBUCKET_TABLE_EVICT)) ||
	    h->flags == (TOKENBUCKET_TABLE_FAIL_OPEN | TOKENBUCKET_TABLE_EVICT) ||
	    atomic_load(&h->corrupt) != 0)
		return -EBADMSG;
	uint64_t gen = atomic_load(&m->regimes.gen);
	if (!tb__table_regime_valid(&m->regimes.slot[(gen >> 1) & 1]) ||
	    ((gen & 1) && !tb__table_regime_valid(&m->regimes.slot[((gen >> 1) + 1) & 1])) ||
	    !tb__shared_mutex_valid(&m->lock.writer))
		return -EBADMSG;
	return 0;
}

/* A handle on checked memory; the constants are copied from the header once. */
static int handle(struct tokenbucket_table **tp, struct tbt_mem *m, enum tbt_owner owner,
		  size_t mapped)
{
	struct tokenbucket_table *t = malloc(sizeof(*t));
	if (t == NULL)
		return -ENOMEM;
	const struct tbt_header *h = &m->header.h;
	*t = (struct tokenbucket_table){
		.mem = m,
		.line = m->line,
		.lines = h->lines,
		.k0 = h->k0,
		.k1 = h->k1,
		.flags = h->flags,
		.owner = owner,
		.mapped = mapped,
	};
	for (int i = 0; i < 2; i++) {
		atomic_init(&t->cached[i].gen, TBT_UNKEPT);
		atomic_init(&t->cached[i].q, 1);
	}
	*tp = t;
	return 0;
}

int tokenbucket_table_create(struct tokenbucket_table **tp, uint64_t tokens, int64_t period_ns,
			     uint64_t burst, uint64_t capacity, unsigned flags)
{
	struct tbt_config k;
	if (tp == NULL)
		return -EINVAL;
	int err = config_check(&k, tokens, period_ns, burst, capacity, flags);
	if (err)
		return err;
	size_t size = tokenbucket_table_size(capacity);
	struct tbt_mem *m = aligned_alloc(TOKENBUCKET_TABLE_ALIGN, size);
	if (m == NULL)
		return -ENOMEM;
	err = table_init(m, &k);
	if (err == 0)
		err = handle(tp, m, TBT_HEAP, 0);
	if (err)
		free(m);
	return err;
}

static bool table_aligned(const void *mem)
{
	return ((uintptr_t)mem & (TOKENBUCKET_TABLE_ALIGN - 1)) == 0;
}

int tokenbucket_table_init_shared(struct tokenbucket_table **tp, void *mem, size_t size,
				  uint64_t tokens, int64_t period_ns, uint64_t burst,
				  uint64_t capacity, unsigned flags)
{
	struct tbt_config k;
	if (tp == NULL || mem == NULL || !table_aligned(mem))
		return -EINVAL;
	int err = config_check(&k, tokens, period_ns, burst, capacity, flags);
	if (err)
		return err;
	if (size < tokenbucket_table_size(capacity))
		return -EINVAL;
	if (!tb__atomics_shareable())
		return -ENOTSUP;
	err = table_init(mem, &k);
	return err ? err : handle(tp, mem, TBT_PLACED, 0);
}

int tokenbucket_table_attach_shared(struct tokenbucket_table **tp, void *mem, size_t size)
{
	if (tp == NULL || mem == NULL || !table_aligned(mem))
		return -EINVAL;
	if (!tb__atomics_shareable())
		return -ENOTSUP;
	int err = table_check(mem, size);
	return err ? err : handle(tp, mem, TBT_PLACED, 0);
}

static int table_init_cb(void *map, void *arg)
{
	return table_init(map, arg);
}

static int table_check_cb(const void *map, size_t have, void *arg)
{
	(void)arg;
	return table_check(map, have);
}

int tokenbucket_table_open(struct tokenbucket_table **tp, const char *name, uint64_t tokens,
			   int64_t period_ns, uint64_t burst, uint64_t capacity, unsigned flags,
			   unsigned mode, unsigned *status)
{
	struct tbt_config k;
	char path[TB__PATH_SIZE];
	if (tp == NULL || mode > 0777)
		return -EINVAL;
	int err = tb__shm_path(name, path, sizeof(path));
	if (err == 0)
		err = config_check(&k, tokens, period_ns, burst, capacity, flags);
	if (err)
		return err;
	if (!tb__atomics_shareable())
		return -ENOTSUP;
	const struct tb__shm_ops ops = {
		.map_size = 0,
		.create_size = tokenbucket_table_size(capacity),
		.min_size = sizeof(struct tbt_header),
		.init = table_init_cb,
		.check = table_check_cb,
		.arg = &k,
	};
	void *map;
	size_t mapped;
	bool created;
	err = tb__shm_open(name, mode, &ops, &map, &mapped, &created);
	if (err)
		return err;
	err = handle(tp, map, TBT_NAMED, mapped);
	if (err) {
		munmap(map, mapped);
		return err;
	}
	if (status) {
		/* The rate and burst in force, which a change may have made others. */
		const struct tbt_header *h = &((struct tbt_mem *)map)->header.h;
		struct tbt_call c = {.now = TB__NO_TIME + 1};
		if (!read_regime(*tp, &c, UINT64_MAX)) {
			tokenbucket_table_free(*tp);
			*tp = NULL;
			return -EBADMSG;
		}
		*status = created ? TOKENBUCKET_OPEN_CREATED
			  : c.v.p == k.p && c.v.q == k.q && c.burst == k.burst &&
					  h->capacity == k.capacity && h->flags == k.flags
				  ? 0
				  : TOKENBUCKET_OPEN_DIFFERS;
	}
	return 0;
}

void tokenbucket_table_free(struct tokenbucket_table *t)
{
	if (t == NULL)
		return;
	if (t->owner == TBT_HEAP)
		free(t->mem);
	else if (t->owner == TBT_NAMED)
		munmap(t->mem, t->mapped);
	free(t);
}
