/* SPDX-License-Identifier: MIT */
/*
 * A private Redis Cluster for one test: 3 primaries and 3 replicas, each a
 * redis-server of tests/redis/server.c (its own temporary directory, a
 * free loopback port, PR_SET_PDEATHSIG), joined by redis-cli --cluster
 * create.  cluster_stop kills every node by pid; a test that fails or
 * crashes takes its nodes with it (PR_SET_PDEATHSIG), and a watchdog
 * process removes their directories then.
 */
#ifndef TOKENBUCKET_TEST_CLUSTER_H
#define TOKENBUCKET_TEST_CLUSTER_H

#include <stdbool.h>
#include <stdint.h>

#include "server.h"

#define CLUSTER_NODES 6

struct cluster {
	struct server node[CLUSTER_NODES];
	char seed[CLUSTER_NODES][64]; /* redis://127.0.0.1:<port> */
	const char *seeds[CLUSTER_NODES];
	int watch_fd;    /* the watchdog's pipe, or -1 */
	pid_t watch_pid;
};

/* True when redis-cli can be run too. */
bool cluster_available(void);
/* Starts 6 nodes (node timeout in ms), joins them, waits for a settled cluster; 0 or -1. */
int cluster_start(struct cluster *c, int node_timeout_ms);
void cluster_stop(struct cluster *c);
/*
 * Waits (up to timeout_ns) until every live node says cluster_state:ok, all
 * agree on one owner per slot, and every primary has an attached replica
 * in sync when replicas is set.  0 or -1.
 */
int cluster_settle(struct cluster *c, int64_t timeout_ns, bool replicas);
/* The index of the node that primary-owns slot, as the live nodes agree; -1 otherwise. */
int cluster_owner(struct cluster *c, unsigned slot);
/* The index of a replica of the node at primary; -1 if none. */
int cluster_replica(struct cluster *c, int primary);
/* The indices of the primaries (3 for a settled cluster), in *out; their count. */
int cluster_primaries(struct cluster *c, int out[CLUSTER_NODES]);
/* The node's CLUSTER MYID into id (41 bytes); 0 or -1. */
int cluster_id(struct cluster *c, int i, char id[41]);
/* True when node i is running. */
bool cluster_alive(const struct cluster *c, int i);
/* A key with tag {tag} (written to buf) whose slot the node at primary owns. */
const char *cluster_key_on(struct cluster *c, int primary, const char *base, char *buf, size_t size);

#endif
