/* SPDX-License-Identifier: MIT */
/*
 * 1.2: tables made from a struct tokenbucket_limit, fronts to the _create,
 * _init_shared and _open of table.c with the same tokens and period_ns.
 */
#include <errno.h>
#include <stdbool.h>

#include <tokenbucket.h>

/*
 * The tokens and period_ns a table function gets for a limit: a table has
 * no unlimited rate, so such a limit goes as the fastest ratio there is,
 * which the table functions refuse with -ERANGE after every -EINVAL of the
 * other arguments.  -EINVAL for lim NULL or a negative period.
 */
static int table_ratio(const struct tokenbucket_limit *lim, uint64_t *tokens, int64_t *period_ns)
{
	if (lim == NULL || lim->period_ns < 0)
		return -EINVAL;
	bool unlimited = lim->tokens > 0 && lim->period_ns == 0;
	*tokens = unlimited ? UINT64_MAX : lim->tokens;
	*period_ns = unlimited ? 1 : lim->period_ns;
	return 0;
}

int tokenbucket_table_create_limit(struct tokenbucket_table **tp,
				   const struct tokenbucket_limit *lim, uint64_t capacity,
				   unsigned flags)
{
	uint64_t tokens;
	int64_t period;
	if (tp == NULL || table_ratio(lim, &tokens, &period))
		return -EINVAL;
	return tokenbucket_table_create(tp, tokens, period, lim->burst, capacity, flags);
}

int tokenbucket_table_init_shared_limit(struct tokenbucket_table **tp, void *mem, size_t size,
					const struct tokenbucket_limit *lim, uint64_t capacity,
					unsigned flags)
{
	uint64_t tokens;
	int64_t period;
	if (tp == NULL || table_ratio(lim, &tokens, &period))
		return -EINVAL;
	return tokenbucket_table_init_shared(tp, mem, size, tokens, period, lim->burst, capacity,
					     flags);
}

int tokenbucket_table_open_limit(struct tokenbucket_table **tp, const char *name,
				 const struct tokenbucket_limit *lim, uint64_t capacity,
				 unsigned flags, unsigned mode, unsigned *status)
{
	uint64_t tokens;
	int64_t period;
	if (tp == NULL || table_ratio(lim, &tokens, &period))
		return -EINVAL;
	return tokenbucket_table_open(tp, name, tokens, period, lim->burst, capacity, flags, mode,
				      status);
}
