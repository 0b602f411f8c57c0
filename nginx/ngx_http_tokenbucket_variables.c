/* SPDX-License-Identifier: MIT */
/* $tokenbucket_status, _remaining, _retry_after; the handler's phase. */
#include "ngx_http_tokenbucket.h"

ngx_uint_t ngx_http_tokenbucket_vars_indexed;

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

ngx_int_t ngx_http_tokenbucket_add_variables(ngx_conf_t *cf)
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

ngx_int_t ngx_http_tokenbucket_init(ngx_conf_t *cf)
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
