/* SPDX-License-Identifier: MIT */
#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "server.h"

bool server_available(void)
{
	return system("redis-server --version >/dev/null 2>&1") == 0;
}

bool server_port_free(int port)
{
	int fd = socket(AF_INET, SOCK_STREAM, 0);
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons((uint16_t)port),
				 .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	bool ok = fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof(a)) == 0;
	if (fd >= 0)
		close(fd);
	return ok;
}

static int free_port(void)
{
	int fd = socket(AF_INET, SOCK_STREAM, 0);
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	socklen_t len = sizeof(a);
	int port = -1;
	if (fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof(a)) == 0 &&
	    getsockname(fd, (struct sockaddr *)&a, &len) == 0)
		port = ntohs(a.sin_port);
	if (fd >= 0)
		close(fd);
	return port;
}

/* A sentinel's configuration file (it rewrites it), or NULL for a server. */
static int spawn_as(struct server *s, const char *const *extra, const char *conf);

static int spawn(struct server *s, const char *const *extra)
{
	return spawn_as(s, extra, NULL);
}

static int spawn_as(struct server *s, const char *const *extra, const char *conf)
{
	char port[16];
	snprintf(port, sizeof(port), "%d", s->port);
	const char *argv[64] = { "redis-server", "--port", port, "--bind", "127.0.0.1",
				 "--unixsocket", s->sock, "--unixsocketperm", "700",
				 "--save", "", "--appendonly", "no", "--dir", s->dir,
				 "--logfile", "redis.log", "--daemonize", "no" };
	int argc = 19;
	if (conf != NULL) {
		/* redis-server FILE --sentinel --port ...: the file first; no persistence options. */
		static const char *const sentinel[] = { "redis-server", NULL, "--sentinel", "--port",
							NULL, "--bind", "127.0.0.1", "--unixsocket",
							NULL, "--unixsocketperm", "700", "--dir", NULL,
							"--logfile", "redis.log", "--daemonize", "no" };
		argc = 17;
		memcpy(argv, sentinel, sizeof(sentinel));
		argv[1] = conf;
		argv[4] = port;
		argv[8] = s->sock;
		argv[12] = s->dir;
	}
	for (int i = 0; extra != NULL && extra[i] != NULL && argc < 62; i++)
		argv[argc++] = extra[i];
	argv[argc] = NULL;
	pid_t parent = getpid();
	pid_t pid = fork();
	if (pid < 0)
		return -1;
	if (pid == 0) {
		prctl(PR_SET_PDEATHSIG, SIGKILL);
		if (getppid() != parent)
			_exit(127);
		int null = open("/dev/null", O_RDWR);
		dup2(null, 0);
		dup2(null, 1);
		execvp("redis-server", (char *const *)argv);
		_exit(127);
	}
	s->pid = pid;
	/* Ready when it answers PING on the socket: at most 10 s. */
	for (int i = 0; i < 1000; i++) {
		struct timeval tv = { 0, 100000 };
		redisContext *c = redisConnectUnixWithTimeout(s->sock, tv);
		if (c != NULL && !c->err) {
			redisReply *r = redisCommand(c, "PING");
			bool ok = r != NULL && r->type == REDIS_REPLY_STATUS;
			if (r != NULL)
				freeReplyObject(r);
			redisFree(c);
			if (ok)
				return 0;
		} else if (c != NULL) {
			redisFree(c);
		}
		if (waitpid(pid, NULL, WNOHANG) == pid) {
			s->pid = 0;
			return -1;
		}
		nanosleep(&(struct timespec){ 0, 10000000 }, NULL);
	}
	return -1;
}

int server_start(struct server *s, const char *const *extra)
{
	return server_start_port(s, free_port(), extra);
}

int server_start_port(struct server *s, int port, const char *const *extra)
{
	memset(s, 0, sizeof(*s));
	snprintf(s->dir, sizeof(s->dir), "%s/tbredis.XXXXXX",
		 getenv("TMPDIR") != NULL && strlen(getenv("TMPDIR")) < 30 ? getenv("TMPDIR") : "/tmp");
	if (mkdtemp(s->dir) == NULL)
		return -1;
	snprintf(s->sock, sizeof(s->sock), "%s/redis.sock", s->dir);
	snprintf(s->url, sizeof(s->url), "unix:%s", s->sock);
	s->port = port;
	snprintf(s->tcp_url, sizeof(s->tcp_url), "redis://127.0.0.1:%d", s->port);
	if (s->port < 0)
		return -1;
	return spawn(s, extra);
}

void server_stop(struct server *s, bool keep_dir)
{
	if (s->pid > 0) {
		kill(s->pid, SIGCONT);
		kill(s->pid, SIGKILL);
		waitpid(s->pid, NULL, 0);
		s->pid = 0;
	}
	if (!keep_dir && s->dir[0] != '\0') {
		/* The server writes only its socket and its log here. */
		DIR *d = opendir(s->dir);
		struct dirent *e;
		while (d != NULL && (e = readdir(d)) != NULL)
			if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0)
				unlinkat(dirfd(d), e->d_name, 0);
		if (d != NULL)
			closedir(d);
		rmdir(s->dir);
		s->dir[0] = '\0';
	}
}

int server_restart(struct server *s)
{
	server_stop(s, true);
	unlink(s->sock);
	return spawn(s, NULL);
}

redisContext *server_admin(const struct server *s)
{
	struct timeval tv = { 5, 0 };
	redisContext *c = redisConnectUnixWithTimeout(s->sock, tv);
	if (c != NULL && c->err) {
		redisFree(c);
		return NULL;
	}
	return c;
}

int server_cmd(const struct server *s, const char *fmt, ...)
{
	redisContext *c = server_admin(s);
	if (c == NULL)
		return -1;
	va_list ap;
	va_start(ap, fmt);
	redisReply *r = redisvCommand(c, fmt, ap);
	va_end(ap);
	int type = r == NULL ? -1 : r->type;
	if (r != NULL)
		freeReplyObject(r);
	redisFree(c);
	return type;
}

int server_start_sentinel(struct server *s, const char *conf_lines)
{
	memset(s, 0, sizeof(*s));
	snprintf(s->dir, sizeof(s->dir), "%s/tbsentinel.XXXXXX",
		 getenv("TMPDIR") != NULL && strlen(getenv("TMPDIR")) < 30 ? getenv("TMPDIR") : "/tmp");
	if (mkdtemp(s->dir) == NULL)
		return -1;
	snprintf(s->sock, sizeof(s->sock), "%s/redis.sock", s->dir);
	snprintf(s->url, sizeof(s->url), "unix:%s", s->sock);
	s->port = free_port();
	snprintf(s->tcp_url, sizeof(s->tcp_url), "redis://127.0.0.1:%d", s->port);
	char conf[128];
	snprintf(conf, sizeof(conf), "%s/sentinel.conf", s->dir);
	FILE *f = fopen(conf, "w");
	if (f == NULL || s->port < 0)
		return -1;
	fputs(conf_lines, f);
	fclose(f);
	return spawn_as(s, NULL, conf);
}
