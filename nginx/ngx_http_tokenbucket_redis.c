/* SPDX-License-Identifier: MIT */
/*
 * Redis zones: each worker's asynchronous client per zone in nginx's
 * event loop, and its leases on hot keys.
 */
#include "ngx_http_tokenbucket.h"

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
	int rc = tokenbucket_redis_async_lease_open(&victim->lease, e->async, k->data, k->len,
						    &z->rate[0], z->lease_share, z->lease_window_ns);
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
ngx_int_t ngx_http_tokenbucket_leased(ngx_http_tokenbucket_zone_t *z, ngx_str_t *k,
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

ngx_int_t ngx_http_tokenbucket_init_process(ngx_cycle_t *cycle)
{
	ngx_list_part_t *part = &cycle->shared_memory.part;
	ngx_http_tokenbucket_zone_t *z;
	ngx_uint_t i = 0;

	while ((z = ngx_http_tokenbucket_next_redis(cycle, &part, &i)) != NULL)
		if (ngx_http_tokenbucket_engine_open(cycle, z) != NGX_OK)
			return NGX_ERROR;
	return NGX_OK;
}

void ngx_http_tokenbucket_exit_process(ngx_cycle_t *cycle)
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
