/* SPDX-License-Identifier: MIT */
/*
 * Runs every suite; CK_RUN_SUITE=<name> runs one (each ctest entry does).
 * Check's fork mode isolates crashes; scale timeouts with CK_TIMEOUT_MULTIPLIER.
 */
#include <stdlib.h>

#include "check_tb.h"

int main(void)
{
	SRunner *sr = srunner_create(seeds_suite());
	srunner_add_suite(sr, go_suite());
	srunner_add_suite(sr, seastar_suite());
	srunner_add_suite(sr, contract_suite());
	srunner_add_suite(sr, exactness_suite());
	srunner_add_suite(sr, errors_suite());
	srunner_add_suite(sr, concurrency_suite());
	srunner_add_suite(sr, wait_suite());
	srunner_add_suite(sr, badinput_suite());
	srunner_add_suite(sr, stress_suite());
	srunner_add_suite(sr, shared_suite());
	srunner_add_suite(sr, table_suite());
	srunner_add_suite(sr, table_shared_suite());
	srunner_add_suite(sr, limit_suite());
	srunner_add_suite(sr, parse_suite());
	srunner_add_suite(sr, table_regime_suite());
	srunner_add_suite(sr, set_suite());
	srunner_add_suite(sr, table_set_suite());
	srunner_run_all(sr, CK_NORMAL);
	int failed = srunner_ntests_failed(sr);
	int run = srunner_ntests_run(sr);
	srunner_free(sr);
	return failed == 0 && run > 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
