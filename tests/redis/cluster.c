/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <tokenbucket-redis.h>

#include "cluster.h"

#define NSLOTS 16384

bool cluster_available(void)
{
	return server_available() && system("redis-cli --version >/dev/null 2>&1") == 0;
}

bool cluster_alive(const struct cluster *c, int i)
{
	return c->node[i].pid > 0;
}

static void nap(long ms)
{
	nanosleep(&(struct timespec){ ms / 1000, (ms % 1000) * 1000000 }, NULL);
}

static int64_t now_ns(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static int index_of_port(const struct cluster *c, long long port)
{
	for (int i = 0; i < CLUSTER_NODES; i++)
		if (c->node[i].port == port)
			return i;
	return -1;
}

/* redis-cli --cluster create, its output in the first node's directory. */
static int create(struct cluster *c)
{
	char addr[CLUSTER_NODES][32], log[128];
	const char *argv[CLUSTER_NODES + 8] = { "redis-cli", "--cluster", "create" };
	int argc = 3;
	for (int i = 0; i < CLUSTER_NODES; i++) {
		snprintf(addr[i], sizeof(addr[i]), "127.0.0.1:%d", c->node[i].port);
		argv[argc++] = addr[i];
	}
	argv[argc++] = "--cluster-replicas";
	argv[argc++] = "1";
	argv[argc++] = "--cluster-yes";
	argv[argc] = NULL;
	snprintf(log, sizeof(log), "%s/create.log", c->node[0].dir);
	pid_t parent = getpid();
	pid_t pid = fork();
	if (pid < 0)
		return -1;
	if (pid == 0) {
		prctl(PR_SET_PDEATHSIG, SIGKILL);
		if (getppid() != parent)
			_exit(127);
		int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
		int null = open("/dev/null", O_RDONLY);
		dup2(null, 0);
		dup2(fd, 1);
		dup2(fd, 2);
		execvp("redis-cli", (char *const *)argv);
		_exit(127);
	}
	int status;
	if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
		fprintf(stderr, "redis-cli --cluster create failed, see %s\n", log);
		return -1;
	}
	return 0;
}

/*
 * A failed assertion ends a Check child with _exit(), past the checked
 * teardown, and a crash ends it anyway.  The nodes die with it
 * (PR_SET_PDEATHSIG); this process, forked once they run, sees the end of
 * the pipe and removes their directories.  cluster_stop tells it that all
 * is done.  The pipe is close-on-exec, so no server holds it open.
 */
static void watchdog(struct cluster *c)
{
	int fd[2];
	c->watch_fd = -1;
	if (pipe2(fd, O_CLOEXEC) != 0)
		return;
	pid_t pid = fork();
	if (pid == 0) {
		/* Out of the test's process group, which Check kills when the test ends. */
		setpgid(0, 0);
		close(fd[1]);
		char done;
		ssize_t n;
		do
			n = read(fd[0], &done, 1);
		while (n < 0 && errno == EINTR);
		if (n == 0) {
			nap(200); /* the nodes' own deaths first */
			for (int i = 0; i < CLUSTER_NODES; i++) {
				c->node[i].pid = 0; /* never signal: the pids are not ours to reuse */
				server_stop(&c->node[i], false);
			}
		}
		_exit(0);
	}
	close(fd[0]);
	if (pid < 0) {
		close(fd[1]);
		return;
	}
	c->watch_fd = fd[1];
	c->watch_pid = pid;
}

int cluster_start(struct cluster *c, int node_timeout_ms)
{
	char timeout[16];
	snprintf(timeout, sizeof(timeout), "%d", node_timeout_ms);
	const char *const extra[] = { "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
				      "--cluster-node-timeout", timeout,
				      /* Replicas sync at once, not after the default 5 s wait for more. */
				      "--repl-diskless-sync-delay", "0", NULL };
	memset(c, 0, sizeof(*c));
	c->watch_fd = -1;
	/* A node's cluster bus listens on its port + 10000: both must be free, and
	 * both below the kernel's ephemeral range (32768 up) so that no outgoing
	 * connection takes one meanwhile.  Ports are drawn at random: other
	 * clusters may run on the machine. */
	unsigned seed = (unsigned)getpid() ^ (unsigned)now_ns();
	for (int i = 0; i < CLUSTER_NODES; i++) {
		int port = 0;
		for (int tries = 0; tries < 1000 && port == 0; tries++) {
			int p = 10000 + (int)(rand_r(&seed) % 12000);
			bool taken = false;
			for (int k = 0; k < i; k++)
				taken = taken || c->node[k].port == p;
			if (!taken && server_port_free(p) && server_port_free(p + 10000))
				port = p;
		}
		if (port == 0 || server_start_port(&c->node[i], port, extra) != 0) {
			cluster_stop(c);
			return -1;
		}
		snprintf(c->seed[i], sizeof(c->seed[i]), "redis://127.0.0.1:%d", c->node[i].port);
		c->seeds[i] = c->seed[i];
	}
	watchdog(c);
	if (create(c) != 0 || cluster_settle(c, 60 * INT64_C(1000000000), true) != 0) {
		cluster_stop(c);
		return -1;
	}
	return 0;
}

void cluster_stop(struct cluster *c)
{
	for (int i = 0; i < CLUSTER_NODES; i++)
		server_stop(&c->node[i], false);
	if (c->watch_fd >= 0) {
		ssize_t n = write(c->watch_fd, "", 1);
		(void)n; /* if it is gone, it has nothing left to do */
		close(c->watch_fd);
		c->watch_fd = -1;
		waitpid(c->watch_pid, NULL, 0);
	}
}

static redisReply *command(const struct cluster *c, int i, const char *cmd)
{
	if (!cluster_alive(c, i))
		return NULL;
	redisContext *x = server_admin(&c->node[i]);
	if (x == NULL)
		return NULL;
	redisReply *r = redisCommand(x, cmd);
	redisFree(x);
	if (r != NULL && r->type == REDIS_REPLY_ERROR) {
		freeReplyObject(r);
		return NULL;
	}
	return r;
}

/* Node i's map as owner node indices (-1: none or unknown); 0 or -1. */
static int owners(const struct cluster *c, int i, int *owner)
{
	redisReply *r = command(c, i, "CLUSTER SLOTS");
	if (r == NULL || r->type != REDIS_REPLY_ARRAY) {
		if (r != NULL)
			freeReplyObject(r);
		return -1;
	}
	for (int s = 0; s < NSLOTS; s++)
		owner[s] = -1;
	for (size_t k = 0; k < r->elements; k++) {
		redisReply *e = r->element[k];
		if (e->type != REDIS_REPLY_ARRAY || e->elements < 3 ||
		    e->element[2]->type != REDIS_REPLY_ARRAY || e->element[2]->elements < 2)
			continue;
		int node = index_of_port(c, e->element[2]->element[1]->integer);
		for (long long s = e->element[0]->integer; s <= e->element[1]->integer && s < NSLOTS; s++)
			owner[s] = node;
	}
	freeReplyObject(r);
	return 0;
}

static bool info_has(const struct cluster *c, int i, const char *section, const char *what)
{
	char cmd[64];
	snprintf(cmd, sizeof(cmd), "INFO %s", section);
	redisReply *r = command(c, i, cmd);
	bool has = r != NULL && r->type == REDIS_REPLY_STRING && strstr(r->str, what) != NULL;
	if (r != NULL)
		freeReplyObject(r);
	return has;
}

static bool settled(struct cluster *c, bool replicas)
{
	static int first[NSLOTS], other[NSLOTS];
	int base = -1;
	for (int i = 0; i < CLUSTER_NODES; i++) {
		if (!cluster_alive(c, i))
			continue;
		redisReply *r = command(c, i, "CLUSTER INFO");
		bool ok = r != NULL && r->type == REDIS_REPLY_STRING && strstr(r->str, "cluster_state:ok") != NULL;
		if (r != NULL)
			freeReplyObject(r);
		if (!ok)
			return false;
		int *owner = base < 0 ? first : other;
		if (owners(c, i, owner) != 0)
			return false;
		for (int s = 0; s < NSLOTS; s++)
			if (owner[s] < 0 || !cluster_alive(c, owner[s]) || (base >= 0 && owner[s] != first[s]))
				return false;
		base = i;
	}
	if (base < 0)
		return false;
	if (!replicas)
		return true;
	int p[CLUSTER_NODES];
	int n = cluster_primaries(c, p);
	for (int k = 0; k < n; k++) {
		int rep = cluster_replica(c, p[k]);
		if (rep < 0 || !info_has(c, rep, "replication", "master_link_status:up"))
			return false;
	}
	return true;
}

int cluster_settle(struct cluster *c, int64_t timeout_ns, bool replicas)
{
	int64_t until = now_ns() + timeout_ns;
	while (now_ns() < until) {
		if (settled(c, replicas))
			return 0;
		nap(50);
	}
	return -1;
}

int cluster_owner(struct cluster *c, unsigned slot)
{
	static int owner[NSLOTS];
	for (int i = 0; i < CLUSTER_NODES; i++)
		if (cluster_alive(c, i) && owners(c, i, owner) == 0)
			return slot < NSLOTS ? owner[slot] : -1;
	return -1;
}

int cluster_primaries(struct cluster *c, int out[CLUSTER_NODES])
{
	static int owner[NSLOTS];
	int n = 0;
	for (int i = 0; i < CLUSTER_NODES && n == 0; i++) {
		if (!cluster_alive(c, i) || owners(c, i, owner) != 0)
			continue;
		for (int s = 0; s < NSLOTS; s++) {
			bool seen = owner[s] < 0;
			for (int k = 0; k < n && !seen; k++)
				seen = out[k] == owner[s];
			if (!seen)
				out[n++] = owner[s];
		}
	}
	return n;
}

int cluster_replica(struct cluster *c, int primary)
{
	redisReply *r = command(c, primary, "INFO replication");
	int found = -1;
	const char *p = r != NULL && r->type == REDIS_REPLY_STRING ? strstr(r->str, "slave0:") : NULL;
	const char *port = p != NULL ? strstr(p, "port=") : NULL;
	if (port != NULL)
		found = index_of_port(c, atoll(port + 5));
	if (r != NULL)
		freeReplyObject(r);
	return found;
}

int cluster_id(struct cluster *c, int i, char id[41])
{
	redisReply *r = command(c, i, "CLUSTER MYID");
	int ok = r != NULL && r->type == REDIS_REPLY_STRING && r->len == 40 ? 0 : -1;
	if (ok == 0)
		memcpy(id, r->str, 41);
	if (r != NULL)
		freeReplyObject(r);
	return ok;
}

const char *cluster_key_on(struct cluster *c, int primary, const char *base, char *buf, size_t size)
{
	static int owner[NSLOTS];
	for (int i = 0; i < CLUSTER_NODES; i++)
		if (cluster_alive(c, i) && owners(c, i, owner) == 0)
			break;
	for (int k = 0; k < 100000; k++) {
		snprintf(buf, size, "{%s%d}", base, k);
		int slot = tokenbucket_redis_slot(NULL, buf, strlen(buf));
		if (slot >= 0 && owner[slot] == primary)
			return buf;
	}
	return NULL;
}
