/* SPDX-License-Identifier: MIT */
/* tokenbucket-redis-check: the suites against one redis-server. */
#include "check_redis.h"

int main(void)
{
	Suite *const suites[] = { redis_diff_suite(), redis_faults_suite(),
				  redis_concurrency_suite(), redis_expiry_suite(),
				  redis_badinput_suite(), redis_api_suite(),
				  redis_lease_suite(), redis_lease_async_suite(),
#ifdef TOKENBUCKET_MODULE_PATH
				  redis_module_suite(),
#endif
				  NULL };
	return redis_run(suites, server_available(), "redis-server (package redis-server)");
}
