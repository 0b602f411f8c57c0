/* SPDX-License-Identifier: MIT */
/*
 * A private redis-server for one test: a unix socket and a loopback port in
 * a temporary directory, no persistence, stopped by its pid.  It dies with
 * the test process (PR_SET_PDEATHSIG), so a failed test leaves none behind.
 */
#ifndef TOKENBUCKET_TEST_SERVER_H
#define TOKENBUCKET_TEST_SERVER_H

#include <stdbool.h>
#include <sys/types.h>

#include <hiredis/hiredis.h>

struct server {
	pid_t pid;
	int port;
	char dir[64];
	char sock[96];
	char url[128];     /* unix:<sock> */
	char tcp_url[64];  /* redis://127.0.0.1:<port> */
};

/* True when redis-server can be run (the suites skip otherwise). */
bool server_available(void);
/* Starts a server (extra: more "--option value" words, NULL-terminated); 0 or -1. */
int server_start(struct server *s, const char *const *extra);
/* The same on a given loopback port. */
int server_start_port(struct server *s, int port, const char *const *extra);
/* True when nothing is bound to the loopback port now. */
bool server_port_free(int port);
/* Starts a Sentinel (redis-server --sentinel) with conf_lines in its configuration; 0 or -1. */
int server_start_sentinel(struct server *s, const char *conf_lines);
/* Stops it (SIGKILL, waits) and removes its directory unless keep_dir. */
void server_stop(struct server *s, bool keep_dir);
/* Stops and starts it again on the same socket and port: an empty server. */
int server_restart(struct server *s);
/* A connection of its own for setting up faults. */
redisContext *server_admin(const struct server *s);
/* Runs one command on the admin connection; the reply's type, or -1. */
int server_cmd(const struct server *s, const char *fmt, ...);

#endif
