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
 *   tokenbucket_headers on|off;  tokenbucket_log_level LEVEL;
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
 */
#include <ngx_config.h>
#include <ngx_core.h>
#include <ngx_http.h>

#include <errno.h>
#include <tokenbucket-redis.h>
#include <tokenbucket.h>

#define NGX_HTTP_TB_PASSED 1
#define NGX_HTTP_TB_DELAYED 2
#define NGX_HTTP_TB_REJECTED 3
#define NGX_HTTP_TB_DELAYED_DRY_RUN 4
#define NGX_HTTP_TB_REJECTED_DRY_RUN 5

/* Room the slab pool takes besides the table: its header and page table. */
#define NGX_HTTP_TB_SLAB_PAGES 8

/* A Redis zone's command timeout unless timeout= says otherwise. */
#define NGX_HTTP_TB_REDIS_TIMEOUT 1000

/* rate= of a local zone at most: a table each, all in the zone's memory. */
#define NGX_HTTP_TB_RATES_MAX 4

/* Seeds of cluster= at most (the library's own limit is 1024). */
#define NGX_HTTP_TB_SEEDS_MAX 64

/* lease=: the defaults of lease_share=, lease_hot= and lease_keys=. */
#define NGX_HTTP_TB_LEASE_SHARE 0.25
#define NGX_HTTP_TB_LEASE_HOT 10
#define NGX_HTTP_TB_LEASE_KEYS 64
/* Candidates for a lease counted per leased key (their counters, direct-mapped). */
#define NGX_HTTP_TB_HEAT_PER_KEY 4

typedef struct ngx_http_tokenbucket_engine_s ngx_http_tokenbucket_engine_t;

typedef struct {
	ngx_str_t name;
	/* The limits of every key: rate[0] (a Redis zone's only one), then
	 * the local zone's further rate= in order; tokens per period_ns, exact. */
	struct tokenbucket_limit rate[NGX_HTTP_TB_RATES_MAX];
	ngx_uint_t nrates;
	uint64_t capacity; /* keys (slots) of each table */
	unsigned flags;    /* TOKENBUCKET_TABLE_FAIL_OPEN or _EVICT, or 0 */
	size_t table_size; /* of one table */
	void *mem;         /* the tables, one after another, in the zone's slab pool */
	/* This cycle's handles, one per rate, set by init. */
	struct tokenbucket_table *table[NGX_HTTP_TB_RATES_MAX];

	/* A Redis zone (nseeds > 0): no table; the buckets are Redis's. */
	char *seeds[NGX_HTTP_TB_SEEDS_MAX]; /* redis=URL, or cluster= seeds */
	size_t nseeds;
	unsigned cluster:1;
	ngx_str_t prefix;  /* before every key in Redis; "tokenbucket:NAME:" */
	double fallback;   /* share of the limit each worker grants while Redis is down; 0: off */
	ngx_msec_t timeout;
	ngx_http_tokenbucket_engine_t *engine; /* this worker's, from init_process */

	/* lease= (a Redis zone): hot keys decided from leases; 0: none. */
	int64_t lease_window_ns;
	double lease_share;
	ngx_uint_t lease_hot;  /* requests within a second in a worker that make a key hot */
	ngx_uint_t lease_keys; /* leases a worker keeps at most, the least recently used closed */
} ngx_http_tokenbucket_zone_t;

/* A key a worker holds a lease on. */
typedef struct {
	struct tokenbucket_redis_lease *lease; /* NULL: a free entry */
	ngx_uint_t hash;
	u_char *key; /* a copy, ngx_alloc'd */
	size_t len;
	ngx_msec_t used;
} ngx_http_tokenbucket_leased_t;

/* Requests on the keys of one hash bucket within the second from since. */
typedef struct {
	ngx_uint_t hash;
	ngx_msec_t since;
	ngx_uint_t count;
} ngx_http_tokenbucket_heat_t;

/*
 * A worker's asynchronous client for one Redis zone.  Only the worker's
 * event loop uses it, so nothing here is shared or locked.
 */
struct ngx_http_tokenbucket_engine_s {
	ngx_http_tokenbucket_zone_t *zone;
	struct tokenbucket_redis *client;       /* its fallback and prefix */
	struct tokenbucket_redis_async *async;
	ngx_event_t timer;                      /* the library's one timer */
	ngx_array_t conns;                      /* ngx_connection_t *, one per watched fd */
	ngx_uint_t inflight;                    /* calls started, not yet completed */
	ngx_log_t *log;
	unsigned closing:1;                     /* exit_process: no request is resumed */
	unsigned lease_failed:1;                /* a lease could not be opened (logged once) */
	ngx_http_tokenbucket_leased_t *leased;  /* lease_keys of them, with lease= */
	ngx_http_tokenbucket_heat_t *heat;      /* lease_keys * NGX_HTTP_TB_HEAT_PER_KEY */
};

typedef struct {
	ngx_shm_zone_t *shm_zone;
	ngx_http_complex_value_t key;
	ngx_int_t key_index;            /* a key of one variable: its index; else NGX_ERROR */
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

typedef struct ngx_http_tokenbucket_pending_s ngx_http_tokenbucket_pending_t;

/*
 * A Redis zone's reply to a request, and the event that resumes it: made
 * with the request's first call, so that a decision made at once (a local
 * zone's) allocates and clears none of it.
 */
typedef struct {
	int err;
	struct tokenbucket_result res;
	struct tokenbucket_reservation rv;
	ngx_event_t resume;   /* posted by the reply's callback */
} ngx_http_tokenbucket_reply_t;

/*
 * One request's decision; found again after an internal redirect.  While a
 * Redis zone decides, it also holds where the request stands: the limit
 * asked (next), what each earlier limit took, and the reply once it came.
 */
typedef struct {
	ngx_uint_t status; /* NGX_HTTP_TB_* */
	struct tokenbucket_result res;
	unsigned has_res:1;
	unsigned replied:1;   /* reply holds the answer for limit next */
	unsigned deciding:1;  /* not yet decided: the handler resumes at next */
	unsigned have_best:1;
	unsigned plain_refused:1; /* unreported's plain decision refused: not asked again */
	ngx_uint_t lazy;      /* 1 + the limit granted without a report, or 0 */
	ngx_uint_t next;
	int64_t now;          /* tokenbucket_now() when the request came */
	int64_t until;        /* tokenbucket_now() time the longest delay ends */
	struct tokenbucket_result best;
	ngx_str_t *keys;      /* per limit */
	uint64_t *costs;
	struct tokenbucket_reservation *rv; /* NGX_HTTP_TB_RATES_MAX per limit */
	u_char *local;        /* per limit: a Redis zone's grant made by its fallback */
	ngx_http_tokenbucket_pending_t *pending; /* the call in flight, or NULL */
	int64_t reply_at;     /* tokenbucket_now() when the last reply came; 0: none */
	ngx_http_tokenbucket_reply_t *reply; /* from the first call to Redis; else NULL */
} ngx_http_tokenbucket_ctx_t;

/*
 * The argument of a call in flight, outside the request's pool: the request
 * may be gone when the reply comes (r is then NULL, set by the request
 * pool's cleanup), and its tokens stay spent.
 */
struct ngx_http_tokenbucket_pending_s {
	ngx_http_request_t *r;
	ngx_http_tokenbucket_ctx_t *ctx;
	ngx_http_tokenbucket_engine_t *engine;
};

static ngx_int_t ngx_http_tokenbucket_init(ngx_conf_t *cf);

/* The configuration reads $tokenbucket_remaining or _retry_after by index (log_format...). */
static ngx_uint_t ngx_http_tokenbucket_vars_indexed;
static ngx_int_t ngx_http_tokenbucket_add_variables(ngx_conf_t *cf);
static void *ngx_http_tokenbucket_create_conf(ngx_conf_t *cf);
static char *ngx_http_tokenbucket_merge_conf(ngx_conf_t *cf, void *parent, void *child);
static char *ngx_http_tokenbucket_zone(ngx_conf_t *cf, ngx_command_t *cmd, void *conf);
static char *ngx_http_tokenbucket(ngx_conf_t *cf, ngx_command_t *cmd, void *conf);
static char *ngx_http_tokenbucket_status(ngx_conf_t *cf, ngx_command_t *cmd, void *conf);
static ngx_int_t ngx_http_tokenbucket_init_process(ngx_cycle_t *cycle);
static void ngx_http_tokenbucket_exit_process(ngx_cycle_t *cycle);

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
	NULL,                              /* init master */
	NULL,                              /* init module */
	ngx_http_tokenbucket_init_process, /* init process */
	NULL,                              /* init thread */
	NULL,                              /* exit thread */
	ngx_http_tokenbucket_exit_process, /* exit process */
	NULL,                              /* exit master */
	NGX_MODULE_V1_PADDING
};

/* ---- The zone ------------------------------------------------------------ */

/*
 * The tables a cycle before this one placed in the zone: nginx reuses a
 * zone's memory for a zone of the same shm name and size only, and the
 * name carries a digest of the terms, so they are this zone's terms; each
 * is checked all the same before a worker may use it.
 */
static ngx_int_t ngx_http_tokenbucket_attach(ngx_shm_zone_t *shm_zone)
{
	ngx_http_tokenbucket_zone_t *z = shm_zone->data;
	u_char *mem = ((ngx_slab_pool_t *)shm_zone->shm.addr)->data;
	struct tokenbucket_limit lim;
	struct tokenbucket_table_stats st;
	ngx_uint_t t;
	int rc = 0;

	if (mem < shm_zone->shm.addr ||
	    mem + z->nrates * z->table_size > shm_zone->shm.addr + shm_zone->shm.size)
		goto bad;
	for (t = 0; t < z->nrates; t++) {
		rc = tokenbucket_table_attach_shared(&z->table[t], mem + t * z->table_size,
						     z->table_size);
		if (rc == 0)
			rc = tokenbucket_table_get_limit(z->table[t], &lim);
		if (rc == 0)
			rc = tokenbucket_table_stats(z->table[t], &st);
		if (rc != 0)
			goto bad;
		/* get_limit gives the rate in lowest terms, the parser may not. */
		if ((unsigned __int128)lim.tokens * (uint64_t)z->rate[t].period_ns !=
			    (unsigned __int128)z->rate[t].tokens * (uint64_t)lim.period_ns ||
		    lim.burst != z->rate[t].burst || st.capacity != z->capacity)
			goto bad;
	}
	z->mem = mem;
	return NGX_OK;

bad:
	ngx_log_error(NGX_LOG_EMERG, shm_zone->shm.log, -rc,
		      "tokenbucket_zone \"%V\": the memory kept over the reload does not hold "
		      "this zone's tables", &z->name);
	return NGX_ERROR;
}

/*
 * The master's, once per cycle.  Whether the memory is kept is told by the
 * memory itself (the slab pool's data, set once the tables are placed), not
 * by data, the old cycle's zone: nginx versions differ in when they pass it.
 */
static ngx_int_t ngx_http_tokenbucket_init_zone(ngx_shm_zone_t *shm_zone, void *data)
{
	ngx_http_tokenbucket_zone_t *z = shm_zone->data;
	ngx_slab_pool_t *shpool = (ngx_slab_pool_t *)shm_zone->shm.addr;
	ngx_uint_t t;
	int rc;

	(void)data;
	if (z->nseeds > 0)
		return NGX_OK; /* a Redis zone keeps nothing here */
	if (shpool->data != NULL)
		return ngx_http_tokenbucket_attach(shm_zone);
	z->mem = ngx_slab_alloc(shpool, z->nrates * z->table_size);
	if (z->mem == NULL) {
		ngx_log_error(NGX_LOG_EMERG, shm_zone->shm.log, 0,
			      "tokenbucket_zone \"%V\": zone too small for %uL keys", &z->name,
			      (unsigned long long)z->capacity);
		return NGX_ERROR;
	}
	for (t = 0; t < z->nrates; t++) {
		rc = tokenbucket_table_init_shared(&z->table[t], (u_char *)z->mem + t * z->table_size,
						   z->table_size, z->rate[t].tokens,
						   z->rate[t].period_ns, z->rate[t].burst,
						   z->capacity, z->flags);
		if (rc != 0) {
			ngx_log_error(NGX_LOG_EMERG, shm_zone->shm.log, -rc,
				      "tokenbucket_zone \"%V\": cannot place the table", &z->name);
			return NGX_ERROR;
		}
	}
	shpool->data = z->mem;
	return NGX_OK;
}

/* The cycle's pool owns the handle (not the table, which the zone keeps). */
static void ngx_http_tokenbucket_free_handle(void *data)
{
	ngx_http_tokenbucket_zone_t *z = data;
	for (ngx_uint_t t = 0; t < z->nrates; t++) {
		tokenbucket_table_free(z->table[t]);
		z->table[t] = NULL;
	}
}

/* This module's shared zone that tokenbucket_zone NAME added to cycle, or NULL. */
static ngx_shm_zone_t *ngx_http_tokenbucket_zone_of(ngx_cycle_t *cycle, ngx_str_t *name)
{
	ngx_list_part_t *part = &cycle->shared_memory.part;
	ngx_shm_zone_t *zone = part->elts;
	ngx_http_tokenbucket_zone_t *z;
	ngx_uint_t i;

	for (i = 0;; i++) {
		if (i >= part->nelts) {
			if (part->next == NULL)
				return NULL;
			part = part->next;
			zone = part->elts;
			i = 0;
			if (part->nelts == 0)
				continue;
		}
		z = zone[i].data;
		if (zone[i].tag == &ngx_http_tokenbucket_module && z != NULL &&
		    z->name.len == name->len && ngx_strncmp(z->name.data, name->data, name->len) == 0)
			return &zone[i];
	}
}

/*
 * Adds z's shared zone of size bytes, named "NAME#DIGEST" by its terms:
 * nginx gives memory of a zone of the same shm name and size to the next
 * cycle, so a zone reloaded unchanged keeps its tables and a changed one is
 * another zone to nginx, whatever its noreuse handling.
 */
static ngx_shm_zone_t *ngx_http_tokenbucket_shm_add(ngx_conf_t *cf, ngx_http_tokenbucket_zone_t *z,
						    size_t size)
{
	ngx_shm_zone_t *shm_zone;
	ngx_str_t shm_name;
	uint32_t crc;
	u_char kind = z->nseeds > 0 ? 'r' : 't';

	if (ngx_http_tokenbucket_zone_of(cf->cycle, &z->name) != NULL) {
		ngx_conf_log_error(NGX_LOG_EMERG, cf, 0, "tokenbucket_zone \"%V\" is already defined",
				   &z->name);
		return NULL;
	}
	ngx_crc32_init(crc);
	ngx_crc32_update(&crc, &kind, 1);
	ngx_crc32_update(&crc, (u_char *)&z->nrates, sizeof(z->nrates));
	ngx_crc32_update(&crc, (u_char *)z->rate, z->nrates * sizeof(z->rate[0]));
	ngx_crc32_update(&crc, (u_char *)&z->capacity, sizeof(z->capacity));
	ngx_crc32_update(&crc, (u_char *)&z->flags, sizeof(z->flags));
	ngx_crc32_update(&crc, (u_char *)&size, sizeof(size));
	ngx_crc32_final(crc);
	shm_name.data = ngx_pnalloc(cf->pool, z->name.len + sizeof("#ffffffff") - 1);
	if (shm_name.data == NULL)
		return NULL;
	shm_name.len = ngx_sprintf(shm_name.data, "%V#%08xD", &z->name, crc) - shm_name.data;
	shm_zone = ngx_shared_memory_add(cf, &shm_name, size, &ngx_http_tokenbucket_module);
	if (shm_zone == NULL)
		return NULL;
	shm_zone->init = ngx_http_tokenbucket_init_zone;
	shm_zone->data = z;
	return shm_zone;
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

/*
 * The value after "name=" read by tokenbucket_limit_parse into *lim: a rate
 * with flags 0, else (TOKENBUCKET_PARSE_BURST) a whole number of at most
 * max into lim->burst.  NGX_CONF_OK, or NGX_CONF_ERROR with the reason.
 */
static char *ngx_http_tokenbucket_quantity(ngx_conf_t *cf, ngx_str_t *v, size_t skip,
					   const char *what, unsigned flags, uint64_t max,
					   struct tokenbucket_limit *lim)
{
	u_char why[128], *last;
	const char *s, *end;
	int e;

	if ((s = ngx_http_tokenbucket_cstr(cf, v, skip)) == NULL)
		return NGX_CONF_ERROR;
	end = s;
	e = tokenbucket_limit_parse(lim, s, &flags, &end);
	if (e == 0 && lim->burst <= max)
		return NGX_CONF_OK;
	/* On failure flags is as passed: TOKENBUCKET_PARSE_BURST or 0. */
	if (e == -EINVAL && end == s)
		last = ngx_sprintf(why, "a number must come first");
	else if (e == -EINVAL && *end == '\0')
		last = ngx_sprintf(why, "incomplete");
	else if (e == -EINVAL)
		last = ngx_snprintf(why, sizeof(why) - 1, "unexpected \"%s\"", end);
	else if (e == -EDOM)
		last = ngx_sprintf(why, "%s", flags ? "not a whole number of at least 1"
						    : "the rate must be positive");
	else if (flags == 0)
		last = ngx_sprintf(why, "too large or too fine to hold exactly");
	else
		last = ngx_sprintf(why, "larger than %uL", max);
	*last = '\0';
	return ngx_http_tokenbucket_param(cf, v, what, (const char *)why);
}

static void ngx_http_tokenbucket_nowatch(void *data, int fd, unsigned events)
{
	(void)data, (void)fd, (void)events;
}

static void ngx_http_tokenbucket_notimer(void *data, int64_t ns)
{
	(void)data, (void)ns;
}

/*
 * redis=URL or cluster=SEED[,SEED...] into z->seeds; NULL, or why not.  The
 * library checks each address (it opens a client, which connects on first
 * use only) and whether its asynchronous client takes that kind of address,
 * so that nginx -t refuses what a worker could not open.
 */
static const char *ngx_http_tokenbucket_seeds(ngx_conf_t *cf, ngx_http_tokenbucket_zone_t *z,
					      ngx_str_t *v)
{
	static const struct tokenbucket_redis_loop probe = {
		.watch = ngx_http_tokenbucket_nowatch, .timer = ngx_http_tokenbucket_notimer,
	};
	struct tokenbucket_redis *r = NULL;
	struct tokenbucket_redis_async *a = NULL;
	u_char *p, *end, *comma;
	size_t skip = v->data[0] == 'r' ? 6 : 8;
	int rc;

	if (z->nseeds > 0)
		return "give one redis= or cluster=";
	z->cluster = skip == 8;
	p = v->data + skip;
	end = v->data + v->len;
	for (;;) {
		comma = z->cluster ? ngx_strlchr(p, end, ',') : NULL;
		if (comma == NULL)
			comma = end;
		if (comma == p)
			return "an empty address";
		if (z->nseeds == NGX_HTTP_TB_SEEDS_MAX)
			return "too many seeds";
		z->seeds[z->nseeds] = ngx_pnalloc(cf->pool, comma - p + 1);
		if (z->seeds[z->nseeds] == NULL)
			return "out of memory";
		ngx_memcpy(z->seeds[z->nseeds], p, comma - p);
		z->seeds[z->nseeds++][comma - p] = '\0';
		if (comma == end)
			break;
		p = comma + 1;
	}
	rc = z->cluster ? tokenbucket_redis_open_cluster(&r, (const char *const *)z->seeds,
							  z->nseeds, 0, 0)
			: tokenbucket_redis_open(&r, z->seeds[0], 0, 0);
	if (rc == 0)
		rc = tokenbucket_redis_async_open(&a, r, &probe);
	tokenbucket_redis_async_close(a);
	tokenbucket_redis_close(r);
	switch (rc) {
	case 0:
		return NULL;
	case -EINVAL:
		return z->cluster ? "not a list of redis://host[:port] seeds"
				  : "not a redis://, redis-sentinel://, unix: or socket path address";
	case -EOPNOTSUPP:
		return "this libtokenbucket-redis cannot reach that kind of address "
		       "without blocking";
	default:
		return strerror(-rc);
	}
}

/* The rest of tokenbucket_zone for a Redis zone: z's name, rate and seeds are set. */
static char *ngx_http_tokenbucket_redis_zone(ngx_conf_t *cf, ngx_http_tokenbucket_zone_t *z,
					     ssize_t size, uint64_t keys)
{
	u_char *p;

	if (size != 0 || keys != 0 || z->flags != 0) {
		ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
				   "tokenbucket_zone \"%V\": a Redis zone takes no size, keys= "
				   "or full=", &z->name);
		return NGX_CONF_ERROR;
	}
	if (z->nrates > 1 && z->lease_window_ns != 0) {
		ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
				   "tokenbucket_zone \"%V\": lease= takes a zone of one rate=",
				   &z->name);
		return NGX_CONF_ERROR;
	}
	for (ngx_uint_t t = 0; t < z->nrates; t++) {
		if (z->rate[t].burst > TOKENBUCKET_BURST_MAX) {
			ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
					   "tokenbucket_zone \"%V\": invalid burst: above %uL",
					   &z->name, (unsigned long long)TOKENBUCKET_BURST_MAX);
			return NGX_CONF_ERROR;
		}
	}
	if (z->prefix.data == NULL) {
		p = ngx_pnalloc(cf->pool, sizeof("tokenbucket::") - 1 + z->name.len);
		if (p == NULL)
			return NGX_CONF_ERROR;
		z->prefix.data = p;
		z->prefix.len = ngx_sprintf(p, "tokenbucket:%V:", &z->name) - p;
	}
	if (z->timeout == 0)
		z->timeout = NGX_HTTP_TB_REDIS_TIMEOUT;
	if (z->lease_window_ns == 0 && (z->lease_share != 0 || z->lease_hot != 0 ||
					z->lease_keys != 0)) {
		ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
				   "tokenbucket_zone \"%V\": lease_share=, lease_hot= and "
				   "lease_keys= need lease=", &z->name);
		return NGX_CONF_ERROR;
	}
	if (z->lease_window_ns != 0) {
		if (z->lease_share == 0)
			z->lease_share = NGX_HTTP_TB_LEASE_SHARE;
		if (z->lease_hot == 0)
			z->lease_hot = NGX_HTTP_TB_LEASE_HOT;
		if (z->lease_keys == 0)
			z->lease_keys = NGX_HTTP_TB_LEASE_KEYS;
		/* What tokenbucket_redis_lease_open(3) refuses, said here. */
		long double made = (long double)z->rate[0].tokens *
				   (long double)z->lease_window_ns / (long double)z->rate[0].period_ns;
		long double cap = (long double)z->lease_share * (long double)z->rate[0].burst;
		if (made * 3 / 8 >= (long double)z->rate[0].burst) {
			ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
					   "tokenbucket_zone \"%V\": the rate makes a burst or more "
					   "in 3/8 of lease=: shorten it or raise burst=", &z->name);
			return NGX_CONF_ERROR;
		}
		if (cap < 1 || made < 1) {
			ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
					   "tokenbucket_zone \"%V\": a lease would hold less than a "
					   "token: raise lease=, lease_share= or burst=", &z->name);
			return NGX_CONF_ERROR;
		}
	}
	/*
	 * A small shared zone holds the zone's terms for "tokenbucket
	 * zone=NAME", as a table's does; nothing is kept in its memory.
	 */
	if (ngx_http_tokenbucket_shm_add(cf, z, NGX_HTTP_TB_SLAB_PAGES * ngx_pagesize) == NULL)
		return NGX_CONF_ERROR;
	return NGX_CONF_OK;
}

static char *ngx_http_tokenbucket_zone(ngx_conf_t *cf, ngx_command_t *cmd, void *conf)
{
	ngx_str_t *value = cf->args->elts, name = ngx_null_string, v;
	ngx_http_tokenbucket_zone_t *z;
	ngx_pool_cleanup_t *cln;
	ssize_t size = 0;
	uint64_t keys = 0;
	ngx_uint_t i, t, nbursts = 0;
	uint64_t amount[NGX_HTTP_TB_RATES_MAX]; /* each rate's, as written */
	size_t room;
	char *s;
	u_char *colon;
	struct tokenbucket_limit lim;

	z = ngx_pcalloc(cf->pool, sizeof(*z));
	if (z == NULL)
		return NGX_CONF_ERROR;
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
			if (ngx_http_tokenbucket_quantity(cf, &v, 5, "rate", 0, UINT64_MAX, &lim) !=
			    NGX_CONF_OK)
				return NGX_CONF_ERROR;
			if (lim.period_ns == 0)
				return ngx_http_tokenbucket_param(cf, &v, "rate",
								  "a zone needs a finite rate");
			if (z->nrates == NGX_HTTP_TB_RATES_MAX)
				return ngx_http_tokenbucket_param(cf, &v, "rate",
								  "a zone holds 4 rates at most");
			z->rate[z->nrates].tokens = lim.tokens;
			z->rate[z->nrates].period_ns = lim.period_ns;
			amount[z->nrates++] = lim.burst;
			continue;
		}
		if (ngx_strncmp(v.data, "burst=", 6) == 0) {
			/* The n-th burst= is the n-th rate='s. */
			if (nbursts == NGX_HTTP_TB_RATES_MAX)
				return ngx_http_tokenbucket_param(cf, &v, "burst",
								  "a zone holds 4 rates at most");
			if (ngx_http_tokenbucket_quantity(cf, &v, 6, "burst", TOKENBUCKET_PARSE_BURST,
							  TOKENBUCKET_TABLE_BURST_MAX, &lim) !=
			    NGX_CONF_OK)
				return NGX_CONF_ERROR;
			z->rate[nbursts++].burst = lim.burst;
			continue;
		}
		if (ngx_strncmp(v.data, "keys=", 5) == 0) {
			if (ngx_http_tokenbucket_quantity(cf, &v, 5, "keys", TOKENBUCKET_PARSE_BURST,
							  TOKENBUCKET_TABLE_CAPACITY_MAX, &lim) !=
			    NGX_CONF_OK)
				return NGX_CONF_ERROR;
			keys = lim.burst;
			continue;
		}
		if (ngx_strncmp(v.data, "redis=", 6) == 0 || ngx_strncmp(v.data, "cluster=", 8) == 0) {
			const char *why = ngx_http_tokenbucket_seeds(cf, z, &v);
			if (why != NULL)
				return ngx_http_tokenbucket_param(cf, &v, "Redis address", why);
			continue;
		}
		if (ngx_strncmp(v.data, "prefix=", 7) == 0) {
			z->prefix.data = v.data + 7;
			z->prefix.len = v.len - 7;
			continue;
		}
		if (ngx_strncmp(v.data, "fallback=", 9) == 0) {
			if (ngx_strcmp(v.data, "fallback=off") == 0) {
				z->fallback = 0;
				continue;
			}
			if ((s = ngx_http_tokenbucket_cstr(cf, &v, 9)) == NULL)
				return NGX_CONF_ERROR;
			char *end;
			errno = 0;
			z->fallback = strtod(s, &end);
			if (errno != 0 || end == s || *end != '\0' || !(z->fallback > 0) ||
			    z->fallback > 1)
				return ngx_http_tokenbucket_param(cf, &v, "fallback",
								  "a share in (0, 1], or off");
			continue;
		}
		if (ngx_strncmp(v.data, "timeout=", 8) == 0) {
			ngx_str_t t = { v.len - 8, v.data + 8 };
			ngx_int_t ms = ngx_parse_time(&t, 0);
			if (ms == NGX_ERROR || ms == 0)
				return ngx_http_tokenbucket_param(cf, &v, "timeout",
								  "not a time above 0");
			z->timeout = (ngx_msec_t)ms;
			continue;
		}
		if (ngx_strncmp(v.data, "lease=", 6) == 0) {
			ngx_str_t t = { v.len - 6, v.data + 6 };
			ngx_int_t ms = ngx_parse_time(&t, 0);
			if (ms == NGX_ERROR || ms == 0 || ms > 3600000)
				return ngx_http_tokenbucket_param(cf, &v, "lease window",
								  "not a time in (0, 1h]");
			z->lease_window_ns = (int64_t)ms * 1000000;
			continue;
		}
		if (ngx_strncmp(v.data, "lease_share=", 12) == 0) {
			if ((s = ngx_http_tokenbucket_cstr(cf, &v, 12)) == NULL)
				return NGX_CONF_ERROR;
			char *end;
			errno = 0;
			z->lease_share = strtod(s, &end);
			if (errno != 0 || end == s || *end != '\0' || !(z->lease_share > 0) ||
			    z->lease_share > 1)
				return ngx_http_tokenbucket_param(cf, &v, "lease_share",
								  "a share of the burst in (0, 1]");
			continue;
		}
		if (ngx_strncmp(v.data, "lease_hot=", 10) == 0 ||
		    ngx_strncmp(v.data, "lease_keys=", 11) == 0) {
			int hot = v.data[6] == 'h';
			ngx_str_t n = { v.len - (hot ? 10 : 11), v.data + (hot ? 10 : 11) };
			ngx_int_t x = ngx_atoi(n.data, n.len);
			if (x == NGX_ERROR || x < 1 || x > 1000000)
				return ngx_http_tokenbucket_param(cf, &v, hot ? "lease_hot" : "lease_keys",
								  "not a count in [1, 1000000]");
			if (hot)
				z->lease_hot = (ngx_uint_t)x;
			else
				z->lease_keys = (ngx_uint_t)x;
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
						  "expected zone=, rate=, burst=, keys=, "
						  "full=closed|open|evict, redis=, cluster=, "
						  "prefix=, fallback=, timeout=, lease=, lease_share=, "
						  "lease_hot= or lease_keys=");
	}
	if (name.len == 0) {
		ngx_conf_log_error(NGX_LOG_EMERG, cf, 0, "tokenbucket_zone: no zone=NAME");
		return NGX_CONF_ERROR;
	}
	if (z->nrates == 0) {
		ngx_conf_log_error(NGX_LOG_EMERG, cf, 0, "tokenbucket_zone \"%V\": no rate=", &name);
		return NGX_CONF_ERROR;
	}
	if (nbursts > z->nrates) {
		ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
				   "tokenbucket_zone \"%V\": more burst= than rate=", &name);
		return NGX_CONF_ERROR;
	}
	/*
	 * Without burst=: 1 for the first rate, as limit_req's burst 0; a
	 * further rate (a quota, "1000r/h") holds its amount over the period it
	 * was written with, as tbrate's further -r does.
	 */
	for (t = nbursts; t < z->nrates; t++)
		z->rate[t].burst = t == 0 ? 1 : ngx_min(amount[t], TOKENBUCKET_TABLE_BURST_MAX);
	if (z->nseeds > 0) {
		z->name = name;
		return ngx_http_tokenbucket_redis_zone(cf, z, size, keys);
	}
	if (z->prefix.data != NULL || z->fallback != 0 || z->timeout != 0 ||
	    z->lease_window_ns != 0 || z->lease_share != 0 || z->lease_hot != 0 ||
	    z->lease_keys != 0) {
		ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
				   "tokenbucket_zone \"%V\": prefix=, fallback=, timeout= and "
				   "lease= need redis= or cluster=", &name);
		return NGX_CONF_ERROR;
	}
	if ((size == 0) == (keys == 0)) {
		ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
				   "tokenbucket_zone \"%V\": give either zone=NAME:SIZE or keys=N",
				   &name);
		return NGX_CONF_ERROR;
	}
	/*
	 * The slab pool's header and page table take about 1/64 and a few
	 * pages; the rest holds a table per rate, each of capacity keys.
	 */
	room = NGX_HTTP_TB_SLAB_PAGES * ngx_pagesize;
	if (keys != 0) {
		z->table_size = tokenbucket_table_size(keys);
		size = (ssize_t)ngx_align(z->nrates * z->table_size +
						  z->nrates * z->table_size / 64 + room,
					  ngx_pagesize);
		z->capacity = keys;
	} else {
		if ((size_t)size < room + 2 * z->nrates * tokenbucket_table_size(1))
			return ngx_http_tokenbucket_param(cf, &value[1], "zone size",
							  z->nrates > 1 ? "too small for its tables"
									: "too small for a table");
		z->capacity = ((size_t)size - room - (size_t)size / 64 - 256 * z->nrates) /
			      (32 * z->nrates);
		if (z->capacity > TOKENBUCKET_TABLE_CAPACITY_MAX)
			z->capacity = TOKENBUCKET_TABLE_CAPACITY_MAX;
		while (z->capacity > 1 && z->nrates * tokenbucket_table_size(z->capacity) +
						  (size_t)size / 64 + room > (size_t)size)
			z->capacity--;
		z->table_size = tokenbucket_table_size(z->capacity);
	}
	z->name = name;

	if (ngx_http_tokenbucket_shm_add(cf, z, (size_t)size) == NULL)
		return NGX_CONF_ERROR;

	cln = ngx_pool_cleanup_add(cf->pool, 0);
	if (cln == NULL)
		return NGX_CONF_ERROR;
	cln->handler = ngx_http_tokenbucket_free_handle;
	cln->data = z;
	return NGX_CONF_OK;
}

/* ---- Where it applies ---------------------------------------------------- */

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
	ngx_http_tokenbucket_zone_t *z;
	ngx_shm_zone_t *sz;
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
	}
	return NGX_CONF_OK;
}

/* ---- Redis zones: a worker's engines in nginx's event loop --------------- */

static void ngx_http_tokenbucket_busy(ngx_http_tokenbucket_engine_t *e, ngx_int_t d)
{
	/* A graceful shutdown waits for the timer while calls are in flight. */
	e->inflight += d;
	e->timer.cancelable = e->inflight == 0;
}

static ngx_connection_t **ngx_http_tokenbucket_conn(ngx_http_tokenbucket_engine_t *e, int fd)
{
	ngx_connection_t **c = e->conns.elts;
	ngx_uint_t i;

	for (i = 0; i < e->conns.nelts; i++)
		if (c[i]->fd == fd)
			return &c[i];
	return NULL;
}

static void ngx_http_tokenbucket_redis_event(ngx_event_t *ev)
{
	ngx_connection_t *c = ev->data;
	ngx_http_tokenbucket_engine_t *e = c->data;

	/* c may be freed within: the library stops watching a socket it closes. */
	tokenbucket_redis_async_ready(e->async, c->fd,
				      ev->write ? TOKENBUCKET_REDIS_WRITE : TOKENBUCKET_REDIS_READ);
}

/* The library closes the socket itself, right after. */
static void ngx_http_tokenbucket_unwatch(ngx_http_tokenbucket_engine_t *e, ngx_connection_t **slot)
{
	ngx_connection_t *c = *slot;

	if (c->read->active)
		ngx_del_event(c->read, NGX_READ_EVENT, 0);
	if (c->write->active)
		ngx_del_event(c->write, NGX_WRITE_EVENT, 0);
	if (c->read->posted) {
		ngx_delete_posted_event(c->read);
	}
	if (c->write->posted) {
		ngx_delete_posted_event(c->write);
	}
	ngx_free_connection(c);
	c->fd = (ngx_socket_t)-1;
	*slot = ((ngx_connection_t **)e->conns.elts)[--e->conns.nelts];
}

/* One event of c as the library wants it (level-triggered, unlike nginx's own sockets). */
static void ngx_http_tokenbucket_want(ngx_http_tokenbucket_engine_t *e, ngx_event_t *ev,
				      ngx_int_t event, ngx_uint_t on)
{
	ngx_int_t rc = NGX_OK;

	if (on && !ev->active)
		rc = ngx_add_event(ev, event, 0);
	else if (!on && ev->active)
		rc = ngx_del_event(ev, event, 0);
	if (rc != NGX_OK)
		ngx_log_error(NGX_LOG_ALERT, e->log, 0,
			      "tokenbucket_zone \"%V\": cannot watch a Redis socket; its calls end at the timeout",
			      &e->zone->name);
}

static void ngx_http_tokenbucket_watch(void *data, int fd, unsigned events)
{
	ngx_http_tokenbucket_engine_t *e = data;
	ngx_connection_t **slot = ngx_http_tokenbucket_conn(e, fd), *c;

	if (events == 0) {
		if (slot != NULL)
			ngx_http_tokenbucket_unwatch(e, slot);
		return;
	}
	if (slot == NULL) {
		c = ngx_get_connection(fd, e->log);
		slot = c == NULL ? NULL : ngx_array_push(&e->conns);
		if (slot == NULL) {
			if (c != NULL) {
				ngx_free_connection(c);
				c->fd = (ngx_socket_t)-1;
			}
			ngx_log_error(NGX_LOG_ALERT, e->log, 0,
				      "tokenbucket_zone \"%V\": no free connection for a Redis socket; "
				      "its calls end at the timeout", &e->zone->name);
			return;
		}
		*slot = c;
		c->data = e;
		c->log = e->log;
		c->read->log = e->log;
		c->write->log = e->log;
		c->read->handler = ngx_http_tokenbucket_redis_event;
		c->write->handler = ngx_http_tokenbucket_redis_event;
	}
	c = *slot;
	ngx_http_tokenbucket_want(e, c->read, NGX_READ_EVENT, events & TOKENBUCKET_REDIS_READ);
	ngx_http_tokenbucket_want(e, c->write, NGX_WRITE_EVENT, events & TOKENBUCKET_REDIS_WRITE);
}

static void ngx_http_tokenbucket_timer(void *data, int64_t ns)
{
	ngx_http_tokenbucket_engine_t *e = data;

	/* Deleted first: ngx_add_timer would keep a timer within 300 ms of the new one. */
	if (e->timer.timer_set)
		ngx_del_timer(&e->timer);
	if (ns >= 0)
		ngx_add_timer(&e->timer, (ngx_msec_t)((ns + 999999) / 1000000));
}

static void ngx_http_tokenbucket_timer_event(ngx_event_t *ev)
{
	ngx_http_tokenbucket_engine_t *e = ev->data;

	tokenbucket_redis_async_timeout(e->async);
}

static ngx_int_t ngx_http_tokenbucket_engine_open(ngx_cycle_t *cycle,
						  ngx_http_tokenbucket_zone_t *z)
{
	ngx_http_tokenbucket_engine_t *e = ngx_pcalloc(cycle->pool, sizeof(*e));
	int64_t ns = (int64_t)z->timeout * 1000000;
	int rc;

	if (e == NULL || ngx_array_init(&e->conns, cycle->pool, 4, sizeof(ngx_connection_t *)) !=
				 NGX_OK)
		return NGX_ERROR;
	e->zone = z;
	e->log = cycle->log;
	e->timer.handler = ngx_http_tokenbucket_timer_event;
	e->timer.data = e;
	e->timer.log = cycle->log;
	e->timer.cancelable = 1;
	struct tokenbucket_redis_loop loop = {
		.data = e, .watch = ngx_http_tokenbucket_watch, .timer = ngx_http_tokenbucket_timer,
	};
	rc = z->cluster ? tokenbucket_redis_open_cluster(&e->client, (const char *const *)z->seeds,
							  z->nseeds, ns, ns)
			: tokenbucket_redis_open(&e->client, z->seeds[0], ns, ns);
	if (rc == 0)
		rc = tokenbucket_redis_set_prefix(e->client, z->prefix.data, z->prefix.len);
	if (rc == 0 && z->fallback > 0)
		rc = tokenbucket_redis_set_fallback(e->client, z->fallback);
	if (rc == 0)
		rc = tokenbucket_redis_async_open(&e->async, e->client, &loop);
	if (rc == 0 && z->lease_window_ns > 0) {
		e->leased = ngx_pcalloc(cycle->pool, z->lease_keys * sizeof(*e->leased));
		e->heat = ngx_pcalloc(cycle->pool, z->lease_keys * NGX_HTTP_TB_HEAT_PER_KEY *
							   sizeof(*e->heat));
		if (e->leased == NULL || e->heat == NULL) {
			tokenbucket_redis_async_close(e->async);
			rc = -ENOMEM;
		}
	}
	if (rc != 0) {
		ngx_log_error(NGX_LOG_EMERG, cycle->log, -rc,
			      "tokenbucket_zone \"%V\": cannot open the Redis client", &z->name);
		tokenbucket_redis_close(e->client);
		return NGX_ERROR;
	}
	z->engine = e;
	return NGX_OK;
}

/* Closes a worker's leases on a zone: each gives its unused tokens back. */
static void ngx_http_tokenbucket_leases_close(ngx_http_tokenbucket_engine_t *e)
{
	ngx_uint_t i;

	for (i = 0; e->leased != NULL && i < e->zone->lease_keys; i++) {
		if (e->leased[i].lease == NULL)
			continue;
		tokenbucket_redis_lease_close(e->leased[i].lease);
		ngx_free(e->leased[i].key);
		e->leased[i].lease = NULL;
	}
}

/*
 * The lease of key k in this worker, once k is hot (lease_hot requests
 * within a second); NULL before.  Making one closes the least recently
 * used lease when lease_keys are open (its tokens go back).
 */
static struct tokenbucket_redis_lease *ngx_http_tokenbucket_lease_of(
	ngx_http_tokenbucket_engine_t *e, ngx_str_t *k)
{
	ngx_http_tokenbucket_zone_t *z = e->zone;
	ngx_http_tokenbucket_leased_t *l, *victim = NULL;
	ngx_http_tokenbucket_heat_t *h;
	ngx_uint_t i, hash = ngx_hash_key(k->data, k->len);
	ngx_msec_t now = ngx_current_msec;

	for (i = 0; i < z->lease_keys; i++) {
		l = &e->leased[i];
		if (l->lease != NULL && l->hash == hash && l->len == k->len &&
		    ngx_memcmp(l->key, k->data, k->len) == 0) {
			l->used = now;
			return l->lease;
		}
		if (victim == NULL ||
		    (victim->lease != NULL && (l->lease == NULL || l->used < victim->used)))
			victim = l;
	}
	h = &e->heat[hash % (z->lease_keys * NGX_HTTP_TB_HEAT_PER_KEY)];
	if (h->hash != hash || now - h->since >= 1000) {
		h->hash = hash;
		h->since = now;
		h->count = 0;
	}
	if (++h->count < z->lease_hot)
		return NULL;
	h->count = 0;
	/* Hot: its lease takes a free entry or the least recently used one's. */
	if (victim->lease != NULL) {
		tokenbucket_redis_lease_close(victim->lease);
		ngx_free(victim->key);
		victim->lease = NULL;
	}
	victim->key = ngx_alloc(k->len > 0 ? k->len : 1, e->log);
	if (victim->key == NULL)
		return NULL;
	ngx_memcpy(victim->key, k->data, k->len);
	struct tokenbucket_redis_limit lim = { z->rate[0].tokens, z->rate[0].period_ns,
					       z->rate[0].burst };
	int rc = tokenbucket_redis_async_lease_open(&victim->lease, e->async, k->data, k->len, &lim,
						    z->lease_share, z->lease_window_ns);
	if (rc != 0) {
		if (!e->lease_failed)
			ngx_log_error(NGX_LOG_ERR, e->log, -rc,
				      "tokenbucket_zone \"%V\": cannot open a lease", &z->name);
		e->lease_failed = 1;
		ngx_free(victim->key);
		victim->lease = NULL;
		return NULL;
	}
	victim->hash = hash;
	victim->len = k->len;
	victim->used = now;
	/* Its first chunk is on its way: this request goes to Redis. */
	return NULL;
}

/*
 * A request on a hot key of a Redis zone with lease=, decided from its
 * lease: NGX_OK with *res, or NGX_DECLINED to go to Redis call by call (no
 * lease yet, a cost above a chunk, or Redis failing the lease's refills,
 * when the fallback must decide).
 */
static ngx_int_t ngx_http_tokenbucket_leased(ngx_http_tokenbucket_zone_t *z, ngx_str_t *k,
					     uint64_t cost, struct tokenbucket_result *res)
{
	struct tokenbucket_redis_lease *l;
	uint64_t held;

	if (z->lease_window_ns == 0 || z->engine == NULL)
		return NGX_DECLINED;
	l = ngx_http_tokenbucket_lease_of(z->engine, k);
	if (l == NULL || tokenbucket_redis_lease_tokens(l, &held) != 0 ||
	    tokenbucket_redis_lease_allow(l, cost, res) != 0)
		return NGX_DECLINED;
	return NGX_OK;
}

/* Each of this cycle's Redis zones, in turn. */
static ngx_http_tokenbucket_zone_t *ngx_http_tokenbucket_next_redis(ngx_cycle_t *cycle,
								    ngx_list_part_t **part,
								    ngx_uint_t *i)
{
	ngx_shm_zone_t *zone;
	ngx_http_tokenbucket_zone_t *z;

	for (;; (*i)++) {
		if (*i >= (*part)->nelts) {
			if ((*part)->next == NULL)
				return NULL;
			*part = (*part)->next;
			*i = 0;
			if ((*part)->nelts == 0)
				continue;
		}
		zone = (*part)->elts;
		z = zone[*i].data;
		if (zone[*i].tag == &ngx_http_tokenbucket_module && z != NULL && z->nseeds > 0) {
			(*i)++;
			return z;
		}
	}
}

static ngx_int_t ngx_http_tokenbucket_init_process(ngx_cycle_t *cycle)
{
	ngx_list_part_t *part = &cycle->shared_memory.part;
	ngx_http_tokenbucket_zone_t *z;
	ngx_uint_t i = 0;

	while ((z = ngx_http_tokenbucket_next_redis(cycle, &part, &i)) != NULL)
		if (ngx_http_tokenbucket_engine_open(cycle, z) != NGX_OK)
			return NGX_ERROR;
	return NGX_OK;
}

static void ngx_http_tokenbucket_exit_process(ngx_cycle_t *cycle)
{
	ngx_list_part_t *part = &cycle->shared_memory.part;
	ngx_http_tokenbucket_zone_t *z;
	ngx_uint_t i = 0;

	while ((z = ngx_http_tokenbucket_next_redis(cycle, &part, &i)) != NULL) {
		if (z->engine == NULL)
			continue;
		/*
		 * The leases give back first: their refunds are written at once and
		 * run in Redis although the connection closes right after.  Calls in
		 * flight complete with -ECANCELED; their requests end with the worker.
		 */
		ngx_http_tokenbucket_leases_close(z->engine);
		z->engine->closing = 1;
		tokenbucket_redis_async_close(z->engine->async);
		tokenbucket_redis_close(z->engine->client);
		z->engine = NULL;
	}
}

/* ---- The request --------------------------------------------------------- */

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

/*
 * Adds "name: value", its digits written backwards to end, where the value
 * stays: no ngx_sprintf format parsing, no reversal, no copy.
 */
static ngx_int_t ngx_http_tokenbucket_header(ngx_http_request_t *r, ngx_str_t *name,
					     u_char *end, uint64_t value)
{
	ngx_table_elt_t *h = ngx_list_push(&r->headers_out.headers);
	u_char *p = end;

	if (h == NULL)
		return NGX_ERROR;
	/* Two digits a division. */
	static const char pairs[] = "00010203040506070809101112131415161718192021222324"
				    "25262728293031323334353637383940414243444546474849"
				    "50515253545556575859606162636465666768697071727374"
				    "75767778798081828384858687888990919293949596979899";
	for (; value >= 100; value /= 100) {
		p -= 2;
		ngx_memcpy(p, &pairs[2 * (value % 100)], 2);
	}
	if (value >= 10) {
		p -= 2;
		ngx_memcpy(p, &pairs[2 * value], 2);
	} else {
		*--p = (u_char)('0' + value);
	}
	h->hash = 1;
	h->key = *name;
	h->value.data = p;
	h->value.len = end - p;
	return NGX_OK;
}

static ngx_int_t ngx_http_tokenbucket_headers(ngx_http_request_t *r,
					      const struct tokenbucket_result *res)
{
	static ngx_str_t limit = ngx_string("RateLimit-Limit");
	static ngx_str_t remaining = ngx_string("RateLimit-Remaining");
	static ngx_str_t reset_name = ngx_string("RateLimit-Reset");
	static ngx_str_t retry_name = ngx_string("Retry-After");
	ngx_int_t reset = ngx_http_tokenbucket_seconds(res->reset_after_ns);
	ngx_int_t retry = ngx_http_tokenbucket_seconds(res->retry_after_ns);
	/* One allocation for the four values, each ending at its own slot's end. */
	u_char *p = ngx_pnalloc(r->pool, 4 * NGX_INT64_LEN);

	if (p == NULL)
		return NGX_ERROR;
	if (ngx_http_tokenbucket_header(r, &limit, p + NGX_INT64_LEN, res->limit) != NGX_OK ||
	    ngx_http_tokenbucket_header(r, &remaining, p + 2 * NGX_INT64_LEN, res->remaining) !=
		    NGX_OK)
		return NGX_ERROR;
	if (reset >= 0 && ngx_http_tokenbucket_header(r, &reset_name, p + 3 * NGX_INT64_LEN,
						      (uint64_t)reset) != NGX_OK)
		return NGX_ERROR;
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
static int ngx_http_tokenbucket_report_local(ngx_http_tokenbucket_zone_t *z, int64_t now,
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
 * when nothing will show its report (no header, no variable, no earlier
 * limit's): the plain decision skips building it, and a variable looked up
 * by name later makes it (lazy).  False for a refusal or an error, which
 * take nothing: decide then decides again with the report, at the same now.
 */
static ngx_inline ngx_uint_t ngx_http_tokenbucket_unreported(ngx_http_tokenbucket_conf_t *tcf,
							     ngx_http_tokenbucket_zone_t *z,
							     ngx_http_tokenbucket_ctx_t *ctx,
							     ngx_uint_t i)
{
	ngx_str_t *k = &ctx->keys[i];

	if (tcf->headers || ngx_http_tokenbucket_vars_indexed || z->nseeds > 0 || z->nrates != 1 ||
	    ctx->have_best || ctx->plain_refused)
		return 0;
	if (!tokenbucket_table_allow_at(z->table[0], ctx->now, k->data, k->len, ctx->costs[i])) {
		ctx->plain_refused = 1;
		return 0;
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
			if (ngx_http_tokenbucket_unreported(tcf, z, ctx, i))
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
			ctx->have_best = 1;
		}
	}

	ctx->deciding = 0;
	if (ctx->have_best) {
		ctx->res = ctx->best;
		ctx->has_res = 1;
		if (tcf->headers && !tcf->dry_run &&
		    ngx_http_tokenbucket_headers(r, &ctx->best) != NGX_OK)
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
	if (tcf->headers && ngx_http_tokenbucket_headers(r, &res) != NGX_OK)
		return NGX_HTTP_INTERNAL_SERVER_ERROR;
	return (ngx_int_t)tcf->status;

lib_error:
	ngx_log_error(NGX_LOG_ERR, r->connection->log, -rc, "tokenbucket: zone \"%V\" failed",
		      &z->name);
	ngx_http_tokenbucket_give_back(r, ctx, i);
	ctx->deciding = 0;
	return NGX_HTTP_INTERNAL_SERVER_ERROR;
}

static ngx_int_t ngx_http_tokenbucket_handler(ngx_http_request_t *r)
{
	ngx_http_tokenbucket_conf_t *tcf;
	ngx_http_tokenbucket_limit_t *limits;
	ngx_http_tokenbucket_ctx_t *ctx = ngx_http_tokenbucket_get_ctx(r);
	ngx_http_variable_value_t *vv;
	ngx_pool_cleanup_t *cln;
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
	    ngx_http_tokenbucket_unreported(tcf, limits[0].shm_zone->data, ctx, 0))
		return NGX_DECLINED;
	ctx->deciding = 1;
	return ngx_http_tokenbucket_decide(r, ctx);
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
	ngx_http_tokenbucket_conf_t *tcf;
	ngx_http_tokenbucket_limit_t *l;
	ngx_int_t secs;
	u_char *p;

	if (ctx != NULL && !ctx->has_res && ctx->lazy != 0) {
		/*
		 * Looked up by name only (as SSI's echo does): the grant's report,
		 * made at the decision's time, as the decision would have made it.
		 */
		tcf = ngx_http_get_module_loc_conf(r, ngx_http_tokenbucket_module);
		l = (ngx_http_tokenbucket_limit_t *)tcf->limits->elts + ctx->lazy - 1;
		if (ngx_http_tokenbucket_report_local(l->shm_zone->data, ctx->now,
						      &ctx->keys[ctx->lazy - 1], &ctx->res) == 0)
			ctx->has_res = 1;
	}
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
	ngx_http_variable_t *v = cmcf->variables.elts;
	ngx_uint_t i;

	if (h == NULL)
		return NGX_ERROR;
	/* The whole configuration is read: every index it asked for is here. */
	ngx_http_tokenbucket_vars_indexed = 0;
	for (i = 0; i < cmcf->variables.nelts; i++)
		if ((v[i].name.len == sizeof("tokenbucket_remaining") - 1 &&
		     ngx_strncasecmp(v[i].name.data, (u_char *)"tokenbucket_remaining", v[i].name.len) == 0) ||
		    (v[i].name.len == sizeof("tokenbucket_retry_after") - 1 &&
		     ngx_strncasecmp(v[i].name.data, (u_char *)"tokenbucket_retry_after", v[i].name.len) == 0))
			ngx_http_tokenbucket_vars_indexed = 1;
	*h = ngx_http_tokenbucket_handler;
	return NGX_OK;
}
