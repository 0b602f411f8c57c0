/* SPDX-License-Identifier: MIT */
/*
 * A request decided: its keys and costs, each limit asked in turn, what
 * was taken given back on a refusal, the RateLimit headers.
 */
#include "ngx_http_tokenbucket.h"

#include "decimal.h"

static void ngx_http_tokenbucket_ctx_cleanup(void *data)
{
	ngx_http_tokenbucket_ctx_t *ctx = data;

	/*
	 * Also marks the cleanup that carries the ctx (see get_ctx).  Braces
	 * around nginx's event macros: some are several statements.
	 */
	if (ctx->pending != NULL)
		ctx->pending->r = NULL;
	if (ctx->reply != NULL && ctx->reply->resume.posted) {
		ngx_delete_posted_event(&ctx->reply->resume);
	}
}

/* The decision made for this request, also after an internal redirect wiped the ctx. */
ngx_http_tokenbucket_ctx_t *ngx_http_tokenbucket_get_ctx(ngx_http_request_t *r)
{
	ngx_http_tokenbucket_ctx_t *ctx = ngx_http_get_module_ctx(r->main,
								  ngx_http_tokenbucket_module);
	ngx_pool_cleanup_t *c;

	if (ctx != NULL)
		return ctx;
	for (c = r->main->pool->cleanup; c != NULL; c = c->next)
		if (c->handler == ngx_http_tokenbucket_ctx_cleanup) {
			ngx_http_set_ctx(r->main, c->data, ngx_http_tokenbucket_module);
			return c->data;
		}
	return NULL;
}

static void ngx_http_tokenbucket_delay_handler(ngx_http_request_t *r)
{
	ngx_event_t *wev = r->connection->write;

	if (wev->delayed) {
		if (ngx_handle_write_event(wev, 0) != NGX_OK)
			ngx_http_finalize_request(r, NGX_HTTP_INTERNAL_SERVER_ERROR);
		return;
	}
	if (ngx_handle_read_event(r->connection->read, 0) != NGX_OK) {
		ngx_http_finalize_request(r, NGX_HTTP_INTERNAL_SERVER_ERROR);
		return;
	}
	r->read_event_handler = ngx_http_block_reading;
	r->write_event_handler = ngx_http_core_run_phases;
	ngx_http_core_run_phases(r);
}

/* Adds "name: value" (the value stays where it is). */
static ngx_inline ngx_int_t ngx_http_tokenbucket_field(ngx_http_request_t *r, ngx_str_t *name,
						       u_char *value, size_t len)
{
	ngx_table_elt_t *h = ngx_list_push(&r->headers_out.headers);

	if (h == NULL)
		return NGX_ERROR;
	h->hash = 1;
	h->key = *name;
	h->value.data = value;
	h->value.len = len;
#if nginx_version >= 1023000
	h->next = NULL;
#endif
	return NGX_OK;
}

/*
 * Adds "name: value", its digits written backwards to end, where the value
 * stays: no ngx_sprintf format parsing, no reversal, no copy.
 */
static ngx_inline ngx_int_t ngx_http_tokenbucket_header(ngx_http_request_t *r, ngx_str_t *name,
							u_char *end, uint64_t value)
{
	u_char *p = (u_char *)put_u64_back((char *)end, value);

	return ngx_http_tokenbucket_field(r, name, p, end - p);
}

/*
 * The draft's fields: RateLimit-Policy, fixed (merge_conf made it), and
 * RateLimit: "NAME";r=REMAINING;t=RESET, written backwards from its end in
 * one allocation; no t when the bucket never refills (reset < 0).
 */
static ngx_inline ngx_int_t ngx_http_tokenbucket_ratelimit(ngx_http_request_t *r,
						ngx_http_tokenbucket_conf_t *tcf,
						ngx_str_t *item, uint64_t remaining,
						ngx_int_t reset)
{
	static ngx_str_t policy = ngx_string("RateLimit-Policy");
	static ngx_str_t ratelimit = ngx_string("RateLimit");
	u_char *p = ngx_pnalloc(r->pool, item->len + 2 * NGX_INT64_LEN + 3), *end;

	if (p == NULL)
		return NGX_ERROR;
	end = p + item->len + 2 * NGX_INT64_LEN + 3;
	p = end;
	if (reset >= 0) {
		p = (u_char *)put_u64_back((char *)p, (uint64_t)reset);
		*--p = '=';
		*--p = 't';
		*--p = ';';
	}
	p = (u_char *)put_u64_back((char *)p, remaining);
	p -= item->len;
	ngx_memcpy(p, item->data, item->len);
	if (ngx_http_tokenbucket_field(r, &policy, tcf->policy.data, tcf->policy.len) != NGX_OK)
		return NGX_ERROR;
	return ngx_http_tokenbucket_field(r, &ratelimit, p, end - p);
}

/* The headers of limit i's report res, in the location's form, and Retry-After on a refusal. */
static ngx_int_t ngx_http_tokenbucket_headers(ngx_http_request_t *r,
					      ngx_http_tokenbucket_conf_t *tcf, ngx_uint_t i,
					      const struct tokenbucket_result *res)
{
	static ngx_str_t limit = ngx_string("RateLimit-Limit");
	static ngx_str_t remaining = ngx_string("RateLimit-Remaining");
	static ngx_str_t reset_name = ngx_string("RateLimit-Reset");
	static ngx_str_t retry_name = ngx_string("Retry-After");
	ngx_http_tokenbucket_limit_t *l = tcf->limits->elts;
	ngx_int_t reset = ngx_http_tokenbucket_seconds(res->reset_after_ns);
	ngx_int_t retry = ngx_http_tokenbucket_seconds(res->retry_after_ns);
	/* One allocation for the values, each ending at its own slot's end. */
	u_char *p = ngx_pnalloc(r->pool, 4 * NGX_INT64_LEN);

	if (p == NULL)
		return NGX_ERROR;
	if (tcf->headers == NGX_HTTP_TB_HEADERS_ON) {
		if (ngx_http_tokenbucket_ratelimit(r, tcf, &l[i].item, res->remaining, reset) !=
		    NGX_OK)
			return NGX_ERROR;
	} else {
		if (ngx_http_tokenbucket_header(r, &limit, p + NGX_INT64_LEN, res->limit) != NGX_OK ||
		    ngx_http_tokenbucket_header(r, &remaining, p + 2 * NGX_INT64_LEN,
						res->remaining) != NGX_OK)
			return NGX_ERROR;
		if (reset >= 0 && ngx_http_tokenbucket_header(r, &reset_name, p + 3 * NGX_INT64_LEN,
							      (uint64_t)reset) != NGX_OK)
			return NGX_ERROR;
	}
	if (!res->allowed && retry >= 0 &&
	    ngx_http_tokenbucket_header(r, &retry_name, p + 4 * NGX_INT64_LEN, (uint64_t)retry) !=
		    NGX_OK)
		return NGX_ERROR;
	return NGX_OK;
}

/* The request's cost: 1, or the value's whole number ("" is 0). */
static ngx_int_t ngx_http_tokenbucket_cost(ngx_http_request_t *r,
					   ngx_http_tokenbucket_limit_t *l, uint64_t *cost)
{
	ngx_str_t v;
	off_t n;

	*cost = 1;
	if (l->cost == NULL)
		return NGX_OK;
	if (ngx_http_complex_value(r, l->cost, &v) != NGX_OK)
		return NGX_ERROR;
	if (v.len == 0) {
		*cost = 0;
		return NGX_OK;
	}
	n = ngx_atoof(v.data, v.len);
	if (n == NGX_ERROR) {
		ngx_log_error(NGX_LOG_ERR, r->connection->log, 0,
			      "tokenbucket: cost \"%V\" is not a whole number", &v);
		return NGX_ERROR;
	}
	*cost = (uint64_t)n;
	return NGX_OK;
}

/* The reply of a Redis zone: kept in the ctx, the request resumed by a posted event. */
static void ngx_http_tokenbucket_reply(void *arg, int err, const struct tokenbucket_result *res,
				       const struct tokenbucket_reservation *rv, double tokens)
{
	ngx_http_tokenbucket_pending_t *p = arg;
	ngx_http_tokenbucket_ctx_t *ctx = p->ctx;

	(void)tokens;
	ngx_http_tokenbucket_busy(p->engine, -1);
	if (p->r != NULL) {
		ctx->pending = NULL;
		if (!p->engine->closing) {
			ctx->replied = 1;
			ctx->reply->err = err;
			ngx_memzero(&ctx->reply->res, sizeof(ctx->reply->res));
			ngx_memzero(&ctx->reply->rv, sizeof(ctx->reply->rv));
			if (res != NULL)
				ctx->reply->res = *res;
			if (rv != NULL)
				ctx->reply->rv = *rv;
			ctx->reply_at = tokenbucket_now();
			ngx_post_event(&ctx->reply->resume, &ngx_posted_events);
		}
	}
	ngx_free(p);
}

/* A set's report as one limit's: the rate that refused, or the one with the fewest tokens. */
static ngx_inline struct tokenbucket_result ngx_http_tokenbucket_result_of(
	const struct tokenbucket_set_result *set)
{
	return (struct tokenbucket_result){
		.allowed = set->allowed,
		.flags = set->flags,
		.limit = set->limit,
		.remaining = set->remaining,
		.retry_after_ns = set->retry_after_ns,
		.reset_after_ns = set->reset_after_ns,
	};
}

/* The reply of a Redis zone of several rates (tokenbucket_redis_async_allow_all). */
static void ngx_http_tokenbucket_reply_all(void *arg, int err,
					   const struct tokenbucket_set_result *set)
{
	struct tokenbucket_result res = ngx_http_tokenbucket_result_of(set);
	ngx_http_tokenbucket_reply(arg, err, &res, NULL, 0);
}

static void ngx_http_tokenbucket_resume(ngx_event_t *ev)
{
	ngx_http_request_t *r = ev->data;
	ngx_connection_t *c = r->connection;

	ngx_http_set_log_request(c->log, r);
	if (ngx_handle_read_event(c->read, 0) != NGX_OK) {
		ngx_http_finalize_request(r, NGX_HTTP_INTERNAL_SERVER_ERROR);
	} else {
		r->read_event_handler = ngx_http_block_reading;
		r->write_event_handler = ngx_http_core_run_phases;
		ngx_http_core_run_phases(r);
	}
	ngx_http_run_posted_requests(c);
}

static void ngx_http_tokenbucket_forget(void *arg, int err, const struct tokenbucket_result *res,
					const struct tokenbucket_reservation *rv, double tokens)
{
	ngx_http_tokenbucket_engine_t *e = arg;

	(void)res, (void)rv, (void)tokens;
	ngx_http_tokenbucket_busy(e, -1);
	if (err != 0 && err != -ECANCELED)
		ngx_log_error(NGX_LOG_WARN, e->log, -err,
			      "tokenbucket_zone \"%V\": tokens of a refused request not given back",
			      &e->zone->name);
}

/* Starts limit i's call on its Redis zone; the request waits for the reply. */
static int ngx_http_tokenbucket_ask(ngx_http_request_t *r, ngx_http_tokenbucket_ctx_t *ctx,
				    ngx_http_tokenbucket_zone_t *z, ngx_uint_t i,
				    enum tokenbucket_redis_op op, int64_t max_wait)
{
	ngx_http_tokenbucket_engine_t *e = z->engine;
	ngx_http_tokenbucket_pending_t *p;
	struct tokenbucket_redis_call call = {
		.op = op,
		.key = ctx->keys[i].data,
		.keylen = ctx->keys[i].len,
		.limit = { z->rate[0].tokens, z->rate[0].period_ns, z->rate[0].burst },
		.n = ctx->costs[i],
		.arg = op == TOKENBUCKET_REDIS_RESERVE ? max_wait : 0,
	};
	int rc;

	if (e == NULL)
		return -ENOTCONN;
	if (ctx->reply == NULL) {
		ctx->reply = ngx_pcalloc(r->main->pool, sizeof(*ctx->reply));
		if (ctx->reply == NULL)
			return -ENOMEM;
		ctx->reply->resume.handler = ngx_http_tokenbucket_resume;
		ctx->reply->resume.data = r;
		ctx->reply->resume.log = r->connection->log;
	}
	p = ngx_alloc(sizeof(*p), r->connection->log);
	if (p == NULL)
		return -ENOMEM;
	p->r = r;
	p->ctx = ctx;
	p->engine = e;
	if (z->nrates > 1) {
		/* The location's last limit, without delay (merge_conf): all rates or none. */
		struct tokenbucket_redis_limit lim[NGX_HTTP_TB_RATES_MAX];
		for (ngx_uint_t t = 0; t < z->nrates; t++)
			lim[t] = (struct tokenbucket_redis_limit){ z->rate[t].tokens,
								   z->rate[t].period_ns,
								   z->rate[t].burst };
		rc = tokenbucket_redis_async_allow_all(e->async, call.key, call.keylen, lim,
						       z->nrates, call.n,
						       ngx_http_tokenbucket_reply_all, p);
	} else {
		rc = tokenbucket_redis_async_start(e->async, &call, ngx_http_tokenbucket_reply, p);
	}
	if (rc != 0) {
		ngx_free(p);
		return rc;
	}
	ngx_http_tokenbucket_busy(e, 1);
	ctx->pending = p;
	r->read_event_handler = ngx_http_test_reading;
	r->write_event_handler = ngx_http_request_empty_handler;
	return 0;
}

/* The reservation of limit i's t-th rate (a Redis zone's is t = 0). */
static ngx_inline struct tokenbucket_reservation *ngx_http_tokenbucket_rv(
	ngx_http_tokenbucket_ctx_t *ctx, ngx_uint_t i, ngx_uint_t t)
{
	return &ctx->rv[i * NGX_HTTP_TB_RATES_MAX + t];
}

/*
 * Gives back a local zone's reservations rv[0] to rv[upto - 1] by the
 * library's give-back rule (tokenbucket_table_refund): all of them, within
 * burst, however far other requests moved the key's clock meanwhile.
 */
static void ngx_http_tokenbucket_refund_local(ngx_http_tokenbucket_zone_t *z, ngx_str_t *k,
					      struct tokenbucket_reservation *rv,
					      ngx_uint_t upto, int64_t now)
{
	for (ngx_uint_t t = 0; t < upto; t++) {
		if (rv[t].tokens != 0)
			(void)tokenbucket_table_refund_at(z->table[t], now, k->data, k->len,
							  rv[t].tokens);
		rv[t].tokens = 0;
	}
}

/*
 * A local zone's decision at once: cost from every rate's table or from
 * none, at now.  0 with *res (for several rates, the report of the table
 * that refused, or of the one with the fewest tokens left), or the
 * library's error.
 */
static int ngx_http_tokenbucket_allow_local(ngx_http_tokenbucket_zone_t *z, int64_t now,
					    ngx_str_t *k, uint64_t cost,
					    struct tokenbucket_result *res)
{
	struct tokenbucket_set_result set;
	ngx_uint_t t;
	int rc;

	if (z->nrates == 1)
		return tokenbucket_table_allow_result_at(z->table[0], now, k->data, k->len, cost,
							 res);
	rc = tokenbucket_table_allow_all_at(z->table, z->nrates, now, k->data, k->len, cost, &set);
	if (rc == -E2BIG) {
		/* Above some rate's burst: refused, as that table alone refuses it. */
		for (t = 0; t + 1 < z->nrates && cost <= z->rate[t].burst; t++)
			;
		return tokenbucket_table_allow_result_at(z->table[t], now, k->data, k->len, cost,
							 res);
	}
	if (rc != 0)
		return rc;
	*res = ngx_http_tokenbucket_result_of(&set);
	return 0;
}

/* A local zone's tokens now, for the headers: the rate with the fewest whole tokens. */
int ngx_http_tokenbucket_report_local(ngx_http_tokenbucket_zone_t *z, int64_t now,
					     ngx_str_t *k, struct tokenbucket_result *res)
{
	struct tokenbucket_result one;
	int rc;

	for (ngx_uint_t t = 0; t < z->nrates; t++) {
		rc = tokenbucket_table_allow_result_at(z->table[t], now, k->data, k->len, 0,
						       t == 0 ? res : &one);
		if (rc != 0)
			return rc;
		if (t > 0 && one.remaining < res->remaining)
			*res = one;
	}
	return 0;
}

/*
 * Limit i's reservation in local zone z: cost from every rate's table,
 * waiting at most max_wait, or from none.  0, ctx->until moved to when
 * all are there; 1 refused, *res the report of the table that could not
 * (its tokens now, and when cost of them is there); or the library's
 * error.
 */
static int ngx_http_tokenbucket_reserve_local(ngx_http_tokenbucket_zone_t *z,
					      ngx_http_tokenbucket_ctx_t *ctx, ngx_uint_t i,
					      int64_t max_wait, struct tokenbucket_result *res)
{
	struct tokenbucket_reservation *rv = ngx_http_tokenbucket_rv(ctx, i, 0), probe;
	struct tokenbucket_table *table;
	ngx_str_t *k = &ctx->keys[i];
	uint64_t cost = ctx->costs[i];
	int64_t now = ctx->now;
	ngx_uint_t t;
	int rc = 0, err;

	for (t = 0; t < z->nrates; t++) {
		rc = tokenbucket_table_reserve_at(z->table[t], now, k->data, k->len, cost, max_wait,
						  &rv[t]);
		if (rc != 0)
			break;
		if (rv[t].time_to_act > ctx->until)
			ctx->until = rv[t].time_to_act;
	}
	if (rc == 0)
		return 0;
	/* All or nothing: the rates before this one give back what they took. */
	ngx_http_tokenbucket_refund_local(z, k, rv, t, now);
	if (rc != -ETIMEDOUT && rc != -E2BIG && rc != -EBUSY && rc != -EOVERFLOW)
		return rc;
	table = z->table[t];
	err = tokenbucket_table_allow_result_at(table, now, k->data, k->len, 0, res);
	if (err != 0)
		return err;
	res->allowed = false;
	res->retry_after_ns = TOKENBUCKET_NEVER;
	if (rc == -ETIMEDOUT && tokenbucket_table_reserve_at(table, now, k->data, k->len, cost,
							      TOKENBUCKET_NEVER, &probe) == 0) {
		res->retry_after_ns = probe.time_to_act - now;
		(void)tokenbucket_table_refund_at(table, now, k->data, k->len, probe.tokens);
	}
	return 1;
}

/*
 * Gives back what limits 0 to upto - 1 took for a request refused or
 * failed, by the library's give-back rule (docs/core.md, "Giving back"):
 * a table's reservation is refunded to its key; a Redis reservation is
 * refunded in Redis (no reply awaited), or to the fallback's bucket that
 * granted it.
 */
static void ngx_http_tokenbucket_give_back(ngx_http_request_t *r, ngx_http_tokenbucket_ctx_t *ctx,
					   ngx_uint_t upto)
{
	ngx_http_tokenbucket_conf_t *tcf = ngx_http_get_module_loc_conf(r,
									ngx_http_tokenbucket_module);
	ngx_http_tokenbucket_limit_t *limits = tcf->limits->elts;
	ngx_http_tokenbucket_zone_t *z;
	struct tokenbucket_reservation *rv;
	ngx_str_t *k;
	ngx_uint_t j;

	for (j = 0; j < upto; j++) {
		k = &ctx->keys[j];
		rv = ngx_http_tokenbucket_rv(ctx, j, 0);
		if (k->len == 0)
			continue;
		z = limits[j].shm_zone->data;
		if (z->nseeds == 0) {
			ngx_http_tokenbucket_refund_local(z, k, rv, z->nrates, ctx->now);
			continue;
		}
		if (rv->tokens == 0)
			continue;
		struct tokenbucket_redis_limit lim = { z->rate[0].tokens, z->rate[0].period_ns,
						       z->rate[0].burst };
		if (ctx->local[j]) {
			/* Go's cancel that is never too late: the request used none of them. */
			rv->time_to_act = TOKENBUCKET_NEVER;
			tokenbucket_redis_cancel(z->engine->client, k->data, k->len, &lim, rv);
			continue;
		}
		struct tokenbucket_redis_call call = {
			.op = TOKENBUCKET_REDIS_REFUND, .key = k->data, .keylen = k->len,
			.limit = lim, .n = rv->tokens,
		};
		if (tokenbucket_redis_async_start(z->engine->async, &call, ngx_http_tokenbucket_forget,
						  z->engine) == 0)
			ngx_http_tokenbucket_busy(z->engine, 1);
		rv->tokens = 0;
	}
}

/*
 * The grant of a local zone's last limit (one rate, not empty, no delay)
 * when at most the draft's RateLimit shows its report (no older headers,
 * no variable, no earlier limit's): the plain decision builds no report
 * (tokenbucket_table_allow_reset reports only what RateLimit shows), and
 * a variable looked up by name later makes it (lazy).  1 granted (its
 * headers added); 0 for a refusal or an error, which take nothing: decide
 * then decides again with the report, at the same now; NGX_ERROR if the
 * headers could not be added.
 */
static ngx_inline ngx_int_t ngx_http_tokenbucket_unreported(ngx_http_request_t *r,
							    ngx_http_tokenbucket_conf_t *tcf,
							    ngx_http_tokenbucket_zone_t *z,
							    ngx_http_tokenbucket_ctx_t *ctx,
							    ngx_uint_t i)
{
	ngx_http_tokenbucket_limit_t *l = tcf->limits->elts;
	ngx_str_t *k = &ctx->keys[i];
	uint64_t remaining;
	int64_t reset;

	if (tcf->headers == NGX_HTTP_TB_HEADERS_LEGACY || ngx_http_tokenbucket_vars_indexed ||
	    z->nseeds > 0 || z->nrates != 1 || ctx->have_best || ctx->plain_refused)
		return 0;
	if (tcf->headers == NGX_HTTP_TB_HEADERS_OFF || tcf->dry_run) {
		if (!tokenbucket_table_allow_at(z->table[0], ctx->now, k->data, k->len,
						ctx->costs[i])) {
			ctx->plain_refused = 1;
			return 0;
		}
	} else {
		if (tokenbucket_table_allow_reset_at(z->table[0], ctx->now, k->data, k->len,
						     ctx->costs[i], &remaining, &reset) != 1) {
			ctx->plain_refused = 1;
			return 0;
		}
		if (ngx_http_tokenbucket_ratelimit(r, tcf, &l[i].item, remaining,
						   reset == TOKENBUCKET_NEVER ? -1
									     : (ngx_int_t)reset) != NGX_OK)
			return NGX_ERROR;
	}
	ctx->lazy = i + 1;
	return 1;
}

/*
 * Every limit must allow.  Each takes its tokens by reservation, the last
 * (without delay) by allow_result; on a refusal what was taken is given
 * back, so a refused request takes nothing.  A Redis zone's limit returns
 * NGX_AGAIN with its call in flight; the reply resumes here at that limit.
 */
static ngx_int_t ngx_http_tokenbucket_decide(ngx_http_request_t *r, ngx_http_tokenbucket_ctx_t *ctx)
{
	ngx_http_tokenbucket_conf_t *tcf = ngx_http_get_module_loc_conf(r,
									ngx_http_tokenbucket_module);
	ngx_http_tokenbucket_limit_t *limits = tcf->limits->elts;
	ngx_http_tokenbucket_zone_t *z;
	struct tokenbucket_result res;
	ngx_str_t *k;
	ngx_uint_t i, n = tcf->limits->nelts, level, last;
	uint64_t cost = 0;
	int64_t now = ctx->now, wait, max_wait;
	int rc = 0;

	for (i = ctx->next; i < n; i++) {
		z = limits[i].shm_zone->data;
		k = &ctx->keys[i];
		cost = ctx->costs[i];
		if (k->len == 0 || cost == 0)
			continue; /* as limit_req: an empty key is not limited */
		max_wait = (int64_t)limits[i].delay * 1000000;
		last = i == n - 1 && max_wait == 0;
		if (z->nseeds > 0 && !ctx->replied && last &&
		    ngx_http_tokenbucket_leased(z, k, cost, &res) == NGX_OK) {
			if (!res.allowed)
				goto refused;
		} else if (z->nseeds > 0) {
			if (!ctx->replied) {
				rc = ngx_http_tokenbucket_ask(r, ctx, z, i,
							      last ? TOKENBUCKET_REDIS_ALLOW
								   : TOKENBUCKET_REDIS_RESERVE,
							      max_wait);
				if (rc != 0)
					goto lib_error;
				ctx->next = i;
				return NGX_AGAIN;
			}
			ctx->replied = 0;
			rc = ctx->reply->err;
			res = ctx->reply->res;
			if (rc == -ETIMEDOUT || rc == -E2BIG || rc == -EOVERFLOW) {
				res.allowed = false;
				if (rc != -ETIMEDOUT)
					res.retry_after_ns = TOKENBUCKET_NEVER;
				goto refused;
			}
			if (rc != 0)
				goto lib_error;
			if (last && !res.allowed)
				goto refused;
			if (!last) {
				*ngx_http_tokenbucket_rv(ctx, i, 0) = ctx->reply->rv;
				ctx->local[i] = (res.flags & TOKENBUCKET_RESULT_LOCAL) != 0;
				/* A granted reservation's retry_after_ns is its delay. */
				if (res.retry_after_ns > 0 &&
				    ctx->reply_at + res.retry_after_ns > ctx->until)
					ctx->until = ctx->reply_at + res.retry_after_ns;
			}
		} else if (last) {
			rc = (int)ngx_http_tokenbucket_unreported(r, tcf, z, ctx, i);
			if (rc == NGX_ERROR)
				return NGX_HTTP_INTERNAL_SERVER_ERROR;
			if (rc == 1)
				continue;
			rc = ngx_http_tokenbucket_allow_local(z, now, k, cost, &res);
			if (rc != 0)
				goto lib_error;
			if (!res.allowed)
				goto refused;
		} else {
			rc = ngx_http_tokenbucket_reserve_local(z, ctx, i, max_wait, &res);
			if (rc == 1)
				goto refused;
			if (rc != 0)
				goto lib_error;
			if (!tcf->headers)
				continue;
			if (ngx_http_tokenbucket_report_local(z, now, k, &res) != 0)
				goto lib_error;
		}
		if (!ctx->have_best || res.remaining < ctx->best.remaining) {
			ctx->best = res;
			ctx->best_limit = i;
			ctx->have_best = 1;
		}
	}

	ctx->deciding = 0;
	if (ctx->have_best) {
		ctx->res = ctx->best;
		ctx->has_res = 1;
		if (tcf->headers && !tcf->dry_run &&
		    ngx_http_tokenbucket_headers(r, tcf, ctx->best_limit, &ctx->best) != NGX_OK)
			return NGX_HTTP_INTERNAL_SERVER_ERROR;
	}
	if (ctx->until <= now)
		return NGX_DECLINED;
	/* What is left of the delay once the replies came. */
	wait = ctx->until - (ctx->reply_at != 0 ? tokenbucket_now() : now);
	if (wait <= 0)
		return NGX_DECLINED;
	if (tcf->dry_run) {
		ctx->status = NGX_HTTP_TB_DELAYED_DRY_RUN;
		ngx_log_error(tcf->log_level, r->connection->log, 0,
			      "tokenbucket: would delay the request %M ms (dry run)",
			      (ngx_msec_t)((wait + 999999) / 1000000));
		return NGX_DECLINED;
	}
	ctx->status = NGX_HTTP_TB_DELAYED;
	/* As limit_req: a delay is logged one level below a refusal. */
	level = tcf->log_level == NGX_LOG_INFO ? NGX_LOG_INFO : tcf->log_level + 1;
	ngx_log_error(level, r->connection->log, 0, "tokenbucket: delaying the request %M ms",
		      (ngx_msec_t)((wait + 999999) / 1000000));
	r->read_event_handler = ngx_http_test_reading;
	r->write_event_handler = ngx_http_tokenbucket_delay_handler;
	r->connection->write->delayed = 1;
	ngx_add_timer(r->connection->write, (ngx_msec_t)((wait + 999999) / 1000000));
	return NGX_AGAIN;

refused:
	ngx_http_tokenbucket_give_back(r, ctx, i);
	ctx->deciding = 0;
	ctx->res = res;
	ctx->has_res = 1;
	ngx_log_error(tcf->log_level, r->connection->log, 0,
		      "tokenbucket: %s request by zone \"%V\", cost %uL%s%s",
		      tcf->dry_run ? "would refuse the" : "refusing the", &z->name,
		      (unsigned long long)cost,
		      res.flags & TOKENBUCKET_RESULT_NO_BUCKET ? ", the zone is full" : "",
		      res.flags & TOKENBUCKET_RESULT_LOCAL ? ", decided by the fallback" : "");
	if (tcf->dry_run) {
		ctx->status = NGX_HTTP_TB_REJECTED_DRY_RUN;
		return NGX_DECLINED;
	}
	ctx->status = NGX_HTTP_TB_REJECTED;
	if (tcf->headers && ngx_http_tokenbucket_headers(r, tcf, i, &res) != NGX_OK)
		return NGX_HTTP_INTERNAL_SERVER_ERROR;
	return (ngx_int_t)tcf->status;

lib_error:
	ngx_log_error(NGX_LOG_ERR, r->connection->log, -rc, "tokenbucket: zone \"%V\" failed",
		      &z->name);
	ngx_http_tokenbucket_give_back(r, ctx, i);
	ctx->deciding = 0;
	return NGX_HTTP_INTERNAL_SERVER_ERROR;
}

ngx_int_t ngx_http_tokenbucket_handler(ngx_http_request_t *r)
{
	ngx_http_tokenbucket_conf_t *tcf;
	ngx_http_tokenbucket_limit_t *limits;
	ngx_http_tokenbucket_ctx_t *ctx = ngx_http_tokenbucket_get_ctx(r);
	ngx_http_variable_value_t *vv;
	ngx_pool_cleanup_t *cln;
	ngx_int_t rc;
	ngx_uint_t i, n, nrv;
	size_t size;
	u_char *p;

	if (ctx != NULL) {
		if (!ctx->deciding)
			return NGX_DECLINED; /* decided already (after a delay or a redirect) */
		if (ctx->pending != NULL)
			return NGX_AGAIN; /* still waiting for Redis */
		return ngx_http_tokenbucket_decide(r, ctx);
	}
	tcf = ngx_http_get_module_loc_conf(r, ngx_http_tokenbucket_module);
	if (tcf->limits == NULL)
		return NGX_DECLINED;

	n = tcf->limits->nelts;
	limits = tcf->limits->elts;
	/* The last limit without delay decides at once: it reserves nothing. */
	nrv = limits[n - 1].delay == 0 ? n - 1 : n;
	size = sizeof(*ctx) + nrv * NGX_HTTP_TB_RATES_MAX * sizeof(*ctx->rv) +
	       n * (sizeof(*ctx->keys) + sizeof(*ctx->costs) + sizeof(*ctx->local));
	/* The ctx is the cleanup's data: one call allocates both. */
	cln = ngx_pool_cleanup_add(r->main->pool, size);
	if (cln == NULL)
		return NGX_HTTP_INTERNAL_SERVER_ERROR;
	p = cln->data;
	ngx_memzero(p, size);
	ctx = (ngx_http_tokenbucket_ctx_t *)p;
	ctx->rv = (struct tokenbucket_reservation *)(ctx + 1);
	ctx->keys = (ngx_str_t *)(ctx->rv + nrv * NGX_HTTP_TB_RATES_MAX);
	ctx->costs = (uint64_t *)(ctx->keys + n);
	ctx->local = (u_char *)(ctx->costs + n);
	cln->handler = ngx_http_tokenbucket_ctx_cleanup;
	ngx_http_set_ctx(r->main, ctx, ngx_http_tokenbucket_module);
	ctx->status = NGX_HTTP_TB_PASSED;

	for (i = 0; i < n; i++) {
		if (limits[i].key_index != NGX_ERROR) {
			/* As the complex value would be: "" when not found. */
			vv = ngx_http_get_indexed_variable(r, limits[i].key_index);
			if (vv == NULL)
				return NGX_HTTP_INTERNAL_SERVER_ERROR;
			if (!vv->not_found) {
				ctx->keys[i].data = vv->data;
				ctx->keys[i].len = vv->len;
			}
		} else if (ngx_http_complex_value(r, &limits[i].key, &ctx->keys[i]) != NGX_OK) {
			return NGX_HTTP_INTERNAL_SERVER_ERROR;
		}
		if (ngx_http_tokenbucket_cost(r, &limits[i], &ctx->costs[i]) != NGX_OK)
			return NGX_HTTP_INTERNAL_SERVER_ERROR;
	}
	ctx->now = tokenbucket_now();
	ctx->until = ctx->now;
	/* As decide would end for this one limit, without its generic loop. */
	if (n == 1 && limits[0].delay == 0 && ctx->keys[0].len != 0 && ctx->costs[0] != 0 &&
	    (rc = ngx_http_tokenbucket_unreported(r, tcf, limits[0].shm_zone->data, ctx, 0)) != 0)
		return rc == 1 ? NGX_DECLINED : NGX_HTTP_INTERNAL_SERVER_ERROR;
	ctx->deciding = 1;
	return ngx_http_tokenbucket_decide(r, ctx);
}
