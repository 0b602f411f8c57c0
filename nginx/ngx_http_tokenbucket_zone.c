/* SPDX-License-Identifier: MIT */
/*
 * tokenbucket_zone: a zone's terms read, its shared memory named, its
 * tables placed by the master or attached over a reload.
 */
#include "ngx_http_tokenbucket.h"

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
ngx_shm_zone_t *ngx_http_tokenbucket_zone_of(ngx_cycle_t *cycle, ngx_str_t *name)
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

/* The value after "name=" as a share in (0, 1] into *out; the reason otherwise. */
static char *ngx_http_tokenbucket_share(ngx_conf_t *cf, ngx_str_t *v, size_t skip,
					const char *what, const char *why, double *out)
{
	char *s = ngx_http_tokenbucket_cstr(cf, v, skip), *end;
	double x;

	if (s == NULL)
		return NGX_CONF_ERROR;
	errno = 0;
	x = strtod(s, &end);
	if (errno != 0 || end == s || *end != '\0' || !(x > 0) || x > 1)
		return ngx_http_tokenbucket_param(cf, v, what, why);
	*out = x;
	return NGX_CONF_OK;
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

char *ngx_http_tokenbucket_zone(ngx_conf_t *cf, ngx_command_t *cmd, void *conf)
{
	ngx_str_t *value = cf->args->elts, name = ngx_null_string, v;
	ngx_http_tokenbucket_zone_t *z;
	ngx_pool_cleanup_t *cln;
	ssize_t size = 0;
	uint64_t keys = 0;
	ngx_uint_t i, t, nbursts = 0;
	uint64_t amount[NGX_HTTP_TB_RATES_MAX]; /* each rate's, as written */
	size_t room;
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
			if (ngx_http_tokenbucket_share(cf, &v, 9, "fallback", "a share in (0, 1], or off",
						       &z->fallback) != NGX_CONF_OK)
				return NGX_CONF_ERROR;
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
			if (ngx_http_tokenbucket_share(cf, &v, 12, "lease_share",
						       "a share of the burst in (0, 1]",
						       &z->lease_share) != NGX_CONF_OK)
				return NGX_CONF_ERROR;
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
