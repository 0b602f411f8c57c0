/* SPDX-License-Identifier: MIT */
/*
 * Several limits per key (1.2): tokenbucket_table_allow_all.  All or none
 * per key, which table refused and when all will allow, exact give-backs
 * and the documented cases that give nothing, every errno, memory per key,
 * tables shared with a forked process, hostile shared bytes, and 8 threads
 * on overlapping sets of tables and keys with a shared fake clock: no
 * key's bucket in any table ever grants more than burst + what the rate
 * produced, counted in integers.
 */
#include <pthread.h>
#include <stdalign.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check_tb.h"
#include "storm.h"
#include "table.h"

#define T0 (1000 * SEC)

static struct tokenbucket_table *tset_table(uint64_t tokens, int64_t period_ns, uint64_t burst,
					    uint64_t capacity, unsigned flags)
{
	struct tokenbucket_table *t = NULL;
	ck_assert_int_eq(tokenbucket_table_create(&t, tokens, period_ns, burst, capacity, flags), 0);
	/* Every table's origin at T0, so that the bounds below count from there. */
	ck_assert(tokenbucket_table_allow_at(t, T0, "", 0, 0));
	return t;
}

/* Whole tokens the key holds at now (rounded down; negative in debt). */
static int64_t held(struct tokenbucket_table *t, int64_t now, const char *key)
{
	return (int64_t)floor(tokenbucket_table_tokens_at(t, now, key, strlen(key)));
}

static int allow_all(struct tokenbucket_table **tables, size_t count, int64_t now, const char *key,
		     uint64_t n, struct tokenbucket_set_result *res)
{
	return tokenbucket_table_allow_all_at(tables, count, now, key, strlen(key), n, res);
}

START_TEST(all_or_none_per_key)
{
	struct tokenbucket_table *a = tset_table(0, 1, 10, 64, 0), *b = tset_table(0, 1, 3, 64, 0);
	struct tokenbucket_table *set[] = { a, b };
	struct tokenbucket_set_result res;
	ck_assert_int_eq(allow_all(set, 2, T0, "k", 2, &res), 0);
	ck_assert(res.allowed);
	ck_assert_uint_eq(res.index, 1); /* the fewest left: b, 1 */
	ck_assert_uint_eq(res.limit, 3);
	ck_assert_uint_eq(res.remaining, 1);
	ck_assert_int_eq(res.retry_after_ns, 0);
	ck_assert_int_eq(res.reset_after_ns, TOKENBUCKET_NEVER);
	ck_assert_uint_eq(res.flags, 0);
	ck_assert_int_eq(held(a, T0, "k"), 8);
	ck_assert_int_eq(held(b, T0, "k"), 1);
	/* b holds 1 for k: nothing taken from a either (refused by the check). */
	ck_assert_int_eq(allow_all(set, 2, T0, "k", 2, &res), 0);
	ck_assert(!res.allowed);
	ck_assert_uint_eq(res.index, 1);
	ck_assert_uint_eq(res.limit, 3);
	ck_assert_uint_eq(res.remaining, 1);
	ck_assert_int_eq(res.retry_after_ns, TOKENBUCKET_NEVER);
	ck_assert_int_eq(held(a, T0, "k"), 8);
	ck_assert_int_eq(held(b, T0, "k"), 1);
	/* b first: refused by b's take, a untouched. */
	struct tokenbucket_table *rev[] = { b, a };
	ck_assert_int_eq(allow_all(rev, 2, T0, "k", 2, &res), 0);
	ck_assert(!res.allowed);
	ck_assert_uint_eq(res.index, 0);
	ck_assert_int_eq(held(a, T0, "k"), 8);
	ck_assert_int_eq(held(b, T0, "k"), 1);
	/* Another key is another bucket in each table. */
	ck_assert_int_eq(allow_all(set, 2, T0, "other", 3, &res), 0);
	ck_assert(res.allowed);
	ck_assert_int_eq(held(a, T0, "other"), 7);
	ck_assert_int_eq(held(b, T0, "other"), 0);
	/* A set of one is the table alone; n 0 is allowed and takes nothing. */
	ck_assert_int_eq(allow_all(set, 1, T0, "k", 8, &res), 0);
	ck_assert(res.allowed);
	ck_assert_uint_eq(res.remaining, 0);
	ck_assert_int_eq(allow_all(set, 2, T0, "k", 0, &res), 0);
	ck_assert(res.allowed);
	ck_assert_int_eq(held(a, T0, "k"), 0);
	ck_assert_int_eq(held(b, T0, "k"), 1);
	tokenbucket_table_free(a);
	tokenbucket_table_free(b);
}
END_TEST

START_TEST(which_refused_and_when)
{
	/* a: 1 token a ms, burst 10; b: 1 every 10 ms, burst 5. */
	struct tokenbucket_table *a = tset_table(1, MS, 10, 64, 0);
	struct tokenbucket_table *b = tset_table(1, 10 * MS, 5, 64, 0);
	struct tokenbucket_table *set[] = { b, a };
	struct tokenbucket_set_result res;
	ck_assert(tokenbucket_table_allow_at(a, T0, "k", 1, 10));
	ck_assert_int_eq(allow_all(set, 2, T0, "k", 3, &res), 0);
	ck_assert(!res.allowed);
	ck_assert_uint_eq(res.index, 1);
	ck_assert_uint_eq(res.limit, 10);
	ck_assert_uint_eq(res.remaining, 0);
	ck_assert_int_eq(res.retry_after_ns, 3 * MS);
	ck_assert_int_eq(res.reset_after_ns, 10 * MS);
	ck_assert_int_eq(held(b, T0, "k"), 5);
	/* b short too: the wait is the latest, b's 20 ms; the first found short is reported. */
	ck_assert(tokenbucket_table_allow_at(b, T0, "k", 1, 4));
	ck_assert_int_eq(allow_all(set, 2, T0, "k", 3, &res), 0);
	ck_assert(!res.allowed);
	ck_assert_uint_eq(res.index, 1);
	ck_assert_int_eq(res.retry_after_ns, 20 * MS);
	ck_assert_int_eq(res.reset_after_ns, 40 * MS);
	/* Then every table allows. */
	ck_assert_int_eq(allow_all(set, 2, T0 + 20 * MS, "k", 3, &res), 0);
	ck_assert(res.allowed);
	ck_assert_int_eq(held(a, T0 + 20 * MS, "k"), 7);
	ck_assert_int_eq(held(b, T0 + 20 * MS, "k"), 0);
	ck_assert_uint_eq(res.index, 0); /* b: the fewest left */
	ck_assert_uint_eq(res.remaining, 0);
	tokenbucket_table_free(a);
	tokenbucket_table_free(b);
}
END_TEST

static struct tbt_mem *tset_placed(uint64_t tokens, int64_t period_ns, uint64_t burst,
				   uint64_t capacity, unsigned flags, struct tokenbucket_table **tp)
{
	size_t size = tokenbucket_table_size(capacity);
	void *mem = aligned_alloc(TOKENBUCKET_TABLE_ALIGN, size);
	ck_assert_ptr_nonnull(mem);
	ck_assert_int_eq(tokenbucket_table_init_shared(tp, mem, size, tokens, period_ns, burst,
						       capacity, flags),
			 0);
	ck_assert(tokenbucket_table_allow_at(*tp, T0, "", 0, 0));
	return mem;
}

/*
 * Refused by the second table's take (no slot for a new key, fail closed:
 * the check cannot see that), the first gives back exactly what it gave,
 * fractions included.
 */
START_TEST(refusal_gives_back_exactly)
{
	struct tokenbucket_table *a;
	struct tbt_mem *ma = tset_placed(1, 3, 100, 4, 0, &a);
	struct tokenbucket_table *b = tset_table(1, MS, 50, 4, 0);
	/* Four live keys fill b (one bucket of four slots). */
	for (int i = 0; i < 4; i++) {
		char key[2] = { (char)('0' + i), 0 };
		ck_assert(tokenbucket_table_allow_at(b, T0, key, 1, 1));
	}
	struct tokenbucket_table *set[] = { a, b };
	struct tokenbucket_set_result res;
	ck_assert(tokenbucket_table_allow_at(a, T0, "k", 1, 60));
	int64_t now = T0 + 7; /* a's key: 40 + 7/3 tokens */
	double before = tokenbucket_table_tokens_at(a, now, "k", 1);
	ck_assert_tokens(before, 40 + 7.0 / 3);
	ck_assert_int_eq(allow_all(set, 2, now, "k", 30, &res), 0);
	ck_assert(!res.allowed);
	ck_assert_uint_eq(res.index, 1);
	ck_assert_uint_eq(res.limit, 50);
	ck_assert_int_eq(res.retry_after_ns, 50 * MS); /* a slot frees within a refill */
	ck_assert(tokenbucket_table_tokens_at(a, now, "k", 1) == before);
	/* A refund is the same rule: exact whatever the time, never above burst. */
	struct tokenbucket_reservation r;
	ck_assert_int_eq(tokenbucket_table_reserve_at(a, now, "k", 1, 30, 0, &r), 0);
	ck_assert_int_eq(tokenbucket_table_refund_at(a, now + 1, "k", 1, 30), 0);
	ck_assert_tokens(tokenbucket_table_tokens_at(a, now + 1, "k", 1), before + 1.0 / 3);
	ck_assert_int_eq(tokenbucket_table_refund_at(a, now + 1, "k", 1, 1000), 0);
	ck_assert_tokens(tokenbucket_table_tokens_at(a, now + 1, "k", 1), 100);
	/* Go's cancel past time_to_act gives nothing; the refund still does. */
	ck_assert_int_eq(tokenbucket_table_reserve_at(a, now + 1, "k", 1, 30, 0, &r), 0);
	tokenbucket_table_cancel_at(a, "k", 1, &r, now + 2);
	ck_assert_tokens(tokenbucket_table_tokens_at(a, now + 2, "k", 1), 71);
	ck_assert_int_eq(tokenbucket_table_refund_at(a, now + 2, "k", 1, 30), 0);
	ck_assert_tokens(tokenbucket_table_tokens_at(a, now + 2, "k", 1), 100);
	/* b passes new keys open: it takes nothing for them, a takes. */
	tokenbucket_table_free(b);
	b = tset_table(1, MS, 50, 4, TOKENBUCKET_TABLE_FAIL_OPEN);
	for (int i = 0; i < 4; i++) {
		char key[2] = { (char)('0' + i), 0 };
		ck_assert(tokenbucket_table_allow_at(b, T0, key, 1, 1));
	}
	set[1] = b;
	ck_assert_int_eq(allow_all(set, 2, now, "k", 3, &res), 0);
	ck_assert(res.allowed);
	ck_assert_tokens(tokenbucket_table_tokens_at(a, now + 2, "k", 1), 97);
	tokenbucket_table_free(a);
	tokenbucket_table_free(b);
	free(ma);
}
END_TEST

START_TEST(every_errno)
{
	struct tokenbucket_table *a = tset_table(1, MS, 10, 64, 0), *b = tset_table(1, MS, 4, 64, 0);
	struct tokenbucket_table *set[TOKENBUCKET_SET_MAX + 1] = { a, b };
	struct tokenbucket_set_result res, untouched;
	memset(&untouched, 0x5a, sizeof(untouched));
	res = untouched;
	const char *k = "k";
	ck_assert_int_eq(tokenbucket_table_allow_all_at(set, 2, T0, k, 1, 1, NULL), -EINVAL);
	ck_assert_int_eq(tokenbucket_table_allow_all_at(NULL, 2, T0, k, 1, 1, &res), -EINVAL);
	ck_assert_int_eq(tokenbucket_table_allow_all_at(set, 0, T0, k, 1, 1, &res), -EINVAL);
	ck_assert_int_eq(tokenbucket_table_allow_all_at(set, 3, T0, k, 1, 1, &res), -EINVAL);
	ck_assert_int_eq(tokenbucket_table_allow_all_at(set, 2, T0, NULL, 1, 1, &res), -EINVAL);
	for (size_t i = 2; i <= TOKENBUCKET_SET_MAX; i++)
		set[i] = a;
	ck_assert_int_eq(tokenbucket_table_allow_all_at(set, TOKENBUCKET_SET_MAX + 1, T0, k, 1, 1,
							&res),
			 -EINVAL);
	/* The same table twice is one limit. */
	ck_assert_int_eq(tokenbucket_table_allow_all_at(set, 3, T0, k, 1, 1, &res), -EINVAL);
	/* n above a burst: nothing taken. */
	ck_assert_int_eq(tokenbucket_table_allow_all_at(set, 2, T0, k, 1, 5, &res), -E2BIG);
	ck_assert_int_eq(tokenbucket_table_allow_all(set, 2, k, 1, 11, &res), -E2BIG);
	ck_assert(memcmp(&res, &untouched, sizeof(res)) == 0);
	ck_assert_int_eq(held(a, T0, k), 10);
	/* A key of length 0 may be NULL. */
	ck_assert_int_eq(tokenbucket_table_allow_all_at(set, 2, T0, NULL, 0, 1, &res), 0);
	ck_assert(res.allowed);
	tokenbucket_table_free(b);
	/* Two handles on one table's memory are one table. */
	struct tbt_mem *m = tset_placed(1, MS, 4, 64, 0, &b);
	struct tokenbucket_table *b2;
	ck_assert_int_eq(tokenbucket_table_attach_shared(&b2, m, tokenbucket_table_size(64)), 0);
	struct tokenbucket_table *twice[] = { a, b, b2 };
	res = untouched;
	ck_assert_int_eq(tokenbucket_table_allow_all_at(twice, 3, T0, k, 1, 1, &res), -EINVAL);
	/* The same table mapped at two addresses is one table too (the same secret). */
	int fd = memfd_create("tset", 0);
	size_t size = tokenbucket_table_size(64);
	ck_assert_int_ge(fd, 0);
	ck_assert_int_eq(ftruncate(fd, (off_t)size), 0);
	void *m1 = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	void *m2 = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	ck_assert(m1 != MAP_FAILED && m2 != MAP_FAILED && m1 != m2);
	struct tokenbucket_table *two[2];
	ck_assert_int_eq(tokenbucket_table_init_shared(&two[0], m1, size, 1, MS, 4, 64, 0), 0);
	ck_assert_int_eq(tokenbucket_table_attach_shared(&two[1], m2, size), 0);
	ck_assert_int_eq(tokenbucket_table_allow_all_at(two, 2, T0, k, 1, 1, &res), -EINVAL);
	for (int i = 0; i < 2; i++)
		tokenbucket_table_free(two[i]);
	munmap(m1, size);
	munmap(m2, size);
	close(fd);
	/* A regime no table holds, written by another process: -EBADMSG, nothing taken from a. */
	double level = tokenbucket_table_tokens_at(a, T0, k, 1);
	atomic_store(&m->regimes.slot[0].q, 0);
	ck_assert_int_eq(tokenbucket_table_allow_all_at(twice, 2, T0, k, 1, 1, &res), -EBADMSG);
	struct tokenbucket_table *after[] = { b2, a };
	ck_assert_int_eq(tokenbucket_table_allow_all_at(after, 2, T0, k, 1, 1, &res), -EBADMSG);
	ck_assert(memcmp(&res, &untouched, sizeof(res)) == 0);
	ck_assert(tokenbucket_table_tokens_at(a, T0, k, 1) == level);
	tokenbucket_table_free(b2);
	tokenbucket_table_free(b);
	free(m);
	tokenbucket_table_free(a);
}
END_TEST

/* A key uses one 32-byte slot in each table: memory per key is count x 32 bytes. */
START_TEST(memory_per_key)
{
	enum { KEYS = 300, CAP = 1024 };
	ck_assert_uint_eq(tokenbucket_table_size(2 * CAP) - tokenbucket_table_size(CAP),
			  CAP * sizeof(struct tbt_slot));
	ck_assert_uint_eq(sizeof(struct tbt_slot), 32);
	struct tokenbucket_table *set[3] = { tset_table(10, SEC, 10, CAP, 0),
					     tset_table(1000, 3600 * SEC, 1000, CAP, 0),
					     tset_table(1, MS, 5, CAP, 0) };
	struct tokenbucket_set_result res;
	for (uint64_t k = 0; k < KEYS; k++) {
		ck_assert_int_eq(tokenbucket_table_allow_all_at(set, 3, T0, &k, sizeof(k), 1, &res),
				 0);
		ck_assert(res.allowed);
	}
	for (int i = 0; i < 3; i++) {
		struct tokenbucket_table_stats st;
		ck_assert_int_eq(tokenbucket_table_stats(set[i], &st), 0);
		ck_assert_uint_eq(st.in_use, KEYS);
		tokenbucket_table_free(set[i]);
	}
}
END_TEST

/* Two tables in MAP_SHARED memory: a forked process decides keys on both. */
START_TEST(shared_with_a_process)
{
	size_t size = tokenbucket_table_size(64);
	void *ma = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	void *mb = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	ck_assert(ma != MAP_FAILED && mb != MAP_FAILED);
	struct tokenbucket_table *set[2];
	ck_assert_int_eq(tokenbucket_table_init_shared(&set[0], ma, size, 0, 1, 10, 64, 0), 0);
	ck_assert_int_eq(tokenbucket_table_init_shared(&set[1], mb, size, 0, 1, 4, 64, 0), 0);
	pid_t pid = fork();
	ck_assert_int_ge(pid, 0);
	if (pid == 0) {
		struct tokenbucket_table *c[2];
		struct tokenbucket_set_result res;
		int ok = tokenbucket_table_attach_shared(&c[0], ma, size) == 0 &&
			 tokenbucket_table_attach_shared(&c[1], mb, size) == 0 &&
			 allow_all(c, 2, T0, "k", 3, &res) == 0 && res.allowed &&
			 allow_all(c, 2, T0, "k", 3, &res) == 0 && !res.allowed && res.index == 1;
		_exit(ok ? 0 : 1);
	}
	int status;
	ck_assert_int_eq(waitpid(pid, &status, 0), pid);
	ck_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0);
	ck_assert_int_eq(held(set[0], T0, "k"), 7);
	ck_assert_int_eq(held(set[1], T0, "k"), 1);
	struct tokenbucket_set_result res;
	ck_assert_int_eq(allow_all(set, 2, T0, "k", 1, &res), 0);
	ck_assert(res.allowed);
	ck_assert_int_eq(held(set[0], T0, "k"), 6);
	ck_assert_int_eq(held(set[1], T0, "k"), 0);
	tokenbucket_table_free(set[0]);
	tokenbucket_table_free(set[1]);
	munmap(ma, size);
	munmap(mb, size);
}
END_TEST

static uint64_t next_random(uint64_t *x)
{
	*x ^= *x << 13;
	*x ^= *x >> 7;
	*x ^= *x << 17;
	return *x;
}

/*
 * An allowed set's reset_after_ns is the latest of its tables' own, as
 * each reports it right after (allow_result_at of 0 at the same time):
 * rates from one token in years to 2^30 a ns, bursts to 2^40, ties of
 * equal rates in every other round, steps to 2^56 ns, keys in debt.
 */
START_TEST(allowed_reset_is_the_latest_table)
{
	uint64_t rnd = 0x9e3779b97f4a7c15u;
	uint64_t checked = 0, distinct = 0;
	for (int round = 0; round < 300; round++) {
		struct tokenbucket_table *set[4];
		struct tokenbucket_limit first_lim = { 0 };
		uint64_t least = UINT64_MAX; /* the least burst: n never passes it */
		size_t count = 2 + (size_t)(next_random(&rnd) % 3);
		for (size_t i = 0; i < count; i++) {
			struct tokenbucket_limit lim;
			do {
				lim = (struct tokenbucket_limit){
					.tokens = 1 + (next_random(&rnd) >> (next_random(&rnd) % 30 + 34)),
					.period_ns = (int64_t)(1 + (next_random(&rnd) >>
								    (next_random(&rnd) % 63 + 1))),
					.burst = 1 + (next_random(&rnd) >> (next_random(&rnd) % 40 + 24)),
				};
				if (i > 0 && (round & 1)) {
					lim.tokens = first_lim.tokens;
					lim.period_ns = first_lim.period_ns;
				}
			} while (tokenbucket_table_create_limit(&set[i], &lim, 64, 0) != 0);
			if (i == 0)
				first_lim = lim;
			if (lim.burst < least)
				least = lim.burst;
		}
		int64_t now = T0;
		for (int step = 0; step < 50; step++) {
			now += (int64_t)(next_random(&rnd) %
					 (1 + (next_random(&rnd) >> (next_random(&rnd) % 56 + 8))));
			uint64_t key = next_random(&rnd) % 3;
			uint64_t n = next_random(&rnd) % (least < 4 ? least + 1 : 4);
			struct tokenbucket_set_result res;
			ck_assert_int_eq(tokenbucket_table_allow_all_at(set, count, now, &key, sizeof(key),
									n, &res), 0);
			if (!res.allowed)
				continue;
			int64_t latest = 0, first = 0;
			for (size_t i = 0; i < count; i++) {
				struct tokenbucket_result one;
				ck_assert_int_eq(tokenbucket_table_allow_result_at(set[i], now, &key,
										   sizeof(key), 0, &one), 0);
				fold_reset(i, one.reset_after_ns, &latest, &first, &distinct);
			}
			ck_assert_int_eq(res.reset_after_ns, latest);
			checked++;
		}
		for (size_t i = 0; i < count; i++)
			tokenbucket_table_free(set[i]);
	}
	ck_assert_uint_gt(checked, 5000);
	ck_assert_uint_gt(distinct, 1000);
}
END_TEST

/* Random words in every slot of two shared tables: defined answers, never above burst. */
START_TEST(hostile_shared_bytes)
{
	struct tokenbucket_table *set[2], *u[2];
	struct tbt_mem *m[2] = { tset_placed(1, MS, 4, 16, 0, &set[0]),
				 tset_placed(0, 1, 6, 16, TOKENBUCKET_TABLE_EVICT, &set[1]) };
	size_t size = tokenbucket_table_size(16);
	for (int i = 0; i < 2; i++)
		ck_assert_int_eq(tokenbucket_table_attach_shared(&u[i], m[i], size), 0);
	uint64_t x = 0x2545f4914f6cdd1du;
	uint64_t decided = 0;
	for (int round = 0; round < 200; round++) {
		for (int i = 0; i < 2; i++)
			for (uint64_t l = 0; l < m[i]->header.h.lines; l++)
				for (int j = 0; j < 2; j++) {
					struct tbt_slot *s = &m[i]->line[l].slot[j];
					uint64_t r = next_random(&x);
					atomic_store(&s->state, r % 3 ? next_random(&x)
								      : r & ~(UINT64_C(1) << 56));
					atomic_store(&s->fp, next_random(&x));
					atomic_store(&s->clock, r % 2 ? (int64_t)next_random(&x) : T0);
					atomic_store(&s->spare, r % 5 ? next_random(&x) : 0);
				}
		for (int k = 0; k < 50; k++) {
			uint64_t key = next_random(&x) % 20;
			int64_t now = T0 + (int64_t)(next_random(&x) % SEC);
			struct tokenbucket_set_result res;
			int err = tokenbucket_table_allow_all_at(u, 2, now, &key, sizeof(key),
								 next_random(&x) % 5, &res);
			ck_assert(err == 0 || err == -EBADMSG);
			if (err == 0) {
				decided++;
				ck_assert_uint_lt(res.index, 2);
				ck_assert_uint_le(res.remaining, 6);
			}
			for (int i = 0; i < 2; i++) {
				double level = tokenbucket_table_tokens_at(u[i], now, &key, sizeof(key));
				ck_assert(isnan(level) || level <= (i ? 6 : 4));
			}
		}
	}
	ck_assert_uint_gt(decided, 0);
	for (int i = 0; i < 2; i++) {
		tokenbucket_table_free(u[i]);
		tokenbucket_table_free(set[i]);
		free(m[i]);
	}
}
END_TEST

/* ---- 8 threads on overlapping sets of tables and keys ----------------------- */

enum { THREADS = 8, TABLES = 5, KEYS = 3 };

static const struct tokenbucket_limit stress_limits[TABLES] = {
	{ 1, 7000, 5 }, { 1, 1000, 20 }, { 1, 3000, 8 }, { 2, 5000, 30 }, { 3, 13000, 50 },
};

struct tset_stress {
	struct tokenbucket_table *t[TABLES];
	struct tokenbucket_table *x; /* no slot for the keys: refuses every set after its takes */
	_Atomic int64_t clock; /* the fake clock: only grows */
	atomic_uint_fast64_t granted[TABLES][KEYS];
	atomic_uint_fast64_t allowed, refused, cancelled;
	int64_t until; /* on tokenbucket_now() */
};

struct tset_worker {
	struct tset_stress *s;
	int id;
};

static void *tset_worker(void *arg)
{
	struct tset_worker *w = arg;
	struct tset_stress *s = w->s;
	uint64_t rnd = 0x9e3779b97f4a7c15u * (uint64_t)(w->id + 1);
	/*
	 * Sets of 2 or 3 tables, overlapping, in an order of their own; table
	 * 0, the slowest, in every set at a place of the thread's own, so that
	 * it is the bottleneck and its bound is reached.
	 */
	size_t count = 2 + (size_t)(w->id & 1), idx[3];
	struct tokenbucket_table *set[4];
	for (size_t i = 0; i < count; i++)
		idx[i] = 1 + ((size_t)w->id + i) % (TABLES - 1);
	idx[(size_t)w->id % count] = 0;
	for (size_t i = 0; i < count; i++)
		set[i] = s->t[idx[i]];
	/*
	 * Two threads of eight end their sets with x: each of their calls takes
	 * from every table and gives back, beside the others' kept takes.
	 */
	size_t refusing = (w->id % 4 == 3) ? 1 : 0;
	set[count] = s->x;
	for (uint64_t calls = 0;; calls++) {
		if (calls > 0 && (calls & 1023) == 0 && tokenbucket_now() > s->until)
			break;
		int64_t step = (int64_t)(next_random(&rnd) % 2001);
		int64_t now = atomic_fetch_add(&s->clock, step) + step;
		uint64_t key = next_random(&rnd) % KEYS, n = 1 + next_random(&rnd) % 3;
		uint64_t what = next_random(&rnd) % 8;
		if (what < 6) {
			struct tokenbucket_set_result res;
			ck_assert_int_eq(tokenbucket_table_allow_all_at(set, count + refusing, now, &key,
									sizeof(key), n, &res),
					 0);
			ck_assert(!refusing || !res.allowed);
			if (res.allowed) {
				for (size_t i = 0; i < count; i++)
					atomic_fetch_add(&s->granted[idx[i]][key], n);
				atomic_fetch_add(&s->allowed, 1);
			} else {
				ck_assert_uint_lt(res.index, count + refusing);
				ck_assert_int_ge(res.retry_after_ns, 0); /* 0: a racing take refused it */
				atomic_fetch_add(&s->refused, 1);
			}
		} else {
			/* A reservation on one table, cancelled: the tail lowered under the sets. */
			size_t i = next_random(&rnd) % count;
			struct tokenbucket_reservation r;
			if (tokenbucket_table_reserve_at(set[i], now, &key, sizeof(key), n, 0, &r) ==
			    0) {
				tokenbucket_table_cancel_at(set[i], &key, sizeof(key), &r, now);
				atomic_fetch_add(&s->cancelled, 1);
			}
		}
	}
	return NULL;
}

START_TEST(threads_never_over_grant)
{
	static struct tset_stress s;
	memset(&s, 0, sizeof(s));
	for (int i = 0; i < TABLES; i++) {
		const struct tokenbucket_limit *l = &stress_limits[i];
		s.t[i] = tset_table(l->tokens, l->period_ns, l->burst, 64, 0);
	}
	s.x = tset_table(0, 1, 5, 4, 0);
	for (int i = 0; i < 4; i++) {
		char key[2] = { (char)('0' + i), 0 };
		ck_assert(tokenbucket_table_allow_at(s.x, T0, key, 1, 1));
	}
	atomic_store(&s.clock, T0);
	s.until = tokenbucket_now() + (int64_t)(stress_seconds(1.0) * (double)SEC);
	struct tset_worker w[THREADS];
	for (int i = 0; i < THREADS; i++)
		w[i] = (struct tset_worker){ &s, i };
	run_each_thread(THREADS, tset_worker, w, sizeof(w[0]));
	int64_t end = atomic_load(&s.clock);
	ck_assert_uint_gt(atomic_load(&s.allowed), 100);
	ck_assert_uint_gt(atomic_load(&s.refused), 100);
	ck_assert_uint_gt(atomic_load(&s.cancelled), 100);
	for (int i = 0; i < TABLES; i++) {
		const struct tokenbucket_limit *l = &stress_limits[i];
		/* Exact, in integers: burst + floor(elapsed * tokens / period) per key. */
		uint64_t bound = limit_bound(l, end - T0);
		int64_t refill = limit_refill(l);
		for (uint64_t k = 0; k < KEYS; k++) {
			uint64_t granted = atomic_load(&s.granted[i][k]);
			int64_t left = (int64_t)floor(
				tokenbucket_table_tokens_at(s.t[i], end, &k, sizeof(k)));
			ck_assert_int_ge(left, 0);
			ck_assert_msg(granted + (uint64_t)left <= bound,
				      "table %d key %ju granted %ju + held %jd > %ju", i,
				      (uintmax_t)k, (uintmax_t)granted, (intmax_t)left,
				      (uintmax_t)bound);
			/* Nothing lost for good: after a quiet period every key is full again. */
			ck_assert_tokens(
				tokenbucket_table_tokens_at(s.t[i], end + refill, &k, sizeof(k)),
				(double)l->burst);
		}
		/* The bottleneck's bound was approached. */
		if (i == 0)
			ck_assert_uint_gt(atomic_load(&s.granted[0][0]), l->burst);
		tokenbucket_table_free(s.t[i]);
	}
	tokenbucket_table_free(s.x);
}
END_TEST

/*
 * Conservation: threads deciding keys on overlapping sets, most of them
 * refused after a take: table x has no slot for the keys (four others fill
 * it, fail closed), which its check cannot see, so every set holding x
 * takes from the tables before it and gives back.  Beside them, sets of a
 * and b alone, kept, and reservations on a or b given back at once (Go's
 * cancel at the reservation's own time at rate 0, a refund at any rate).
 * The keys start half full and never fill again, so by the give-back rule
 * (docs/core.md, "Giving back") for every key granted + level = level at
 * the start + production, exactly.  _i 0: rate 0, every call at T0; _i 1:
 * a token every microsecond, on a fake clock that every call moves on.
 */
enum { CONSERVE_BURST = 100000 };

struct tset_conserve {
	struct tokenbucket_table *t[3]; /* a, b, and x */
	_Atomic int64_t clock;
	bool moving;
	atomic_uint_fast64_t granted[2][KEYS];
	atomic_uint_fast64_t refused, cancelled;
	int64_t until;
};

struct tset_conserver {
	struct tset_conserve *c;
	int id;
};

static void *tset_conserve_worker(void *arg)
{
	struct tset_conserver *w = arg;
	struct tset_conserve *c = w->c;
	uint64_t rnd = 0x2545f4914f6cdd1du * (uint64_t)(w->id + 1);
	struct tokenbucket_table *a = c->t[0], *b = c->t[1], *x = c->t[2];
	struct tokenbucket_table *sets[4][3] = { { a, b, x }, { b, x, a }, { a, x, b }, { b, a, x } };
	struct tokenbucket_table **set = sets[w->id % 4];
	for (uint64_t calls = 0;; calls++) {
		if (calls > 0 && (calls & 1023) == 0 && tokenbucket_now() > c->until)
			break;
		int64_t step = c->moving ? (int64_t)(next_random(&rnd) % 21) : 0;
		int64_t now = atomic_fetch_add(&c->clock, step) + step;
		uint64_t key = next_random(&rnd) % KEYS, n = 1 + next_random(&rnd) % 3;
		uint64_t what = next_random(&rnd) % 64;
		struct tokenbucket_set_result res;
		if (what == 0) {
			/* Now and then a and b alone: allowed, kept. */
			struct tokenbucket_table *ab[2] = { a, b };
			ck_assert_int_eq(tokenbucket_table_allow_all_at(ab, 2, now, &key, sizeof(key), n,
									&res),
					 0);
			if (res.allowed)
				for (int i = 0; i < 2; i++)
					atomic_fetch_add(&c->granted[i][key], n);
		} else if (what < 16) {
			/* A reservation on a or b, given back at once. */
			struct tokenbucket_table *t = what & 1 ? a : b;
			struct tokenbucket_reservation r;
			if (tokenbucket_table_reserve_at(t, now, &key, sizeof(key), n, 0, &r) == 0) {
				if (c->moving || (what & 2))
					ck_assert_int_eq(tokenbucket_table_refund_at(t, now, &key,
										     sizeof(key), n),
							 0);
				else
					tokenbucket_table_cancel_at(t, &key, sizeof(key), &r, now);
				atomic_fetch_add(&c->cancelled, 1);
			}
		} else {
			ck_assert_int_eq(tokenbucket_table_allow_all_at(set, 3, now, &key, sizeof(key),
									n, &res),
					 0);
			ck_assert(!res.allowed);
			ck_assert_ptr_eq(set[res.index], x);
			atomic_fetch_add(&c->refused, 1);
		}
	}
	return NULL;
}

START_TEST(threads_conserve)
{
	static struct tset_conserve c;
	memset(&c, 0, sizeof(c));
	uint64_t tokens = _i ? 1 : 0;
	int64_t period = _i ? 1000 : 1;
	c.moving = _i != 0;
	c.t[0] = tset_table(tokens, period, CONSERVE_BURST, 64, 0);
	c.t[1] = tset_table(tokens, period, CONSERVE_BURST, 64, 0);
	c.t[2] = tset_table(0, 1, 5, 4, 0);
	for (int i = 0; i < 4; i++) {
		char key[2] = { (char)('0' + i), 0 };
		ck_assert(tokenbucket_table_allow_at(c.t[2], T0, key, 1, 1));
	}
	double start[2][KEYS];
	for (int i = 0; i < 2; i++)
		for (uint64_t k = 0; k < KEYS; k++) {
			ck_assert(tokenbucket_table_allow_at(c.t[i], T0, &k, sizeof(k),
							     CONSERVE_BURST / 2 + k));
			start[i][k] = tokenbucket_table_tokens_at(c.t[i], T0, &k, sizeof(k));
		}
	atomic_store(&c.clock, T0);
	/* Every thread makes 1024 calls at least, however late it starts. */
	c.until = tokenbucket_now() + (int64_t)(stress_seconds(2.0) / 4 * (double)SEC);
	struct tset_conserver w[THREADS];
	for (int i = 0; i < THREADS; i++)
		w[i] = (struct tset_conserver){ &c, i };
	run_each_thread(THREADS, tset_conserve_worker, w, sizeof(w[0]));
	ck_assert_uint_gt(atomic_load(&c.refused), 1000);
	ck_assert_uint_gt(atomic_load(&c.cancelled), 100);
	int64_t end = atomic_load(&c.clock);
	double made = (double)(end - T0) * (double)tokens / (double)period;
	for (int i = 0; i < 2; i++)
		for (uint64_t k = 0; k < KEYS; k++) {
			uint64_t granted = atomic_load(&c.granted[i][k]);
			double left = tokenbucket_table_tokens_at(c.t[i], end, &k, sizeof(k));
			ck_assert_msg(fabs((double)granted + left - start[i][k] - made) < 1e-6,
				      "table %d key %ju: granted %ju + left %.6f != %.6f + made %.6f",
				      i, (uintmax_t)k, (uintmax_t)granted, left, start[i][k], made);
		}
	for (int i = 0; i < 3; i++)
		tokenbucket_table_free(c.t[i]);
}
END_TEST

/* ---- Processes killed at random ------------------------------------------ */

enum { STORM_PROCS = 4, STORM_KEYS = 8, STORM_BURST = 400 };

/* Three tables in one MAP_SHARED mapping, and what the processes count. */
struct tset_storm {
	_Atomic uint64_t granted[STORM_KEYS]; /* by sets of a and b: counted in both */
	_Atomic long calls;
	size_t size;                          /* of each table */
	alignas(TOKENBUCKET_TABLE_ALIGN) unsigned char mem[];
};

static _Noreturn void tset_storm_child(void *arg, unsigned seed)
{
	struct tset_storm *s = arg;
	struct tokenbucket_table *t[3];
	for (int i = 0; i < 3; i++)
		if (tokenbucket_table_attach_shared(&t[i], s->mem + (size_t)i * s->size, s->size))
			_exit(3);
	uint64_t x = seed * 2654435761u + 1;
	for (;;) {
		uint64_t key = next_random(&x) % STORM_KEYS, what = next_random(&x) % 8;
		struct tokenbucket_set_result res;
		if (what == 0) {
			struct tokenbucket_table *ab[2] = { t[0], t[1] };
			if (tokenbucket_table_allow_all_at(ab, 2, T0, &key, sizeof(key), 1, &res))
				_exit(4);
			if (res.allowed)
				atomic_fetch_add(&s->granted[key], 1);
		} else if (what == 1) {
			struct tokenbucket_reservation r;
			if (tokenbucket_table_reserve_at(t[key & 1], T0, &key, sizeof(key), 1, 0, &r) ==
			    0)
				tokenbucket_table_cancel_at(t[key & 1], &key, sizeof(key), &r, T0);
		} else {
			/* x, last or between, has no slot for the keys: a set that takes and gives back. */
			struct tokenbucket_table *set[3] = { t[what & 1], t[2], t[!(what & 1)] };
			if (what & 2) {
				set[1] = set[2];
				set[2] = t[2];
			}
			if (tokenbucket_table_allow_all_at(set, 3, T0, &key, sizeof(key), 1, &res) ||
			    res.allowed)
				_exit(5);
		}
		atomic_fetch_add(&s->calls, 1);
	}
}

/*
 * Rate 0: processes deciding keys on shared tables die at random instants
 * (inside takes, give-backs, cancels).  No key may ever hold more than its
 * burst less what it granted: a take that died before its give-back only
 * leaves it short.
 */
START_TEST(processes_killed_never_over_grant)
{
	size_t size = tokenbucket_table_size(64);
	struct tset_storm *s = mmap(NULL, sizeof(*s) + 3 * size, PROT_READ | PROT_WRITE,
				    MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	ck_assert(s != MAP_FAILED);
	s->size = size;
	struct tokenbucket_table *t[3];
	for (int i = 0; i < 2; i++)
		ck_assert_int_eq(tokenbucket_table_init_shared(&t[i], s->mem + (size_t)i * size, size,
							       0, 1, STORM_BURST, 64, 0),
				 0);
	ck_assert_int_eq(tokenbucket_table_init_shared(&t[2], s->mem + 2 * size, size, 0, 1, 5, 4,
						       0),
			 0);
	for (int i = 0; i < 4; i++) {
		char key[2] = { (char)('0' + i), 0 };
		ck_assert(tokenbucket_table_allow_at(t[2], T0, key, 1, 1));
	}
	pid_t pids[STORM_PROCS];
	for (int i = 0; i < STORM_PROCS; i++) {
		pids[i] = fork();
		TBT_FORKED(pids[i]);
		if (pids[i] == 0)
			tset_storm_child(s, (unsigned)i);
	}
	int kills = storm_run(pids, STORM_PROCS, &s->calls, 100, 20, 2626, STORM_PROCS,
			      tset_storm_child, s);
	ck_assert_int_ge(kills, 10);
	uint64_t granted = 0;
	for (uint64_t k = 0; k < STORM_KEYS; k++) {
		granted += atomic_load(&s->granted[k]);
		for (int i = 0; i < 2; i++) {
			double left = tokenbucket_table_tokens_at(t[i], T0, &k, sizeof(k));
			ck_assert_msg(atomic_load(&s->granted[k]) + left <= STORM_BURST,
				      "table %d key %ju granted %ju + held %g > %d", i, (uintmax_t)k,
				      (uintmax_t)atomic_load(&s->granted[k]), left, STORM_BURST);
			ck_assert(left >= 0);
		}
	}
	ck_assert_uint_gt(granted, 0);
	for (int i = 0; i < 3; i++)
		tokenbucket_table_free(t[i]);
	munmap(s, sizeof(*s) + 3 * size);
}
END_TEST

Suite *table_set_suite(void)
{
	Suite *s = suite_create("table-set");
	TCase *tc = tcase_create("set");
	tcase_add_test(tc, all_or_none_per_key);
	tcase_add_test(tc, which_refused_and_when);
	tcase_add_test(tc, refusal_gives_back_exactly);
	tcase_add_test(tc, every_errno);
	tcase_add_test(tc, memory_per_key);
	tcase_add_test(tc, shared_with_a_process);
	tcase_add_test(tc, hostile_shared_bytes);
	tcase_add_test(tc, allowed_reset_is_the_latest_table);
	suite_add_tcase(s, tc);
	TCase *t = tcase_create("threads");
	tcase_set_timeout(t, 120);
	tcase_add_test(t, threads_never_over_grant);
	tcase_add_loop_test(t, threads_conserve, 0, 2);
	tcase_add_test(t, processes_killed_never_over_grant);
	suite_add_tcase(s, t);
	return s;
}
