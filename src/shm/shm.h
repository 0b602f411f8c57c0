/* SPDX-License-Identifier: MIT */
/*
 * Named objects in /dev/shm, for buckets and tables alike: their paths,
 * creation complete before the name appears, and attaching with a check
 * (shared.c).  Above the core: it includes core.h, never the reverse.
 */
#ifndef TOKENBUCKET_SHM_H
#define TOKENBUCKET_SHM_H

#include <stdbool.h>
#include <stddef.h>

#include "core.h"

/* Where named objects live, and the prefix that keeps them apart from others. */
#define TB__SHM_DIR "/dev/shm/"
#define TB__SHM_PREFIX "tokenbucket."
#define TB__PATH_SIZE (sizeof(TB__SHM_DIR TB__SHM_PREFIX) + TOKENBUCKET_NAME_MAX)

/*
 * tokenbucket_init_shared and tokenbucket_open with the rate as the bucket
 * stores it (kind, and p/q in lowest terms; 0/1 unless finite), for the
 * double and the exact (struct tokenbucket_limit) entry points alike.
 */
int tb__init_shared(struct tokenbucket **tbp, void *mem, size_t size, enum tb__kind kind,
		    uint64_t p, uint64_t q, uint64_t burst, unsigned flags);
int tb__open(struct tokenbucket **tbp, const char *name, enum tb__kind kind, uint64_t p,
	     uint64_t q, uint64_t burst, unsigned flags, unsigned mode, unsigned *status);

/* The writer mutex of shared objects: process-shared and robust.  0 or -errno. */
int tb__shared_mutexattr(pthread_mutexattr_t *attr);
/*
 * Whether a mutex in shared memory is of the kind tb__shared_mutexattr makes
 * (glibc asserts, or fails every lock, on a kind it never made).
 */
bool tb__shared_mutex_valid(const pthread_mutex_t *m);
/* Whether 8-byte atomics are lock-free and address-free here. */
bool tb__atomics_shareable(void);
/* The file of a named object, or -EINVAL / -ENAMETOOLONG for a bad name. */
int tb__shm_path(const char *name, char *path, size_t size);

/* What tb__shm_open needs to know of a kind of named object. */
struct tb__shm_ops {
	size_t map_size;    /* bytes an existing object maps; 0: the whole file */
	size_t create_size; /* bytes a new object has */
	size_t min_size;    /* a shorter file is not one (-EBADMSG) */
	int (*init)(void *map, void *arg);                     /* a new object, in place */
	int (*check)(const void *map, size_t have, void *arg); /* an existing one: have bytes */
	void *arg;
};
/*
 * Opens the named object (a bucket or a table), creating it complete before
 * its name appears if it does not exist; *created says which.  0 or a
 * negative errno; *map and *mapped describe the mapping.
 */
int tb__shm_open(const char *name, unsigned mode, const struct tb__shm_ops *ops, void **map,
		 size_t *mapped, bool *created);

#endif /* TOKENBUCKET_SHM_H */
