/* SPDX-License-Identifier: MIT */
/*
 * tokenbucket_wait on the real clock.  Lower bounds are exact (the tokens are
 * not there before time_to_act); upper bounds are generous margins.
 */
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include "check_tb.h"

#define MARGIN (5 * SEC)

/* "Not late": 250 ms, scaled like Check's timeouts for slow (sanitizer, valgrind) runs. */
static int64_t late(void)
{
	const char *env = getenv("CK_TIMEOUT_MULTIPLIER");
	double k = env ? atof(env) : 1;
	return (int64_t)(250 * MS * (k > 1 ? k : 1));
}

static void sleep_ns(int64_t ns)
{
	struct timespec ts = { ns / SEC, ns % SEC };
	while (nanosleep(&ts, &ts) != 0)
		;
}

/* An empty bucket producing a token every period_ns from *since, which is now. */
static struct tokenbucket *empty_bucket(int64_t period_ns, uint64_t burst, int64_t *since)
{
	*since = tokenbucket_now();
	return bucket_empty_at(1, period_ns, burst, 0, *since);
}

START_TEST(wait_returns_at_once_when_tokens_are_there)
{
	struct tokenbucket *tb = bucket_every(1, SEC, 3, 0);
	int64_t start = tokenbucket_now();
	ck_assert_int_eq(tokenbucket_wait(tb, 3, TOKENBUCKET_NEVER, -1), 0);
	ck_assert_int_lt(tokenbucket_now() - start, MARGIN);
	ck_assert(!tokenbucket_allow(tb, 1));
	tokenbucket_free(tb);
}
END_TEST

START_TEST(wait_sleeps_until_the_tokens_are_there)
{
	int64_t start;
	struct tokenbucket *tb = empty_bucket(50 * MS, 5, &start);
	ck_assert_int_eq(tokenbucket_wait(tb, 2, TOKENBUCKET_NEVER, -1), 0);
	int64_t took = tokenbucket_now() - start;
	ck_assert_int_ge(took, 100 * MS);
	ck_assert_int_lt(took, 100 * MS + MARGIN);
	/* They were taken: the bucket holds what time produced, less 2. */
	int64_t after = tokenbucket_now();
	double produced = (double)(after - start) / (double)(50 * MS);
	ck_assert_tokens(tokenbucket_tokens_at(tb, after), fmin(5, produced - 2));
	tokenbucket_free(tb);
}
END_TEST

START_TEST(wait_with_a_cancel_fd_that_stays_quiet)
{
	int64_t start;
	struct tokenbucket *tb = empty_bucket(30 * MS, 5, &start);
	int efd = eventfd(0, EFD_CLOEXEC);
	ck_assert_int_eq(tokenbucket_wait(tb, 1, start + MARGIN, efd), 0);
	ck_assert_int_ge(tokenbucket_now() - start, 30 * MS);
	close(efd);
	tokenbucket_free(tb);
}
END_TEST

START_TEST(wait_refuses_a_deadline_it_cannot_meet)
{
	int64_t start;
	struct tokenbucket *tb = empty_bucket(10 * SEC, 5, &start);
	ck_assert_int_eq(tokenbucket_wait(tb, 1, start + 100 * MS, -1), -ETIMEDOUT);
	ck_assert_int_lt(tokenbucket_now() - start, MARGIN); /* at once, not at the deadline */
	ck_assert_double_lt(tokenbucket_tokens(tb), 1);
	ck_assert_double_ge(tokenbucket_tokens(tb), 0); /* nothing taken */
	tokenbucket_free(tb);
}
END_TEST

struct canceller {
	int fd;
	int64_t after;
	bool hang_up;
};

static void *cancel_later(void *arg)
{
	struct canceller *c = arg;
	sleep_ns(c->after);
	if (c->hang_up) {
		close(c->fd);
	} else {
		uint64_t one = 1;
		ck_assert_int_eq(write(c->fd, &one, sizeof(one)), (int)sizeof(one));
	}
	return NULL;
}

static void check_cancel_mid_wait(bool hang_up)
{
	int64_t since;
	struct tokenbucket *tb = empty_bucket(10 * SEC, 5, &since);
	int fds[2];
	struct canceller c = { .after = 50 * MS, .hang_up = hang_up };
	int wait_fd;
	if (hang_up) {
		ck_assert_int_eq(pipe(fds), 0);
		wait_fd = fds[0];
		c.fd = fds[1];
	} else {
		wait_fd = c.fd = eventfd(0, EFD_CLOEXEC);
	}
	pthread_t t;
	int64_t start = tokenbucket_now(); /* before the canceller starts counting */
	ck_assert_int_eq(pthread_create(&t, NULL, cancel_later, &c), 0);
	ck_assert_int_eq(tokenbucket_wait(tb, 3, TOKENBUCKET_NEVER, wait_fd), -ECANCELED);
	int64_t took = tokenbucket_now() - start;
	pthread_join(t, NULL);
	ck_assert_int_ge(took, 50 * MS);
	ck_assert_int_lt(took, MARGIN);
	/* The reservation was given back: the bucket holds what time produced. */
	double tokens = tokenbucket_tokens(tb);
	ck_assert_double_ge(tokens, 0);
	ck_assert_double_lt(tokens, 1);
	close(wait_fd);
	tokenbucket_free(tb);
}

START_TEST(cancel_fd_written_mid_wait)
{
	check_cancel_mid_wait(false);
}
END_TEST

START_TEST(cancel_pipe_hung_up_mid_wait)
{
	check_cancel_mid_wait(true);
}
END_TEST

/*
 * Capped release: a full bucket of 2 (a token a millisecond) whose tokens are
 * all grabbed and in flight.  The rate alone would cover one more token in
 * 1 ms, but ceil holds head back until a release.
 */
static struct tokenbucket *capped_bucket_in_flight(void)
{
	struct tokenbucket *tb = NULL;
	ck_assert_int_eq(tokenbucket_create_every(&tb, 1, MS, 2, TOKENBUCKET_CAPPED_RELEASE), 0);
	tokenbucket_grab(tb, 2);
	return tb;
}

/* A thread that sleeps `after` ns, then calls act(tb) and records when. */
struct later {
	struct tokenbucket *tb;
	int64_t after;
	int (*act)(struct tokenbucket *tb);
	int64_t done; /* tokenbucket_now() once act returned */
};

static void *act_later(void *arg)
{
	struct later *l = arg;
	sleep_ns(l->after);
	ck_assert_int_eq(l->act(l->tb), 0);
	l->done = tokenbucket_now();
	return NULL;
}

static int release_one(struct tokenbucket *tb)
{
	return tokenbucket_release(tb, 1);
}

static int slow_down(struct tokenbucket *tb)
{
	return tokenbucket_set_rate_every_at(tb, tokenbucket_now(), 1, 2 * SEC);
}

START_TEST(capped_wait_lasts_until_a_release)
{
	struct tokenbucket *tb = capped_bucket_in_flight();
	struct later rl = { .tb = tb, .after = 60 * MS, .act = release_one };
	int64_t start = tokenbucket_now(); /* before the releaser starts counting */
	pthread_t t;
	ck_assert_int_eq(pthread_create(&t, NULL, act_later, &rl), 0);
	ck_assert_int_eq(tokenbucket_wait(tb, 1, start + MARGIN, -1), 0);
	int64_t took = tokenbucket_now() - start;
	pthread_join(t, NULL);
	ck_assert_int_ge(took, 60 * MS);
	ck_assert_int_lt(took, MARGIN);
	ck_assert_uint_eq(tokenbucket_deficiency(tb, 3), 0);
	tokenbucket_free(tb);
}
END_TEST

START_TEST(capped_wait_without_a_release_times_out_and_gives_back)
{
	struct tokenbucket *tb = capped_bucket_in_flight();
	int64_t start = tokenbucket_now();
	ck_assert_int_eq(tokenbucket_wait(tb, 1, start + 60 * MS, -1), -ETIMEDOUT);
	int64_t took = tokenbucket_now() - start;
	ck_assert_int_ge(took, 60 * MS);
	ck_assert_int_lt(took, MARGIN);
	/* Nothing was taken: two in flight, none in the bucket, none owed. */
	ck_assert_tokens(tokenbucket_tokens(tb), 0);
	/* One release makes room for exactly one token. */
	ck_assert_int_eq(tokenbucket_release(tb, 1), 0);
	int64_t later = tokenbucket_now() + 10 * MS;
	ck_assert_tokens(tokenbucket_tokens_at(tb, later), 1);
	ck_assert(tokenbucket_allow_at(tb, later, 1));
	ck_assert(!tokenbucket_allow_at(tb, later + SEC, 1));
	tokenbucket_free(tb);
}
END_TEST

START_TEST(wait_follows_a_rate_lowered_while_it_sleeps)
{
	int64_t start;
	struct tokenbucket *tb = empty_bucket(200 * MS, 5, &start);
	struct later sl = { .tb = tb, .after = 10 * MS, .act = slow_down };
	pthread_t t;
	ck_assert_int_eq(pthread_create(&t, NULL, act_later, &sl), 0);
	ck_assert_int_eq(tokenbucket_wait(tb, 1, TOKENBUCKET_NEVER, -1), 0);
	int64_t took = tokenbucket_now() - start;
	pthread_join(t, NULL);
	ck_assert_int_lt(took, MARGIN);
	/*
	 * Changed at c < 150 ms, at least 1/4 token was still missing, which the
	 * new rate makes in 500 ms: not before 500 ms.  (A later change proves
	 * nothing; the first reservation may have been covered already.)
	 */
	if (sl.done - start < 150 * MS)
		ck_assert_int_ge(took, 500 * MS);
	tokenbucket_free(tb);
}
END_TEST

static void on_signal(int sig)
{
	(void)sig;
}

struct storm {
	pthread_t target;
	atomic_bool stop;
	atomic_int sent;
};

/* SIGUSR1 to the waiting thread every 100 us or so. */
static void *signal_storm(void *arg)
{
	struct storm *s = arg;
	while (!atomic_load(&s->stop)) {
		pthread_kill(s->target, SIGUSR1);
		atomic_fetch_add(&s->sent, 1);
		sleep_ns(100 * US);
	}
	return NULL;
}

static void check_signal_storm(bool with_fd)
{
	struct sigaction sa = { .sa_handler = on_signal }; /* no SA_RESTART: calls see EINTR */
	sigemptyset(&sa.sa_mask);
	ck_assert_int_eq(sigaction(SIGUSR1, &sa, NULL), 0);
	int64_t start;
	struct tokenbucket *tb = empty_bucket(100 * MS, 5, &start);
	struct storm s = { .target = pthread_self() };
	pthread_t t;
	ck_assert_int_eq(pthread_create(&t, NULL, signal_storm, &s), 0);
	int efd = with_fd ? eventfd(0, EFD_CLOEXEC) : -1;
	int err = tokenbucket_wait(tb, 2, TOKENBUCKET_NEVER, efd);
	int64_t took = tokenbucket_now() - start;
	atomic_store(&s.stop, true);
	pthread_join(t, NULL);
	ck_assert_int_eq(err, 0);
	ck_assert_int_gt(atomic_load(&s.sent), 10);
	ck_assert_int_ge(took, 200 * MS); /* not early */
	ck_assert_int_lt(took, 200 * MS + late()); /* not late */
	/* Both tokens taken, and no more: the bucket holds only what came since. */
	double tokens = tokenbucket_tokens(tb);
	double produced = (double)(tokenbucket_now() - start) / (double)(100 * MS);
	ck_assert_double_le(tokens, produced - 2 + 1e-9);
	if (efd >= 0)
		close(efd);
	tokenbucket_free(tb);
}

START_TEST(signals_do_not_end_the_wait)
{
	check_signal_storm(false);
}
END_TEST

START_TEST(signals_do_not_end_the_wait_with_a_cancel_fd)
{
	check_signal_storm(true);
}
END_TEST

/*
 * Faults while waiting: the cancel descriptor closed, or its pipe hung up,
 * while the call sleeps towards a time_to_act 1000 s away.  The wait ends
 * within a slice of the sleep (50 ms) plus a margin, with the documented
 * error, and gives its reservation back: the bucket holds its 2 tokens again.
 */
enum fault { CLOSE_EVENTFD, CLOSE_PIPE_READ_END, HANG_UP_PIPE };

struct closer {
	int fd;
	int64_t after;
	int64_t done; /* tokenbucket_now() once closed */
};

static void *close_later(void *arg)
{
	struct closer *c = arg;
	sleep_ns(c->after);
	ck_assert_int_eq(close(c->fd), 0);
	c->done = tokenbucket_now();
	return NULL;
}

static void check_fault_mid_wait(enum fault fault, int want)
{
	int64_t start = tokenbucket_now();
	struct tokenbucket *tb = bucket_empty_at(1, 1000 * SEC, 5, 0, start);
	ck_assert_int_eq(tokenbucket_reset_at(tb, start, 2), 0);
	int fds[2] = { -1, -1 }, wait_fd;
	struct closer c = { .after = 50 * MS };
	if (fault == CLOSE_EVENTFD) {
		wait_fd = c.fd = eventfd(0, EFD_CLOEXEC);
		ck_assert_int_ge(wait_fd, 0);
	} else {
		ck_assert_int_eq(pipe(fds), 0);
		wait_fd = fds[0];
		c.fd = fault == HANG_UP_PIPE ? fds[1] : fds[0];
	}
	pthread_t t;
	ck_assert_int_eq(pthread_create(&t, NULL, close_later, &c), 0);
	int err = tokenbucket_wait(tb, 3, TOKENBUCKET_NEVER, wait_fd);
	int64_t end = tokenbucket_now();
	pthread_join(t, NULL);
	ck_assert_int_eq(err, want);
	ck_assert_int_ge(end - start, 50 * MS); /* not before the fault */
	ck_assert_int_lt(end - c.done, 50 * MS + late()); /* promptly after it */
	/* The reservation came back whole: 2 tokens and what 1000 s make in 0.1. */
	double tokens = tokenbucket_tokens(tb);
	ck_assert_double_ge(tokens, 2);
	ck_assert_double_lt(tokens, 2.001);
	ck_assert(tokenbucket_allow(tb, 2));
	ck_assert(!tokenbucket_allow(tb, 1));
	if (fault == HANG_UP_PIPE)
		close(fds[0]);
	else if (fault == CLOSE_PIPE_READ_END)
		close(fds[1]);
	tokenbucket_free(tb);
}

START_TEST(eventfd_closed_mid_wait)
{
	check_fault_mid_wait(CLOSE_EVENTFD, -EBADF);
}
END_TEST

START_TEST(pipe_closed_mid_wait)
{
	check_fault_mid_wait(CLOSE_PIPE_READ_END, -EBADF);
}
END_TEST

START_TEST(pipe_hung_up_mid_wait_gives_back)
{
	check_fault_mid_wait(HANG_UP_PIPE, -ECANCELED);
}
END_TEST

/*
 * A deadline already past: an answer at once and nothing taken.  At a finite
 * rate it is -ETIMEDOUT, tokens there or not; at an unlimited rate the rate
 * wins and it is 0 (tokenbucket_wait(3), NOTES).
 */
START_TEST(past_deadline_returns_at_once)
{
	static const int64_t past[] = { INT64_MIN, -1, 0 };
	for (int i = 0; i < 3; i++) {
		int64_t start;
		struct tokenbucket *tb = empty_bucket(10 * SEC, 5, &start);
		int64_t t0 = tokenbucket_now();
		ck_assert_int_eq(tokenbucket_wait(tb, 1, past[i], -1), -ETIMEDOUT);
		ck_assert_int_eq(tokenbucket_wait(tb, 0, past[i], -1), -ETIMEDOUT);
		ck_assert_int_eq(tokenbucket_reset_at(tb, tokenbucket_now(), 5), 0);
		ck_assert_int_eq(tokenbucket_wait(tb, 1, past[i], -1), -ETIMEDOUT);
		ck_assert_int_eq(tokenbucket_wait(tb, 1, tokenbucket_now() - 1, -1), -ETIMEDOUT);
		ck_assert_int_lt(tokenbucket_now() - t0, late());
		ck_assert_double_ge(tokenbucket_tokens(tb), 5); /* nothing taken */
		tokenbucket_free(tb);

		tb = bucket_rate(TOKENBUCKET_INF, 5, 0);
		t0 = tokenbucket_now();
		ck_assert_int_eq(tokenbucket_wait(tb, 1, past[i], -1), 0);
		ck_assert_int_eq(tokenbucket_wait(tb, UINT64_MAX, past[i], -1), 0);
		ck_assert_int_lt(tokenbucket_now() - t0, late());
		ck_assert_tokens(tokenbucket_tokens(tb), 5);
		tokenbucket_free(tb);
	}
}
END_TEST

Suite *wait_suite(void)
{
	Suite *s = suite_create("wait");
	TCase *tc = tcase_create("sleeping");
	tcase_set_timeout(tc, 30);
	tcase_add_test(tc, wait_returns_at_once_when_tokens_are_there);
	tcase_add_test(tc, wait_sleeps_until_the_tokens_are_there);
	tcase_add_test(tc, wait_with_a_cancel_fd_that_stays_quiet);
	tcase_add_test(tc, wait_refuses_a_deadline_it_cannot_meet);
	tcase_add_test(tc, cancel_fd_written_mid_wait);
	tcase_add_test(tc, cancel_pipe_hung_up_mid_wait);
	tcase_add_test(tc, signals_do_not_end_the_wait);
	tcase_add_test(tc, signals_do_not_end_the_wait_with_a_cancel_fd);
	tcase_add_test(tc, wait_follows_a_rate_lowered_while_it_sleeps);
	tcase_add_test(tc, capped_wait_lasts_until_a_release);
	tcase_add_test(tc, capped_wait_without_a_release_times_out_and_gives_back);
	tcase_add_test(tc, eventfd_closed_mid_wait);
	tcase_add_test(tc, pipe_closed_mid_wait);
	tcase_add_test(tc, pipe_hung_up_mid_wait_gives_back);
	tcase_add_test(tc, past_deadline_returns_at_once);
	suite_add_tcase(s, tc);
	return s;
}
