/* SPDX-License-Identifier: MIT */
/*
 * tokenbucket-redis-cluster-lease-check: the leases' fleet tests
 * (test_redis_lease.c) on a 6-node Redis Cluster, each process's client a
 * cluster client from one seed: the plain run, a process SIGKILLed and a
 * rate changed (cluster-lease), the key's primary SIGKILLed
 * (cluster-lease-failover).
 */
#include <signal.h>
#include <sys/wait.h>

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

START_TEST(test_cluster_fleet_kill)
{
	lease_fleet_kill(cl.seeds, 1);
}
END_TEST

START_TEST(test_cluster_rate_change)
{
	lease_fleet_rate_change(cl.seeds, 1);
}
END_TEST

/* SIGKILL of the primary that owns the fleet's key; back once a replica took over. */
static void kill_hot_primary(void)
{
	int owner = cluster_owner(&cl, (unsigned)tokenbucket_redis_slot(NULL, "hot", 3));
	ck_assert_int_ge(owner, 0);
	ck_assert_int_ge(cluster_replica(&cl, owner), 0);
	ck_assert_int_eq(kill(cl.node[owner].pid, SIGKILL), 0);
	waitpid(cl.node[owner].pid, NULL, 0);
	cl.node[owner].pid = 0;
	ck_assert_msg(cluster_settle(&cl, 30 * SEC, false) == 0,
		      "the cluster did not settle after the kill");
}

/*
 * The primary of the key killed a third into the run: the leases' refills
 * fail until a replica is promoted (the bucket it had, up to the
 * replication lag), then every process leases again, within the bound
 * from the failover on.
 */
START_TEST(test_cluster_fleet_failover)
{
	lease_fleet_failover(cl.seeds, CLUSTER_NODES, kill_hot_primary);
}
END_TEST

static Suite *suite(const char *name, const TTest *const *tests)
{
	Suite *s = suite_create(name);
	TCase *tc = tcase_create("fleet");
	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_set_timeout(tc, 120);
	for (int i = 0; tests[i] != NULL; i++)
		tcase_add_test(tc, tests[i]);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	Suite *const suites[] = {
		suite("cluster-lease",
		      (const TTest *const[]){ test_cluster_fleet, test_cluster_fleet_kill,
					      test_cluster_rate_change, NULL }),
		suite("cluster-lease-failover",
		      (const TTest *const[]){ test_cluster_fleet_failover, NULL }),
		NULL
	};
	return redis_run(suites, cluster_available(),
			 "redis-server or redis-cli (package redis-server, redis-tools)");
}
