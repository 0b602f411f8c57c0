/* SPDX-License-Identifier: MIT */
#include "check_redis.h"

START_TEST(test_placeholder_badinput)
{
}
END_TEST

Suite *redis_badinput_suite(void)
{
	Suite *s = suite_create("redis-badinput");
	TCase *tc = tcase_create("badinput");
	tcase_add_checked_fixture(tc, redis_setup, redis_teardown);
	tcase_add_test(tc, test_placeholder_badinput);
	suite_add_tcase(s, tc);
	return s;
}
