/* SPDX-License-Identifier: MIT */
/*
 * Buckets shared between processes: placement in caller memory, named
 * buckets in /dev/shm, the header that tells a bucket from anything else;
 * and the named objects themselves, for buckets and tables alike (shm.h).
 *
 * The state needs nothing new to be shared: every word is an 8-byte atomic
 * and holds no pointer.  What a shared bucket adds is a header in front of
 * it (checked before the state is ever read), a writer mutex that is
 * process-shared and robust, and the repair that EOWNERDEAD calls for
 * (the core's, src/core/writer.c: private buckets take the same lock).
 */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "shm.h"

/* "TBUCKET\0" read as a little-endian word: a bucket, of any layout. */
#define TB__MAGIC UINT64_C(0x0054454b43554254)
/* The layout of header and state; raised whenever either changes. */
#define TB__LAYOUT 1
/* The last word written by initialisation: the state behind it is complete. */
#define TB__READY UINT32_C(0x52454459)


struct tb__header {
	uint64_t magic;
	_Atomic uint32_t ready;    /* TB__READY once the state is initialised */
	uint32_t layout;           /* TB__LAYOUT */
	uint32_t major;            /* TOKENBUCKET_VERSION_MAJOR of the initialiser */
	uint32_t header_size;      /* sizeof(union tb__shared_header) */
	uint32_t state_size;       /* sizeof(struct tokenbucket) */
	uint32_t state_align;      /* alignof(struct tokenbucket) */
};

/* The header takes one state alignment, so that the state after it is aligned. */
union tb__shared_header {
	struct tb__header h;
	alignas(struct tokenbucket) unsigned char pad[alignof(struct tokenbucket)];
};

_Static_assert(sizeof(struct tb__header) <= alignof(struct tokenbucket),
	       "the header fits in one alignment unit of the state");

struct tb__shared {
	union tb__shared_header header;
	struct tokenbucket state;
};

size_t tokenbucket_shared_size(void)
{
	return sizeof(struct tb__shared);
}

size_t tokenbucket_shared_align(void)
{
	return alignof(struct tb__shared);
}

/*
 * Whether every shared word is lock-free and address-free here: the C
 * standard counts a lock-free atomic as address-free, so an 8-byte atomic
 * that is always lock-free works in a mapping at any address, in any
 * process.
 */
bool tb__atomics_shareable(void)
{
	return __atomic_always_lock_free(sizeof(uint64_t), 0) &&
	       __atomic_always_lock_free(sizeof(uint32_t), 0);
}

/* The writer mutex of a shared bucket or table: process-shared and robust. */
int tb__shared_mutexattr(pthread_mutexattr_t *attr)
{
	int err = pthread_mutexattr_init(attr);
	if (err)
		return -err;
	if (pthread_mutexattr_setpshared(attr, PTHREAD_PROCESS_SHARED) ||
	    pthread_mutexattr_setrobust(attr, PTHREAD_MUTEX_ROBUST)) {
		pthread_mutexattr_destroy(attr);
		return -ENOTSUP;
	}
	return 0;
}

static bool aligned(const void *mem)
{
	return ((uintptr_t)mem & (alignof(struct tb__shared) - 1)) == 0;
}

/* Initialises the header and the state; ready is stored last. */
static int shared_init(struct tb__shared *s, enum tb__kind kind, uint64_t p, uint64_t q,
		       uint64_t burst, unsigned flags)
{
	pthread_mutexattr_t attr;
	int err = tb__shared_mutexattr(&attr);
	if (err)
		return err;
	atomic_store_explicit(&s->header.h.ready, 0, memory_order_relaxed);
	err = tb__bucket_init(&s->state, kind, p, q, burst, flags, &attr);
	pthread_mutexattr_destroy(&attr);
	if (err)
		return err;
	s->header.h.magic = TB__MAGIC;
	s->header.h.layout = TB__LAYOUT;
	s->header.h.major = TOKENBUCKET_VERSION_MAJOR;
	s->header.h.header_size = sizeof(union tb__shared_header);
	s->header.h.state_size = sizeof(struct tokenbucket);
	s->header.h.state_align = alignof(struct tokenbucket);
	atomic_store_explicit(&s->header.h.ready, TB__READY, memory_order_release);
	return 0;
}

/* The rate as the bucket stores it: kind, and p/q (0/1 unless finite). */
static int rate_ratio(double rate, enum tb__kind *kind, uint64_t *p, uint64_t *q)
{
	if (isnan(rate) || rate < 0)
		return -EINVAL;
	*kind = tb__ratio_from_rate(rate, p, q);
	if (*kind != TB__FINITE) {
		*p = 0;
		*q = 1;
	}
	return 0;
}

int tokenbucket_init_shared(struct tokenbucket **tbp, void *mem, size_t size, double rate,
			    uint64_t burst, unsigned flags)
{
	enum tb__kind kind;
	uint64_t p, q;
	if (rate_ratio(rate, &kind, &p, &q))
		return -EINVAL;
	return tb__init_shared(tbp, mem, size, kind, p, q, burst, flags);
}

int tb__init_shared(struct tokenbucket **tbp, void *mem, size_t size, enum tb__kind kind,
		    uint64_t p, uint64_t q, uint64_t burst, unsigned flags)
{
	if (tbp == NULL || mem == NULL || !aligned(mem) || size < sizeof(struct tb__shared))
		return -EINVAL;
	int err = tb__bucket_check(burst, flags);
	if (err)
		return err;
	if (!tb__atomics_shareable())
		return -ENOTSUP;
	struct tb__shared *s = mem;
	err = shared_init(s, kind, p, q, burst, flags);
	if (err)
		return err;
	*tbp = &s->state;
	return 0;
}

/*
 * The regime in force is one a bucket can be in: nothing a reader could
 * divide by zero or misread.  Only the slot in force is checked, read under
 * the seqlock as every reader reads it: a writer in another process may be
 * rewriting the other slot (or have died doing so), and no reader uses
 * that slot before the next writer has written it whole.
 */
static bool regime_valid(const struct tokenbucket *tb)
{
	struct tb__view v;
	tb__view(tb, &v);
	if (v.kind == TB__FINITE) {
		if (v.p == 0 || v.q == 0 || v.fine0 >= v.q)
			return false;
	} else if ((v.kind != TB__ZERO && v.kind != TB__INF) || v.p != 0 || v.q != 1 ||
		   v.fine0 != 0) {
		return false;
	}
	/*
	 * The horizon the fast paths trust: none before the origin is fixed,
	 * then the one its origin and rate give (INT64_MIN until the caller
	 * that fixed the origin stores it, which may have been killed).
	 */
	if (v.origin == TB__NO_TIME)
		return v.limit == INT64_MIN;
	return v.limit == INT64_MIN || v.limit == tb__limit(v.origin, v.p, v.q, v.fine0);
}

/*
 * Whether the writer mutex is of the kind tb__shared_mutexattr makes: glibc
 * asserts, or fails every lock, on a kind it never made.  Its other words
 * (owner, lock) are checked by locking: a dead owner is repaired, an
 * unrecoverable mutex is an error, a lock word no live holder wrote times
 * out (tb__writer_lock).
 */
bool tb__shared_mutex_valid(const pthread_mutex_t *m)
{
#ifdef __GLIBC__
	pthread_mutexattr_t attr;
	pthread_mutex_t made;
	if (tb__shared_mutexattr(&attr))
		return false;
	int err = pthread_mutex_init(&made, &attr);
	pthread_mutexattr_destroy(&attr);
	if (err)
		return false;
	bool same = m->__data.__kind == made.__data.__kind;
	pthread_mutex_destroy(&made);
	return same;
#else
	(void)m;
	return true;
#endif
}

/*
 * The checks of the header, then of the state's words that readers rely
 * on.  Words that writers change in several steps are checked only for
 * what holds at every step (a writer may be running, or have died): the
 * threshold may briefly exceed a burst being lowered.
 */
static int shared_check(const struct tb__shared *s, size_t size)
{
	if (size < sizeof(struct tb__header) || s->header.h.magic != TB__MAGIC)
		return -EBADMSG;
	if (s->header.h.layout != TB__LAYOUT || s->header.h.major != TOKENBUCKET_VERSION_MAJOR ||
	    s->header.h.header_size != sizeof(union tb__shared_header) ||
	    s->header.h.state_size != sizeof(struct tokenbucket) ||
	    s->header.h.state_align != alignof(struct tokenbucket))
		return -EPROTO;
	if (atomic_load_explicit(&s->header.h.ready, memory_order_acquire) != TB__READY)
		return -EAGAIN;
	if (size < sizeof(struct tb__shared))
		return -EBADMSG;
	const struct tokenbucket *tb = &s->state;
	uint64_t threshold = atomic_load(&tb->threshold);
	if (atomic_load(&tb->burst) > TOKENBUCKET_BURST_MAX || threshold == 0 ||
	    threshold > TOKENBUCKET_BURST_MAX || (tb->flags & ~TOKENBUCKET_CAPPED_RELEASE) ||
	    atomic_load(&tb->kind) > TB__INF || tb__is_corrupt(tb) || !regime_valid(tb) ||
	    !tb__shared_mutex_valid(&tb->writer))
		return -EBADMSG;
	return 0;
}

int tokenbucket_attach_shared(struct tokenbucket **tbp, void *mem, size_t size)
{
	if (tbp == NULL || mem == NULL || !aligned(mem))
		return -EINVAL;
	if (!tb__atomics_shareable())
		return -ENOTSUP;
	struct tb__shared *s = mem;
	int err = shared_check(s, size);
	if (err)
		return err;
	*tbp = &s->state;
	return 0;
}

/* ---- Named buckets ------------------------------------------------------- */

/* "/dev/shm/tokenbucket.<name without its slash>", or a negative errno for a bad name. */
int tb__shm_path(const char *name, char *path, size_t size)
{
	if (name == NULL || name[0] != '/' || name[1] == '\0')
		return -EINVAL;
	size_t len = strnlen(name + 1, TOKENBUCKET_NAME_MAX + 1);
	if (len > TOKENBUCKET_NAME_MAX)
		return -ENAMETOOLONG;
	if (memchr(name + 1, '/', len) != NULL || strcmp(name + 1, ".") == 0 ||
	    strcmp(name + 1, "..") == 0)
		return -EINVAL;
	int n = snprintf(path, size, TB__SHM_DIR TB__SHM_PREFIX "%s", name + 1);
	return n < 0 || (size_t)n >= size ? -ENAMETOOLONG : 0;
}

static struct tokenbucket *state_of(void *map)
{
	return &((struct tb__shared *)map)->state;
}

static struct tb__shared *map_of(struct tokenbucket *tb)
{
	return (struct tb__shared *)((char *)tb - offsetof(struct tb__shared, state));
}

/*
 * Maps an open object and checks it.  map_size 0 maps the whole file (at
 * least min_size bytes), else exactly map_size bytes, of which check reads
 * only what the file has: a shorter file is truncated, never read past its
 * end.  On success *map and *mapped describe the mapping.
 */
static int attach_fd(int fd, const struct tb__shm_ops *ops, void **map, size_t *mapped)
{
	struct stat st;
	if (fstat(fd, &st) < 0)
		return -errno;
	if (!S_ISREG(st.st_mode))
		return -EBADMSG;
	if (st.st_size < (off_t)ops->min_size || (uint64_t)st.st_size > SIZE_MAX / 2)
		return -EBADMSG;
	size_t have = (size_t)st.st_size;
	size_t len = ops->map_size ? ops->map_size : have;
	if (have > len)
		have = len;
	void *m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (m == MAP_FAILED)
		return -errno;
	int err = ops->check(m, have, ops->arg);
	if (err) {
		munmap(m, len);
		return err;
	}
	*map = m;
	*mapped = len;
	return 0;
}

/*
 * A new object, complete before it has a name: an unnamed file in /dev/shm
 * (O_TMPFILE), initialised, then linked to its name, which fails if the
 * name exists.  Where O_TMPFILE is missing, a temporary name does the same.
 * Returns 0 (*map set), -EEXIST (someone else created it first: attach), or
 * another negative errno.
 */
static int create_named(const char *path, const struct tb__shm_ops *ops, unsigned mode,
			void **mapp)
{
	char tmp[TB__PATH_SIZE + 16];
	bool named_tmp = false;
	int fd = open(TB__SHM_DIR, O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
	if (fd < 0) {
		snprintf(tmp, sizeof(tmp), TB__SHM_DIR ".tokenbucket.XXXXXX");
		fd = mkostemp(tmp, O_CLOEXEC);
		if (fd < 0)
			return -errno;
		named_tmp = true;
	}
	int err = 0;
	void *map = MAP_FAILED;
	if (fchmod(fd, mode) < 0 || ftruncate(fd, (off_t)ops->create_size) < 0) {
		err = -errno;
		goto out;
	}
	map = mmap(NULL, ops->create_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (map == MAP_FAILED) {
		err = -errno;
		goto out;
	}
	err = ops->init(map, ops->arg);
	if (err)
		goto out;
	if (named_tmp) {
		if (link(tmp, path) < 0)
			err = -errno;
	} else {
		char self[64];
		snprintf(self, sizeof(self), "/proc/self/fd/%d", fd);
		if (linkat(AT_FDCWD, self, AT_FDCWD, path, AT_SYMLINK_FOLLOW) < 0)
			err = -errno;
	}
out:
	if (named_tmp)
		unlink(tmp);
	close(fd);
	if (err == 0)
		*mapp = map;
	else if (map != MAP_FAILED)
		munmap(map, ops->create_size);
	return err;
}

int tb__shm_open(const char *name, unsigned mode, const struct tb__shm_ops *ops, void **map,
		 size_t *mapped, bool *created)
{
	char path[TB__PATH_SIZE];
	int err = tb__shm_path(name, path, sizeof(path));
	if (err)
		return err;
	if (mode > 0777)
		return -EINVAL;
	if (mode == 0)
		mode = 0600;
	/* Each retry means the name was created or removed by someone else meanwhile. */
	for (int tries = 0; tries < 100; tries++) {
		int fd = open(path, O_RDWR | O_NOFOLLOW | O_CLOEXEC);
		if (fd >= 0) {
			err = attach_fd(fd, ops, map, mapped);
			close(fd);
			*created = false;
			return err;
		}
		/* A symbolic link or a directory there is not one of ours. */
		if (errno != ENOENT)
			return errno == ELOOP || errno == EISDIR ? -EBADMSG : -errno;
		err = create_named(path, ops, mode, map);
		if (err == 0) {
			*mapped = ops->create_size;
			*created = true;
			return 0;
		}
		if (err != -EEXIST)
			return err;
	}
	return -EAGAIN;
}

/* What tokenbucket_open asks for. */
struct bucket_config {
	enum tb__kind kind;
	uint64_t p, q, burst;
	unsigned flags;
};

/* Whether the bucket's rate, burst and flags are the ones given. */
static bool same_config(struct tokenbucket *tb, enum tb__kind kind, uint64_t p, uint64_t q,
			uint64_t burst, unsigned flags)
{
	struct tb__view v;
	tb__view(tb, &v);
	return v.kind == kind && v.p == p && v.q == q &&
	       atomic_load(&tb->burst) == burst && tb->flags == flags;
}

static int bucket_init_cb(void *map, void *arg)
{
	const struct bucket_config *c = arg;
	return shared_init(map, c->kind, c->p, c->q, c->burst, c->flags);
}

static int bucket_check_cb(const void *map, size_t have, void *arg)
{
	(void)arg;
	return shared_check(map, have);
}

int tokenbucket_open(struct tokenbucket **tbp, const char *name, double rate, uint64_t burst,
		     unsigned flags, unsigned mode, unsigned *status)
{
	enum tb__kind kind;
	uint64_t p, q;
	if (rate_ratio(rate, &kind, &p, &q))
		return -EINVAL;
	return tb__open(tbp, name, kind, p, q, burst, flags, mode, status);
}

int tb__open(struct tokenbucket **tbp, const char *name, enum tb__kind kind, uint64_t p,
	     uint64_t q, uint64_t burst, unsigned flags, unsigned mode, unsigned *status)
{
	char path[TB__PATH_SIZE];
	struct bucket_config c = {.kind = kind, .p = p, .q = q, .burst = burst, .flags = flags};
	if (tbp == NULL || mode > 0777)
		return -EINVAL;
	int err = tb__shm_path(name, path, sizeof(path));
	if (err == 0)
		err = tb__bucket_check(burst, flags);
	if (err)
		return err;
	if (!tb__atomics_shareable())
		return -ENOTSUP;
	const struct tb__shm_ops ops = {
		.map_size = sizeof(struct tb__shared),
		.create_size = sizeof(struct tb__shared),
		.min_size = sizeof(struct tb__header),
		.init = bucket_init_cb,
		.check = bucket_check_cb,
		.arg = &c,
	};
	void *map;
	size_t mapped;
	bool created;
	err = tb__shm_open(name, mode, &ops, &map, &mapped, &created);
	if (err)
		return err;
	struct tokenbucket *tb = state_of(map);
	if (status)
		*status = created ? TOKENBUCKET_OPEN_CREATED
			  : same_config(tb, c.kind, c.p, c.q, burst, flags) ? 0
									: TOKENBUCKET_OPEN_DIFFERS;
	*tbp = tb;
	return 0;
}

void tokenbucket_close(struct tokenbucket *tb)
{
	if (tb != NULL)
		munmap(map_of(tb), sizeof(struct tb__shared));
}

int tokenbucket_unlink(const char *name)
{
	char path[TB__PATH_SIZE];
	int err = tb__shm_path(name, path, sizeof(path));
	if (err)
		return err;
	return unlink(path) < 0 ? -errno : 0;
}
