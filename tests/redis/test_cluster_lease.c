/* SPDX-License-Identifier: MIT */
/*
 * tokenbucket-redis-cluster-lease-check: the leases' fleet test
 * (test_redis_lease.c) on a 6-node Redis Cluster, each process's client a
 * cluster client from one seed.
 */
#include "check_redis.h"
#include "cluster.h"

static struct cluster cl;

static void setup(void)
{
	ck_assert_msg(cluster_start(&cl, 1000) == 0, "the cluster did not come up");
}

static void teardown(void)
{
	cluster_stop(&cl);
}

START_TEST(test_cluster_fleet)
{
	lease_fleet(cl.seeds, 1);
}
END_TEST

int main(void)
{
	Suite *s = suite_create("cluster-lease");
	TCase *tc = tcase_create("fleet");
	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_set_timeout(tc, 120);
	tcase_add_test(tc, test_cluster_fleet);
	suite_add_tcase(s, tc);
	Suite *const suites[] = { s, NULL };
	return redis_run(suites, cluster_available(),
			 "redis-server or redis-cli (package redis-server, redis-tools)");
}
