/* SPDX-License-Identifier: MIT */
/*
 * 1.2: exact limits (struct tokenbucket_limit), the entry points that take
 * them, the twins without _at, and a table's wait.  Exactness is checked
 * against the 1.0/1.1 _every forms: the same ratio must give the same
 * answers, bit for bit, on the same calls at the same times.
 */
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdalign.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check_tb.h"
#include "core.h"

typedef struct tokenbucket_limit limit_t;

static void assert_limit(const limit_t *l, uint64_t tokens, int64_t period_ns, uint64_t burst)
{
	ck_assert_uint_eq(l->tokens, tokens);
	ck_assert_int_eq(l->period_ns, period_ns);
	ck_assert_uint_eq(l->burst, burst);
}

static void name_for(char *buf, size_t size, const char *tag)
{
	snprintf(buf, size, "/tblimit.%s.%ld", tag, (long)getpid());
	tokenbucket_unlink(buf);
}

/* A small deterministic generator for call sequences. */
static uint64_t next_rand(uint64_t *s)
{
	*s ^= *s << 13;
	*s ^= *s >> 7;
	*s ^= *s << 17;
	return *s;
}

/*
 * The same calls at the same times on a and b, with every answer compared
 * exactly (doubles by their bits).
 */
static void same_answers(struct tokenbucket *a, struct tokenbucket *b, uint64_t burst,
			 int64_t step_max, uint64_t seed)
{
	int64_t now = 1000;
	for (int i = 0; i < 2000; i++) {
		now += (int64_t)(next_rand(&seed) % (uint64_t)step_max);
		uint64_t n = next_rand(&seed) % (burst + 1);
		switch (next_rand(&seed) % 4) {
		case 0:
			ck_assert_int_eq(tokenbucket_allow_at(a, now, n), tokenbucket_allow_at(b, now, n));
			break;
		case 1: {
			struct tokenbucket_reservation ra, rb;
			int ea = tokenbucket_reserve_at(a, now, n, 50 * MS, &ra);
			int eb = tokenbucket_reserve_at(b, now, n, 50 * MS, &rb);
			ck_assert_int_eq(ea, eb);
			if (ea == 0) {
				ck_assert_int_eq(ra.time_to_act, rb.time_to_act);
				ck_assert_uint_eq(ra.tokens, rb.tokens);
				ck_assert_uint_eq(ra.ticket, rb.ticket);
			}
			break;
		}
		case 2: {
			double ta = tokenbucket_tokens_at(a, now), tb = tokenbucket_tokens_at(b, now);
			ck_assert_mem_eq(&ta, &tb, sizeof(ta));
			break;
		}
		default: {
			struct tokenbucket_result x, y;
			ck_assert_int_eq(tokenbucket_allow_result_at(a, now, n, &x), 0);
			ck_assert_int_eq(tokenbucket_allow_result_at(b, now, n, &y), 0);
			/* Field by field: the padding after allowed is nobody's. */
			ck_assert_int_eq(x.allowed, y.allowed);
			ck_assert_uint_eq(x.flags, y.flags);
			ck_assert_uint_eq(x.limit, y.limit);
			ck_assert_uint_eq(x.remaining, y.remaining);
			ck_assert_int_eq(x.retry_after_ns, y.retry_after_ns);
			ck_assert_int_eq(x.reset_after_ns, y.reset_after_ns);
		}
		}
	}
}

/* ---- The limit and the double ---------------------------------------------- */

START_TEST(from_rate_values)
{
	limit_t l;
	ck_assert_int_eq(tokenbucket_limit_from_rate(&l, 0.1, 7), 0);
	assert_limit(&l, 1, 10 * SEC, 7);
	ck_assert_int_eq(tokenbucket_limit_from_rate(&l, 1e9 / 3, 1), 0);
	assert_limit(&l, 1, 3, 1);
	ck_assert_int_eq(tokenbucket_limit_from_rate(&l, 1000, 5), 0);
	assert_limit(&l, 1, 1000000, 5);
	ck_assert_int_eq(tokenbucket_limit_from_rate(&l, 0, 5), 0);
	assert_limit(&l, 0, 1, 5);
	ck_assert_int_eq(tokenbucket_limit_from_rate(&l, -0.0, 5), 0);
	assert_limit(&l, 0, 1, 5);
	ck_assert_int_eq(tokenbucket_limit_from_rate(&l, TOKENBUCKET_INF, 9), 0);
	assert_limit(&l, 1, 0, 9);
	ck_assert_int_eq(tokenbucket_limit_from_rate(&l, 1e308 * 10, 9), 0);
	assert_limit(&l, 1, 0, 9);
	/* 1.5 tokens per ns: 3 every 2 ns, exactly. */
	ck_assert_int_eq(tokenbucket_limit_from_rate(&l, 1.5e9, 2), 0);
	assert_limit(&l, 3, 2, 2);
}
END_TEST

START_TEST(from_rate_errors)
{
	limit_t l = {11, 22, 33};
	ck_assert_int_eq(tokenbucket_limit_from_rate(NULL, 1, 1), -EINVAL);
	ck_assert_int_eq(tokenbucket_limit_from_rate(&l, NAN, 1), -EINVAL);
	ck_assert_int_eq(tokenbucket_limit_from_rate(&l, -1, 1), -EINVAL);
	ck_assert_int_eq(tokenbucket_limit_from_rate(&l, -TOKENBUCKET_INF, 1), -EINVAL);
	assert_limit(&l, 11, 22, 33);
}
END_TEST

/* A bucket made from the limit of a double is the bucket made from the double. */
START_TEST(from_rate_same_bucket)
{
	static const double rates[] = {0.1, 1, 3.7, 1000, 123456.789, 1e9 / 3, 2.5e9, 1e-12, 0};
	for (size_t i = 0; i < sizeof(rates) / sizeof(rates[0]); i++) {
		limit_t l, back;
		ck_assert_int_eq(tokenbucket_limit_from_rate(&l, rates[i], 40), 0);
		struct tokenbucket *a = bucket_rate(rates[i], 40, 0), *b = NULL;
		ck_assert_int_eq(tokenbucket_create_limit(&b, &l, 0), 0);
		ck_assert_int_eq(tokenbucket_get_limit(a, &back), 0);
		ck_assert_mem_eq(&back, &l, sizeof(l));
		double ra = tokenbucket_rate(a), rb = tokenbucket_rate(b);
		ck_assert_mem_eq(&ra, &rb, sizeof(ra));
		same_answers(a, b, 40, 200 * MS, 0x9e3779b97f4a7c15u + i);
		tokenbucket_free(a);
		tokenbucket_free(b);
	}
}
END_TEST

/* ---- Buckets ------------------------------------------------------------------ */

START_TEST(create_limit_exact)
{
	/* Ratios as given, unreduced, and their twins from create_every. */
	static const limit_t lims[] = {
		{3, 7, 10}, {2, 6, 4}, {1000, 1000000007, 100}, {UINT64_MAX, INT64_MAX, 1},
		{123456789, 987654321000, 1000}, {1, INT64_MAX, 3}, {0, 5, 8}, {0, 0, 8},
	};
	for (size_t i = 0; i < sizeof(lims) / sizeof(lims[0]); i++) {
		const limit_t *l = &lims[i];
		struct tokenbucket *a = NULL, *b = NULL;
		ck_assert_int_eq(tokenbucket_create_limit(&a, l, 0), 0);
		ck_assert_int_eq(tokenbucket_create_every(&b, l->tokens, l->period_ns, l->burst, 0),
				 0);
		limit_t got;
		ck_assert_int_eq(tokenbucket_get_limit(a, &got), 0);
		if (l->tokens == 0) {
			assert_limit(&got, 0, 1, l->burst);
		} else {
			/* Lowest terms: the same ratio, nothing in common left. */
			ck_assert((tb__u128)got.tokens * (uint64_t)l->period_ns ==
				  (tb__u128)l->tokens * (uint64_t)got.period_ns);
			ck_assert_uint_le(got.tokens, l->tokens);
		}
		same_answers(a, b, l->burst, 3 * SEC, 12345 + i);
		tokenbucket_free(a);
		tokenbucket_free(b);
	}
	limit_t got;
	struct tokenbucket *a = NULL;
	ck_assert_int_eq(tokenbucket_create_limit(&a, &(limit_t){2, 6, 4}, 0), 0);
	ck_assert_int_eq(tokenbucket_get_limit(a, &got), 0);
	assert_limit(&got, 1, 3, 4);
	tokenbucket_free(a);
}
END_TEST

START_TEST(create_limit_unlimited)
{
	struct tokenbucket *a = NULL;
	ck_assert_int_eq(tokenbucket_create_limit(&a, &(limit_t){5, 0, 3}, 0), 0);
	ck_assert(isinf(tokenbucket_rate(a)));
	for (int i = 0; i < 10; i++)
		ck_assert(tokenbucket_allow_at(a, i, 3));
	limit_t got;
	ck_assert_int_eq(tokenbucket_get_limit(a, &got), 0);
	assert_limit(&got, 1, 0, 3);
	tokenbucket_free(a);
}
END_TEST

START_TEST(create_limit_errors)
{
	struct tokenbucket *a = (struct tokenbucket *)&a;
	const limit_t ok = {1, 1, 1};
	ck_assert_int_eq(tokenbucket_create_limit(NULL, &ok, 0), -EINVAL);
	ck_assert_int_eq(tokenbucket_create_limit(&a, NULL, 0), -EINVAL);
	ck_assert_int_eq(tokenbucket_create_limit(&a, &(limit_t){1, -1, 1}, 0), -EINVAL);
	ck_assert_int_eq(tokenbucket_create_limit(&a, &(limit_t){0, INT64_MIN, 1}, 0), -EINVAL);
	ck_assert_int_eq(tokenbucket_create_limit(&a, &ok, 1u << 5), -EINVAL);
	ck_assert_int_eq(tokenbucket_create_limit(&a, &(limit_t){1, 1, TOKENBUCKET_BURST_MAX + 1}, 0),
			 -ERANGE);
	/* -EINVAL before -ERANGE. */
	ck_assert_int_eq(tokenbucket_create_limit(&a, &(limit_t){1, -1, UINT64_MAX}, 0), -EINVAL);
	ck_assert_ptr_eq(a, (struct tokenbucket *)&a);
	ck_assert_int_eq(tokenbucket_create_limit(&a, &(limit_t){1, 1, TOKENBUCKET_BURST_MAX}, 0), 0);
	tokenbucket_free(a);

	limit_t l = {7, 8, 9};
	ck_assert_int_eq(tokenbucket_get_limit(NULL, &l), -EINVAL);
	a = bucket_every(1, 1, 1, 0);
	ck_assert_int_eq(tokenbucket_get_limit(a, NULL), -EINVAL);
	tokenbucket_free(a);
	assert_limit(&l, 7, 8, 9);
}
END_TEST

/* ---- Shared and named buckets -------------------------------------------------- */

static void *shared_mem(size_t *size)
{
	*size = tokenbucket_shared_size();
	void *mem = aligned_alloc(tokenbucket_shared_align(), *size);
	ck_assert_ptr_nonnull(mem);
	return mem;
}

START_TEST(init_shared_limit_exact)
{
	size_t size;
	void *mem = shared_mem(&size);
	struct tokenbucket *a = NULL, *b = bucket_every(123456789, 987654321000, 50, 0);
	limit_t l = {123456789, 987654321000, 50}, got;
	ck_assert_int_eq(tokenbucket_init_shared_limit(&a, mem, size, &l, 0), 0);
	ck_assert_int_eq(tokenbucket_get_limit(a, &got), 0);
	ck_assert_int_eq(tokenbucket_get_limit(b, &l), 0);
	ck_assert_mem_eq(&got, &l, sizeof(l));
	same_answers(a, b, 50, 2 * SEC, 77);
	tokenbucket_free(b);
	free(mem);
}
END_TEST

START_TEST(init_shared_limit_errors)
{
	size_t size;
	void *mem = shared_mem(&size);
	struct tokenbucket *a = NULL;
	const limit_t ok = {1, 1, 1};
	ck_assert_int_eq(tokenbucket_init_shared_limit(NULL, mem, size, &ok, 0), -EINVAL);
	ck_assert_int_eq(tokenbucket_init_shared_limit(&a, NULL, size, &ok, 0), -EINVAL);
	ck_assert_int_eq(tokenbucket_init_shared_limit(&a, (char *)mem + 8, size - 8, &ok, 0),
			 -EINVAL);
	ck_assert_int_eq(tokenbucket_init_shared_limit(&a, mem, size - 1, &ok, 0), -EINVAL);
	ck_assert_int_eq(tokenbucket_init_shared_limit(&a, mem, size, NULL, 0), -EINVAL);
	ck_assert_int_eq(tokenbucket_init_shared_limit(&a, mem, size, &(limit_t){1, -5, 1}, 0),
			 -EINVAL);
	ck_assert_int_eq(tokenbucket_init_shared_limit(&a, mem, size, &ok, 4), -EINVAL);
	ck_assert_int_eq(tokenbucket_init_shared_limit(&a, mem, size,
						       &(limit_t){1, 1, UINT64_MAX}, 0),
			 -ERANGE);
	ck_assert_ptr_null(a);
	/* Nothing was written: the memory holds no bucket. */
	struct tokenbucket *b = NULL;
	memset(mem, 0, size);
	ck_assert_int_eq(tokenbucket_init_shared_limit(&a, mem, size, &(limit_t){1, -5, 1}, 0),
			 -EINVAL);
	ck_assert_int_eq(tokenbucket_attach_shared(&b, mem, size), -EBADMSG);
	free(mem);
}
END_TEST

/* Shared memory is input: a rate no bucket can have is refused, never misread. */
START_TEST(get_limit_corrupt)
{
	size_t size;
	void *mem = shared_mem(&size);
	struct tokenbucket *a = NULL;
	ck_assert_int_eq(tokenbucket_init_shared_limit(&a, mem, size, &(limit_t){1, 3, 5}, 0), 0);
	uint64_t gen = atomic_load(&a->gen);
	struct tb__slot *s = &a->slot[(gen >> 1) & 1];
	limit_t l = {7, 8, 9};
	atomic_store(&s->q, UINT64_MAX);
	ck_assert_int_eq(tokenbucket_get_limit(a, &l), -EBADMSG);
	atomic_store(&s->q, 3);
	atomic_store(&s->p, 0);
	ck_assert_int_eq(tokenbucket_get_limit(a, &l), -EBADMSG);
	atomic_store(&s->p, 1);
	atomic_store(&s->kind, 77);
	ck_assert_int_eq(tokenbucket_get_limit(a, &l), -EBADMSG);
	assert_limit(&l, 7, 8, 9);
	atomic_store(&s->kind, TB__FINITE);
	ck_assert_int_eq(tokenbucket_get_limit(a, &l), 0);
	assert_limit(&l, 1, 3, 5);
	free(mem);
}
END_TEST

START_TEST(open_limit_exact)
{
	char name[64];
	name_for(name, sizeof(name), "open");
	/* A ratio the double conversion would not give back: 1 token every 3e9 + 1 ns. */
	limit_t l = {1, 3 * SEC + 1, 4}, got, approx;
	ck_assert_int_eq(tokenbucket_limit_from_rate(&approx, 1e9 / (3e9 + 1), 4), 0);
	struct tokenbucket *a = NULL, *b = NULL, *c = NULL, *d = NULL;
	unsigned status = 99;
	ck_assert_int_eq(tokenbucket_open_limit(&a, name, &l, 0, 0600, &status), 0);
	ck_assert_uint_eq(status, TOKENBUCKET_OPEN_CREATED);
	/* Exact from the first instant: no double rate ever stood. */
	ck_assert_int_eq(tokenbucket_get_limit(a, &got), 0);
	assert_limit(&got, 1, 3 * SEC + 1, 4);
	/* The same ratio, unreduced: not different. */
	ck_assert_int_eq(tokenbucket_open_limit(&b, name, &(limit_t){3, 9 * SEC + 3, 4}, 0, 0,
						&status),
			 0);
	ck_assert_uint_eq(status, 0);
	/* A ratio one ns off is different, exactly, even if its double reads the same. */
	ck_assert_int_eq(tokenbucket_open_limit(&c, name, &(limit_t){1, 3 * SEC + 2, 4}, 0, 0,
						&status),
			 0);
	ck_assert_uint_eq(status, TOKENBUCKET_OPEN_DIFFERS);
	tokenbucket_close(c);
	ck_assert_int_eq(tokenbucket_open_limit(&c, name, &(limit_t){1, 3 * SEC + 1, 5}, 0, 0,
						&status),
			 0);
	ck_assert_uint_eq(status, TOKENBUCKET_OPEN_DIFFERS);
	tokenbucket_close(c);
	ck_assert_int_eq(tokenbucket_open_limit(&c, name, &l, TOKENBUCKET_CAPPED_RELEASE, 0,
						&status),
			 0);
	ck_assert_uint_eq(status, TOKENBUCKET_OPEN_DIFFERS);
	tokenbucket_close(c);
	/* status may be NULL; the bucket stays as it was. */
	ck_assert_int_eq(tokenbucket_open_limit(&d, name, &approx, 0, 0, NULL), 0);
	ck_assert_int_eq(tokenbucket_get_limit(d, &got), 0);
	assert_limit(&got, 1, 3 * SEC + 1, 4);
	ck_assert(tokenbucket_allow_at(a, 10, 4));
	ck_assert(!tokenbucket_allow_at(d, 10, 1));
	tokenbucket_close(a);
	tokenbucket_close(b);
	tokenbucket_close(d);
	ck_assert_int_eq(tokenbucket_unlink(name), 0);
}
END_TEST

START_TEST(open_limit_kinds)
{
	char name[64];
	name_for(name, sizeof(name), "kinds");
	struct tokenbucket *a = NULL, *b = NULL;
	unsigned status;
	/* A 1.1 open with the double 0.1 and a limit of 1 every 10 s: the same. */
	ck_assert_int_eq(tokenbucket_open(&a, name, 0.1, 3, 0, 0, &status), 0);
	ck_assert_int_eq(tokenbucket_open_limit(&b, name, &(limit_t){1, 10 * SEC, 3}, 0, 0, &status),
			 0);
	ck_assert_uint_eq(status, 0);
	tokenbucket_close(b);
	ck_assert_int_eq(tokenbucket_open_limit(&b, name, &(limit_t){1, 0, 3}, 0, 0, &status), 0);
	ck_assert_uint_eq(status, TOKENBUCKET_OPEN_DIFFERS);
	tokenbucket_close(b);
	tokenbucket_close(a);
	ck_assert_int_eq(tokenbucket_unlink(name), 0);

	ck_assert_int_eq(tokenbucket_open_limit(&a, name, &(limit_t){7, 0, 3}, 0, 0, &status), 0);
	ck_assert_uint_eq(status, TOKENBUCKET_OPEN_CREATED);
	ck_assert(isinf(tokenbucket_rate(a)));
	ck_assert_int_eq(tokenbucket_open(&b, name, TOKENBUCKET_INF, 3, 0, 0, &status), 0);
	ck_assert_uint_eq(status, 0);
	tokenbucket_close(b);
	ck_assert_int_eq(tokenbucket_open_limit(&b, name, &(limit_t){0, 0, 3}, 0, 0, &status), 0);
	ck_assert_uint_eq(status, TOKENBUCKET_OPEN_DIFFERS);
	tokenbucket_close(b);
	tokenbucket_close(a);
	ck_assert_int_eq(tokenbucket_unlink(name), 0);
}
END_TEST

START_TEST(open_limit_errors)
{
	char name[64];
	name_for(name, sizeof(name), "errors");
	struct tokenbucket *a = NULL;
	unsigned status = 42;
	const limit_t ok = {1, 1, 1};
	ck_assert_int_eq(tokenbucket_open_limit(NULL, name, &ok, 0, 0, &status), -EINVAL);
	ck_assert_int_eq(tokenbucket_open_limit(&a, name, NULL, 0, 0, &status), -EINVAL);
	ck_assert_int_eq(tokenbucket_open_limit(&a, name, &(limit_t){1, -1, 1}, 0, 0, &status),
			 -EINVAL);
	ck_assert_int_eq(tokenbucket_open_limit(&a, NULL, &ok, 0, 0, &status), -EINVAL);
	ck_assert_int_eq(tokenbucket_open_limit(&a, "noslash", &ok, 0, 0, &status), -EINVAL);
	ck_assert_int_eq(tokenbucket_open_limit(&a, name, &ok, 0, 01000, &status), -EINVAL);
	ck_assert_int_eq(tokenbucket_open_limit(&a, name, &ok, 8, 0, &status), -EINVAL);
	ck_assert_int_eq(tokenbucket_open_limit(&a, name, &(limit_t){1, 1, UINT64_MAX}, 0, 0,
						&status),
			 -ERANGE);
	char longname[TOKENBUCKET_NAME_MAX + 3];
	memset(longname, 'x', sizeof(longname) - 1);
	longname[0] = '/';
	longname[sizeof(longname) - 1] = 0;
	ck_assert_int_eq(tokenbucket_open_limit(&a, longname, &ok, 0, 0, &status), -ENAMETOOLONG);
	ck_assert_ptr_null(a);
	ck_assert_uint_eq(status, 42);
	ck_assert_int_eq(tokenbucket_unlink(name), -ENOENT);
}
END_TEST

/* ---- Changes ----------------------------------------------------------------- */

/* set_limit_at is set_rate_every_at then set_burst_at at the same time. */
START_TEST(set_limit_exact)
{
	static const limit_t to[] = {
		{3, 7 * MS, 10}, {1, 3, 2}, {0, 0, 5}, {9, 0, 4}, {5, 11 * MS, 1}, {2, 3 * MS, 40},
	};
	struct tokenbucket *a = bucket_every(1, MS, 20, 0), *b = bucket_every(1, MS, 20, 0);
	uint64_t seed = 4242;
	int64_t now = 0;
	for (size_t i = 0; i < sizeof(to) / sizeof(to[0]); i++) {
		now += 5 * MS;
		ck_assert_int_eq(tokenbucket_allow_at(a, now, 3), tokenbucket_allow_at(b, now, 3));
		now += 1234567;
		ck_assert_int_eq(tokenbucket_set_limit_at(a, now, &to[i]), 0);
		ck_assert_int_eq(tokenbucket_set_rate_every_at(b, now, to[i].tokens,
							       to[i].period_ns ? to[i].period_ns : 1),
				 0);
		if (to[i].tokens > 0 && to[i].period_ns == 0)
			ck_assert_int_eq(tokenbucket_set_rate_at(b, now, TOKENBUCKET_INF), 0);
		ck_assert_int_eq(tokenbucket_set_burst_at(b, now, to[i].burst), 0);
		limit_t la, lb;
		ck_assert_int_eq(tokenbucket_get_limit(a, &la), 0);
		ck_assert_int_eq(tokenbucket_get_limit(b, &lb), 0);
		ck_assert_mem_eq(&la, &lb, sizeof(la));
		ck_assert_uint_eq(la.burst, to[i].burst);
		for (int k = 0; k < 50; k++) {
			now += (int64_t)(next_rand(&seed) % (3 * MS));
			double ta = tokenbucket_tokens_at(a, now), tb = tokenbucket_tokens_at(b, now);
			ck_assert_mem_eq(&ta, &tb, sizeof(ta));
			uint64_t n = next_rand(&seed) % (to[i].burst + 1);
			ck_assert_int_eq(tokenbucket_allow_at(a, now, n), tokenbucket_allow_at(b, now, n));
		}
	}
	tokenbucket_free(a);
	tokenbucket_free(b);
}
END_TEST

START_TEST(set_limit_errors)
{
	struct tokenbucket *a = bucket_empty_at(1, MS, 10, 0, 100 * MS);
	const limit_t ok = {1, 1, 1};
	ck_assert_int_eq(tokenbucket_set_limit(NULL, &ok), -EINVAL);
	ck_assert_int_eq(tokenbucket_set_limit_at(NULL, 0, &ok), -EINVAL);
	ck_assert_int_eq(tokenbucket_set_limit(a, NULL), -EINVAL);
	ck_assert_int_eq(tokenbucket_set_limit_at(a, 200 * MS, &(limit_t){1, -1, 1}), -EINVAL);
	ck_assert_int_eq(tokenbucket_set_limit_at(a, 200 * MS, &(limit_t){1, 1, UINT64_MAX}),
			 -ERANGE);
	ck_assert_int_eq(tokenbucket_set_limit_at(a, 200 * MS, &(limit_t){1, -1, UINT64_MAX}),
			 -EINVAL);
	/* Nothing changed, not even the clock: at 150 ms the bucket holds 10 (50 made, burst 10). */
	limit_t l;
	ck_assert_int_eq(tokenbucket_get_limit(a, &l), 0);
	assert_limit(&l, 1, MS, 10);
	ck_assert_tokens(tokenbucket_tokens_at(a, 105 * MS), 5);
	/* The form without _at changes the limit now. */
	ck_assert_int_eq(tokenbucket_set_limit(a, &(limit_t){4, 6, 3}), 0);
	ck_assert_int_eq(tokenbucket_get_limit(a, &l), 0);
	assert_limit(&l, 2, 3, 3);
	tokenbucket_free(a);
}
END_TEST

START_TEST(twins_without_at)
{
	struct tokenbucket *a = bucket_every(1, SEC, 10, 0);
	ck_assert_int_eq(tokenbucket_reset(NULL, 0), -EINVAL);
	ck_assert_int_eq(tokenbucket_reset(a, 11), -EINVAL);
	ck_assert_int_eq(tokenbucket_reset(a, 2), 0);
	/* Reset at tokenbucket_now(): 2 tokens, and less than a token made since. */
	double t = tokenbucket_tokens(a);
	ck_assert(t >= 2 && t < 3);
	ck_assert(tokenbucket_allow(a, 2));
	ck_assert(!tokenbucket_allow(a, 1));

	ck_assert_int_eq(tokenbucket_set_rate_every(NULL, 1, 1), -EINVAL);
	ck_assert_int_eq(tokenbucket_set_rate_every(a, 1, 0), -EINVAL);
	ck_assert_int_eq(tokenbucket_set_rate_every(a, 1, -1), -EINVAL);
	limit_t l;
	ck_assert_int_eq(tokenbucket_get_limit(a, &l), 0);
	assert_limit(&l, 1, SEC, 10);
	ck_assert_int_eq(tokenbucket_set_rate_every(a, 6, 4 * SEC), 0);
	ck_assert_int_eq(tokenbucket_get_limit(a, &l), 0);
	assert_limit(&l, 3, 2 * SEC, 10);
	ck_assert_int_eq(tokenbucket_set_rate_every(a, 0, -1), 0);
	ck_assert_int_eq(tokenbucket_get_limit(a, &l), 0);
	assert_limit(&l, 0, 1, 10);
	tokenbucket_free(a);
}
END_TEST


/* ---- SIGKILL in the middle of set_limit ------------------------------------------ */

static bool limit_is(const limit_t *l, const limit_t *rate, const limit_t *burst)
{
	return l->tokens == rate->tokens && l->period_ns == rate->period_ns &&
	       l->burst == burst->burst;
}

/*
 * A writer killed at any instant of a set_limit leaves the old limit, the
 * new one, or the new rate with the old burst (or, within set_burst, the
 * new burst): a consistent bucket the next writer takes over, which never
 * holds more than its burst.
 */
START_TEST(set_limit_killed)
{
	const limit_t a = {1, 3, 5}, b = {7, 2 * MS, 9};
	size_t size = tokenbucket_shared_size();
	void *mem = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	ck_assert_ptr_ne(mem, MAP_FAILED);
	struct tokenbucket *tb = NULL;
	ck_assert_int_eq(tokenbucket_init_shared_limit(&tb, mem, size, &a, 0), 0);
	uint64_t seed = 2718281828u;
	int64_t now = 1000;
	for (int round = 0; round < 40; round++) {
		pid_t pid = fork();
		TBT_FORKED(pid);
		if (pid == 0) {
			for (int64_t t = now;; t += 1000) {
				tokenbucket_set_limit_at(tb, t, (t / 1000) & 1 ? &a : &b);
				tokenbucket_allow_at(tb, t, 1);
			}
		}
		struct timespec ts = {0, (long)(next_rand(&seed) % 3000000)};
		nanosleep(&ts, NULL);
		ck_assert_int_eq(kill(pid, SIGKILL), 0);
		int status;
		ck_assert_int_eq(waitpid(pid, &status, 0), pid);
		limit_t got;
		ck_assert_int_eq(tokenbucket_get_limit(tb, &got), 0);
		ck_assert_msg(limit_is(&got, &a, &a) || limit_is(&got, &b, &b) ||
				      limit_is(&got, &a, &b) || limit_is(&got, &b, &a),
			      "a limit no set_limit leaves: %" PRIu64 "/%" PRId64 " burst %" PRIu64,
			      got.tokens, got.period_ns, got.burst);
		/* Past anything the child reached: its clock ran 1000 ns a call. */
		now = INT64_C(1) << 50 << (round % 8);
		now += round;
		ck_assert(tokenbucket_tokens_at(tb, now) <= (double)got.burst);
		ck_assert_int_eq(tokenbucket_set_limit_at(tb, now, &a), 0);
		ck_assert_int_eq(tokenbucket_get_limit(tb, &got), 0);
		ck_assert(limit_is(&got, &a, &a));
		ck_assert(tokenbucket_tokens_at(tb, now) <= 5);
		ck_assert_int_eq(tokenbucket_reset_at(tb, now, 0), 0);
		ck_assert(!tokenbucket_allow_at(tb, now + 2, 1));
		ck_assert(tokenbucket_allow_at(tb, now + 3, 1));
		now += 10;
	}
	munmap(mem, size);
}
END_TEST

/* ---- Tables --------------------------------------------------------------------- */

/* The same calls on one key of two tables give the same answers. */
static void same_key_answers(struct tokenbucket_table *a, struct tokenbucket_table *b,
			     uint64_t burst, uint64_t seed)
{
	int64_t now = 0;
	for (int i = 0; i < 1000; i++) {
		now += (int64_t)(next_rand(&seed) % (20 * MS));
		uint64_t n = next_rand(&seed) % (burst + 1);
		if (next_rand(&seed) & 1) {
			ck_assert_int_eq(tokenbucket_table_allow_at(a, now, "k", 1, n),
					 tokenbucket_table_allow_at(b, now, "k", 1, n));
		} else {
			double ta = tokenbucket_table_tokens_at(a, now, "k", 1);
			double tb = tokenbucket_table_tokens_at(b, now, "k", 1);
			ck_assert_mem_eq(&ta, &tb, sizeof(ta));
		}
	}
}

START_TEST(table_limit_exact)
{
	limit_t l = {7, 9 * MS, 12};
	struct tokenbucket_table *a = NULL, *b = NULL, *c = NULL;
	ck_assert_int_eq(tokenbucket_table_create_limit(&a, &l, 16, 0), 0);
	ck_assert_int_eq(tokenbucket_table_create(&b, 7, 9 * MS, 12, 16, 0), 0);
	same_key_answers(a, b, 12, 99);
	size_t size = tokenbucket_table_size(16);
	void *mem = aligned_alloc(TOKENBUCKET_TABLE_ALIGN, size);
	ck_assert_int_eq(tokenbucket_table_init_shared_limit(&c, mem, size, &l, 16, 0), 0);
	tokenbucket_table_free(b);
	b = NULL;
	ck_assert_int_eq(tokenbucket_table_create(&b, 7, 9 * MS, 12, 16, 0), 0);
	same_key_answers(c, b, 12, 99);
	tokenbucket_table_free(a);
	tokenbucket_table_free(b);
	tokenbucket_table_free(c);
	/* Rate 0, however said. */
	ck_assert_int_eq(tokenbucket_table_create_limit(&a, &(limit_t){0, 0, 2}, 4, 0), 0);
	ck_assert(tokenbucket_table_allow_at(a, 0, "k", 1, 2));
	ck_assert(!tokenbucket_table_allow_at(a, INT64_MAX - 1, "k", 1, 1));
	tokenbucket_table_free(a);
	free(mem);
}
END_TEST

START_TEST(table_limit_errors)
{
	struct tokenbucket_table *a = NULL;
	const limit_t ok = {1, MS, 1}, inf = {1, 0, 1};
	size_t size = tokenbucket_table_size(4);
	void *mem = aligned_alloc(TOKENBUCKET_TABLE_ALIGN, size);
	ck_assert_int_eq(tokenbucket_table_create_limit(NULL, &ok, 4, 0), -EINVAL);
	ck_assert_int_eq(tokenbucket_table_create_limit(&a, NULL, 4, 0), -EINVAL);
	ck_assert_int_eq(tokenbucket_table_create_limit(&a, &(limit_t){1, -1, 1}, 4, 0), -EINVAL);
	ck_assert_int_eq(tokenbucket_table_create_limit(&a, &ok, 0, 0), -EINVAL);
	ck_assert_int_eq(tokenbucket_table_create_limit(&a, &ok, 4, 3), -EINVAL);
	ck_assert_int_eq(tokenbucket_table_create_limit(&a, &inf, 4, 0), -ERANGE);
	/* -EINVAL before -ERANGE, an unlimited rate's too. */
	ck_assert_int_eq(tokenbucket_table_create_limit(&a, &inf, 0, 0), -EINVAL);
	ck_assert_int_eq(tokenbucket_table_create_limit(&a, &(limit_t){17, 1, 1}, 4, 0), -ERANGE);
	ck_assert_int_eq(tokenbucket_table_create_limit(
				 &a, &(limit_t){1, 1, TOKENBUCKET_TABLE_BURST_MAX + 1}, 4, 0),
			 -ERANGE);
	ck_assert_int_eq(tokenbucket_table_init_shared_limit(NULL, mem, size, &ok, 4, 0), -EINVAL);
	ck_assert_int_eq(tokenbucket_table_init_shared_limit(&a, mem, size, NULL, 4, 0), -EINVAL);
	ck_assert_int_eq(tokenbucket_table_init_shared_limit(&a, NULL, size, &ok, 4, 0), -EINVAL);
	ck_assert_int_eq(tokenbucket_table_init_shared_limit(&a, mem, size - 1, &ok, 4, 0),
			 -EINVAL);
	ck_assert_int_eq(tokenbucket_table_init_shared_limit(&a, mem, size, &(limit_t){1, -2, 1}, 4,
							     0),
			 -EINVAL);
	ck_assert_int_eq(tokenbucket_table_init_shared_limit(&a, mem, size, &inf, 4, 0), -ERANGE);
	char name[64];
	name_for(name, sizeof(name), "tbl-errors");
	unsigned status = 5;
	ck_assert_int_eq(tokenbucket_table_open_limit(NULL, name, &ok, 4, 0, 0, &status), -EINVAL);
	ck_assert_int_eq(tokenbucket_table_open_limit(&a, name, NULL, 4, 0, 0, &status), -EINVAL);
	ck_assert_int_eq(tokenbucket_table_open_limit(&a, "bad", &ok, 4, 0, 0, &status), -EINVAL);
	ck_assert_int_eq(tokenbucket_table_open_limit(&a, name, &(limit_t){1, -1, 1}, 4, 0, 0,
						      &status),
			 -EINVAL);
	ck_assert_int_eq(tokenbucket_table_open_limit(&a, name, &ok, 4, 0, 01000, &status), -EINVAL);
	ck_assert_int_eq(tokenbucket_table_open_limit(&a, name, &inf, 4, 0, 0, &status), -ERANGE);
	ck_assert_ptr_null(a);
	ck_assert_uint_eq(status, 5);
	ck_assert_int_eq(tokenbucket_unlink(name), -ENOENT);
	free(mem);
}
END_TEST

START_TEST(table_open_limit_differs)
{
	char name[64];
	name_for(name, sizeof(name), "tbl");
	struct tokenbucket_table *a = NULL, *b = NULL;
	unsigned status;
	ck_assert_int_eq(tokenbucket_table_open_limit(&a, name, &(limit_t){2, 6, 8}, 8, 0, 0, &status),
			 0);
	ck_assert_uint_eq(status, TOKENBUCKET_OPEN_CREATED);
	ck_assert_int_eq(tokenbucket_table_open_limit(&b, name, &(limit_t){1, 3, 8}, 8, 0, 0, &status),
			 0);
	ck_assert_uint_eq(status, 0);
	tokenbucket_table_free(b);
	ck_assert_int_eq(tokenbucket_table_open(&b, name, 5, 15, 8, 8, 0, 0, &status), 0);
	ck_assert_uint_eq(status, 0);
	tokenbucket_table_free(b);
	ck_assert_int_eq(tokenbucket_table_open_limit(&b, name, &(limit_t){1, 4, 8}, 8, 0, 0, &status),
			 0);
	ck_assert_uint_eq(status, TOKENBUCKET_OPEN_DIFFERS);
	tokenbucket_table_free(b);
	ck_assert_int_eq(tokenbucket_table_open_limit(&b, name, &(limit_t){1, 3, 9}, 8, 0, 0, &status),
			 0);
	ck_assert_uint_eq(status, TOKENBUCKET_OPEN_DIFFERS);
	tokenbucket_table_free(b);
	tokenbucket_table_free(a);
	ck_assert_int_eq(tokenbucket_unlink(name), 0);
}
END_TEST

/* ---- A table's wait ----------------------------------------------------------- */

START_TEST(table_wait_errors)
{
	struct tokenbucket_table *a = NULL;
	ck_assert_int_eq(tokenbucket_table_create(&a, 1, SEC, 2, 8, 0), 0);
	ck_assert_int_eq(tokenbucket_table_wait(NULL, "k", 1, 1, TOKENBUCKET_NEVER, -1), -EINVAL);
	ck_assert_int_eq(tokenbucket_table_wait(a, NULL, 1, 1, TOKENBUCKET_NEVER, -1), -EINVAL);
	ck_assert_int_eq(tokenbucket_table_wait(a, "k", 1, 3, TOKENBUCKET_NEVER, -1), -E2BIG);
	ck_assert_int_eq(tokenbucket_table_wait(a, "k", 1, 1, TOKENBUCKET_NEVER, -2), -EBADF);
	int fds[2];
	ck_assert_int_eq(pipe(fds), 0);
	close(fds[0]);
	ck_assert_int_eq(tokenbucket_table_wait(a, "k", 1, 1, TOKENBUCKET_NEVER, fds[0]), -EBADF);
	/* A hung-up pipe is a cancel: nothing taken. */
	close(fds[1]);
	ck_assert_int_eq(pipe(fds), 0);
	close(fds[1]);
	ck_assert_int_eq(tokenbucket_table_wait(a, "k", 1, 1, TOKENBUCKET_NEVER, fds[0]),
			 -ECANCELED);
	close(fds[0]);
	ck_assert_tokens(tokenbucket_table_tokens(a, "k", 1), 2);
	/* Full: no sleep; then empty, and a token a second away is past a 10 ms deadline. */
	ck_assert_int_eq(tokenbucket_table_wait(a, "k", 1, 2, TOKENBUCKET_NEVER, -1), 0);
	double before = tokenbucket_table_tokens(a, "k", 1);
	ck_assert(before < 1);
	ck_assert_int_eq(tokenbucket_table_wait(a, "k", 1, 1, tokenbucket_now() + 10 * MS, -1),
			 -ETIMEDOUT);
	ck_assert(tokenbucket_table_tokens(a, "k", 1) >= before);
	ck_assert(tokenbucket_table_tokens(a, "k", 1) < 1);
	/* A deadline already past. */
	ck_assert_int_eq(tokenbucket_table_wait(a, "k", 1, 1, 0, -1), -ETIMEDOUT);
	tokenbucket_table_free(a);

	/* Rate 0: never, at once. */
	ck_assert_int_eq(tokenbucket_table_create(&a, 0, 0, 1, 8, 0), 0);
	ck_assert_int_eq(tokenbucket_table_wait(a, "z", 1, 1, TOKENBUCKET_NEVER, -1), 0);
	ck_assert_int_eq(tokenbucket_table_wait(a, "z", 1, 1, TOKENBUCKET_NEVER, -1), -ETIMEDOUT);
	ck_assert_tokens(tokenbucket_table_tokens(a, "z", 1), 0);
	tokenbucket_table_free(a);

	/* Fail closed with no slot: -EBUSY, as reserve. */
	ck_assert_int_eq(tokenbucket_table_create(&a, 1, SEC, 1, 1, 0), 0);
	char key[8];
	int busy = 0;
	for (int i = 0; i < 64 && !busy; i++) {
		snprintf(key, sizeof(key), "k%d", i);
		int err = tokenbucket_table_wait(a, key, strlen(key), 1, TOKENBUCKET_NEVER, -1);
		ck_assert(err == 0 || err == -EBUSY);
		busy = err == -EBUSY;
	}
	ck_assert(busy);
	tokenbucket_table_free(a);
}
END_TEST

START_TEST(table_wait_sleeps)
{
	struct tokenbucket_table *a = NULL;
	ck_assert_int_eq(tokenbucket_table_create(&a, 1, 30 * MS, 1, 8, 0), 0);
	ck_assert_int_eq(tokenbucket_table_wait(a, "k", 1, 1, TOKENBUCKET_NEVER, -1), 0);
	int64_t t0 = tokenbucket_now();
	int efd = eventfd(0, EFD_CLOEXEC);
	ck_assert_int_ge(efd, 0);
	/* The next token is at most 30 ms away; it cannot come sooner than the rate makes it. */
	ck_assert_int_eq(tokenbucket_table_wait(a, "k", 1, 1, t0 + 60 * SEC, efd), 0);
	ck_assert_int_eq(tokenbucket_table_wait(a, "k", 1, 1, TOKENBUCKET_NEVER, -1), 0);
	ck_assert_int_ge(tokenbucket_now() - t0, 30 * MS);
	ck_assert(!tokenbucket_table_allow(a, "k", 1, 1));
	close(efd);
	tokenbucket_table_free(a);
}
END_TEST

struct later {
	int fd;
	int64_t after_ns;
	bool close_it;
};

static void *act_later(void *arg)
{
	struct later *l = arg;
	struct timespec ts = {.tv_sec = l->after_ns / SEC, .tv_nsec = l->after_ns % SEC};
	nanosleep(&ts, NULL);
	if (l->close_it) {
		close(l->fd);
	} else {
		uint64_t one = 1;
		ck_assert_int_eq(write(l->fd, &one, sizeof(one)), (ssize_t)sizeof(one));
	}
	return NULL;
}

/* A cancel while sleeping gives the reservation back whole. */
static void cancel_while_sleeping(bool close_it, int want)
{
	struct tokenbucket_table *a = NULL;
	ck_assert_int_eq(tokenbucket_table_create(&a, 1, 100 * SEC, 3, 8, 0), 0);
	ck_assert(tokenbucket_table_allow(a, "k", 1, 3));
	double before = tokenbucket_table_tokens(a, "k", 1);
	int efd = eventfd(0, EFD_CLOEXEC);
	struct later l = {.fd = efd, .after_ns = 20 * MS, .close_it = close_it};
	pthread_t th;
	ck_assert_int_eq(pthread_create(&th, NULL, act_later, &l), 0);
	ck_assert_int_eq(tokenbucket_table_wait(a, "k", 1, 2, TOKENBUCKET_NEVER, efd), want);
	pthread_join(th, NULL);
	double after = tokenbucket_table_tokens(a, "k", 1);
	/* Given back: the level is what it was, plus what the rate made meanwhile (tiny). */
	ck_assert(after >= before && after < before + 0.5);
	if (!close_it)
		close(efd);
	tokenbucket_table_free(a);
}

START_TEST(table_wait_cancel)
{
	cancel_while_sleeping(false, -ECANCELED);
}
END_TEST

START_TEST(table_wait_closed)
{
	cancel_while_sleeping(true, -EBADF);
}
END_TEST

/* A key whose clock was put ahead of CLOCK_MONOTONIC: past the deadline, given back. */
START_TEST(table_wait_clock_ahead)
{
	struct tokenbucket_table *a = NULL;
	ck_assert_int_eq(tokenbucket_table_create(&a, 1, 50 * MS, 1, 8, 0), 0);
	int64_t now = tokenbucket_now();
	ck_assert(tokenbucket_table_allow_at(a, now + 10 * SEC, "k", 1, 1));
	double before = tokenbucket_table_tokens(a, "k", 1);
	ck_assert_int_eq(tokenbucket_table_wait(a, "k", 1, 1, now + SEC, -1), -ETIMEDOUT);
	double after = tokenbucket_table_tokens(a, "k", 1);
	ck_assert_mem_eq(&before, &after, sizeof(before));
	tokenbucket_table_free(a);
}
END_TEST

/* Threads waiting on one key: each token goes to one of them, none is lost or made. */
struct waiter {
	struct tokenbucket_table *t;
	int got;
};

static void *wait_some(void *arg)
{
	struct waiter *w = arg;
	for (int i = 0; i < 5; i++)
		if (tokenbucket_table_wait(w->t, "shared", 6, 1, TOKENBUCKET_NEVER, -1) == 0)
			w->got++;
	return NULL;
}

START_TEST(table_wait_threads)
{
	struct tokenbucket_table *a = NULL;
	ck_assert_int_eq(tokenbucket_table_create(&a, 1, 2 * MS, 2, 8, 0), 0);
	int64_t t0 = tokenbucket_now();
	struct waiter w[4] = {{a, 0}, {a, 0}, {a, 0}, {a, 0}};
	pthread_t th[4];
	for (int i = 0; i < 4; i++)
		ck_assert_int_eq(pthread_create(&th[i], NULL, wait_some, &w[i]), 0);
	for (int i = 0; i < 4; i++) {
		pthread_join(th[i], NULL);
		ck_assert_int_eq(w[i].got, 5);
	}
	/* 20 tokens: 2 were there, 18 had to be made. */
	ck_assert_int_ge(tokenbucket_now() - t0, 18 * 2 * MS);
	tokenbucket_table_free(a);
}
END_TEST

Suite *limit_suite(void)
{
	Suite *s = suite_create("limit");
	TCase *tc = tcase_create("limit");
	tcase_add_test(tc, from_rate_values);
	tcase_add_test(tc, from_rate_errors);
	tcase_add_test(tc, from_rate_same_bucket);
	tcase_add_test(tc, create_limit_exact);
	tcase_add_test(tc, create_limit_unlimited);
	tcase_add_test(tc, create_limit_errors);
	tcase_add_test(tc, init_shared_limit_exact);
	tcase_add_test(tc, init_shared_limit_errors);
	tcase_add_test(tc, get_limit_corrupt);
	tcase_add_test(tc, open_limit_exact);
	tcase_add_test(tc, open_limit_kinds);
	tcase_add_test(tc, open_limit_errors);
	tcase_add_test(tc, set_limit_exact);
	tcase_add_test(tc, set_limit_errors);
	tcase_add_test(tc, twins_without_at);
	tcase_add_test(tc, table_limit_exact);
	tcase_add_test(tc, table_limit_errors);
	tcase_add_test(tc, table_open_limit_differs);
	suite_add_tcase(s, tc);
	TCase *k = tcase_create("killed");
	tcase_set_timeout(k, 60);
	tcase_add_test(k, set_limit_killed);
	suite_add_tcase(s, k);
	TCase *w = tcase_create("table-wait");
	tcase_set_timeout(w, 30);
	tcase_add_test(w, table_wait_errors);
	tcase_add_test(w, table_wait_sleeps);
	tcase_add_test(w, table_wait_cancel);
	tcase_add_test(w, table_wait_closed);
	tcase_add_test(w, table_wait_clock_ahead);
	tcase_add_test(w, table_wait_threads);
	suite_add_tcase(s, w);
	return s;
}
