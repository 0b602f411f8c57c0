/* SPDX-License-Identifier: MIT */
#include "check_redis.h"

START_TEST(test_placeholder_api)
{
}
END_TEST

Suite *redis_api_suite(void)
{
	Suite *s = suite_create("redis-api");
	TCase *tc = tcase_create("api");
	tcase_add_checked_fixture(tc, redis_setup, redis_teardown);
	tcase_add_test(tc, test_placeholder_api);
	suite_add_tcase(s, tc);
	return s;
}
