/* SPDX-License-Identifier: MIT */
#include "check_redis.h"

START_TEST(test_placeholder_faults)
{
}
END_TEST

Suite *redis_faults_suite(void)
{
	Suite *s = suite_create("redis-faults");
	TCase *tc = tcase_create("faults");
	tcase_add_checked_fixture(tc, redis_setup, redis_teardown);
	tcase_add_test(tc, test_placeholder_faults);
	suite_add_tcase(s, tc);
	return s;
}
