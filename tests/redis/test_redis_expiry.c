/* SPDX-License-Identifier: MIT */
#include "check_redis.h"

START_TEST(test_placeholder_expiry)
{
}
END_TEST

Suite *redis_expiry_suite(void)
{
	Suite *s = suite_create("redis-expiry");
	TCase *tc = tcase_create("expiry");
	tcase_add_checked_fixture(tc, redis_setup, redis_teardown);
	tcase_add_test(tc, test_placeholder_expiry);
	suite_add_tcase(s, tc);
	return s;
}
