/* SPDX-License-Identifier: MIT */
/*
 * ngx_http_tokenbucket_module: per-key rate limits on libtokenbucket's
 * tables in nginx shared memory, or on buckets kept in Redis by
 * libtokenbucket-redis.  A consumer of the public headers only; rates,
 * bursts and key counts are read by tokenbucket_limit_parse, exactly.
 *
 *   tokenbucket_zone zone=NAME:SIZE | zone=NAME keys=N  rate=R [burst=B]
 *                    [rate=R [burst=B]]... [full=closed|open|evict];  (http)
 *   tokenbucket_zone zone=NAME redis=URL | cluster=SEED[,SEED...]  rate=R
 *                    [burst=B] [prefix=P] [fallback=SHARE] [timeout=T]
 *                    [lease=WINDOW [lease_share=F] [lease_hot=N] [lease_keys=N]];
 *   tokenbucket zone=NAME key=VALUE [cost=VALUE] [delay=TIME];
 *   tokenbucket_status CODE;  tokenbucket_dry_run on|off;
 *   tokenbucket_headers on|off|legacy;  tokenbucket_log_level LEVEL;
 *
 * A local zone's table is placed once in the zone's slab pool by the
 * master; every worker uses it lock-free (nginx's zone mutex is never taken
 * after that).  A zone's shm name carries a digest of its terms, so a
 * reload keeps a zone whose size, rates, bursts, keys and policy are
 * unchanged (nginx hands the same memory to the new cycle and the tables
 * are attached, not initialised) and any change makes it another zone to
 * nginx, with fresh memory.  A local zone of several rates ("rate=10r/s
 * rate=1000r/h") keeps a table per rate, side by side in its memory, and
 * a request takes its cost from every table or from none
 * (tokenbucket_table_allow_all_at, or a reservation per table where the
 * zone must reserve); a Redis zone of several rates keeps them in one key
 * (tokenbucket_redis_async_allow_all) and decides last in its location,
 * having nothing to give back.
 *
 * A Redis zone is decided by libtokenbucket-redis's asynchronous client,
 * one per zone in each worker (opened in init_process), driven by nginx's
 * own event loop: its sockets are nginx connections with level-triggered
 * read and write events, its timer an nginx timer.  A request waiting for
 * a reply returns NGX_AGAIN and is resumed by a posted event from the
 * reply's callback; the worker never blocks.  Both kinds follow the same
 * per-request protocol: decide, reserve with a bound, give back on refusal.
 * With lease=, a key that turns hot in a worker (lease_hot requests within
 * a second) gets a lease of that worker's asynchronous client: its
 * requests decided at once (the last limit of a location, without delay=)
 * are then decided from the tokens leased, with no round trip.
 *
 * This file holds the module's tables and the directives of where a limit
 * applies; ngx_http_tokenbucket_zone.c the zones, _redis.c the Redis
 * engines, _request.c the decision, _variables.c the variables.
 */
#include "ngx_http_tokenbucket.h"

static void *ngx_http_tokenbucket_create_conf(ngx_conf_t *cf);
static char *ngx_http_tokenbucket_merge_conf(ngx_conf_t *cf, void *parent, void *child);
static char *ngx_http_tokenbucket(ngx_conf_t *cf, ngx_command_t *cmd, void *conf);
static char *ngx_http_tokenbucket_status(ngx_conf_t *cf, ngx_command_t *cmd, void *conf);

static ngx_conf_enum_t ngx_http_tokenbucket_log_levels[] = {
	{ ngx_string("info"), NGX_LOG_INFO },
	{ ngx_string("notice"), NGX_LOG_NOTICE },
	{ ngx_string("warn"), NGX_LOG_WARN },
	{ ngx_string("error"), NGX_LOG_ERR },
	{ ngx_null_string, 0 },
};

static ngx_conf_enum_t ngx_http_tokenbucket_header_forms[] = {
	{ ngx_string("off"), NGX_HTTP_TB_HEADERS_OFF },
	{ ngx_string("on"), NGX_HTTP_TB_HEADERS_ON },
	{ ngx_string("legacy"), NGX_HTTP_TB_HEADERS_LEGACY },
	{ ngx_null_string, 0 },
};

static ngx_command_t ngx_http_tokenbucket_commands[] = {
	{ ngx_string("tokenbucket_zone"), NGX_HTTP_MAIN_CONF | NGX_CONF_2MORE,
	  ngx_http_tokenbucket_zone, 0, 0, NULL },
	{ ngx_string("tokenbucket"),
	  NGX_HTTP_MAIN_CONF | NGX_HTTP_SRV_CONF | NGX_HTTP_LOC_CONF | NGX_CONF_1MORE,
	  ngx_http_tokenbucket, NGX_HTTP_LOC_CONF_OFFSET, 0, NULL },
	{ ngx_string("tokenbucket_status"),
	  NGX_HTTP_MAIN_CONF | NGX_HTTP_SRV_CONF | NGX_HTTP_LOC_CONF | NGX_CONF_TAKE1,
	  ngx_http_tokenbucket_status, NGX_HTTP_LOC_CONF_OFFSET, 0, NULL },
	{ ngx_string("tokenbucket_log_level"),
	  NGX_HTTP_MAIN_CONF | NGX_HTTP_SRV_CONF | NGX_HTTP_LOC_CONF | NGX_CONF_TAKE1,
	  ngx_conf_set_enum_slot, NGX_HTTP_LOC_CONF_OFFSET,
	  offsetof(ngx_http_tokenbucket_conf_t, log_level), &ngx_http_tokenbucket_log_levels },
	{ ngx_string("tokenbucket_dry_run"),
	  NGX_HTTP_MAIN_CONF | NGX_HTTP_SRV_CONF | NGX_HTTP_LOC_CONF | NGX_CONF_FLAG,
	  ngx_conf_set_flag_slot, NGX_HTTP_LOC_CONF_OFFSET,
	  offsetof(ngx_http_tokenbucket_conf_t, dry_run), NULL },
	{ ngx_string("tokenbucket_headers"),
	  NGX_HTTP_MAIN_CONF | NGX_HTTP_SRV_CONF | NGX_HTTP_LOC_CONF | NGX_CONF_TAKE1,
	  ngx_conf_set_enum_slot, NGX_HTTP_LOC_CONF_OFFSET,
	  offsetof(ngx_http_tokenbucket_conf_t, headers), &ngx_http_tokenbucket_header_forms },
	ngx_null_command
};

static ngx_http_module_t ngx_http_tokenbucket_module_ctx = {
	ngx_http_tokenbucket_add_variables, /* preconfiguration */
	ngx_http_tokenbucket_init,          /* postconfiguration */
	NULL, NULL,                         /* main */
	NULL, NULL,                         /* server */
	ngx_http_tokenbucket_create_conf,   /* location */
	ngx_http_tokenbucket_merge_conf,
};

ngx_module_t ngx_http_tokenbucket_module = {
	NGX_MODULE_V1,
	&ngx_http_tokenbucket_module_ctx,
	ngx_http_tokenbucket_commands,
	NGX_HTTP_MODULE,
	NULL,                              /* init master */
	NULL,                              /* init module */
	ngx_http_tokenbucket_init_process, /* init process */
	NULL,                              /* init thread */
	NULL,                              /* exit thread */
	ngx_http_tokenbucket_exit_process, /* exit process */
	NULL,                              /* exit master */
	NGX_MODULE_V1_PADDING
};

/*
 * A key that is one variable ("$binary_remote_addr") is read by its index,
 * without the script engine's copy: NGX_ERROR for any other key.
 */
static ngx_int_t ngx_http_tokenbucket_one_variable(ngx_conf_t *cf, ngx_str_t *t)
{
	ngx_str_t name;
	ngx_uint_t i;

	/* Not "$1" (a capture) nor "${name}" nor text around the variable. */
	if (t->len < 2 || t->data[0] != '$' || (t->data[1] >= '0' && t->data[1] <= '9'))
		return NGX_ERROR;
	for (i = 1; i < t->len; i++)
		if (!((t->data[i] >= 'a' && t->data[i] <= 'z') ||
		      (t->data[i] >= 'A' && t->data[i] <= 'Z') ||
		      (t->data[i] >= '0' && t->data[i] <= '9') || t->data[i] == '_'))
			return NGX_ERROR;
	name.data = t->data + 1;
	name.len = t->len - 1;
	return ngx_http_get_variable_index(cf, &name);
}

static char *ngx_http_tokenbucket(ngx_conf_t *cf, ngx_command_t *cmd, void *conf)
{
	ngx_http_tokenbucket_conf_t *tcf = conf;
	ngx_str_t *value = cf->args->elts, name = ngx_null_string, v, t;
	ngx_http_tokenbucket_limit_t *limit;
	ngx_http_compile_complex_value_t ccv;
	ngx_int_t ms;
	ngx_uint_t i, have_key = 0;

	if (tcf->limits == NULL) {
		tcf->limits = ngx_array_create(cf->pool, 2, sizeof(*limit));
		if (tcf->limits == NULL)
			return NGX_CONF_ERROR;
	}
	limit = ngx_array_push(tcf->limits);
	if (limit == NULL)
		return NGX_CONF_ERROR;
	ngx_memzero(limit, sizeof(*limit));
	limit->key_index = NGX_ERROR;

	for (i = 1; i < cf->args->nelts; i++) {
		v = value[i];
		if (ngx_strncmp(v.data, "zone=", 5) == 0) {
			name.data = v.data + 5;
			name.len = v.len - 5;
			continue;
		}
		if (ngx_strncmp(v.data, "key=", 4) == 0 || ngx_strncmp(v.data, "cost=", 5) == 0) {
			size_t skip = v.data[0] == 'k' ? 4 : 5;
			ngx_http_complex_value_t *cv = &limit->key;
			t.data = v.data + skip;
			t.len = v.len - skip;
			if (t.len == 0)
				goto invalid;
			if (skip == 5) {
				cv = ngx_palloc(cf->pool, sizeof(*cv));
				if (cv == NULL)
					return NGX_CONF_ERROR;
				limit->cost = cv;
			} else {
				have_key = 1;
			}
			ngx_memzero(&ccv, sizeof(ccv));
			ccv.cf = cf;
			ccv.value = &t;
			ccv.complex_value = cv;
			if (ngx_http_compile_complex_value(&ccv) != NGX_OK)
				return NGX_CONF_ERROR;
			if (skip == 4)
				limit->key_index = ngx_http_tokenbucket_one_variable(cf, &t);
			continue;
		}
		if (ngx_strncmp(v.data, "delay=", 6) == 0) {
			t.data = v.data + 6;
			t.len = v.len - 6;
			ms = ngx_parse_time(&t, 0);
			if (ms == NGX_ERROR || t.len == 0)
				goto invalid;
			limit->delay = (ngx_msec_t)ms;
			continue;
		}
		if (ngx_strcmp(v.data, "nodelay") == 0) {
			limit->delay = 0;
			continue;
		}
		goto invalid;
	}
	if (name.len == 0 || !have_key) {
		ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
				   "tokenbucket: \"zone=\" and \"key=\" are required");
		return NGX_CONF_ERROR;
	}
	/*
	 * The shm zone's name is not NAME (see shm_add): a zone defined
	 * further on is found by merge_conf, through this stand-in's name.
	 */
	limit->shm_zone = ngx_http_tokenbucket_zone_of(cf->cycle, &name);
	if (limit->shm_zone == NULL) {
		limit->shm_zone = ngx_pcalloc(cf->pool, sizeof(*limit->shm_zone));
		if (limit->shm_zone == NULL)
			return NGX_CONF_ERROR;
		limit->shm_zone->shm.name = name;
	}
	return NGX_CONF_OK;

invalid:
	ngx_conf_log_error(NGX_LOG_EMERG, cf, 0, "tokenbucket: invalid parameter \"%V\"", &v);
	return NGX_CONF_ERROR;
}

static char *ngx_http_tokenbucket_status(ngx_conf_t *cf, ngx_command_t *cmd, void *conf)
{
	ngx_http_tokenbucket_conf_t *tcf = conf;
	ngx_str_t *value = cf->args->elts;
	ngx_int_t code;

	if (tcf->status != NGX_CONF_UNSET_UINT)
		return "is duplicate";
	code = ngx_atoi(value[1].data, value[1].len);
	if (code < 400 || code > 599) {
		ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
				   "tokenbucket_status: invalid code \"%V\": must be between 400 and 599",
				   &value[1]);
		return NGX_CONF_ERROR;
	}
	tcf->status = (ngx_uint_t)code;
	return NGX_CONF_OK;
}

/* NAME as a structured field's string: in quotes, '"' and '\\' escaped. */
static u_char *ngx_http_tokenbucket_sf_string(u_char *p, ngx_str_t *name)
{
	*p++ = '"';
	for (size_t i = 0; i < name->len; i++) {
		if (name->data[i] == '"' || name->data[i] == '\\')
			*p++ = '\\';
		*p++ = name->data[i];
	}
	*p++ = '"';
	return p;
}

/*
 * The draft's fields, made once here: each limit's start of RateLimit
 * ("NAME";r=), and RateLimit-Policy, one item a limit: "NAME";q=BURST;w=W,
 * W the whole seconds (rounded up, at least 1) its first rate takes to
 * refill the burst from empty; no w for a rate of 0.
 */
static ngx_int_t ngx_http_tokenbucket_policy(ngx_conf_t *cf, ngx_http_tokenbucket_conf_t *conf)
{
	ngx_http_tokenbucket_limit_t *l = conf->limits->elts;
	ngx_http_tokenbucket_zone_t *z;
	ngx_uint_t i, n = conf->limits->nelts;
	size_t size = 0;
	u_char *p;

	for (i = 0; i < n; i++)
		size += 2 * ((ngx_http_tokenbucket_zone_t *)l[i].shm_zone->data)->name.len + 2 +
			sizeof(";q=;w=, ") - 1 + 2 * NGX_INT64_LEN;
	p = ngx_pnalloc(cf->pool, size);
	if (p == NULL)
		return NGX_ERROR;
	conf->policy.data = p;
	for (i = 0; i < n; i++) {
		z = l[i].shm_zone->data;
		if (l[i].item.data == NULL) {
			/* Limits a location shares with its parent are made once. */
			l[i].item.data = ngx_pnalloc(cf->pool, 2 * z->name.len + 2 + 3);
			if (l[i].item.data == NULL)
				return NGX_ERROR;
			l[i].item.len = ngx_cpymem(ngx_http_tokenbucket_sf_string(l[i].item.data,
										  &z->name),
						   ";r=", 3) -
					l[i].item.data;
		}
		if (i > 0)
			p = ngx_cpymem(p, ", ", 2);
		p = ngx_http_tokenbucket_sf_string(p, &z->name);
		p = ngx_sprintf(p, ";q=%uL", (unsigned long long)z->rate[0].burst);
		if (z->rate[0].tokens != 0) {
			unsigned __int128 ns = (unsigned __int128)z->rate[0].burst *
					       (uint64_t)z->rate[0].period_ns;
			unsigned __int128 w = (ns + z->rate[0].tokens - 1) / z->rate[0].tokens;
			w = (w + 999999999) / 1000000000;
			p = ngx_sprintf(p, ";w=%uL",
					(unsigned long long)(w == 0 ? 1 : w > (uint64_t)NGX_MAX_INT_T_VALUE
									? (uint64_t)NGX_MAX_INT_T_VALUE
									: (uint64_t)w));
		}
	}
	conf->policy.len = p - conf->policy.data;
	return NGX_OK;
}

static void *ngx_http_tokenbucket_create_conf(ngx_conf_t *cf)
{
	ngx_http_tokenbucket_conf_t *conf = ngx_pcalloc(cf->pool, sizeof(*conf));
	if (conf == NULL)
		return NULL;
	conf->status = NGX_CONF_UNSET_UINT;
	conf->log_level = NGX_CONF_UNSET_UINT;
	conf->dry_run = NGX_CONF_UNSET;
	conf->headers = NGX_CONF_UNSET_UINT;
	return conf;
}

static char *ngx_http_tokenbucket_merge_conf(ngx_conf_t *cf, void *parent, void *child)
{
	ngx_http_tokenbucket_conf_t *prev = parent, *conf = child;
	ngx_http_tokenbucket_limit_t *l;
	ngx_http_tokenbucket_zone_t *z;
	ngx_shm_zone_t *sz;
	ngx_uint_t i;

	/* As limit_req: a level with no limit of its own takes its parent's. */
	if (conf->limits == NULL)
		conf->limits = prev->limits;
	ngx_conf_merge_uint_value(conf->status, prev->status, 429);
	ngx_conf_merge_uint_value(conf->log_level, prev->log_level, NGX_LOG_WARN);
	ngx_conf_merge_value(conf->dry_run, prev->dry_run, 0);
	ngx_conf_merge_uint_value(conf->headers, prev->headers, NGX_HTTP_TB_HEADERS_ON);
	if (conf->limits != NULL) {
		l = conf->limits->elts;
		for (i = 0; i < conf->limits->nelts; i++) {
			if (l[i].shm_zone->data == NULL) {
				sz = ngx_http_tokenbucket_zone_of(cf->cycle, &l[i].shm_zone->shm.name);
				if (sz != NULL)
					l[i].shm_zone = sz;
			}
			z = l[i].shm_zone->data;
			if (z == NULL) {
				ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
						   "tokenbucket: unknown zone \"%V\"",
						   &l[i].shm_zone->shm.name);
				return NGX_CONF_ERROR;
			}
			/*
			 * Redis decides several rates at once only (allow_all: no
			 * reservation to give back), so such a zone decides last.
			 */
			if (z->nseeds > 0 && z->nrates > 1 &&
			    (i + 1 != conf->limits->nelts || l[i].delay != 0)) {
				ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
						   "tokenbucket: the Redis zone \"%V\" of several "
						   "rates must be the last limit, without delay=",
						   &z->name);
				return NGX_CONF_ERROR;
			}
		}
		if (conf->headers == NGX_HTTP_TB_HEADERS_ON &&
		    ngx_http_tokenbucket_policy(cf, conf) != NGX_OK)
			return NGX_CONF_ERROR;
	}
	return NGX_CONF_OK;
}
