/* SPDX-License-Identifier: MIT */
/*
 * Several limits in one decision (1.2): tokenbucket_allow_all,
 * reserve_all, cancel_all, wait_all.  All or none, which limit refused and
 * when all will allow, the set's time to act, give-backs that are exact
 * (or, documented, never more than the bucket missed), every errno, buckets
 * shared with another process, and 8 threads on overlapping sets with a
 * shared fake clock: no bucket ever grants more than burst + what its rate
 * produced, counted in integers, and every bucket is full again after a
 * quiet period.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check_tb.h"
#include "core.h"

#define T0 (1000 * SEC)

static uint64_t next_random(uint64_t *x);

/* Whole tokens at t (tokens_at rounded down; negative in debt). */
static int64_t whole(struct tokenbucket *tb, int64_t t)
{
	return (int64_t)floor(tokenbucket_tokens_at(tb, t));
}

START_TEST(all_or_none)
{
	struct tokenbucket *a = bucket_every(0, 1, 10, 0), *b = bucket_every(0, 1, 3, 0);
	struct tokenbucket *set[] = { a, b };
	struct tokenbucket_set_result res;
	ck_assert_int_eq(tokenbucket_allow_all_at(set, 2, T0, 2, &res), 0);
	ck_assert(res.allowed);
	ck_assert_uint_eq(res.index, 1); /* the fewest left: b, 1 */
	ck_assert_uint_eq(res.limit, 3);
	ck_assert_uint_eq(res.remaining, 1);
	ck_assert_int_eq(res.retry_after_ns, 0);
	ck_assert_int_eq(res.reset_after_ns, TOKENBUCKET_NEVER);
	ck_assert_int_eq(whole(a, T0), 8);
	ck_assert_int_eq(whole(b, T0), 1);
	/* b holds 1: nothing is taken from a either. */
	ck_assert_int_eq(tokenbucket_allow_all_at(set, 2, T0, 2, &res), 0);
	ck_assert(!res.allowed);
	ck_assert_uint_eq(res.index, 1);
	ck_assert_uint_eq(res.limit, 3);
	ck_assert_uint_eq(res.remaining, 1);
	ck_assert_int_eq(res.retry_after_ns, TOKENBUCKET_NEVER);
	ck_assert_int_eq(whole(a, T0), 8);
	ck_assert_int_eq(whole(b, T0), 1);
	/* The same with b first: refused by the take of b, a untouched. */
	struct tokenbucket *rev[] = { b, a };
	ck_assert_int_eq(tokenbucket_allow_all_at(rev, 2, T0, 2, &res), 0);
	ck_assert(!res.allowed);
	ck_assert_uint_eq(res.index, 0);
	ck_assert_int_eq(whole(a, T0), 8);
	ck_assert_int_eq(whole(b, T0), 1);
	/* A set of one is the bucket alone. */
	ck_assert_int_eq(tokenbucket_allow_all_at(set, 1, T0, 8, &res), 0);
	ck_assert(res.allowed);
	ck_assert_uint_eq(res.remaining, 0);
	ck_assert_int_eq(whole(a, T0), 0);
	tokenbucket_free(a);
	tokenbucket_free(b);
}
END_TEST

START_TEST(which_refused_and_when)
{
	/* a: 1 token a ms, empty; b: 1 every 10 ms, full at 5; c: unlimited. */
	struct tokenbucket *a = bucket_empty_at(1, MS, 10, 0, T0);
	struct tokenbucket *b = bucket_every(1, 10 * MS, 5, 0);
	struct tokenbucket *c = bucket_rate(TOKENBUCKET_INF, 7, 0);
	struct tokenbucket *set[] = { b, c, a };
	struct tokenbucket_set_result res;
	ck_assert_int_eq(tokenbucket_allow_all_at(set, 3, T0, 3, &res), 0);
	ck_assert(!res.allowed);
	ck_assert_uint_eq(res.index, 2);
	ck_assert_uint_eq(res.limit, 10);
	ck_assert_uint_eq(res.remaining, 0);
	ck_assert_int_eq(res.retry_after_ns, 3 * MS); /* a needs 3 ms, b and c none */
	ck_assert_int_eq(res.reset_after_ns, 10 * MS); /* a is full last */
	ck_assert_int_eq(whole(b, T0), 5);
	/* When all will allow, they do, and the fewest left is reported. */
	ck_assert_int_eq(tokenbucket_allow_all_at(set, 3, T0 + 3 * MS, 3, &res), 0);
	ck_assert(res.allowed);
	ck_assert_uint_eq(res.index, 2);
	ck_assert_uint_eq(res.remaining, 0);
	ck_assert_int_eq(whole(b, T0 + 3 * MS), 2);
	/* b, 2.3 of 5 at 1 every 10 ms, is full last. */
	ck_assert_int_eq(res.reset_after_ns, 27 * MS);
	/* Now b binds: 2 left of 5. */
	ck_assert_int_eq(tokenbucket_allow_all_at(set, 3, T0 + 6 * MS, 3, &res), 0);
	ck_assert(!res.allowed);
	ck_assert_uint_eq(res.index, 0);
	ck_assert_uint_eq(res.limit, 5);
	ck_assert_uint_eq(res.remaining, 2);
	ck_assert_int_eq(res.retry_after_ns, 4 * MS); /* 2.6 there: 0.4 more */
	ck_assert_int_eq(whole(a, T0 + 6 * MS), 3);
	tokenbucket_free(a);
	tokenbucket_free(b);
	tokenbucket_free(c);
}
END_TEST

/*
 * The give-back after a take that its set refused: a capped bucket is not
 * checked ahead, so the refusal comes from its take and the bucket before
 * it gets back what it gave, exactly (undone: no take came between).
 */
START_TEST(refusal_gives_back_exactly)
{
	struct tokenbucket *a = bucket_every(1, MS, 10, 0);
	struct tokenbucket *b = bucket_every(1, MS, 4, TOKENBUCKET_CAPPED_RELEASE);
	struct tokenbucket *set[] = { a, b };
	struct tokenbucket_set_result res;
	ck_assert(tokenbucket_allow_at(b, T0, 4));
	ck_assert_int_eq(tokenbucket_tokens_at(a, T0), 10);
	ck_assert_int_eq(tokenbucket_allow_all_at(set, 2, T0, 3, &res), 0);
	ck_assert(!res.allowed);
	ck_assert_uint_eq(res.index, 1);
	ck_assert_tokens(tokenbucket_tokens_at(a, T0), 10);
	/* Full, not over: half a ms later a still holds 10, and takes 10. */
	ck_assert(!tokenbucket_allow_at(a, T0 + MS / 2, 11));
	ck_assert(tokenbucket_allow_at(a, T0 + MS / 2, 10));
	/* A bucket in debt as the first of a refused set. */
	struct tokenbucket *d = bucket_empty_at(1, MS, 10, 0, T0);
	struct tokenbucket_reservation r;
	ck_assert_int_eq(tokenbucket_reserve_at(d, T0, 5, TOKENBUCKET_NEVER, &r), 0);
	struct tokenbucket *set2[] = { d, b };
	ck_assert_int_eq(tokenbucket_reserve_all_at(set2, 2, T0, 3, 0, (struct tokenbucket_reservation[2]){ 0 }),
			 -ETIMEDOUT);
	ck_assert_tokens(tokenbucket_tokens_at(d, T0), -5);
	tokenbucket_free(a);
	tokenbucket_free(b);
	tokenbucket_free(d);
}
END_TEST

START_TEST(reserve_acts_at_the_latest)
{
	struct tokenbucket *a = bucket_empty_at(1, MS, 10, 0, T0);
	struct tokenbucket *b = bucket_empty_at(1, 2 * MS, 10, 0, T0);
	struct tokenbucket *set[] = { a, b };
	struct tokenbucket_reservation r[2], keep[2];
	memset(r, 0x5a, sizeof(r));
	memcpy(keep, r, sizeof(r));
	/* b needs 4 ms: a wait of 3 is refused, and nothing is taken from a. */
	ck_assert_int_eq(tokenbucket_reserve_all_at(set, 2, T0, 2, 3 * MS, r), -ETIMEDOUT);
	ck_assert_mem_eq(r, keep, sizeof(r));
	ck_assert_tokens(tokenbucket_tokens_at(a, T0), 0);
	ck_assert_tokens(tokenbucket_tokens_at(b, T0), 0);
	ck_assert_int_eq(tokenbucket_reserve_all_at(set, 2, T0, 2, 4 * MS, r), 0);
	ck_assert_int_eq(r[0].time_to_act, T0 + 4 * MS);
	ck_assert_int_eq(r[1].time_to_act, T0 + 4 * MS);
	ck_assert_uint_eq(r[0].tokens, 2);
	ck_assert_uint_eq(r[1].tokens, 2);
	ck_assert_int_eq(tokenbucket_reservation_delay(&r[0], T0 + MS), 3 * MS);
	/* At the set's time every bucket covers its ticket. */
	ck_assert_tokens(tokenbucket_tokens_at(a, T0 + 4 * MS), 2);
	ck_assert_tokens(tokenbucket_tokens_at(b, T0 + 4 * MS), 0);
	ck_assert_uint_eq(tokenbucket_deficiency(a, r[0].ticket), 0);
	ck_assert_uint_eq(tokenbucket_deficiency(b, r[1].ticket), 0);
	/* Too late to cancel: the set acted, nothing comes back. */
	ck_assert_int_eq(tokenbucket_cancel_all_at(set, 2, T0 + 4 * MS + 1, r), 0);
	ck_assert_uint_eq(r[0].tokens, 0);
	ck_assert_int_eq(whole(a, T0 + 4 * MS + 1), 2);
	tokenbucket_free(a);
	tokenbucket_free(b);
}
END_TEST

START_TEST(cancel_gives_back_all)
{
	/* a covers its tokens at once, b at T0 + 40 ms: the set acts then. */
	struct tokenbucket *a = bucket_every(1, MS, 10, 0);
	struct tokenbucket *b = bucket_empty_at(1, 10 * MS, 5, 0, T0);
	struct tokenbucket *set[] = { a, b };
	struct tokenbucket_reservation r[2];
	ck_assert_int_eq(tokenbucket_tokens_at(a, T0), 10);
	ck_assert_int_eq(tokenbucket_reserve_all_at(set, 2, T0, 4, TOKENBUCKET_NEVER, r), 0);
	ck_assert_int_eq(r[0].time_to_act, T0 + 40 * MS);
	/* Past a's own time to act, before the set's: a gets all back (undone). */
	ck_assert_int_eq(tokenbucket_cancel_all_at(set, 2, T0 + 2 * MS, r), 0);
	ck_assert_uint_eq(r[0].tokens, 0);
	ck_assert_uint_eq(r[1].tokens, 0);
	ck_assert_tokens(tokenbucket_tokens_at(a, T0 + 2 * MS), 10);
	ck_assert_tokens(tokenbucket_tokens_at(b, T0 + 2 * MS), 0.2);
	/* A second cancel gives nothing more. */
	ck_assert_int_eq(tokenbucket_cancel_all_at(set, 2, T0 + 2 * MS, r), 0);
	ck_assert_tokens(tokenbucket_tokens_at(b, T0 + 2 * MS), 0.2);
	tokenbucket_free(a);
	tokenbucket_free(b);
}
END_TEST

/*
 * A give-back after other calls took from the bucket (no undo): the rule
 * of docs/core.md, "Giving back": all n back, never above burst.
 */
START_TEST(give_back_after_other_takes)
{
	struct tokenbucket *b = bucket_empty_at(1, 10 * MS, 5, 0, T0);
	struct tokenbucket_reservation r[2];

	/* Rate 0: the other take's token stays taken, ours come back. */
	struct tokenbucket *z = bucket_every(0, 1, 10, 0);
	struct tokenbucket *sz[] = { z, b };
	ck_assert_int_eq(tokenbucket_reserve_all_at(sz, 2, T0, 4, TOKENBUCKET_NEVER, r), 0);
	ck_assert(tokenbucket_allow_at(z, T0, 1));
	ck_assert_int_eq(tokenbucket_cancel_all_at(sz, 2, T0, r), 0);
	ck_assert_tokens(tokenbucket_tokens_at(z, T0), 9);
	ck_assert_tokens(tokenbucket_tokens_at(b, T0), 0);

	/*
	 * Full at T0, 4 taken; 2 ms refill 2 of them, 1 is taken: without the
	 * set the 2 would have been lost to the cap (9); the give-back cannot
	 * tell when the other take came, and keeps them: 10, the bucket's
	 * burst.  The production of the set's own duration, at most.
	 */
	struct tokenbucket *a = bucket_every(1, MS, 10, 0);
	struct tokenbucket *sa[] = { a, b };
	ck_assert_int_eq(tokenbucket_tokens_at(a, T0), 10);
	ck_assert_int_eq(tokenbucket_reserve_all_at(sa, 2, T0, 4, TOKENBUCKET_NEVER, r), 0);
	ck_assert(tokenbucket_allow_at(a, T0 + 2 * MS, 1));
	ck_assert_int_eq(tokenbucket_cancel_all_at(sa, 2, T0 + 2 * MS, r), 0);
	ck_assert_tokens(tokenbucket_tokens_at(a, T0 + 2 * MS), 10);

	/* At 5 of 10, 5 taken; 3 made and taken by another, 3 made again: 8, as without the set. */
	struct tokenbucket *c = bucket_empty_at(1, MS, 10, 0, T0);
	ck_assert_int_eq(tokenbucket_reset_at(c, T0, 5), 0);
	struct tokenbucket *sc[] = { c, b };
	ck_assert_int_eq(tokenbucket_reserve_all_at(sc, 2, T0, 5, TOKENBUCKET_NEVER, r), 0);
	ck_assert(tokenbucket_allow_at(c, T0 + 3 * MS, 3));
	ck_assert_int_eq(tokenbucket_cancel_all_at(sc, 2, T0 + 6 * MS, r), 0);
	ck_assert_tokens(tokenbucket_tokens_at(c, T0 + 6 * MS), 8);
	ck_assert_tokens(tokenbucket_tokens_at(c, T0 + 9 * MS), 10);
	ck_assert_tokens(tokenbucket_tokens_at(c, T0 + 20 * MS), 10);

	/* A reset between the take and the give-back: the tokens still come back, within burst. */
	struct tokenbucket *e = bucket_every(0, 1, 10, 0);
	struct tokenbucket *se[] = { e, b };
	ck_assert_int_eq(tokenbucket_reserve_all_at(se, 2, T0, 4, TOKENBUCKET_NEVER, r), 0);
	ck_assert_int_eq(tokenbucket_reset_at(e, T0, 3), 0);
	ck_assert_int_eq(tokenbucket_cancel_all_at(se, 2, T0, r), 0);
	ck_assert_tokens(tokenbucket_tokens_at(e, T0), 7);

	tokenbucket_free(a);
	tokenbucket_free(b);
	tokenbucket_free(c);
	tokenbucket_free(e);
	tokenbucket_free(z);
}
END_TEST

START_TEST(every_errno)
{
	struct tokenbucket *a = bucket_every(0, 1, 10, 0), *b = bucket_every(0, 1, 3, 0);
	struct tokenbucket *set[] = { a, b }, *dup[] = { a, b, a }, *hole[] = { a, NULL };
	struct tokenbucket *many[TOKENBUCKET_SET_MAX + 1];
	for (size_t i = 0; i <= TOKENBUCKET_SET_MAX; i++)
		many[i] = bucket_every(0, 1, 10, 0);
	struct tokenbucket_set_result res, keep;
	memset(&res, 0x5a, sizeof(res));
	keep = res;
	struct tokenbucket_reservation r[TOKENBUCKET_SET_MAX + 1];
	int (*allow)(struct tokenbucket *const *, size_t, int64_t, uint64_t,
		     struct tokenbucket_set_result *) = tokenbucket_allow_all_at;

	ck_assert_int_eq(allow(NULL, 2, T0, 1, &res), -EINVAL);
	ck_assert_int_eq(allow(set, 2, T0, 1, NULL), -EINVAL);
	ck_assert_int_eq(allow(set, 0, T0, 1, &res), -EINVAL);
	ck_assert_int_eq(allow(many, TOKENBUCKET_SET_MAX + 1, T0, 1, &res), -EINVAL);
	ck_assert_int_eq(allow(hole, 2, T0, 1, &res), -EINVAL);
	ck_assert_int_eq(allow(dup, 3, T0, 1, &res), -EINVAL);
	ck_assert_int_eq(allow(set, 2, T0, 4, &res), -E2BIG);
	ck_assert_int_eq(tokenbucket_allow_all(set, 2, 4, &res), -E2BIG);
	ck_assert_mem_eq(&res, &keep, sizeof(res));
	/* The largest set is accepted. */
	ck_assert_int_eq(allow(many, TOKENBUCKET_SET_MAX, T0, 10, &res), 0);
	ck_assert(res.allowed);

	ck_assert_int_eq(tokenbucket_reserve_all_at(NULL, 2, T0, 1, 0, r), -EINVAL);
	ck_assert_int_eq(tokenbucket_reserve_all_at(set, 2, T0, 1, 0, NULL), -EINVAL);
	ck_assert_int_eq(tokenbucket_reserve_all_at(set, 0, T0, 1, 0, r), -EINVAL);
	ck_assert_int_eq(tokenbucket_reserve_all_at(many, TOKENBUCKET_SET_MAX + 1, T0, 1, 0, r),
			 -EINVAL);
	ck_assert_int_eq(tokenbucket_reserve_all_at(hole, 2, T0, 1, 0, r), -EINVAL);
	ck_assert_int_eq(tokenbucket_reserve_all_at(dup, 3, T0, 1, 0, r), -EINVAL);
	ck_assert_int_eq(tokenbucket_reserve_all_at(set, 2, T0, 4, 0, r), -E2BIG);
	ck_assert_int_eq(tokenbucket_reserve_all(set, 2, 4, TOKENBUCKET_NEVER, r), -E2BIG);
	/* Rate 0: b's 3 are not enough for 4 more... and never will be. */
	ck_assert_int_eq(tokenbucket_reserve_all_at(set, 2, T0, 3, 0, r), 0);
	ck_assert_int_eq(tokenbucket_reserve_all_at(set, 2, T0, 1, TOKENBUCKET_NEVER / 2, r),
			 -ETIMEDOUT);
	ck_assert_tokens(tokenbucket_tokens_at(a, T0), 7);

	/* -EOVERFLOW: the second bucket's debt would pass TOKENBUCKET_DEBT_MAX. */
	struct tokenbucket *big = bucket_every(0, 1, TOKENBUCKET_BURST_MAX, 0);
	struct tokenbucket *huge = bucket_every(1, SEC, TOKENBUCKET_BURST_MAX, 0);
	struct tokenbucket *deep[] = { huge, big };
	ck_assert(tokenbucket_allow_at(big, T0, TOKENBUCKET_BURST_MAX));
	ck_assert_int_eq(tokenbucket_reserve_all_at(deep, 2, T0, TOKENBUCKET_BURST_MAX,
						    TOKENBUCKET_NEVER, r),
			 -EOVERFLOW);
	ck_assert_tokens(tokenbucket_tokens_at(huge, T0), (double)TOKENBUCKET_BURST_MAX);
	/* allow_all reads the overflow as a refusal. */
	ck_assert_int_eq(allow(deep, 2, T0, 1, &res), 0);
	ck_assert(!res.allowed);
	ck_assert_uint_eq(res.index, 1);

	/* -EBADMSG: a bucket marked corrupt, found by the general path (capped). */
	struct tokenbucket *bad = bucket_every(0, 1, 10, TOKENBUCKET_CAPPED_RELEASE);
	atomic_store(&bad->corrupt, 1);
	struct tokenbucket *sick[] = { a, bad };
	ck_assert_int_eq(tokenbucket_reserve_all_at(sick, 2, T0, 1, 0, r), -EBADMSG);
	ck_assert_int_eq(allow(sick, 2, T0, 1, &res), -EBADMSG);
	ck_assert_tokens(tokenbucket_tokens_at(a, T0), 7);

	ck_assert_int_eq(tokenbucket_cancel_all_at(NULL, 2, T0, r), -EINVAL);
	ck_assert_int_eq(tokenbucket_cancel_all_at(set, 2, T0, NULL), -EINVAL);
	ck_assert_int_eq(tokenbucket_cancel_all_at(set, 0, T0, r), -EINVAL);
	ck_assert_int_eq(tokenbucket_cancel_all_at(many, TOKENBUCKET_SET_MAX + 1, T0, r), -EINVAL);
	ck_assert_int_eq(tokenbucket_cancel_all_at(hole, 2, T0, r), -EINVAL);
	ck_assert_int_eq(tokenbucket_cancel_all(dup, 3, r), -EINVAL);

	ck_assert_int_eq(tokenbucket_wait_all(NULL, 2, 1, TOKENBUCKET_NEVER, -1), -EINVAL);
	ck_assert_int_eq(tokenbucket_wait_all(set, 0, 1, TOKENBUCKET_NEVER, -1), -EINVAL);
	ck_assert_int_eq(tokenbucket_wait_all(many, TOKENBUCKET_SET_MAX + 1, 1, TOKENBUCKET_NEVER, -1),
			 -EINVAL);
	ck_assert_int_eq(tokenbucket_wait_all(hole, 2, 1, TOKENBUCKET_NEVER, -1), -EINVAL);
	ck_assert_int_eq(tokenbucket_wait_all(dup, 3, 1, TOKENBUCKET_NEVER, -1), -EINVAL);
	ck_assert_int_eq(tokenbucket_wait_all(set, 2, 4, TOKENBUCKET_NEVER, -1), -E2BIG);
	int fds[2];
	ck_assert_int_eq(pipe(fds), 0);
	close(fds[1]);
	ck_assert_int_eq(tokenbucket_wait_all(set, 2, 1, TOKENBUCKET_NEVER, fds[0]), -ECANCELED);
	close(fds[0]);
	ck_assert_int_eq(tokenbucket_wait_all(set, 2, 1, TOKENBUCKET_NEVER, fds[0]), -EBADF);
	/* Rate 0 and not enough: never by any deadline. */
	ck_assert_int_eq(tokenbucket_wait_all(set, 2, 1, tokenbucket_now() + SEC, -1), -ETIMEDOUT);
	ck_assert_int_eq(tokenbucket_wait_all(sick, 2, 1, TOKENBUCKET_NEVER, -1), -EBADMSG);
	ck_assert_tokens(tokenbucket_tokens_at(a, T0), 7);

	for (size_t i = 0; i <= TOKENBUCKET_SET_MAX; i++)
		tokenbucket_free(many[i]);
	tokenbucket_free(a);
	tokenbucket_free(b);
	tokenbucket_free(big);
	tokenbucket_free(huge);
	tokenbucket_free(bad);
}
END_TEST

/* Two buckets in MAP_SHARED memory, taken as a set by another process. */
START_TEST(shared_buckets)
{
	size_t size = tokenbucket_shared_size();
	char *mem = mmap(NULL, 2 * size + 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
			 -1, 0);
	ck_assert_ptr_ne(mem, MAP_FAILED);
	size_t stride = (size + 4095) / 4096 * 4096;
	struct tokenbucket_limit la = { 1, MS, 10 }, lb = { 0, 1, 4 };
	struct tokenbucket *a, *b;
	ck_assert_int_eq(tokenbucket_init_shared_limit(&a, mem, size, &la, 0), 0);
	ck_assert_int_eq(tokenbucket_init_shared_limit(&b, mem + stride, size, &lb, 0), 0);
	ck_assert_int_eq(tokenbucket_tokens_at(a, T0), 10);
	pid_t pid = fork();
	TBT_FORKED(pid);
	if (pid == 0) {
		struct tokenbucket *ca, *cb;
		if (tokenbucket_attach_shared(&ca, mem, size) ||
		    tokenbucket_attach_shared(&cb, mem + stride, size))
			_exit(2);
		struct tokenbucket *set[] = { ca, cb };
		struct tokenbucket_set_result res;
		if (tokenbucket_allow_all_at(set, 2, T0, 3, &res) || !res.allowed)
			_exit(3);
		if (tokenbucket_allow_all_at(set, 2, T0, 3, &res) || res.allowed || res.index != 1)
			_exit(4);
		struct tokenbucket_reservation r[2];
		if (tokenbucket_reserve_all_at(set, 2, T0, 1, 0, r) ||
		    tokenbucket_cancel_all_at(set, 2, T0, r))
			_exit(5);
		_exit(0);
	}
	int status;
	ck_assert_int_eq(waitpid(pid, &status, 0), pid);
	ck_assert(WIFEXITED(status));
	ck_assert_int_eq(WEXITSTATUS(status), 0);
	ck_assert_tokens(tokenbucket_tokens_at(a, T0), 7);
	ck_assert_tokens(tokenbucket_tokens_at(b, T0), 1);
	munmap(mem, 2 * size + 4096);
}
END_TEST

/*
 * One thread, random calls at times that only grow: every set call must
 * answer and leave the buckets exactly as the single-bucket calls it is
 * made of, run by hand on twin buckets (a model of a set in the public
 * API): allow_all is "every bucket holds n at now, then allow_at on each";
 * reserve_all is reserve_at on each in order, the earlier ones cancelled
 * at the same now when one refuses; a cancel_all at the same now is
 * cancel_at on each.  Levels are compared exactly after every call.
 */
static const struct tokenbucket_limit model_limits[3] = {
	{ 1, MS, 10 }, { 1, 3 * MS, 5 }, { 2, 5 * MS, 7 },
};

static int twin_reserve(struct tokenbucket **twin, int64_t now, uint64_t n, int64_t max_wait,
			struct tokenbucket_reservation *r)
{
	for (size_t i = 0; i < 3; i++) {
		int err = tokenbucket_reserve_at(twin[i], now, n, max_wait, &r[i]);
		if (err) {
			while (i-- > 0)
				tokenbucket_cancel_at(twin[i], &r[i], now);
			return err;
		}
	}
	return 0;
}

/*
 * An allowed set reports as reset_after_ns the latest of its buckets'
 * own times until full (each bucket's allow_result of 0 tokens, which
 * takes nothing), over rates from one token in years to 2^40 a ns and
 * bursts to 2^40: the set finds that latest bucket without dividing for
 * the others, and must never pick another.
 */
START_TEST(allowed_reset_is_the_latest_bucket)
{
	uint64_t rnd = 0x2545f4914f6cdd1du;
	uint64_t checked = 0, distinct = 0;
	for (int round = 0; round < 400; round++) {
		struct tokenbucket *set[4];
		struct tokenbucket_limit first_lim = { 0 };
		uint64_t least = UINT64_MAX; /* the least burst: n never passes it */
		size_t count = 2 + (size_t)(next_random(&rnd) % 3);
		for (size_t i = 0; i < count; i++) {
			struct tokenbucket_limit lim = {
				.tokens = 1 + (next_random(&rnd) >> (next_random(&rnd) % 40 + 24)),
				.period_ns = (int64_t)(1 + (next_random(&rnd) >> (next_random(&rnd) % 63 + 1))),
				.burst = 1 + (next_random(&rnd) >> (next_random(&rnd) % 40 + 24)),
			};
			/* Every other round, two buckets of one rate: ties. */
			if (lim.burst < least)
				least = lim.burst;
			if (i == 0) {
				first_lim = lim;
			} else if (round & 1) {
				lim.tokens = first_lim.tokens;
				lim.period_ns = first_lim.period_ns;
			}
			ck_assert_int_eq(tokenbucket_create_limit(&set[i], &lim, 0), 0);
		}
		int64_t now = T0;
		for (int step = 0; step < 50; step++) {
			/* Steps below 2^56 ns: 50 of them stay far below INT64_MAX. */
			now += (int64_t)(next_random(&rnd) % (1 + (next_random(&rnd) >> (next_random(&rnd) % 56 + 8))));
			uint64_t n = next_random(&rnd) % (least < 4 ? least + 1 : 4);
			struct tokenbucket_set_result res;
			ck_assert_int_eq(tokenbucket_allow_all_at(set, count, now, n, &res), 0);
			if (!res.allowed)
				continue;
			int64_t latest = 0, first = 0;
			for (size_t i = 0; i < count; i++) {
				struct tokenbucket_result one;
				ck_assert_int_eq(tokenbucket_allow_result_at(set[i], now, 0, &one), 0);
				fold_reset(i, one.reset_after_ns, &latest, &first, &distinct);
			}
			ck_assert_int_eq(res.reset_after_ns, latest);
			checked++;
		}
		for (size_t i = 0; i < count; i++)
			tokenbucket_free(set[i]);
	}
	ck_assert_uint_gt(checked, 5000);
	ck_assert_uint_gt(distinct, 1000);
}
END_TEST

START_TEST(sequential_matches_single_calls)
{
	struct tokenbucket *set[3], *twin[3];
	for (int i = 0; i < 3; i++) {
		ck_assert_int_eq(tokenbucket_create_limit(&set[i], &model_limits[i], 0), 0);
		ck_assert_int_eq(tokenbucket_create_limit(&twin[i], &model_limits[i], 0), 0);
	}
	uint64_t rnd = 0x853c49e6748fea9bu;
	int64_t now = T0;
	uint64_t allowed = 0, refused = 0;
	for (int step = 0; step < 20000; step++) {
		now += (int64_t)(next_random(&rnd) % (3 * MS));
		uint64_t n = next_random(&rnd) % 6;
		struct tokenbucket_reservation r[3], tr[3];
		switch (next_random(&rnd) % 5) {
		case 0:
		case 1: {
			struct tokenbucket_set_result res;
			ck_assert_int_eq(tokenbucket_allow_all_at(set, 3, now, n, &res), 0);
			bool all = true;
			for (int i = 0; i < 3; i++)
				all &= tokenbucket_tokens_at(twin[i], now) >= (double)n;
			for (int i = 0; all && i < 3; i++)
				ck_assert(tokenbucket_allow_at(twin[i], now, n));
			ck_assert_int_eq(res.allowed, all);
			if (all)
				allowed++;
			else
				refused++;
			break;
		}
		case 2: {
			int k = (int)(next_random(&rnd) % 3);
			ck_assert_int_eq(tokenbucket_allow_at(set[k], now, n),
					 tokenbucket_allow_at(twin[k], now, n));
			break;
		}
		case 3:
		case 4: {
			int64_t waits[] = { 0, 2 * MS, 20 * MS };
			int64_t max_wait = waits[next_random(&rnd) % 3];
			int err = tokenbucket_reserve_all_at(set, 3, now, n, max_wait, r);
			ck_assert_int_eq(err, twin_reserve(twin, now, n, max_wait, tr));
			if (err == 0 && (next_random(&rnd) & 1)) {
				ck_assert_int_eq(tokenbucket_cancel_all_at(set, 3, now, r), 0);
				for (int i = 0; i < 3; i++)
					tokenbucket_cancel_at(twin[i], &tr[i], now);
			}
			break;
		}
		}
		for (int i = 0; i < 3; i++)
			ck_assert_msg(tokenbucket_tokens_at(set[i], now) ==
					      tokenbucket_tokens_at(twin[i], now),
				      "step %d bucket %d: %g, twin %g", step, i,
				      tokenbucket_tokens_at(set[i], now),
				      tokenbucket_tokens_at(twin[i], now));
	}
	ck_assert_uint_gt(allowed, 100);
	ck_assert_uint_gt(refused, 100);
	for (int i = 0; i < 3; i++) {
		tokenbucket_free(set[i]);
		tokenbucket_free(twin[i]);
	}
}
END_TEST

/* ---- wait_all: generous margins, the clock is real ------------------------ */

#define MARGIN (2 * SEC)

START_TEST(wait_sleeps_until_all)
{
	int64_t start = tokenbucket_now();
	struct tokenbucket *a = bucket_empty_at(1, 10 * MS, 5, 0, start);
	struct tokenbucket *b = bucket_every(1, SEC, 5, 0);
	struct tokenbucket *set[] = { b, a };
	ck_assert_int_eq(tokenbucket_wait_all(set, 2, 2, TOKENBUCKET_NEVER, -1), 0);
	int64_t took = tokenbucket_now() - start;
	ck_assert_int_ge(took, 20 * MS);
	ck_assert_int_lt(took, MARGIN);
	ck_assert_double_lt(tokenbucket_tokens(b), 4); /* 3 left, plus what a few ms made */
	/*
	 * A deadline too close: -ETIMEDOUT at once, and nothing taken.  The
	 * short bucket makes 1 token a second, so that no slowness between
	 * the calls (valgrind) can fill it before the deadline.
	 */
	struct tokenbucket *c = bucket_empty_at(1, SEC, 5, 0, tokenbucket_now());
	struct tokenbucket *late[] = { b, c };
	int64_t before = tokenbucket_now();
	ck_assert_int_eq(tokenbucket_wait_all(late, 2, 3, before + 5 * MS, -1), -ETIMEDOUT);
	ck_assert_int_lt(tokenbucket_now() - before, MARGIN);
	ck_assert_double_ge(tokenbucket_tokens(b), 3);
	ck_assert_double_ge(tokenbucket_tokens(c), 0);
	tokenbucket_free(a);
	tokenbucket_free(b);
	tokenbucket_free(c);
}
END_TEST

struct closer {
	int fd;
	int64_t after;
};

static void *write_later(void *arg)
{
	struct closer *c = arg;
	struct timespec ts = { 0, (long)c->after };
	nanosleep(&ts, NULL);
	ck_assert_int_eq(write(c->fd, "x", 1), 1);
	return NULL;
}

START_TEST(wait_cancelled_gives_back)
{
	int64_t start = tokenbucket_now();
	struct tokenbucket *a = bucket_empty_at(1, 10 * SEC, 5, 0, start);
	struct tokenbucket *b = bucket_every(0, 1, 5, 0);
	struct tokenbucket *set[] = { b, a };
	int fds[2];
	ck_assert_int_eq(pipe(fds), 0);
	struct closer c = { fds[1], 50 * MS };
	pthread_t t;
	ck_assert_int_eq(pthread_create(&t, NULL, write_later, &c), 0);
	ck_assert_int_eq(tokenbucket_wait_all(set, 2, 3, TOKENBUCKET_NEVER, fds[0]), -ECANCELED);
	int64_t took = tokenbucket_now() - start;
	pthread_join(t, NULL);
	ck_assert_int_ge(took, 50 * MS);
	ck_assert_int_lt(took, MARGIN);
	/* Every bucket got back what it gave: b (rate 0) exactly, a its level. */
	ck_assert_tokens(tokenbucket_tokens(b), 5);
	double level = tokenbucket_tokens(a);
	ck_assert_double_ge(level, 0);
	ck_assert_double_lt(level, 1);
	close(fds[0]);
	close(fds[1]);
	tokenbucket_free(a);
	tokenbucket_free(b);
}
END_TEST

/* ---- 8 threads on overlapping sets ---------------------------------------- */

enum { THREADS = 8, BUCKETS = 6 };

static const struct tokenbucket_limit stress_limits[BUCKETS] = {
	{ 1, 7000, 5 },	 { 1, 1000, 20 }, { 1, 3000, 8 },
	{ 2, 5000, 30 }, { 3, 13000, 50 }, { 1, 11000, 12 },
};

struct set_stress {
	struct tokenbucket *tb[BUCKETS];
	_Atomic int64_t clock; /* the fake clock: only grows */
	atomic_uint_fast64_t granted[BUCKETS];
	atomic_uint_fast64_t allowed, refused, cancelled;
	int64_t until; /* on tokenbucket_now() */
};

struct set_worker {
	struct set_stress *s;
	int id;
};

static uint64_t next_random(uint64_t *x)
{
	*x ^= *x << 13;
	*x ^= *x >> 7;
	*x ^= *x << 17;
	return *x;
}

static void *set_worker(void *arg)
{
	struct set_worker *w = arg;
	struct set_stress *s = w->s;
	uint64_t rnd = 0x9e3779b97f4a7c15u * (uint64_t)(w->id + 1);
	/*
	 * Sets of 3 or 4 buckets, overlapping, in an order of their own.  Bucket
	 * 0, the slowest, is in every set (at a place of the thread's own), so
	 * that it is the bottleneck and its bound is reached: a give-back of one
	 * token too many shows there.
	 */
	size_t count = 3 + (size_t)(w->id & 1), idx[4];
	struct tokenbucket *set[4];
	for (size_t i = 0; i < count; i++) {
		idx[i] = 1 + ((size_t)w->id + i * (size_t)(1 + w->id % 3)) % (BUCKETS - 1);
		for (size_t j = 0; j < i; j++)
			if (idx[j] == idx[i])
				idx[i] = 1 + idx[i] % (BUCKETS - 1), j = (size_t)-1;
	}
	idx[(size_t)w->id % count] = 0;
	for (size_t i = 0; i < count; i++)
		set[i] = s->tb[idx[i]];
	for (uint64_t calls = 0;; calls++) {
		if ((calls & 255) == 0 && tokenbucket_now() > s->until)
			break;
		int64_t step = (int64_t)(next_random(&rnd) % 2001);
		int64_t now = atomic_fetch_add(&s->clock, step) + step;
		uint64_t n = 1 + next_random(&rnd) % 3;
		uint64_t what = next_random(&rnd) % 4;
		bool got = false;
		if (what < 2) {
			struct tokenbucket_set_result res;
			ck_assert_int_eq(tokenbucket_allow_all_at(set, count, now, n, &res), 0);
			got = res.allowed;
			if (!got)
				ck_assert_uint_lt(res.index, count);
		} else {
			struct tokenbucket_reservation r[4];
			int err = tokenbucket_reserve_all_at(set, count, now, n, 0, r);
			if (err != 0) {
				ck_assert_int_eq(err, -ETIMEDOUT);
			} else if (what == 2) {
				/* Changed its mind: everything goes back. */
				ck_assert_int_eq(tokenbucket_cancel_all_at(set, count, now, r), 0);
				atomic_fetch_add(&s->cancelled, 1);
			} else {
				got = true;
			}
		}
		if (got) {
			for (size_t i = 0; i < count; i++)
				atomic_fetch_add(&s->granted[idx[i]], n);
			atomic_fetch_add(&s->allowed, 1);
		} else if (what != 2) {
			atomic_fetch_add(&s->refused, 1);
		}
	}
	return NULL;
}

START_TEST(threads_never_over_grant)
{
	static struct set_stress s;
	memset(&s, 0, sizeof(s));
	for (int i = 0; i < BUCKETS; i++) {
		ck_assert_int_eq(tokenbucket_create_limit(&s.tb[i], &stress_limits[i], 0), 0);
		ck_assert_int_eq(tokenbucket_tokens_at(s.tb[i], T0), stress_limits[i].burst);
	}
	atomic_store(&s.clock, T0);
	s.until = tokenbucket_now() + (int64_t)(stress_seconds(1.0) * (double)SEC);
	struct set_worker w[THREADS];
	for (int i = 0; i < THREADS; i++)
		w[i] = (struct set_worker){ &s, i };
	run_each_thread(THREADS, set_worker, w, sizeof(w[0]));
	int64_t end = atomic_load(&s.clock);
	ck_assert_uint_gt(atomic_load(&s.allowed), 100);
	ck_assert_uint_gt(atomic_load(&s.refused), 100);
	ck_assert_uint_gt(atomic_load(&s.cancelled), 100);
	for (int i = 0; i < BUCKETS; i++) {
		const struct tokenbucket_limit *l = &stress_limits[i];
		/* Exact, in integers: burst + floor(elapsed * tokens / period). */
		uint64_t bound = limit_bound(l, end - T0);
		uint64_t granted = atomic_load(&s.granted[i]);
		ck_assert_msg(granted <= bound, "bucket %d granted %ju > %ju", i, (uintmax_t)granted,
			      (uintmax_t)bound);
		/* What it still holds was not granted either (drops only lower this). */
		int64_t held = whole(s.tb[i], end);
		ck_assert_int_ge(held, 0);
		ck_assert_msg(granted + (uint64_t)held <= bound, "bucket %d granted %ju + held %jd > %ju",
			      i, (uintmax_t)granted, (intmax_t)held, (uintmax_t)bound);
		/* Taken from, and not idle: the bound was approached. */
		ck_assert_uint_gt(granted, 100);
		/* Nothing lost for good: after a quiet period each bucket is full again. */
		int64_t refill = limit_refill(l);
		ck_assert_tokens(tokenbucket_tokens_at(s.tb[i], end + refill), (double)l->burst);
		ck_assert(tokenbucket_allow_at(s.tb[i], end + refill, l->burst));
		ck_assert(!tokenbucket_allow_at(s.tb[i], end + refill, 1));
		tokenbucket_free(s.tb[i]);
	}
}
END_TEST

/*
 * Conservation under contention: 8 threads on overlapping sets of 3 of 4
 * buckets and a fake clock, each call one of: a set allowed and kept; a
 * set reserved without waiting and kept; the same given back at once with
 * tokenbucket_refund; a set ending with x (rate 0, empty), which its take
 * refuses after the others' takes (reserve_all does not check first), so
 * every one of those gives back.  The buckets start half full and are
 * never full again, so the give-back rule (docs/core.md, "Giving back")
 * loses nothing and invents nothing: for each bucket, granted + level =
 * level at the start + production, exactly.  _i 0: rate 0; _i 1: one
 * token every microsecond.
 */
enum { CONSERVE_BURST = 1000000 };

struct conserve {
	struct tokenbucket *tb[4], *x;
	_Atomic int64_t clock;
	int64_t step_most; /* each call moves the fake clock by 0 to this */
	atomic_uint_fast64_t granted[4], refused;
	int64_t until;
};

static void *conserve_worker(void *arg)
{
	struct conserve *c = ((struct conserve **)arg)[0];
	uintptr_t id = (uintptr_t)((void **)arg)[1];
	size_t idx[3] = { id % 4, (id + 1) % 4, (id + 2) % 4 };
	struct tokenbucket *set[4] = { c->tb[idx[0]], c->tb[idx[1]], c->tb[idx[2]], c->x };
	uint64_t rnd = 0x2545f4914f6cdd1du * (id + 1);
	for (uint64_t calls = 0;; calls++) {
		if ((calls & 255) == 0 && tokenbucket_now() > c->until)
			break;
		int64_t step = c->step_most ? (int64_t)(next_random(&rnd) % (uint64_t)(c->step_most + 1)) : 0;
		int64_t now = atomic_fetch_add(&c->clock, step) + step;
		uint64_t n = 1 + next_random(&rnd) % 4, what = next_random(&rnd) % 8;
		struct tokenbucket_reservation r[4];
		struct tokenbucket_set_result res;
		bool kept = false;
		if (what == 0) {
			ck_assert_int_eq(tokenbucket_allow_all_at(set, 3, now, n, &res), 0);
			kept = res.allowed;
		} else if (what <= 2) {
			int err = tokenbucket_reserve_all_at(set, 3, now, n, 0, r);
			ck_assert(err == 0 || err == -ETIMEDOUT);
			if (err == 0 && what == 2)
				for (size_t i = 0; i < 3; i++)
					tokenbucket_refund(set[i], r[i].tokens);
			kept = err == 0 && what == 1;
		} else {
			ck_assert_int_eq(tokenbucket_reserve_all_at(set, 4, now, n, 0, r), -ETIMEDOUT);
			atomic_fetch_add(&c->refused, 1);
		}
		if (kept)
			for (size_t i = 0; i < 3; i++)
				atomic_fetch_add(&c->granted[idx[i]], n);
	}
	return NULL;
}

START_TEST(threads_conserve)
{
	static struct conserve c;
	memset(&c, 0, sizeof(c));
	uint64_t tokens = _i ? 1 : 0;
	int64_t period = _i ? 1000 : 1;
	c.step_most = _i ? 20 : 0;
	double start[4];
	for (int i = 0; i < 4; i++) {
		c.tb[i] = bucket_every(tokens, period, CONSERVE_BURST, 0);
		ck_assert(tokenbucket_allow_at(c.tb[i], T0, CONSERVE_BURST / 2 + (uint64_t)i));
		start[i] = tokenbucket_tokens_at(c.tb[i], T0);
	}
	c.x = bucket_every(0, 1, 100, 0);
	ck_assert(tokenbucket_allow_at(c.x, T0, 100));
	atomic_store(&c.clock, T0);
	c.until = tokenbucket_now() + (int64_t)(stress_seconds(1.0) / 2 * (double)SEC);
	pthread_t t[THREADS];
	void *args[THREADS][2];
	for (uintptr_t i = 0; i < THREADS; i++) {
		args[i][0] = &c;
		args[i][1] = (void *)i;
		ck_assert_int_eq(pthread_create(&t[i], NULL, conserve_worker, args[i]), 0);
	}
	for (int i = 0; i < THREADS; i++)
		pthread_join(t[i], NULL);
	ck_assert_uint_gt(atomic_load(&c.refused), 1000);
	int64_t end = atomic_load(&c.clock);
	double made = (double)(end - T0) * (double)tokens / (double)period;
	for (int i = 0; i < 4; i++) {
		uint64_t granted = atomic_load(&c.granted[i]);
		double left = tokenbucket_tokens_at(c.tb[i], end);
		ck_assert_uint_gt(granted, 100);
		ck_assert_msg(fabs((double)granted + left - start[i] - made) < 1e-6,
			      "bucket %d: granted %ju + left %.6f != %.6f + made %.6f", i,
			      (uintmax_t)granted, left, start[i], made);
		tokenbucket_free(c.tb[i]);
	}
	tokenbucket_free(c.x);
}
END_TEST

Suite *set_suite(void)
{
	Suite *s = suite_create("set");
	TCase *tc = tcase_create("set");
	tcase_add_test(tc, all_or_none);
	tcase_add_test(tc, which_refused_and_when);
	tcase_add_test(tc, refusal_gives_back_exactly);
	tcase_add_test(tc, reserve_acts_at_the_latest);
	tcase_add_test(tc, cancel_gives_back_all);
	tcase_add_test(tc, give_back_after_other_takes);
	tcase_add_test(tc, every_errno);
	tcase_add_test(tc, shared_buckets);
	tcase_add_test(tc, sequential_matches_single_calls);
	tcase_add_test(tc, allowed_reset_is_the_latest_bucket);
	suite_add_tcase(s, tc);
	TCase *w = tcase_create("set-wait");
	tcase_set_timeout(w, 30);
	tcase_add_test(w, wait_sleeps_until_all);
	tcase_add_test(w, wait_cancelled_gives_back);
	suite_add_tcase(s, w);
	TCase *t = tcase_create("set-threads");
	tcase_set_timeout(t, 60);
	tcase_add_test(t, threads_never_over_grant);
	tcase_add_loop_test(t, threads_conserve, 0, 2);
	suite_add_tcase(s, t);
	return s;
}
