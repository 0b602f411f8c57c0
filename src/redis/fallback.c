/* SPDX-License-Identifier: MIT */
/*
 * The local fallback: while Redis cannot answer, allow and reserve decide
 * with a bucket of this process holding a share of the key's limit, one
 * per key in 256 slots (allow_all: one per limit of the key).  Used by the blocking and the asynchronous client;
 * safe from any thread (one mutex over the slots).
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fallback.h"

/* Local fallback buckets: one per slot, a key hashing into a taken slot replaces it. */
#define TBR__FALLBACK_SLOTS 256

struct tbr__local {
	char *key;
	size_t keylen;
	struct tokenbucket_redis_limit limit;
	struct tokenbucket *tb;
};

void tbr__fallback_init(struct tbr__fallback *fb)
{
	memset(fb, 0, sizeof(*fb));
	pthread_mutex_init(&fb->lock, NULL);
}

void tbr__fallback_fini(struct tbr__fallback *fb)
{
	if (fb->local != NULL) {
		for (int i = 0; i < TBR__FALLBACK_SLOTS; i++) {
			free(fb->local[i].key);
			tokenbucket_free(fb->local[i].tb);
		}
		free(fb->local);
	}
	pthread_mutex_destroy(&fb->lock);
}

/* Errors after which Redis may answer again later; the fallback covers these. */
static bool unavailable(int err)
{
	switch (-err) {
	case ETIME: case ECONNREFUSED: case ECONNRESET: case ECONNABORTED: case EPIPE:
	case ENOENT: case EHOSTUNREACH: case ENETUNREACH: case ENOTCONN: case EROFS:
	case EBUSY: case EAGAIN: case ENOMEM:
		return true;
	default:
		return false;
	}
}

static uint64_t hash(const char *s, size_t len)
{
	uint64_t h = 1469598103934665603u; /* FNV-1a */
	for (size_t i = 0; i < len; i++)
		h = (h ^ (unsigned char)s[i]) * 1099511628211u;
	return h;
}

static struct tbr__local *local_slot(struct tbr__fallback *r, const char *key, size_t len)
{
	return &r->local[hash(key, len) % TBR__FALLBACK_SLOTS];
}

/* The key's local bucket, made (or remade, if its limit changed) with share of the limit. */
static struct tokenbucket *local_bucket(struct tbr__fallback *r, const char *key, size_t len,
					const struct tokenbucket_redis_limit *lim)
{
	if (r->local == NULL) {
		r->local = calloc(TBR__FALLBACK_SLOTS, sizeof(*r->local));
		if (r->local == NULL)
			return NULL;
	}
	struct tbr__local *s = local_slot(r, key, len);
	if (s->tb != NULL && s->keylen == len && memcmp(s->key, key, len) == 0 &&
	    memcmp(&s->limit, lim, sizeof(*lim)) == 0)
		return s->tb;
	char *copy = malloc(len + 1);
	if (copy == NULL)
		return NULL;
	memcpy(copy, key, len);
	/* share of the rate: the same tokens over a period longer by 1 / share. */
	double period = ceil((double)lim->period_ns / r->share);
	int64_t p = period >= 0x1p63 ? INT64_MAX : (int64_t)period;
	struct tokenbucket *tb = NULL;
	if (tokenbucket_create_every(&tb, lim->tokens, lim->tokens > 0 ? p : 1,
				     (uint64_t)floor((double)lim->burst * r->share), 0) != 0) {
		free(copy);
		return NULL;
	}
	free(s->key);
	tokenbucket_free(s->tb);
	*s = (struct tbr__local){ .key = copy, .keylen = len, .limit = *lim, .tb = tb };
	return tb;
}

static void local_result(struct tokenbucket *tb, bool allowed, int64_t retry,
			 struct tokenbucket_result *res)
{
	if (res == NULL)
		return;
	double level = tokenbucket_tokens(tb);
	uint64_t burst = tokenbucket_burst(tb);
	*res = (struct tokenbucket_result){
		.allowed = allowed,
		.flags = TOKENBUCKET_RESULT_LOCAL,
		.limit = burst,
		.remaining = level >= 1 ? (uint64_t)level : 0,
		.retry_after_ns = retry,
		.reset_after_ns = level >= (double)burst
			? 0 : tokenbucket_duration_for(tb, burst - (uint64_t)(level > 0 ? level : 0)),
	};
}

/* allow and reserve by the local bucket; 1 if it could not decide either. */
static int fallback(struct tbr__fallback *r, const struct tokenbucket_redis_call *call,
		    struct tokenbucket_result *res, struct tokenbucket_reservation *rv)
{
	pthread_mutex_lock(&r->lock);
	struct tokenbucket *tb = local_bucket(r, call->key, call->keylen, &call->limit);
	int err = 1;
	if (tb != NULL && call->op == TOKENBUCKET_REDIS_ALLOW) {
		bool ok = tokenbucket_allow(tb, call->n);
		local_result(tb, ok, ok ? 0 : tokenbucket_duration_for(tb, call->n), res);
		err = 0;
	} else if (tb != NULL) {
		struct tokenbucket_reservation v;
		err = tokenbucket_reserve(tb, call->n, call->arg, &v);
		int64_t delay = err == 0 ? tokenbucket_reservation_delay(&v, tokenbucket_now())
				       : TOKENBUCKET_NEVER;
		local_result(tb, err == 0, delay, res);
		if (err == 0 && rv != NULL) {
			*rv = v;
			rv->reserved = 1; /* cancel goes to the local bucket */
		}
	}
	pthread_mutex_unlock(&r->lock);
	return err;
}

/*
 * allow_all by local buckets, one per limit, each named by the key, a NUL
 * and the limit's index (so no single key's); 1 if they could not decide,
 * as when two of them fall in one slot (the second would replace the first).
 */
static int fallback_all(struct tbr__fallback *r, const struct tokenbucket_redis_call *call)
{
	const struct tokenbucket_redis_call_all *all = tbr__call_all_of(call);
	size_t len = call->keylen + 2;
	char *name = malloc(len);
	if (name == NULL)
		return 1;
	if (call->keylen > 0)
		memcpy(name, call->key, call->keylen);
	name[call->keylen] = '\0';
	struct tokenbucket *set[TOKENBUCKET_SET_MAX];
	struct tbr__local *slot[TOKENBUCKET_SET_MAX];
	int err = 1;
	pthread_mutex_lock(&r->lock);
	size_t i;
	for (i = 0; i < all->count; i++) {
		name[len - 1] = (char)i;
		struct tokenbucket_redis_limit lim = tbr__limit(&all->limits[i]);
		set[i] = local_bucket(r, name, len, &lim);
		slot[i] = r->local == NULL ? NULL : local_slot(r, name, len);
		bool clash = false;
		for (size_t j = 0; j < i; j++)
			clash |= slot[j] == slot[i];
		if (set[i] == NULL || clash)
			break;
	}
	if (i == all->count) {
		struct tokenbucket_set_result res;
		err = tokenbucket_allow_all(set, all->count, call->n, &res);
		if (err == -E2BIG) {
			/* n above a local share of a burst: refused, as a local allow refuses it. */
			for (i = 0; i + 1 < all->count && tokenbucket_burst(set[i]) >= call->n; i++)
				;
			struct tokenbucket_result one;
			local_result(set[i], false, TOKENBUCKET_NEVER, &one);
			res = (struct tokenbucket_set_result){ .index = i, .limit = one.limit,
							       .remaining = one.remaining,
							       .retry_after_ns = TOKENBUCKET_NEVER,
							       .reset_after_ns = one.reset_after_ns };
			err = 0;
		}
		if (err == 0 && all->res != NULL) {
			res.flags = TOKENBUCKET_RESULT_LOCAL;
			*all->res = res;
		}
		if (err != 0)
			err = 1;
	}
	pthread_mutex_unlock(&r->lock);
	free(name);
	return err;
}

static bool decides(const struct tokenbucket_redis_call *call)
{
	return call->op == TOKENBUCKET_REDIS_ALLOW || call->op == TOKENBUCKET_REDIS_RESERVE ||
	       call->op == TOKENBUCKET_REDIS_ALLOW_ALL;
}

int tbr__fallback_apply(struct tbr__fallback *fb, const struct tokenbucket_redis_call *call,
			int err, struct tokenbucket_result *res, struct tokenbucket_reservation *rv)
{
	if (unavailable(err) && fb->share > 0 && decides(call)) {
		int local = call->op == TOKENBUCKET_REDIS_ALLOW_ALL ? fallback_all(fb, call)
							   : fallback(fb, call, res, rv);
		if (local != 1)
			err = local;
	}
	return err;
}

bool tbr__fallback_down_returns(const struct tbr__fallback *fb,
				const struct tokenbucket_redis_call *call)
{
	return fb->share > 0 && decides(call);
}

void tbr__fallback_cancel(struct tbr__fallback *fb, const char *key, size_t len,
			  struct tokenbucket_reservation *rv)
{
	pthread_mutex_lock(&fb->lock);
	struct tbr__local *s = fb->local == NULL ? NULL : local_slot(fb, key, len);
	if (s != NULL && s->tb != NULL && s->keylen == len && memcmp(s->key, key, len) == 0)
		tokenbucket_cancel(s->tb, rv);
	rv->tokens = 0;
	pthread_mutex_unlock(&fb->lock);
}
