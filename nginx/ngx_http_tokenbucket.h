/* SPDX-License-Identifier: MIT */
/*
 * ngx_http_tokenbucket_module's own header, not installed: the structures
 * its files share and what one file calls in another.  The calls go one
 * way: the module's tables and directives (ngx_http_tokenbucket_module.c)
 * call the zone's, the variables the request's, the request the Redis
 * engines'; the zone and the engines call none of the others.  Helpers of
 * the request's path are inline here, as they were in one file.
 */
#ifndef NGX_HTTP_TOKENBUCKET_H_INCLUDED
#define NGX_HTTP_TOKENBUCKET_H_INCLUDED

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

/* tokenbucket_headers: none, the draft's RateLimit and RateLimit-Policy, the older three. */
#define NGX_HTTP_TB_HEADERS_OFF 0
#define NGX_HTTP_TB_HEADERS_ON 1
#define NGX_HTTP_TB_HEADERS_LEGACY 2

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
	ngx_str_t item;                 /* "NAME";r= : the RateLimit field this limit reports */
} ngx_http_tokenbucket_limit_t;

typedef struct {
	ngx_array_t *limits; /* of ngx_http_tokenbucket_limit_t */
	ngx_uint_t status;
	ngx_uint_t log_level;
	ngx_flag_t dry_run;
	ngx_uint_t headers; /* NGX_HTTP_TB_HEADERS_* */
	ngx_str_t policy;   /* RateLimit-Policy's value, fixed per location */
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
	ngx_uint_t best_limit; /* the limit best reports */
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

extern ngx_module_t ngx_http_tokenbucket_module;

/*
 * Hidden: no other object may take these names, so a call within a file
 * may be inlined and a call across files goes without the PLT.
 */
#pragma GCC visibility push(hidden)

/* The configuration reads $tokenbucket_remaining or _retry_after by index (log_format...). */
extern ngx_uint_t ngx_http_tokenbucket_vars_indexed;

/* The zone (ngx_http_tokenbucket_zone.c) */
char *ngx_http_tokenbucket_zone(ngx_conf_t *cf, ngx_command_t *cmd, void *conf);
ngx_shm_zone_t *ngx_http_tokenbucket_zone_of(ngx_cycle_t *cycle, ngx_str_t *name);

/* Redis zones (ngx_http_tokenbucket_redis.c) */
ngx_int_t ngx_http_tokenbucket_init_process(ngx_cycle_t *cycle);
void ngx_http_tokenbucket_exit_process(ngx_cycle_t *cycle);
ngx_int_t ngx_http_tokenbucket_leased(ngx_http_tokenbucket_zone_t *z, ngx_str_t *k, uint64_t cost,
				      struct tokenbucket_result *res);

/* The request (ngx_http_tokenbucket_request.c) */
ngx_int_t ngx_http_tokenbucket_handler(ngx_http_request_t *r);
ngx_http_tokenbucket_ctx_t *ngx_http_tokenbucket_get_ctx(ngx_http_request_t *r);
int ngx_http_tokenbucket_report_local(ngx_http_tokenbucket_zone_t *z, int64_t now, ngx_str_t *k,
				      struct tokenbucket_result *res);

/* Variables (ngx_http_tokenbucket_variables.c) */
ngx_int_t ngx_http_tokenbucket_add_variables(ngx_conf_t *cf);
ngx_int_t ngx_http_tokenbucket_init(ngx_conf_t *cf);

#pragma GCC visibility pop

static ngx_inline void ngx_http_tokenbucket_busy(ngx_http_tokenbucket_engine_t *e, ngx_int_t d)
{
	/* A graceful shutdown waits for the timer while calls are in flight. */
	e->inflight += d;
	e->timer.cancelable = e->inflight == 0;
}

/* Seconds, rounded up, for the headers; -1 for never. */
static ngx_inline ngx_int_t ngx_http_tokenbucket_seconds(int64_t ns)
{
	if (ns == TOKENBUCKET_NEVER)
		return -1;
	return (ngx_int_t)((ns + 999999999) / 1000000000);
}

#endif
