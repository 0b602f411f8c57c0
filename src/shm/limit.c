/* SPDX-License-Identifier: MIT */
/*
 * 1.2: shared and named buckets made from a struct tokenbucket_limit, with
 * the ratio the core reads from it (tb__limit_ratio) and the work of
 * shared.c: nothing is converted twice.
 */
#include <errno.h>

#include "shm.h"

int tokenbucket_init_shared_limit(struct tokenbucket **tbp, void *mem, size_t size,
				  const struct tokenbucket_limit *lim, unsigned flags)
{
	enum tb__kind kind;
	uint64_t p, q;
	if (tbp == NULL || lim == NULL || tb__limit_ratio(lim, &kind, &p, &q))
		return -EINVAL;
	return tb__init_shared(tbp, mem, size, kind, p, q, lim->burst, flags);
}

int tokenbucket_open_limit(struct tokenbucket **tbp, const char *name,
			   const struct tokenbucket_limit *lim, unsigned flags, unsigned mode,
			   unsigned *status)
{
	enum tb__kind kind;
	uint64_t p, q;
	if (tbp == NULL || lim == NULL || tb__limit_ratio(lim, &kind, &p, &q))
		return -EINVAL;
	return tb__open(tbp, name, kind, p, q, lim->burst, flags, mode, status);
}
