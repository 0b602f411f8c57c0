/* SPDX-License-Identifier: MIT */
/*
 * Buckets shared between processes (1.1): real processes made with fork(2)
 * on one bucket.  The invariants are the in-process ones, across processes:
 * no more is granted than burst + what the rate produced, against a manual
 * clock that all processes share; at rate 0 reserve/cancel conserves the
 * tokens exactly; a process killed with SIGKILL at any moment, inside a take
 * or inside a writer, never blocks the next writer nor lets the bucket
 * report more than burst.  Bad names, foreign files, other layouts and
 * other users are refused with the documented errors and change nothing.
 *
 * The bucket's internals (src/core/core.h) are read to check that a writer
 * killed mid-change leaves no frozen regime behind once recovered.
 */
#include <dirent.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check_tb.h"
#include "core.h"

/* Offsets of the header fields (src/shm/shared.c): magic, ready, layout, major, sizes. */
enum { H_MAGIC = 0, H_READY = 8, H_LAYOUT = 12, H_MAJOR = 16, H_STATE_SIZE = 24 };

/* Memory every process of a test sees: MAP_SHARED, anonymous. */
static void *shared_anon(size_t size)
{
	void *m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	ck_assert_ptr_ne(m, MAP_FAILED);
	return m;
}

/* A name no other test (or run) uses. */
static void test_name(char *buf, size_t size, const char *tag)
{
	snprintf(buf, size, "/tbtest.%s.%ld", tag, (long)getpid());
	tokenbucket_unlink(buf);
}

static void shm_file(char *buf, size_t size, const char *name)
{
	snprintf(buf, size, "/dev/shm/tokenbucket.%s", name + 1);
}

/* Waits for a child; true if it exited with status 0. */
static bool child_ok(pid_t pid)
{
	int st;
	ck_assert_int_eq(waitpid(pid, &st, 0), pid);
	return WIFEXITED(st) && WEXITSTATUS(st) == 0;
}

static struct tokenbucket *open_new(const char *name, uint64_t tokens, int64_t period,
				    uint64_t burst)
{
	struct tokenbucket *tb = NULL;
	unsigned status = 99;
	/* A rate of tokens per period as a double is exact for the rates used here. */
	double rate = (double)tokens * 1e9 / (double)period;
	ck_assert_int_eq(tokenbucket_open(&tb, name, rate, burst, 0, 0, &status), 0);
	ck_assert_uint_eq(status, TOKENBUCKET_OPEN_CREATED);
	ck_assert_ptr_nonnull(tb);
	return tb;
}

/* A new named bucket for one test: its name goes to name (64 bytes). */
static struct tokenbucket *fresh(char *name, const char *tag, uint64_t tokens, int64_t period,
				 uint64_t burst)
{
	test_name(name, 64, tag);
	return open_new(name, tokens, period, burst);
}

/* In a forked child: the named bucket as it is, or the child exits with 1. */
static struct tokenbucket *child_open(const char *name)
{
	struct tokenbucket *tb = NULL;
	if (tokenbucket_open(&tb, name, 0, 0, 0, 0, NULL) != 0)
		_exit(1);
	return tb;
}

/* Closes the test's bucket and removes its name. */
static void done(struct tokenbucket *tb, const char *name)
{
	tokenbucket_close(tb);
	ck_assert_int_eq(tokenbucket_unlink(name), 0);
}

/* ---- Placement in caller memory ----------------------------------------- */

START_TEST(placed_size_and_attach)
{
	size_t size = tokenbucket_shared_size(), align = tokenbucket_shared_align();
	ck_assert_uint_ge(size, 64);
	ck_assert_uint_ge(align, 8);
	ck_assert_uint_eq(align & (align - 1), 0);
	char *mem = shared_anon(size + align);
	struct tokenbucket *tb = NULL;
	ck_assert_int_eq(tokenbucket_init_shared(NULL, mem, size, 100, 10, 0), -EINVAL);
	ck_assert_int_eq(tokenbucket_init_shared(&tb, NULL, size, 100, 10, 0), -EINVAL);
	ck_assert_int_eq(tokenbucket_init_shared(&tb, mem + 8, size, 100, 10, 0), -EINVAL);
	ck_assert_int_eq(tokenbucket_init_shared(&tb, mem, size - 1, 100, 10, 0), -EINVAL);
	ck_assert_int_eq(tokenbucket_init_shared(&tb, mem, size, -1, 10, 0), -EINVAL);
	ck_assert_int_eq(tokenbucket_init_shared(&tb, mem, size, 100, 10, 2), -EINVAL);
	ck_assert_int_eq(tokenbucket_init_shared(&tb, mem, size, 100, TOKENBUCKET_BURST_MAX + 1, 0),
			 -ERANGE);
	ck_assert_ptr_null(tb);
	/* Zeroed memory is not a bucket. */
	ck_assert_int_eq(tokenbucket_attach_shared(&tb, mem, size), -EBADMSG);
	ck_assert_int_eq(tokenbucket_init_shared(&tb, mem, size, 0, 10, 0), 0);
	ck_assert_ptr_nonnull(tb);
	ck_assert_int_eq(tokenbucket_reset_at(tb, 0, 10), 0);
	pid_t pid = fork();
	TBT_FORKED(pid);
	if (pid == 0) {
		struct tokenbucket *mine = NULL;
		if (tokenbucket_attach_shared(&mine, mem, size) != 0 || mine != tb)
			_exit(1);
		_exit(tokenbucket_allow_at(mine, 5, 4) ? 0 : 2);
	}
	ck_assert(child_ok(pid));
	ck_assert_tokens(tokenbucket_tokens_at(tb, 5), 6);
	/* Another process's writers work here. */
	pid = fork();
	if (pid == 0) {
		struct tokenbucket *mine = NULL;
		if (tokenbucket_attach_shared(&mine, mem, size) != 0)
			_exit(1);
		_exit(tokenbucket_set_rate_every_at(mine, 5, 1, SEC) == 0 ? 0 : 2);
	}
	ck_assert(child_ok(pid));
	ck_assert_tokens(tokenbucket_rate(tb), 1.0);
	munmap(mem, size + align);
}
END_TEST

START_TEST(placed_bad_headers)
{
	size_t size = tokenbucket_shared_size();
	unsigned char *mem = shared_anon(size), *copy = malloc(size);
	struct tokenbucket *tb = NULL;
	ck_assert_int_eq(tokenbucket_init_shared(&tb, mem, size, 100, 10, 0), 0);
	memcpy(copy, mem, size);
	struct {
		size_t at;
		uint32_t add;
		int err;
	} cases[] = {
		{H_MAGIC, 1, -EBADMSG},     {H_READY, 1, -EAGAIN},
		{H_LAYOUT, 1, -EPROTO},     {H_MAJOR, 1, -EPROTO},
		{H_STATE_SIZE, 8, -EPROTO}, {H_STATE_SIZE + 4, 64, -EPROTO},
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		uint32_t w;
		memcpy(&w, mem + cases[i].at, 4);
		w += cases[i].add;
		memcpy(mem + cases[i].at, &w, 4);
		struct tokenbucket *got = NULL;
		ck_assert_int_eq(tokenbucket_attach_shared(&got, mem, size), cases[i].err);
		ck_assert_ptr_null(got);
		memcpy(mem, copy, size);
	}
	/* Truncated: too small for the state, or for the header. */
	ck_assert_int_eq(tokenbucket_attach_shared(&tb, mem, size - 1), -EBADMSG);
	ck_assert_int_eq(tokenbucket_attach_shared(&tb, mem, 8), -EBADMSG);
	/* States no bucket can be in: a finite rate with period 0, a burst too large. */
	struct tokenbucket *state = tb;
	atomic_store(&state->slot[0].q, 0);
	ck_assert_int_eq(tokenbucket_attach_shared(&tb, mem, size), -EBADMSG);
	memcpy(mem, copy, size);
	atomic_store(&state->burst, TOKENBUCKET_BURST_MAX + 1);
	ck_assert_int_eq(tokenbucket_attach_shared(&tb, mem, size), -EBADMSG);
	memcpy(mem, copy, size);
	atomic_store(&state->threshold, 0);
	ck_assert_int_eq(tokenbucket_attach_shared(&tb, mem, size), -EBADMSG);
	memcpy(mem, copy, size);
	/* Random bytes anywhere in the header: an error or the bucket, never a crash. */
	srand(11);
	for (int i = 0; i < 2000; i++) {
		mem[rand() % 64] = (unsigned char)rand();
		struct tokenbucket *got = NULL;
		int err = tokenbucket_attach_shared(&got, mem, size);
		ck_assert(err == 0 || err == -EBADMSG || err == -EPROTO || err == -EAGAIN);
		if (i % 7 == 0)
			memcpy(mem, copy, size);
	}
	memcpy(mem, copy, size);
	ck_assert_int_eq(tokenbucket_attach_shared(&tb, mem, size), 0);
	free(copy);
	munmap(mem, size);
}
END_TEST

/* ---- Named buckets -------------------------------------------------------- */

START_TEST(named_open_attach_close)
{
	char name[64], file[128];
	test_name(name, sizeof(name), "basic");
	shm_file(file, sizeof(file), name);
	struct tokenbucket *a = open_new(name, 1, MS, 10), *b = NULL;
	struct stat st;
	ck_assert_int_eq(stat(file, &st), 0);
	ck_assert_uint_eq(st.st_mode & 0777, 0600);
	ck_assert_uint_eq((size_t)st.st_size, tokenbucket_shared_size());
	unsigned status = 99;
	ck_assert_int_eq(tokenbucket_open(&b, name, 1000, 10, 0, 0644, &status), 0);
	ck_assert_uint_eq(status, 0);
	ck_assert_ptr_ne(a, b);
	ck_assert(tokenbucket_allow_at(a, SEC, 3));
	ck_assert_tokens(tokenbucket_tokens_at(b, SEC), 7);
	tokenbucket_close(b);
	/* Another burst, rate or flags: attached as it is, and told. */
	ck_assert_int_eq(tokenbucket_open(&b, name, 1000, 11, 0, 0, &status), 0);
	ck_assert_uint_eq(status, TOKENBUCKET_OPEN_DIFFERS);
	ck_assert_uint_eq(tokenbucket_burst(b), 10);
	tokenbucket_close(b);
	ck_assert_int_eq(tokenbucket_open(&b, name, 999, 10, 0, 0, &status), 0);
	ck_assert_uint_eq(status, TOKENBUCKET_OPEN_DIFFERS);
	tokenbucket_close(b);
	ck_assert_int_eq(tokenbucket_open(&b, name, 1000, 10, TOKENBUCKET_CAPPED_RELEASE, 0, NULL), 0);
	tokenbucket_close(b);
	/* A rate set since counts: the configuration is the bucket's now. */
	ck_assert_int_eq(tokenbucket_set_rate_at(a, SEC, 5), 0);
	ck_assert_int_eq(tokenbucket_open(&b, name, 5, 10, 0, 0, &status), 0);
	ck_assert_uint_eq(status, 0);
	tokenbucket_close(b);
	tokenbucket_close(a);
	tokenbucket_close(NULL);
	/* Exact permissions, umask aside. */
	ck_assert_int_eq(tokenbucket_unlink(name), 0);
	ck_assert_int_eq(tokenbucket_unlink(name), -ENOENT);
	mode_t old = umask(077);
	ck_assert_int_eq(tokenbucket_open(&a, name, 1, 1, 0, 0640, &status), 0);
	umask(old);
	ck_assert_uint_eq(status, TOKENBUCKET_OPEN_CREATED);
	ck_assert_int_eq(stat(file, &st), 0);
	ck_assert_uint_eq(st.st_mode & 0777, 0640);
	tokenbucket_close(a);
	ck_assert_int_eq(tokenbucket_unlink(name), 0);
}
END_TEST

START_TEST(named_bad_names)
{
	struct tokenbucket *tb = NULL;
	const char *bad[] = {"", "/", "noslash", "/a/b", "/.", "/..", "//"};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		ck_assert_int_eq(tokenbucket_open(&tb, bad[i], 1, 1, 0, 0, NULL), -EINVAL);
		ck_assert_int_eq(tokenbucket_unlink(bad[i]), -EINVAL);
	}
	ck_assert_int_eq(tokenbucket_open(&tb, NULL, 1, 1, 0, 0, NULL), -EINVAL);
	ck_assert_int_eq(tokenbucket_unlink(NULL), -EINVAL);
	ck_assert_int_eq(tokenbucket_open(NULL, "/x", 1, 1, 0, 0, NULL), -EINVAL);
	ck_assert_int_eq(tokenbucket_open(&tb, "/x", NAN, 1, 0, 0, NULL), -EINVAL);
	ck_assert_int_eq(tokenbucket_open(&tb, "/x", 1, 1, 4, 0, NULL), -EINVAL);
	ck_assert_int_eq(tokenbucket_open(&tb, "/x", 1, 1, 0, 01000, NULL), -EINVAL);
	ck_assert_int_eq(tokenbucket_open(&tb, "/x", 1, TOKENBUCKET_BURST_MAX + 1, 0, 0, NULL),
			 -ERANGE);
	char name[TOKENBUCKET_NAME_MAX + 3];
	name[0] = '/';
	memset(name + 1, 'n', TOKENBUCKET_NAME_MAX + 1);
	name[TOKENBUCKET_NAME_MAX + 2] = '\0';
	ck_assert_int_eq(tokenbucket_open(&tb, name, 1, 1, 0, 0, NULL), -ENAMETOOLONG);
	ck_assert_int_eq(tokenbucket_unlink(name), -ENAMETOOLONG);
	ck_assert_ptr_null(tb);
	/* The longest name works. */
	snprintf(name + TOKENBUCKET_NAME_MAX - 10, 12, "%010ld", (long)getpid());
	tokenbucket_unlink(name);
	ck_assert_int_eq(tokenbucket_open(&tb, name, 1, 1, 0, 0, NULL), 0);
	done(tb, name);
}
END_TEST

/* Writes len bytes into the object of name; returns nothing, fails the test on error. */
static void write_file(const char *file, const void *data, size_t len)
{
	int fd = open(file, O_CREAT | O_TRUNC | O_WRONLY, 0600);
	ck_assert_int_ge(fd, 0);
	ck_assert_int_eq(write(fd, data, len), (ssize_t)len);
	close(fd);
}

/* The open fails with err and leaves the file as it was. */
static void refused(const char *name, const char *file, int err)
{
	struct stat before, after;
	ck_assert_int_eq(stat(file, &before), 0);
	char *old = malloc((size_t)before.st_size + 1);
	int fd = open(file, O_RDONLY);
	ck_assert_int_eq(read(fd, old, (size_t)before.st_size + 1), before.st_size);
	close(fd);
	struct tokenbucket *tb = NULL;
	unsigned status = 99;
	ck_assert_int_eq(tokenbucket_open(&tb, name, 1, 1, 0, 0, &status), err);
	ck_assert_ptr_null(tb);
	ck_assert_uint_eq(status, 99);
	ck_assert_int_eq(stat(file, &after), 0);
	ck_assert_int_eq(after.st_size, before.st_size);
	char *now = malloc((size_t)before.st_size + 1);
	fd = open(file, O_RDONLY);
	ck_assert_int_eq(read(fd, now, (size_t)before.st_size + 1), before.st_size);
	close(fd);
	ck_assert_int_eq(memcmp(old, now, (size_t)before.st_size), 0);
	free(old);
	free(now);
}

START_TEST(named_foreign_objects)
{
	char name[64], file[128];
	test_name(name, sizeof(name), "foreign");
	shm_file(file, sizeof(file), name);
	size_t size = tokenbucket_shared_size();
	/* Not a bucket: empty, text, zeros of the right size. */
	write_file(file, "", 0);
	refused(name, file, -EBADMSG);
	write_file(file, "hello, world\n", 13);
	refused(name, file, -EBADMSG);
	char *zeros = calloc(1, size);
	write_file(file, zeros, size);
	refused(name, file, -EBADMSG);
	free(zeros);
	/* A real bucket, then truncated, then of another layout or major. */
	ck_assert_int_eq(unlink(file), 0);
	struct tokenbucket *tb = open_new(name, 1, MS, 10);
	tokenbucket_close(tb);
	unsigned char *image = malloc(size);
	int fd = open(file, O_RDONLY);
	ck_assert_int_eq(read(fd, image, size), (ssize_t)size);
	close(fd);
	write_file(file, image, size - 1);
	refused(name, file, -EBADMSG);
	write_file(file, image, 40);
	refused(name, file, -EBADMSG);
	image[H_LAYOUT]++;
	write_file(file, image, size);
	refused(name, file, -EPROTO);
	image[H_LAYOUT]--;
	image[H_MAJOR]++;
	write_file(file, image, size);
	refused(name, file, -EPROTO);
	image[H_MAJOR]--;
	/* Not a regular file: a symbolic link is not followed. */
	ck_assert_int_eq(unlink(file), 0);
	ck_assert_int_eq(symlink("/dev/null", file), 0);
	tb = NULL;
	ck_assert_int_eq(tokenbucket_open(&tb, name, 1, 1, 0, 0, NULL), -EBADMSG);
	ck_assert_int_eq(tokenbucket_unlink(name), 0);
	/* Nor a directory, for a bucket or a table. */
	ck_assert_int_eq(mkdir(file, 0700), 0);
	ck_assert_int_eq(tokenbucket_open(&tb, name, 1, 1, 0, 0, NULL), -EBADMSG);
	struct tokenbucket_table *t = NULL;
	ck_assert_int_eq(tokenbucket_table_open(&t, name, 1, SEC, 1, 4, 0, 0, NULL), -EBADMSG);
	ck_assert_int_eq(rmdir(file), 0);
	free(image);
}
END_TEST

START_TEST(named_other_user)
{
	if (geteuid() != 0)
		return; /* needs root to become another user; skipped otherwise */
	char name[64];
	struct tokenbucket *tb = fresh(name, "perm", 1, MS, 10);
	pid_t pid = fork();
	TBT_FORKED(pid);
	if (pid == 0) {
		/*
		 * Root stays the saved user, so that the child is root again
		 * before it exits: under valgrind, its files in /tmp are root's.
		 */
		if (setresgid(65534, 65534, 0) != 0 || setresuid(65534, 65534, 0) != 0)
			_exit(3);
		int ret = 0;
		struct tokenbucket *mine = NULL;
		if (tokenbucket_open(&mine, name, 1, 10, 0, 0, NULL) != -EACCES || mine != NULL)
			ret = 1;
		/* /dev/shm is sticky: another user's name cannot be removed either. */
		else if (tokenbucket_unlink(name) != -EPERM)
			ret = 2;
		if (setresuid(0, 0, 0) != 0 || setresgid(0, 0, 0) != 0)
			ret = 4;
		_exit(ret);
	}
	ck_assert(child_ok(pid));
	/* Nothing changed. */
	ck_assert_tokens(tokenbucket_tokens_at(tb, 0), 10);
	done(tb, name);
}
END_TEST

enum { RACERS = 12, ROUNDS = 15 };

struct race {
	atomic_int go;
	atomic_int created, differs, failed;
};

/* One racer: opens the name when told to; exits 0 if it got a whole bucket. */
static void racer(const char *name, struct race *r)
{
	while (!atomic_load(&r->go))
		;
	struct tokenbucket *tb = NULL;
	unsigned status = 0;
	int err = tokenbucket_open(&tb, name, 1000, 100, 0, 0600, &status);
	if (err) {
		atomic_fetch_add(&r->failed, 1);
		_exit(1);
	}
	if (status & TOKENBUCKET_OPEN_CREATED)
		atomic_fetch_add(&r->created, 1);
	if (status & TOKENBUCKET_OPEN_DIFFERS)
		atomic_fetch_add(&r->differs, 1);
	/* Complete whoever created it: full, with the asked burst. */
	_exit(tokenbucket_burst(tb) == 100 && tokenbucket_tokens_at(tb, 0) == 100 ? 0 : 2);
}

/*
 * RACERS processes open one new name at once, ROUNDS times; with kill, the
 * odd ones are killed at a random moment of it.  The others all get the
 * one bucket, whole.
 */
static void create_race(const char *tag, bool kill_some)
{
	char name[64];
	test_name(name, sizeof(name), tag);
	struct race *r = shared_anon(sizeof(*r));
	srand(7);
	for (int round = 0; round < ROUNDS; round++) {
		atomic_store(&r->go, 0);
		int created = atomic_load(&r->created);
		pid_t pids[RACERS];
		for (int i = 0; i < RACERS; i++) {
			pids[i] = fork();
			TBT_FORKED(pids[i]);
			if (pids[i] == 0)
				racer(name, r);
		}
		atomic_store(&r->go, 1);
		for (int i = 1; kill_some && i < RACERS; i += 2) {
			usleep((useconds_t)(rand() % 200));
			kill(pids[i], SIGKILL);
		}
		for (int i = 0; i < RACERS; i++)
			if (!kill_some || i % 2 == 0)
				ck_assert(child_ok(pids[i]));
			else
				waitpid(pids[i], NULL, 0);
		/* One creator a round, or none seen if the one that created it was killed after. */
		ck_assert_int_le(atomic_load(&r->created) - created, 1);
		if (!kill_some)
			ck_assert_int_eq(atomic_load(&r->created) - created, 1);
		struct tokenbucket *tb = NULL;
		unsigned status = 99;
		ck_assert_int_eq(tokenbucket_open(&tb, name, 1000, 100, 0, 0, &status), 0);
		ck_assert_uint_eq(status, 0);
		done(tb, name);
	}
	ck_assert_int_eq(atomic_load(&r->differs), 0);
	ck_assert_int_eq(atomic_load(&r->failed), 0);
	munmap(r, sizeof(*r));
}

START_TEST(named_create_race)
{
	create_race("race", false);
}
END_TEST

/* Creators killed while creating leave no half bucket, and nothing else in /dev/shm. */
START_TEST(named_create_killed)
{
	create_race("killed", true);
	DIR *dir = opendir("/dev/shm");
	ck_assert_ptr_nonnull(dir);
	for (struct dirent *e; (e = readdir(dir)) != NULL;)
		ck_assert_msg(strncmp(e->d_name, ".tokenbucket.", 13) != 0, "left behind: %s",
			      e->d_name);
	closedir(dir);
}
END_TEST

/* ---- Many processes on one bucket ---------------------------------------- */

enum { PROCS = 4, PTHREADS = 2, STEPS = 20000 };

struct arena {
	_Atomic int64_t clock; /* the manual clock every process shares */
	atomic_uint_fast64_t granted;
	atomic_int bad;
	atomic_int go;
};

struct worker {
	struct tokenbucket *tb;
	struct arena *a;
	bool reserve; /* rate 0: reserve then cancel */
};

static void *exact_loop(void *arg)
{
	struct worker *w = arg;
	uint64_t mine = 0;
	while (!atomic_load(&w->a->go))
		;
	for (int i = 0; i < STEPS; i++) {
		/*
		 * Reservations are cancelled at the time they were made: the
		 * clock stands still for them, since a cancel after another
		 * process moved time past time_to_act is too late (Go's rule).
		 */
		int64_t t = w->reserve ? atomic_load(&w->a->clock)
				       : atomic_fetch_add(&w->a->clock, 3 * US);
		if (w->reserve) {
			struct tokenbucket_reservation r;
			if (tokenbucket_reserve_at(w->tb, t, 1 + (uint64_t)(i % 3), TOKENBUCKET_NEVER,
						   &r) != 0) {
				atomic_fetch_add(&w->a->bad, 1);
				continue;
			}
			tokenbucket_cancel_at(w->tb, &r, t);
		} else {
			uint64_t n = 1 + (uint64_t)(i & 1);
			mine += tokenbucket_allow_at(w->tb, t, n) ? n : 0;
			if (tokenbucket_tokens_at(w->tb, t) > (double)tokenbucket_burst(w->tb))
				atomic_fetch_add(&w->a->bad, 1);
		}
	}
	atomic_fetch_add(&w->a->granted, mine);
	return NULL;
}

/* PROCS processes of PTHREADS threads each run exact_loop on the named bucket. */
static void run_procs(const char *name, struct arena *a, bool reserve)
{
	pid_t pids[PROCS];
	for (int i = 0; i < PROCS; i++) {
		pids[i] = fork();
		TBT_FORKED(pids[i]);
		if (pids[i] == 0) {
			struct worker w = {.a = a, .reserve = reserve, .tb = child_open(name)};
			pthread_t th[PTHREADS];
			for (int j = 0; j < PTHREADS; j++)
				pthread_create(&th[j], NULL, exact_loop, &w);
			for (int j = 0; j < PTHREADS; j++)
				pthread_join(th[j], NULL);
			tokenbucket_close(w.tb);
			_exit(0);
		}
	}
	atomic_store(&a->go, 1);
	for (int i = 0; i < PROCS; i++)
		ck_assert(child_ok(pids[i]));
}

START_TEST(procs_exact_bound)
{
	char name[64];
	test_name(name, sizeof(name), "exact");
	struct arena *a = shared_anon(sizeof(*a));
	const int64_t t0 = 1000 * SEC;
	const uint64_t burst = 25;
	/* 7 tokens every 100 us: 20000 * 8 steps of 3 us make 33600 tokens. */
	struct tokenbucket *tb = open_new(name, 7, 100 * US, burst);
	ck_assert_int_eq(tokenbucket_reset_at(tb, t0, burst), 0);
	atomic_store(&a->clock, t0);
	run_procs(name, a, false);
	int64_t elapsed = atomic_load(&a->clock) - t0;
	uint64_t produced = (uint64_t)(elapsed * 7 / (100 * US));
	uint64_t granted = atomic_load(&a->granted);
	ck_assert_int_eq(atomic_load(&a->bad), 0);
	ck_assert_uint_le(granted, burst + produced);
	/* The clock ran on between the last takes: what is left accounts for the rest. */
	double left = tokenbucket_tokens_at(tb, t0 + elapsed);
	ck_assert(left >= 0 && left <= (double)burst);
	ck_assert_uint_ge(granted, produced / 2);
	done(tb, name);
}
END_TEST

START_TEST(procs_rate0_conserves)
{
	char name[64];
	struct arena *a = shared_anon(sizeof(*a));
	struct tokenbucket *tb = fresh(name, "rate0", 0, SEC, 50);
	atomic_store(&a->clock, SEC);
	run_procs(name, a, true);
	ck_assert_int_eq(atomic_load(&a->bad), 0);
	ck_assert_tokens(tokenbucket_tokens_at(tb, atomic_load(&a->clock)), 50);
	done(tb, name);
}
END_TEST

/* ---- Crashes -------------------------------------------------------------- */

/*
 * A writer killed with the regime frozen (gen odd), as a rate change is
 * between its freeze and its publish: the next writer recovers the lock
 * (EOWNERDEAD) and publishes the frozen regime again.
 */
START_TEST(dead_writer_recovered)
{
	char name[64];
	struct tokenbucket *tb = fresh(name, "dead", 1, MS, 10);
	ck_assert_int_eq(tokenbucket_reset_at(tb, SEC, 0), 0);
	pid_t pid = fork();
	TBT_FORKED(pid);
	if (pid == 0) {
		pthread_mutex_lock(&tb->writer);
		atomic_store(&tb->frozen_at, SEC + 2 * MS);
		atomic_fetch_add(&tb->gen, 1);
		atomic_store(&tb->threshold, 1000); /* a burst change half done */
		raise(SIGKILL);
	}
	int st;
	ck_assert_int_eq(waitpid(pid, &st, 0), pid);
	ck_assert(WIFSIGNALED(st));
	ck_assert_uint_eq(atomic_load(&tb->gen) & 1, 1);
	/* The next writer is not blocked and rolls the change back. */
	ck_assert_int_eq(tokenbucket_set_threshold(tb, 3), 0);
	ck_assert_uint_eq(atomic_load(&tb->gen) & 1, 0);
	ck_assert_tokens(tokenbucket_tokens_at(tb, SEC + 5 * MS), 5);
	ck_assert_int_eq(tokenbucket_set_rate_every_at(tb, SEC + 5 * MS, 2, MS), 0);
	ck_assert_tokens(tokenbucket_tokens_at(tb, SEC + 6 * MS), 7);
	/* A take that finds a dead writer's freeze repairs it too, without a writer. */
	pid = fork();
	if (pid == 0) {
		pthread_mutex_lock(&tb->writer);
		atomic_store(&tb->frozen_at, SEC + 6 * MS);
		atomic_fetch_add(&tb->gen, 1);
		raise(SIGKILL);
	}
	ck_assert_int_eq(waitpid(pid, &st, 0), pid);
	ck_assert_uint_eq(atomic_load(&tb->gen) & 1, 1);
	ck_assert(tokenbucket_allow_at(tb, SEC + 10 * MS, 10));
	ck_assert_uint_eq(atomic_load(&tb->gen) & 1, 0);
	ck_assert_int_eq(pthread_mutex_trylock(&tb->writer), 0);
	pthread_mutex_unlock(&tb->writer);
	/* A second death in a row, at unlimited rate, is recovered as well. */
	ck_assert_int_eq(tokenbucket_set_rate(tb, TOKENBUCKET_INF), 0);
	pid = fork();
	if (pid == 0) {
		pthread_mutex_lock(&tb->writer);
		atomic_store(&tb->head, atomic_load(&tb->tail)); /* as if fill had not run */
		raise(SIGKILL);
	}
	ck_assert_int_eq(waitpid(pid, &st, 0), pid);
	ck_assert_int_eq(tokenbucket_set_burst_at(tb, 2 * SEC, 10), 0);
	ck_assert_tokens(tokenbucket_tokens_at(tb, 2 * SEC), 10);
	done(tb, name);
}
END_TEST

/*
 * A writer killed while another one waits for the lock: the waiter's
 * bounded wait ends in EOWNERDEAD (not a timeout), it repairs the freeze
 * and its own change goes through.
 */
START_TEST(dead_writer_while_waiting)
{
	char name[64];
	struct tokenbucket *tb = fresh(name, "deadwait", 1, MS, 10);
	ck_assert_int_eq(tokenbucket_reset_at(tb, SEC, 0), 0);
	int ready[2];
	ck_assert_int_eq(pipe(ready), 0);
	pid_t pid = fork();
	TBT_FORKED(pid);
	if (pid == 0) {
		pthread_mutex_lock(&tb->writer);
		atomic_store(&tb->frozen_at, SEC + 2 * MS);
		atomic_fetch_add(&tb->gen, 1);
		(void)!write(ready[1], "x", 1);
		/* Long enough for the parent to be waiting; well inside its 2 s. */
		usleep(300 * 1000);
		raise(SIGKILL);
	}
	char c;
	ck_assert_int_eq(read(ready[0], &c, 1), 1);
	ck_assert_int_eq(tokenbucket_set_rate_every_at(tb, SEC + 5 * MS, 2, MS), 0);
	int st;
	ck_assert_int_eq(waitpid(pid, &st, 0), pid);
	ck_assert(WIFSIGNALED(st));
	ck_assert_uint_eq(atomic_load(&tb->gen) & 1, 0);
	/* 5 tokens at 1/ms up to 5 ms, then 2/ms: 7 at 6 ms. */
	ck_assert_tokens(tokenbucket_tokens_at(tb, SEC + 6 * MS), 7);
	ck_assert_int_eq(tokenbucket_set_burst_at(tb, SEC + 6 * MS, 10), 0);
	close(ready[0]);
	close(ready[1]);
	done(tb, name);
}
END_TEST

enum { TAKERS = 4, CHANGERS = 2, KILLS = 400 };

struct storm {
	_Atomic int64_t clock;
	atomic_uint_fast64_t granted;
	atomic_int bad;
	atomic_int open_err; /* a child that could not open the bucket: its error */
	atomic_long calls;
};

static const uint64_t storm_rates[] = {3, 7, 1, 0, 5}; /* tokens per 100 us */
enum { STORM_MAX_RATE = 7, STORM_BURST = 40 };

static void storm_child(const char *name, struct storm *s, bool changer, unsigned seed)
{
	/*
	 * The children spin; niced, they leave the killer its turn at once
	 * when it wakes, so the storm keeps its pace on a loaded machine.
	 */
	(void)setpriority(PRIO_PROCESS, 0, 10);
	struct tokenbucket *tb = NULL;
	int err = tokenbucket_open(&tb, name, 0, 0, 0, 0, NULL);
	if (err != 0) {
		atomic_store(&s->open_err, err);
		_exit(1);
	}
	for (unsigned i = seed;; i++) {
		int64_t t = atomic_fetch_add(&s->clock, 1 * US);
		if (changer) {
			uint64_t r = storm_rates[i % 5];
			if (tokenbucket_set_rate_every_at(tb, t, r, 100 * US) != 0)
				atomic_fetch_add(&s->bad, 1);
		} else if (tokenbucket_allow_at(tb, t, 1)) {
			atomic_fetch_add(&s->granted, 1);
		}
		if (tokenbucket_tokens_at(tb, t) > STORM_BURST)
			atomic_fetch_add(&s->bad, 1);
		atomic_fetch_add(&s->calls, 1);
	}
}


/*
 * A reset killed after its freeze on a bucket that has seen no time: the
 * repair publishes the frozen regime again, with no origin, in slot 1.  The
 * next call that passes a time fixes that slot's origin (1.1 fixed only
 * slot 0's, and every call then looped).
 */
START_TEST(dead_reset_before_first_time)
{
	char name[64];
	struct tokenbucket *tb = fresh(name, "deadreset", 1, MS, 10);
	ck_assert_int_eq(atomic_load(&tb->clock), TB__NO_TIME);
	pid_t pid = fork();
	TBT_FORKED(pid);
	if (pid == 0) {
		/* reset_at's first steps: the lock, the freeze, the clock. */
		pthread_mutex_lock(&tb->writer);
		atomic_store(&tb->frozen_at, TB__NO_TIME);
		atomic_fetch_add(&tb->gen, 1);
		atomic_store(&tb->clock, SEC);
		raise(SIGKILL);
	}
	int st;
	ck_assert_int_eq(waitpid(pid, &st, 0), pid);
	ck_assert(WIFSIGNALED(st));
	/* The take repairs (gen 2: slot 1, no origin), then fixes the origin at 2 s. */
	ck_assert(tokenbucket_allow_at(tb, 2 * SEC, 10));
	ck_assert_uint_eq(atomic_load(&tb->gen), 2);
	ck_assert_int_eq(atomic_load(&tb->slot[1].origin), 2 * SEC);
	ck_assert(!tokenbucket_allow_at(tb, 2 * SEC, 1));
	ck_assert_tokens(tokenbucket_tokens_at(tb, 2 * SEC + 3 * MS), 3);
	ck_assert_uint_eq(atomic_load(&tb->corrupt), 0);
	done(tb, name);
}
END_TEST

START_TEST(sigkill_storm)
{
	char name[64];
	test_name(name, sizeof(name), "storm");
	struct storm *s = shared_anon(sizeof(*s));
	const int64_t t0 = SEC;
	struct tokenbucket *tb = open_new(name, 3, 100 * US, STORM_BURST);
	ck_assert_int_eq(tokenbucket_reset_at(tb, t0, STORM_BURST), 0);
	atomic_store(&s->clock, t0);
	enum { N = TAKERS + CHANGERS };
	pid_t pids[N];
	for (int i = 0; i < N; i++) {
		pids[i] = fork();
		TBT_FORKED(pids[i]);
		if (pids[i] == 0)
			storm_child(name, s, i >= TAKERS, (unsigned)i);
	}
	srand(1111);
	int kills = 0, writer_kills = 0, frozen = 0;
	int64_t end = tokenbucket_now() + 40 * SEC; /* 400 take a few seconds on a quiet machine */
	while (kills < KILLS && tokenbucket_now() < end) {
		long calls = atomic_load(&s->calls);
		/* Let the survivors work between kills: some calls, a few hundred us. */
		usleep((useconds_t)(50 + rand() % 400));
		while (atomic_load(&s->calls) == calls && atomic_load(&s->open_err) == 0)
			usleep(50);
		ck_assert_int_eq(atomic_load(&s->open_err), 0);
		int i = rand() % N;
		kill(pids[i], SIGKILL);
		int st;
		ck_assert_int_eq(waitpid(pids[i], &st, 0), pids[i]);
		kills++;
		if (i >= TAKERS) {
			writer_kills++;
			if (atomic_load(&tb->gen) & 1)
				frozen++; /* killed between freeze and publish, or racing its peer */
		}
		pids[i] = fork();
		TBT_FORKED(pids[i]);
		if (pids[i] == 0)
			storm_child(name, s, i >= TAKERS, (unsigned)(kills * N + i));
	}
	for (int i = 0; i < N; i++) {
		kill(pids[i], SIGKILL);
		waitpid(pids[i], NULL, 0);
	}
	fprintf(stderr, "sigkill storm: %d kills survived (%d of writers, %d seen mid-change), %ld calls\n",
		kills, writer_kills, frozen, atomic_load(&s->calls));
	/* Under valgrind (20 times slower) fewer than 400 come in 40 s. */
	const char *slow = getenv("CK_TIMEOUT_MULTIPLIER");
	int need = KILLS / (slow && atoi(slow) > 1 ? atoi(slow) : 1);
	ck_assert_int_ge(kills, need);
	ck_assert_int_eq(atomic_load(&s->bad), 0);
	/* A writer lock held by a dead process does not block the next writer. */
	alarm(10);
	int64_t t = atomic_load(&s->clock);
	ck_assert_int_eq(tokenbucket_set_rate_every_at(tb, t, 3, 100 * US), 0);
	alarm(0);
	ck_assert_uint_eq(atomic_load(&tb->gen) & 1, 0);
	int64_t elapsed = t - t0;
	uint64_t bound = STORM_BURST + (uint64_t)(elapsed * STORM_MAX_RATE / (100 * US));
	ck_assert_uint_le(atomic_load(&s->granted), bound);
	ck_assert(tokenbucket_tokens_at(tb, t) <= STORM_BURST);
	/* Survivors go on: the bucket still grants what the rate produces. */
	ck_assert(tokenbucket_allow_at(tb, t + 100 * SEC, STORM_BURST));
	done(tb, name);
}
END_TEST

/* ---- Both faces across processes ------------------------------------------ */

START_TEST(faces_across_processes)
{
	char name[64];
	/* 20000 tokens per second, burst 20: the 400 tokens below need 19 ms at least. */
	struct tokenbucket *tb = fresh(name, "faces", 20, MS, 20);
	struct arena *a = shared_anon(sizeof(*a));
	int64_t start = tokenbucket_now();
	tokenbucket_replenish(tb, start);
	pid_t replenisher = fork();
	TBT_FORKED(replenisher);
	if (replenisher == 0) {
		struct tokenbucket *mine = child_open(name);
		while (!atomic_load(&a->go)) {
			tokenbucket_replenish(mine, tokenbucket_now());
			usleep(100);
		}
		_exit(0);
	}
	pid_t dispatcher = fork();
	TBT_FORKED(dispatcher);
	if (dispatcher == 0) {
		struct tokenbucket *mine = child_open(name);
		for (int i = 0; i < 20; i++) {
			uint64_t ticket = tokenbucket_grab(mine, 10);
			while (tokenbucket_deficiency(mine, ticket) != 0)
				sched_yield();
		}
		_exit(0);
	}
	pid_t client = fork();
	TBT_FORKED(client);
	if (client == 0) {
		struct tokenbucket *mine = child_open(name);
		for (int i = 0; i < 20; i++)
			if (tokenbucket_wait(mine, 10, tokenbucket_now() + 10 * SEC, -1) != 0)
				_exit(2);
		_exit(0);
	}
	ck_assert(child_ok(dispatcher));
	ck_assert(child_ok(client));
	int64_t took = tokenbucket_now() - start;
	atomic_store(&a->go, 1);
	ck_assert(child_ok(replenisher));
	/* 400 tokens at 20 per ms with 20 there at the start: at least 19 ms. */
	ck_assert_int_ge(took, 19 * MS);
	done(tb, name);
}
END_TEST


/* ---- Corrupt mappings: every call returns -------------------------------- */

/*
 * File offsets of the 8-byte words the tests below change, in the layout of
 * 1.1 (header, then the state; docs/shm.md, "Corrupt mappings").
 */
enum {
	W_CORRUPT = 120,      /* the corrupt mark */
	W_GEN = 128,          /* the regime index */
	W_SLOT1_LIMIT = 248,  /* slot 1's horizon */
	W_LOCK = 320,         /* the writer mutex: lock word and count */
	W_OWNER = 328,        /* owner and users */
	W_KIND = 336,         /* kind */
};

static uint64_t word_at(const void *mem, size_t off)
{
	uint64_t w;
	memcpy(&w, (const char *)mem + off, sizeof(w));
	return w;
}

static void word_set(void *mem, size_t off, uint64_t w)
{
	memcpy((char *)mem + off, &w, sizeof(w));
}

/* A bucket at rate/burst in mem, with one allow at 1 s. */
static struct tokenbucket *used_bucket(void *mem, double rate, uint64_t burst)
{
	struct tokenbucket *tb = NULL;
	ck_assert_int_eq(tokenbucket_init_shared(&tb, mem, tokenbucket_shared_size(), rate, burst, 0),
			 0);
	ck_assert(tokenbucket_allow_at(tb, SEC, 1));
	return tb;
}

/*
 * Every call of both faces and every writer on tb, at times from now: each
 * returns, with a value its page documents (a hang fails the test by its
 * timeout, a crash by its signal).
 */
static void every_call_returns(struct tokenbucket *tb, int64_t now)
{
	static const int writer_errors[] = {0, -EBADMSG, -EDEADLK, -EINVAL};
	struct tokenbucket_reservation r;
	struct tokenbucket_result res;
	for (int i = 0; i < 4; i++) {
		int64_t t = now + i * SEC;
		(void)tokenbucket_allow_at(tb, t, 1);
		int err = tokenbucket_reserve_at(tb, t, 1, SEC, &r);
		ck_assert(err == 0 || err == -EBADMSG || err == -ETIMEDOUT || err == -EOVERFLOW ||
			  err == -E2BIG);
		if (err == 0)
			tokenbucket_cancel_at(tb, &r, t);
		double x = tokenbucket_tokens_at(tb, t);
		ck_assert(isnan(x) || x <= (double)tokenbucket_burst(tb));
		err = tokenbucket_allow_result_at(tb, t, 1, &res);
		ck_assert(err == 0 || err == -EBADMSG);
		uint64_t ticket = tokenbucket_grab(tb, 1);
		(void)tokenbucket_deficiency(tb, ticket);
		tokenbucket_refund(tb, 1);
		tokenbucket_replenish(tb, t);
		(void)tokenbucket_duration_for(tb, 1);
		(void)tokenbucket_rate(tb);
		bool found = false;
		err = tokenbucket_set_rate_at(tb, t, 5);
		for (size_t k = 0; k < sizeof(writer_errors) / sizeof(writer_errors[0]); k++)
			found |= err == writer_errors[k];
		ck_assert_msg(found, "set_rate_at: %d", err);
		err = tokenbucket_set_burst_at(tb, t, 4);
		ck_assert(err == 0 || err == -EBADMSG || err == -EDEADLK);
		err = tokenbucket_reset_at(tb, t, 1);
		ck_assert(err == 0 || err == -EBADMSG || err == -EDEADLK);
		err = tokenbucket_set_threshold(tb, 1);
		ck_assert(err == 0 || err == -EBADMSG || err == -EDEADLK || err == -EINVAL);
	}
}

/*
 * The regime index selects a slot with no origin (the first hang): a state
 * a reset of a never-used bucket killed mid-way leaves too.  Attach takes
 * it, and the first call fixes that slot's origin.
 */
START_TEST(corrupt_gen_unfixed_slot)
{
	size_t size = tokenbucket_shared_size();
	void *mem = shared_anon(size);
	static const uint64_t gens[] = {2, 6, 10, UINT64_C(0x8000000000000002)};
	for (size_t i = 0; i < sizeof(gens) / sizeof(gens[0]); i++) {
		used_bucket(mem, 7, 3);
		word_set(mem, W_GEN, gens[i]);
		struct tokenbucket *tb = NULL;
		ck_assert_int_eq(tokenbucket_attach_shared(&tb, mem, size), 0);
		/* The level as it was: 2 tokens, none produced before the new origin. */
		ck_assert_tokens(tokenbucket_tokens_at(tb, 2 * SEC), 2);
		ck_assert_tokens(tokenbucket_tokens_at(tb, 2 * SEC + SEC / 7 + 1), 3);
		every_call_returns(tb, 3 * SEC);
	}
	munmap(mem, size);
}
END_TEST

/* A horizon that the origin and the rate do not give is refused. */
START_TEST(corrupt_limit_refused)
{
	size_t size = tokenbucket_shared_size();
	void *mem = shared_anon(size);
	struct tokenbucket *tb = used_bucket(mem, 7, 3);
	ck_assert_int_eq(tokenbucket_set_rate_at(tb, 2 * SEC, 9), 0); /* regime 1: slot 1 */
	ck_assert_uint_eq(word_at(mem, W_GEN), 2);
	/* At 9/s production never reaches the anchor: no horizon. */
	ck_assert_uint_eq(word_at(mem, W_SLOT1_LIMIT), (uint64_t)INT64_MAX);
	ck_assert_int_eq(tokenbucket_attach_shared(&tb, mem, size), 0);
	word_set(mem, W_SLOT1_LIMIT, (uint64_t)(3 * SEC));
	ck_assert_int_eq(tokenbucket_attach_shared(&tb, mem, size), -EBADMSG);
	word_set(mem, W_SLOT1_LIMIT, (uint64_t)INT64_MAX - 1);
	ck_assert_int_eq(tokenbucket_attach_shared(&tb, mem, size), -EBADMSG);
	word_set(mem, W_SLOT1_LIMIT, (uint64_t)INT64_MIN); /* its origin's fixer was killed */
	ck_assert_int_eq(tokenbucket_attach_shared(&tb, mem, size), 0);
	every_call_returns(tb, 3 * SEC);
	munmap(mem, size);
}
END_TEST

/*
 * A mutex kind this library never makes (the second hang): attach refuses
 * it, and a bucket already attached when it changes fails its calls that
 * need the lock, marks itself corrupt, and fails fast from then on.
 */
START_TEST(corrupt_mutex_kind)
{
	size_t size = tokenbucket_shared_size();
	void *mem = shared_anon(size);
	struct tokenbucket *tb = NULL;
	ck_assert_int_eq(tokenbucket_init_shared(&tb, mem, size, 1e15, TOKENBUCKET_BURST_MAX, 0), 0);
	ck_assert(tokenbucket_allow_at(tb, INT64_MAX / 2, 1));
	uint64_t kind = word_at(mem, W_KIND);
	word_set(mem, W_KIND, 0x94);
	struct tokenbucket *other = NULL;
	ck_assert_int_eq(tokenbucket_attach_shared(&other, mem, size), -EBADMSG);
	/* Far past the horizon: the take must normalize under the lock. */
	ck_assert(!tokenbucket_allow_at(tb, INT64_MAX / 2 + INT64_MAX / 4, 1));
	ck_assert_uint_ne(word_at(mem, W_CORRUPT), 0);
	ck_assert_int_eq(tokenbucket_set_rate_at(tb, INT64_MAX / 2, 1), -EBADMSG);
	ck_assert(isnan(tokenbucket_tokens_at(tb, INT64_MAX / 2 + INT64_MAX / 4)));
	struct tokenbucket_reservation r;
	ck_assert_int_eq(tokenbucket_reserve_at(tb, INT64_MAX / 2 + INT64_MAX / 4, 1, 0, &r),
			 -EBADMSG);
	/* The mark is sticky: a right kind again does not make the bucket whole. */
	word_set(mem, W_KIND, kind);
	ck_assert_int_eq(tokenbucket_attach_shared(&other, mem, size), -EBADMSG);
	every_call_returns(tb, INT64_MAX / 2);
	munmap(mem, size);
}
END_TEST

/* An unrecoverable writer mutex is an error returned, and marks the bucket. */
START_TEST(corrupt_mutex_unrecoverable)
{
	size_t size = tokenbucket_shared_size();
	void *mem = shared_anon(size);
	struct tokenbucket *tb = used_bucket(mem, 7, 3);
	/* glibc's owner word: PTHREAD_MUTEX_NOTRECOVERABLE, no users. */
	word_set(mem, W_OWNER, 0x7ffffffe);
	ck_assert_int_eq(tokenbucket_attach_shared(&tb, mem, size), 0);
	ck_assert_int_eq(tokenbucket_set_rate_at(tb, 2 * SEC, 9), -EBADMSG);
	ck_assert_int_eq(tokenbucket_attach_shared(&tb, mem, size), -EBADMSG);
	ck_assert_int_eq(tokenbucket_set_burst_at(tb, 2 * SEC, 9), -EBADMSG);
	every_call_returns(tb, 3 * SEC);
	munmap(mem, size);
}
END_TEST

/*
 * A lock word naming a thread that does not exist: a writer gives up after
 * its bounded wait with -EDEADLK, and lock-free calls go on.  Not marked:
 * a stopped holder looks the same.
 */
START_TEST(corrupt_lock_word)
{
	size_t size = tokenbucket_shared_size();
	void *mem = shared_anon(size);
	struct tokenbucket *tb = used_bucket(mem, 7, 3);
	word_set(mem, W_LOCK, 0x3ffffff0); /* above any pid_max: no such thread */
	ck_assert_int_eq(tokenbucket_attach_shared(&tb, mem, size), 0);
	ck_assert_int_eq(tokenbucket_set_rate_at(tb, 2 * SEC, 9), -EDEADLK);
	ck_assert_uint_eq(word_at(mem, W_CORRUPT), 0);
	ck_assert(tokenbucket_allow_at(tb, 2 * SEC, 2));
	ck_assert(!tokenbucket_allow_at(tb, 2 * SEC, 2));
	ck_assert_int_eq(tokenbucket_attach_shared(&tb, mem, size), 0);
	munmap(mem, size);
}
END_TEST

/* A regime frozen with no writer holding the lock is unfrozen by the next call. */
START_TEST(corrupt_frozen_unlocked)
{
	size_t size = tokenbucket_shared_size();
	void *mem = shared_anon(size);
	struct tokenbucket *tb = used_bucket(mem, 7, 3);
	word_set(mem, W_GEN, word_at(mem, W_GEN) | 1);
	ck_assert_int_eq(tokenbucket_attach_shared(&tb, mem, size), 0);
	ck_assert(tokenbucket_allow_at(tb, 2 * SEC, 1));
	ck_assert_uint_eq(word_at(mem, W_GEN) & 1, 0);
	ck_assert_int_eq(tokenbucket_set_rate_at(tb, 2 * SEC, 9), 0);
	every_call_returns(tb, 3 * SEC);
	ck_assert_uint_eq(word_at(mem, W_CORRUPT), 0);
	munmap(mem, size);
}
END_TEST

/* A bucket marked corrupt is refused by attach and by open. */
START_TEST(corrupt_mark_refused)
{
	char name[64], path[128];
	test_name(name, sizeof(name), "corrupt");
	struct tokenbucket *tb = NULL;
	ck_assert_int_eq(tokenbucket_open(&tb, name, 7, 3, 0, 0600, NULL), 0);
	ck_assert(tokenbucket_allow_at(tb, SEC, 1));
	tokenbucket_close(tb);
	shm_file(path, sizeof(path), name);
	int fd = open(path, O_RDWR);
	ck_assert_int_ge(fd, 0);
	uint64_t one = 1;
	ck_assert_int_eq(pwrite(fd, &one, sizeof(one), W_CORRUPT), (ssize_t)sizeof(one));
	close(fd);
	ck_assert_int_eq(tokenbucket_open(&tb, name, 7, 3, 0, 0600, NULL), -EBADMSG);
	ck_assert_int_eq(tokenbucket_unlink(name), 0);
}
END_TEST

Suite *shared_suite(void)
{
	Suite *s = suite_create("shared");
	TCase *tc = tcase_create("placed");
	tcase_add_test(tc, placed_size_and_attach);
	tcase_add_test(tc, placed_bad_headers);
	suite_add_tcase(s, tc);
	tc = tcase_create("named");
	tcase_set_timeout(tc, 30);
	tcase_add_test(tc, named_open_attach_close);
	tcase_add_test(tc, named_bad_names);
	tcase_add_test(tc, named_foreign_objects);
	tcase_add_test(tc, named_other_user);
	tcase_add_test(tc, named_create_race);
	tcase_add_test(tc, named_create_killed);
	suite_add_tcase(s, tc);
	tc = tcase_create("processes");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, procs_exact_bound);
	tcase_add_test(tc, procs_rate0_conserves);
	tcase_add_test(tc, faces_across_processes);
	suite_add_tcase(s, tc);
	tc = tcase_create("crashes");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, dead_writer_recovered);
	tcase_add_test(tc, dead_writer_while_waiting);
	tcase_add_test(tc, dead_reset_before_first_time);
	tcase_add_test(tc, sigkill_storm);
	suite_add_tcase(s, tc);
	tc = tcase_create("corrupt");
	/* corrupt_lock_word waits out one bounded lock wait (2 s) per writer call. */
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, corrupt_gen_unfixed_slot);
	tcase_add_test(tc, corrupt_limit_refused);
	tcase_add_test(tc, corrupt_mutex_kind);
	tcase_add_test(tc, corrupt_mutex_unrecoverable);
	tcase_add_test(tc, corrupt_lock_word);
	tcase_add_test(tc, corrupt_frozen_unlocked);
	tcase_add_test(tc, corrupt_mark_refused);
	suite_add_tcase(s, tc);
	return s;
}
