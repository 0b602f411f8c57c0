/* SPDX-License-Identifier: MIT */
/*
 * ngx_http_tokenbucket_module: per-key rate limits on libtokenbucket's
 * tables, in nginx shared memory.  A consumer of include/tokenbucket.h
 * only; the rates are read by tbrate's exact parser (tools/tbrate/units.c).
 *
 *   tokenbucket_zone zone=NAME:SIZE | zone=NAME keys=N  rate=R [burst=B]
 *                    [full=closed|open|evict];                      (http)
 *   tokenbucket zone=NAME key=VALUE [cost=VALUE] [delay=TIME];
 *   tokenbucket_status CODE;  tokenbucket_dry_run on|off;
 *   tokenbucket_headers on|off;  tokenbucket_log_level LEVEL;
 *
 * The table is placed once in the zone's slab pool by the master; every
 * worker uses it lock-free (nginx's zone mutex is never taken after that).
 * A reload keeps a zone whose size, rate, burst, keys and policy are
 * unchanged: nginx hands the old memory to the new cycle and the table is
 * attached, not initialised.  Any change gives the zone fresh memory.
 *
 * A zone is a table reached through three calls (decide, reserve, cancel);
 * a zone of another kind (kept in Redis, say) would be a second set of
 * them selected by the zone's kind, with the same per-request protocol.
 */
#include <ngx_config.h>
#include <ngx_core.h>
#include <ngx_http.h>

#include <errno.h>
#include <tokenbucket.h>

#include "units.h"

#define NGX_HTTP_TB_PASSED 1
#define NGX_HTTP_TB_DELAYED 2
#define NGX_HTTP_TB_REJECTED 3
#define NGX_HTTP_TB_DELAYED_DRY_RUN 4
#define NGX_HTTP_TB_REJECTED_DRY_RUN 5

/* Limits of one location decided without allocating (more are allocated). */
#define NGX_HTTP_TB_LOCAL_LIMITS 8

/* Room the slab pool takes besides the table: its header and page table. */
#define NGX_HTTP_TB_SLAB_PAGES 8

typedef struct {
	ngx_str_t name;
	uint64_t tokens;   /* per period_ns: the exact rate */
	int64_t period_ns;
	uint64_t burst;
	uint64_t capacity; /* keys (slots) */
	unsigned flags;    /* TOKENBUCKET_TABLE_FAIL_OPEN or _EVICT, or 0 */
	size_t table_size;
	void *mem;         /* the table, in the zone's slab pool */
	struct tokenbucket_table *table; /* this cycle's handle, set by init */
} ngx_http_tokenbucket_zone_t;

typedef struct {
	ngx_shm_zone_t *shm_zone;
	ngx_http_complex_value_t key;
	ngx_http_complex_value_t *cost; /* NULL: one token a request */
	ngx_msec_t delay;               /* the longest wait; 0 refuses at once */
} ngx_http_tokenbucket_limit_t;

typedef struct {
	ngx_array_t *limits; /* of ngx_http_tokenbucket_limit_t */
	ngx_uint_t status;
	ngx_uint_t log_level;
	ngx_flag_t dry_run;
	ngx_flag_t headers;
} ngx_http_tokenbucket_conf_t;

/* One request's decision; found again after an internal redirect. */
typedef struct {
	ngx_uint_t status; /* NGX_HTTP_TB_* */
	struct tokenbucket_result res;
	unsigned has_res:1;
} ngx_http_tokenbucket_ctx_t;

static ngx_int_t ngx_http_tokenbucket_init(ngx_conf_t *cf);
static ngx_int_t ngx_http_tokenbucket_add_variables(ngx_conf_t *cf);
static void *ngx_http_tokenbucket_create_conf(ngx_conf_t *cf);
static char *ngx_http_tokenbucket_merge_conf(ngx_conf_t *cf, void *parent, void *child);
static char *ngx_http_tokenbucket_zone(ngx_conf_t *cf, ngx_command_t *cmd, void *conf);
static char *ngx_http_tokenbucket(ngx_conf_t *cf, ngx_command_t *cmd, void *conf);
static char *ngx_http_tokenbucket_status(ngx_conf_t *cf, ngx_command_t *cmd, void *conf);

static ngx_conf_enum_t ngx_http_tokenbucket_log_levels[] = {
	{ ngx_string("info"), NGX_LOG_INFO },
	{ ngx_string("notice"), NGX_LOG_NOTICE },
	{ ngx_string("warn"), NGX_LOG_WARN },
	{ ngx_string("error"), NGX_LOG_ERR },
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
	  NGX_HTTP_MAIN_CONF | NGX_HTTP_SRV_CONF | NGX_HTTP_LOC_CONF | NGX_CONF_FLAG,
	  ngx_conf_set_flag_slot, NGX_HTTP_LOC_CONF_OFFSET,
	  offsetof(ngx_http_tokenbucket_conf_t, headers), NULL },
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
	NULL, NULL, NULL, NULL, NULL, NULL, NULL,
	NGX_MODULE_V1_PADDING
};

/* ---- The zone ------------------------------------------------------------ */

static ngx_int_t ngx_http_tokenbucket_init_zone(ngx_shm_zone_t *shm_zone, void *data)
{
	ngx_http_tokenbucket_zone_t *z = shm_zone->data, *old = data;
	ngx_slab_pool_t *shpool = (ngx_slab_pool_t *)shm_zone->shm.addr;
	int rc;

	if (old != NULL) {
		/* A reload with unchanged parameters (else noreuse was set). */
		z->mem = old->mem;
		rc = tokenbucket_table_attach_shared(&z->table, z->mem, z->table_size);
		if (rc == 0)
			return NGX_OK;
		ngx_log_error(NGX_LOG_EMERG, shm_zone->shm.log, -rc,
			      "tokenbucket_zone \"%V\": cannot attach the table kept over reload",
			      &z->name);
		return NGX_ERROR;
	}
	z->mem = ngx_slab_alloc(shpool, z->table_size);
	if (z->mem == NULL) {
		ngx_log_error(NGX_LOG_EMERG, shm_zone->shm.log, 0,
			      "tokenbucket_zone \"%V\": zone too small for %uL keys", &z->name,
			      (unsigned long long)z->capacity);
		return NGX_ERROR;
	}
	rc = tokenbucket_table_init_shared(&z->table, z->mem, z->table_size, z->tokens,
					   z->period_ns, z->burst, z->capacity, z->flags);
	if (rc != 0) {
		ngx_log_error(NGX_LOG_EMERG, shm_zone->shm.log, -rc,
			      "tokenbucket_zone \"%V\": cannot place the table", &z->name);
		return NGX_ERROR;
	}
	shpool->data = z->mem;
	return NGX_OK;
}

/* The cycle's pool owns the handle (not the table, which the zone keeps). */
static void ngx_http_tokenbucket_free_handle(void *data)
{
	ngx_http_tokenbucket_zone_t *z = data;
	tokenbucket_table_free(z->table);
	z->table = NULL;
}

/* The old cycle's zone of that name, if it is ours. */
static ngx_http_tokenbucket_zone_t *ngx_http_tokenbucket_old_zone(ngx_conf_t *cf,
								    ngx_str_t *name)
{
	ngx_cycle_t *old = cf->cycle->old_cycle;
	ngx_list_part_t *part;
	ngx_shm_zone_t *zone;
	ngx_uint_t i;

	if (old == NULL || old->shared_memory.part.elts == NULL)
		return NULL;
	part = &old->shared_memory.part;
	zone = part->elts;
	for (i = 0;; i++) {
		if (i >= part->nelts) {
			if (part->next == NULL)
				return NULL;
			part = part->next;
			zone = part->elts;
			i = 0;
		}
		if (zone[i].tag == &ngx_http_tokenbucket_module && zone[i].shm.name.len == name->len &&
		    ngx_strncmp(zone[i].shm.name.data, name->data, name->len) == 0)
			return zone[i].data;
	}
}

static char *ngx_http_tokenbucket_param(ngx_conf_t *cf, ngx_str_t *v, const char *what,
					const char *why)
{
	ngx_conf_log_error(NGX_LOG_EMERG, cf, 0, "tokenbucket_zone: invalid %s \"%V\": %s", what,
			   v, why);
	return NGX_CONF_ERROR;
}

/* A NUL-terminated copy of the value after "name=" for the parser. */
static char *ngx_http_tokenbucket_cstr(ngx_conf_t *cf, ngx_str_t *v, size_t skip)
{
	char *s = ngx_pnalloc(cf->pool, v->len - skip + 1);
	if (s != NULL) {
		ngx_memcpy(s, v->data + skip, v->len - skip);
		s[v->len - skip] = '\0';
	}
	return s;
}

static char *ngx_http_tokenbucket_zone(ngx_conf_t *cf, ngx_command_t *cmd, void *conf)
{
	ngx_str_t *value = cf->args->elts, name = ngx_null_string, v;
	ngx_http_tokenbucket_zone_t *z, *old;
	ngx_shm_zone_t *shm_zone;
	ngx_pool_cleanup_t *cln;
	ssize_t size = 0;
	uint64_t keys = 0;
	ngx_uint_t i, have_rate = 0;
	size_t room;
	char err[TBRATE_ERR_SIZE], *s;
	u_char *colon;
	struct tbrate_rate rate;

	z = ngx_pcalloc(cf->pool, sizeof(*z));
	if (z == NULL)
		return NGX_CONF_ERROR;
	z->burst = 1;
	for (i = 1; i < cf->args->nelts; i++) {
		v = value[i];
		if (ngx_strncmp(v.data, "zone=", 5) == 0) {
			name.data = v.data + 5;
			name.len = v.len - 5;
			colon = ngx_strlchr(name.data, name.data + name.len, ':');
			if (colon != NULL) {
				ngx_str_t sz = { name.data + name.len - colon - 1, colon + 1 };
				name.len = colon - name.data;
				size = ngx_parse_size(&sz);
				if (size == NGX_ERROR || size == 0)
					return ngx_http_tokenbucket_param(cf, &v, "zone size",
									  "not a size");
			}
			if (name.len == 0)
				return ngx_http_tokenbucket_param(cf, &v, "zone", "no name");
			continue;
		}
		if (ngx_strncmp(v.data, "rate=", 5) == 0) {
			if ((s = ngx_http_tokenbucket_cstr(cf, &v, 5)) == NULL)
				return NGX_CONF_ERROR;
			if (tbrate_parse_rate(s, &rate, err) != 0)
				return ngx_http_tokenbucket_param(cf, &v, "rate", err);
			if (rate.unlimited)
				return ngx_http_tokenbucket_param(cf, &v, "rate",
								  "a zone needs a finite rate");
			z->tokens = rate.tokens;
			z->period_ns = rate.period_ns;
			have_rate = 1;
			continue;
		}
		if (ngx_strncmp(v.data, "burst=", 6) == 0) {
			if ((s = ngx_http_tokenbucket_cstr(cf, &v, 6)) == NULL)
				return NGX_CONF_ERROR;
			if (tbrate_parse_size(s, TOKENBUCKET_TABLE_BURST_MAX, &z->burst, err) != 0)
				return ngx_http_tokenbucket_param(cf, &v, "burst", err);
			continue;
		}
		if (ngx_strncmp(v.data, "keys=", 5) == 0) {
			if ((s = ngx_http_tokenbucket_cstr(cf, &v, 5)) == NULL)
				return NGX_CONF_ERROR;
			if (tbrate_parse_size(s, TOKENBUCKET_TABLE_CAPACITY_MAX, &keys, err) != 0)
				return ngx_http_tokenbucket_param(cf, &v, "keys", err);
			continue;
		}
		if (ngx_strcmp(v.data, "full=closed") == 0) {
			z->flags = 0;
			continue;
		}
		if (ngx_strcmp(v.data, "full=open") == 0) {
			z->flags = TOKENBUCKET_TABLE_FAIL_OPEN;
			continue;
		}
		if (ngx_strcmp(v.data, "full=evict") == 0) {
			z->flags = TOKENBUCKET_TABLE_EVICT;
			continue;
		}
		return ngx_http_tokenbucket_param(cf, &v, "parameter",
						  "expected zone=, rate=, burst=, keys= or "
						  "full=closed|open|evict");
	}
	if (name.len == 0) {
		ngx_conf_log_error(NGX_LOG_EMERG, cf, 0, "tokenbucket_zone: no zone=NAME");
		return NGX_CONF_ERROR;
	}
	if (!have_rate) {
		ngx_conf_log_error(NGX_LOG_EMERG, cf, 0, "tokenbucket_zone \"%V\": no rate=", &name);
		return NGX_CONF_ERROR;
	}
	if ((size == 0) == (keys == 0)) {
		ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
				   "tokenbucket_zone \"%V\": give either zone=NAME:SIZE or keys=N",
				   &name);
		return NGX_CONF_ERROR;
	}
	/* The slab pool's header and page table take about 1/64 and a few pages. */
	room = NGX_HTTP_TB_SLAB_PAGES * ngx_pagesize;
	if (keys != 0) {
		z->table_size = tokenbucket_table_size(keys);
		size = (ssize_t)ngx_align(z->table_size + z->table_size / 64 + room, ngx_pagesize);
		z->capacity = keys;
	} else {
		if ((size_t)size < room + 2 * tokenbucket_table_size(1))
			return ngx_http_tokenbucket_param(cf, &value[1], "zone size",
							  "too small for a table");
		z->capacity = ((size_t)size - room - (size_t)size / 64 - 256) / 32;
		if (z->capacity > TOKENBUCKET_TABLE_CAPACITY_MAX)
			z->capacity = TOKENBUCKET_TABLE_CAPACITY_MAX;
		while (z->capacity > 1 && tokenbucket_table_size(z->capacity) + (size_t)size / 64 +
						  room > (size_t)size)
			z->capacity--;
		z->table_size = tokenbucket_table_size(z->capacity);
	}
	z->name = name;
	if (z->burst > TOKENBUCKET_TABLE_BURST_MAX)
		return ngx_http_tokenbucket_param(cf, &value[1], "burst", "too large");

	shm_zone = ngx_shared_memory_add(cf, &name, (size_t)size, &ngx_http_tokenbucket_module);
	if (shm_zone == NULL)
		return NGX_CONF_ERROR;
	if (shm_zone->data != NULL) {
		ngx_conf_log_error(NGX_LOG_EMERG, cf, 0, "tokenbucket_zone \"%V\" is already defined",
				   &name);
		return NGX_CONF_ERROR;
	}
	/* Memory kept over a reload must hold a table of exactly these terms. */
	old = ngx_http_tokenbucket_old_zone(cf, &name);
	if (old != NULL &&
	    (old->tokens != z->tokens || old->period_ns != z->period_ns || old->burst != z->burst ||
	     old->capacity != z->capacity || old->flags != z->flags))
		shm_zone->noreuse = 1;
	shm_zone->init = ngx_http_tokenbucket_init_zone;
	shm_zone->data = z;

	cln = ngx_pool_cleanup_add(cf->pool, 0);
	if (cln == NULL)
		return NGX_CONF_ERROR;
	cln->handler = ngx_http_tokenbucket_free_handle;
	cln->data = z;
	return NGX_CONF_OK;
}

/* ---- Where it applies ---------------------------------------------------- */

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
	limit->shm_zone =
		ngx_shared_memory_add(cf, &name, 0, &ngx_http_tokenbucket_module);
	if (limit->shm_zone == NULL)
		return NGX_CONF_ERROR;
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

static void *ngx_http_tokenbucket_create_conf(ngx_conf_t *cf)
{
	ngx_http_tokenbucket_conf_t *conf = ngx_pcalloc(cf->pool, sizeof(*conf));
	if (conf == NULL)
		return NULL;
	conf->status = NGX_CONF_UNSET_UINT;
	conf->log_level = NGX_CONF_UNSET_UINT;
	conf->dry_run = NGX_CONF_UNSET;
	conf->headers = NGX_CONF_UNSET;
	return conf;
}

static char *ngx_http_tokenbucket_merge_conf(ngx_conf_t *cf, void *parent, void *child)
{
	ngx_http_tokenbucket_conf_t *prev = parent, *conf = child;
	ngx_http_tokenbucket_limit_t *l;
	ngx_uint_t i;

	/* As limit_req: a level with no limit of its own takes its parent's. */
	if (conf->limits == NULL)
		conf->limits = prev->limits;
	ngx_conf_merge_uint_value(conf->status, prev->status, 429);
	ngx_conf_merge_uint_value(conf->log_level, prev->log_level, NGX_LOG_WARN);
	ngx_conf_merge_value(conf->dry_run, prev->dry_run, 0);
	ngx_conf_merge_value(conf->headers, prev->headers, 1);
	if (conf->limits != NULL) {
		l = conf->limits->elts;
		for (i = 0; i < conf->limits->nelts; i++)
			if (l[i].shm_zone->data == NULL) {
				ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
						   "tokenbucket: unknown zone \"%V\"",
						   &l[i].shm_zone->shm.name);
				return NGX_CONF_ERROR;
			}
	}
	return NGX_CONF_OK;
}

/* ---- The request --------------------------------------------------------- */

static void ngx_http_tokenbucket_ctx_cleanup(void *data)
{
	(void)data; /* marks the cleanup that carries the ctx; nothing to free */
}

/* The decision made for this request, also after an internal redirect wiped the ctx. */
static ngx_http_tokenbucket_ctx_t *ngx_http_tokenbucket_get_ctx(ngx_http_request_t *r)
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

/* Seconds, rounded up, for the headers; -1 for never. */
static ngx_int_t ngx_http_tokenbucket_seconds(int64_t ns)
{
	if (ns == TOKENBUCKET_NEVER)
		return -1;
	return (ngx_int_t)((ns + 999999999) / 1000000000);
}

static ngx_int_t ngx_http_tokenbucket_header(ngx_http_request_t *r, const char *name,
					     uint64_t value)
{
	ngx_table_elt_t *h = ngx_list_push(&r->headers_out.headers);
	u_char *p;

	if (h == NULL)
		return NGX_ERROR;
	p = ngx_pnalloc(r->pool, NGX_INT64_LEN);
	if (p == NULL)
		return NGX_ERROR;
	h->hash = 1;
	h->key.data = (u_char *)name;
	h->key.len = ngx_strlen(name);
	h->value.data = p;
	h->value.len = ngx_sprintf(p, "%uL", (unsigned long long)value) - p;
	return NGX_OK;
}

static ngx_int_t ngx_http_tokenbucket_headers(ngx_http_request_t *r,
					      const struct tokenbucket_result *res)
{
	ngx_int_t reset = ngx_http_tokenbucket_seconds(res->reset_after_ns);
	ngx_int_t retry = ngx_http_tokenbucket_seconds(res->retry_after_ns);

	if (ngx_http_tokenbucket_header(r, "RateLimit-Limit", res->limit) != NGX_OK ||
	    ngx_http_tokenbucket_header(r, "RateLimit-Remaining", res->remaining) != NGX_OK)
		return NGX_ERROR;
	if (reset >= 0 && ngx_http_tokenbucket_header(r, "RateLimit-Reset", reset) != NGX_OK)
		return NGX_ERROR;
	if (!res->allowed && retry >= 0 &&
	    ngx_http_tokenbucket_header(r, "Retry-After", retry) != NGX_OK)
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

/*
 * Every limit must allow.  Each takes its tokens by reservation, the last
 * (without delay) by allow_result; on a refusal the reservations made are
 * cancelled at the same "now", so a refused request takes nothing.
 */
static ngx_int_t ngx_http_tokenbucket_handler(ngx_http_request_t *r)
{
	ngx_http_tokenbucket_conf_t *tcf;
	ngx_http_tokenbucket_limit_t *limits;
	ngx_http_tokenbucket_zone_t *z;
	ngx_http_tokenbucket_ctx_t *ctx;
	ngx_pool_cleanup_t *cln;
	struct tokenbucket_reservation *rv, rv_local[NGX_HTTP_TB_LOCAL_LIMITS] = { 0 };
	struct tokenbucket_result res, best;
	ngx_str_t *keys, keys_local[NGX_HTTP_TB_LOCAL_LIMITS];
	ngx_uint_t i, j, n, have_best = 0, level;
	uint64_t cost = 0;
	int64_t now, wait = 0, max_wait;
	int rc;

	if (ngx_http_tokenbucket_get_ctx(r) != NULL)
		return NGX_DECLINED; /* decided already (after a delay or a redirect) */
	tcf = ngx_http_get_module_loc_conf(r, ngx_http_tokenbucket_module);
	if (tcf->limits == NULL)
		return NGX_DECLINED;

	ctx = ngx_pcalloc(r->main->pool, sizeof(*ctx));
	cln = ngx_pool_cleanup_add(r->main->pool, 0);
	n = tcf->limits->nelts;
	rv = rv_local;
	keys = keys_local;
	if (n > NGX_HTTP_TB_LOCAL_LIMITS) {
		rv = ngx_pcalloc(r->pool, n * sizeof(*rv));
		keys = ngx_pcalloc(r->pool, n * sizeof(*keys));
	}
	if (ctx == NULL || cln == NULL || rv == NULL || keys == NULL)
		return NGX_HTTP_INTERNAL_SERVER_ERROR;
	cln->handler = ngx_http_tokenbucket_ctx_cleanup;
	cln->data = ctx;
	ngx_http_set_ctx(r->main, ctx, ngx_http_tokenbucket_module);
	ctx->status = NGX_HTTP_TB_PASSED;

	limits = tcf->limits->elts;
	now = tokenbucket_now();
	for (i = 0; i < n; i++) {
		z = limits[i].shm_zone->data;
		if (ngx_http_complex_value(r, &limits[i].key, &keys[i]) != NGX_OK ||
		    ngx_http_tokenbucket_cost(r, &limits[i], &cost) != NGX_OK)
			goto failed;
		if (keys[i].len == 0 || cost == 0)
			continue; /* as limit_req: an empty key is not limited */
		max_wait = (int64_t)limits[i].delay * 1000000;
		if (i == n - 1 && max_wait == 0) {
			rc = tokenbucket_table_allow_result_at(z->table, now, keys[i].data,
							       keys[i].len, cost, &res);
			if (rc != 0)
				goto lib_error;
			if (!res.allowed)
				goto refused;
		} else {
			rc = tokenbucket_table_reserve_at(z->table, now, keys[i].data, keys[i].len,
							  cost, max_wait, &rv[i]);
			if (rc == -ETIMEDOUT || rc == -E2BIG || rc == -EBUSY || rc == -EOVERFLOW) {
				/* The report: the tokens now, and when cost of them is there. */
				struct tokenbucket_reservation probe;
				if (tokenbucket_table_allow_result_at(z->table, now, keys[i].data,
								      keys[i].len, 0, &res) != 0)
					goto lib_error;
				res.allowed = false;
				res.retry_after_ns = TOKENBUCKET_NEVER;
				if (rc == -ETIMEDOUT &&
				    tokenbucket_table_reserve_at(z->table, now, keys[i].data,
								 keys[i].len, cost,
								 TOKENBUCKET_NEVER, &probe) == 0) {
					res.retry_after_ns = probe.time_to_act - now;
					tokenbucket_table_cancel_at(z->table, keys[i].data,
								    keys[i].len, &probe, now);
				}
				goto refused;
			}
			if (rc != 0)
				goto lib_error;
			if (rv[i].time_to_act - now > wait)
				wait = rv[i].time_to_act - now;
			if (!tcf->headers)
				continue;
			if (tokenbucket_table_allow_result_at(z->table, now, keys[i].data,
							      keys[i].len, 0, &res) != 0)
				goto lib_error;
		}
		if (!have_best || res.remaining < best.remaining) {
			best = res;
			have_best = 1;
		}
	}

	if (have_best) {
		ctx->res = best;
		ctx->has_res = 1;
		if (tcf->headers && !tcf->dry_run && ngx_http_tokenbucket_headers(r, &best) != NGX_OK)
			return NGX_HTTP_INTERNAL_SERVER_ERROR;
	}
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
	for (j = 0; j < i; j++)
		if (keys[j].len != 0 && rv[j].tokens != 0) {
			z = limits[j].shm_zone->data;
			tokenbucket_table_cancel_at(z->table, keys[j].data, keys[j].len, &rv[j], now);
		}
	z = limits[i].shm_zone->data;
	ctx->res = res;
	ctx->has_res = 1;
	ngx_log_error(tcf->log_level, r->connection->log, 0,
		      "tokenbucket: %s request by zone \"%V\", cost %uL%s",
		      tcf->dry_run ? "would refuse the" : "refusing the", &z->name,
		      (unsigned long long)cost,
		      res.flags & TOKENBUCKET_RESULT_NO_BUCKET ? ", the zone is full" : "");
	if (tcf->dry_run) {
		ctx->status = NGX_HTTP_TB_REJECTED_DRY_RUN;
		return NGX_DECLINED;
	}
	ctx->status = NGX_HTTP_TB_REJECTED;
	if (tcf->headers && ngx_http_tokenbucket_headers(r, &res) != NGX_OK)
		return NGX_HTTP_INTERNAL_SERVER_ERROR;
	return (ngx_int_t)tcf->status;

lib_error:
	z = limits[i].shm_zone->data;
	ngx_log_error(NGX_LOG_ERR, r->connection->log, -rc, "tokenbucket: zone \"%V\" failed",
		      &z->name);
failed:
	for (j = 0; j < i; j++)
		if (keys[j].len != 0 && rv[j].tokens != 0) {
			z = limits[j].shm_zone->data;
			tokenbucket_table_cancel_at(z->table, keys[j].data, keys[j].len, &rv[j], now);
		}
	return NGX_HTTP_INTERNAL_SERVER_ERROR;
}

/* ---- Variables ----------------------------------------------------------- */

static ngx_str_t ngx_http_tokenbucket_status_names[] = {
	ngx_null_string,
	ngx_string("PASSED"),
	ngx_string("DELAYED"),
	ngx_string("REJECTED"),
	ngx_string("DELAYED_DRY_RUN"),
	ngx_string("REJECTED_DRY_RUN"),
};

enum { NGX_HTTP_TB_VAR_STATUS, NGX_HTTP_TB_VAR_REMAINING, NGX_HTTP_TB_VAR_RETRY_AFTER };

static ngx_int_t ngx_http_tokenbucket_variable(ngx_http_request_t *r,
					       ngx_http_variable_value_t *v, uintptr_t data)
{
	ngx_http_tokenbucket_ctx_t *ctx = ngx_http_tokenbucket_get_ctx(r);
	ngx_int_t secs;
	u_char *p;

	if (ctx == NULL || (data != NGX_HTTP_TB_VAR_STATUS && !ctx->has_res)) {
		v->not_found = 1;
		return NGX_OK;
	}
	v->valid = 1;
	v->no_cacheable = 0;
	v->not_found = 0;
	if (data == NGX_HTTP_TB_VAR_STATUS) {
		v->len = ngx_http_tokenbucket_status_names[ctx->status].len;
		v->data = ngx_http_tokenbucket_status_names[ctx->status].data;
		return NGX_OK;
	}
	p = ngx_pnalloc(r->pool, NGX_INT64_LEN);
	if (p == NULL)
		return NGX_ERROR;
	if (data == NGX_HTTP_TB_VAR_REMAINING) {
		v->len = ngx_sprintf(p, "%uL", (unsigned long long)ctx->res.remaining) - p;
	} else {
		secs = ctx->res.allowed ? 0 : ngx_http_tokenbucket_seconds(ctx->res.retry_after_ns);
		if (secs < 0) {
			v->len = 0; /* never */
		} else {
			v->len = ngx_sprintf(p, "%i", secs) - p;
		}
	}
	v->data = p;
	return NGX_OK;
}

static ngx_int_t ngx_http_tokenbucket_add_variables(ngx_conf_t *cf)
{
	static ngx_str_t names[] = {
		ngx_string("tokenbucket_status"),
		ngx_string("tokenbucket_remaining"),
		ngx_string("tokenbucket_retry_after"),
	};
	ngx_http_variable_t *var;
	ngx_uint_t i;

	for (i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
		var = ngx_http_add_variable(cf, &names[i], NGX_HTTP_VAR_NOCACHEABLE);
		if (var == NULL)
			return NGX_ERROR;
		var->get_handler = ngx_http_tokenbucket_variable;
		var->data = i;
	}
	return NGX_OK;
}

static ngx_int_t ngx_http_tokenbucket_init(ngx_conf_t *cf)
{
	ngx_http_core_main_conf_t *cmcf = ngx_http_conf_get_module_main_conf(cf, ngx_http_core_module);
	ngx_http_handler_pt *h = ngx_array_push(&cmcf->phases[NGX_HTTP_PREACCESS_PHASE].handlers);

	if (h == NULL)
		return NGX_ERROR;
	*h = ngx_http_tokenbucket_handler;
	return NGX_OK;
}
