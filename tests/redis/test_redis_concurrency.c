/* SPDX-License-Identifier: MIT */
#include "check_redis.h"

START_TEST(test_placeholder_concurrency)
{
}
END_TEST

Suite *redis_concurrency_suite(void)
{
	Suite *s = suite_create("redis-concurrency");
	TCase *tc = tcase_create("concurrency");
	tcase_add_checked_fixture(tc, redis_setup, redis_teardown);
	tcase_add_test(tc, test_placeholder_concurrency);
	suite_add_tcase(s, tc);
	return s;
}
