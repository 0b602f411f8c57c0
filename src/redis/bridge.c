/* SPDX-License-Identifier: MIT */
/*
 * Blocking calls pipelined (tokenbucket_redis_configure, pipelining): the
 * calling threads hand their calls to one I/O thread of the client's,
 * which runs the asynchronous engine (async.c) on its own poll loop, so
 * every thread's calls share one connection per server, written together
 * and answered in order.  A blocking call is then a thin layer: queue the
 * call, wake the I/O thread if the queue was empty, wait for the answer.
 *
 * Concurrency, without a lock on a call's way: a calling thread pushes
 * its request onto `queue` (a stack, compare-and-swap) and writes the
 * eventfd if it found the stack empty; the I/O thread reads its eventfd
 * before it takes the whole stack (one exchange), so a call pushed after
 * the take finds the stack empty and wakes it again: no call is left
 * waiting.  The answer is published by a release store to the request's
 * `done`; its thread checks that word and sleeps on one of the bridge's
 * futex words (`gen`, below).  The I/O thread wakes the threads it
 * answered once per turn of its loop, with one FUTEX_WAKE_BITSET per word
 * rather than one wake per call: the wakes cost a few system calls a turn,
 * not one a decision (docs/redis-client.md has the counts).  No mutex is
 * handed back and forth.  The engine, the descriptors and the timer belong
 * to the I/O thread alone.
 *
 * fork(): the child gets the engine as the I/O thread left it, and that
 * thread is not in the child.  A handler of pthread_atfork waits until
 * every I/O thread is outside its engine (`engine` below), so the child's
 * copy is whole: nothing half linked, nothing held only in the frames of
 * a thread that is gone.  The child frees it without running a callback.
 */
#include <errno.h>
#include <linux/futex.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "bridge.h"

/* A waiting call, on its thread's stack until done is set. */
struct breq {
	/* op TOKENBUCKET_REDIS_ALLOW_ALL: a call_all's, whose res the engine fills */
	const struct tokenbucket_redis_call *call;
	struct tokenbucket_result res;
	struct tokenbucket_reservation rv;
	double tokens;
	int err;
	/* 0, then 1 (release) once the fields above hold the answer. */
	_Atomic uint32_t done;
	unsigned slot; /* the calling thread's: gen[slot / 32], bit slot % 32 */
	struct tbr__bridge *b;
	struct breq *next; /* on the queue: the one pushed before */
};

/*
 * Waiting threads are dealt slots round-robin, once per thread; a word of
 * gen serves 32 of them.  Threads that share a slot (more than
 * BRIDGE_SLOTS calling) only wake each other spuriously.
 */
#define BRIDGE_WORDS 8
#define BRIDGE_SLOTS (BRIDGE_WORDS * 32)

struct watched {
	int fd;
	unsigned events;
};

struct tbr__bridge {
	_Atomic(struct breq *) queue; /* the calls pushed and not yet taken, latest first */
	atomic_bool stop;
	int wake; /* eventfd: the queue was empty and is not */
	pthread_t thread;
	pthread_mutex_t engine; /* held by the I/O thread while it runs the engine */
	struct tbr__bridge *next_bridge; /* in bridges, under bridges_lock */
	/*
	 * Set in a fork()ed child (fork_child): the I/O thread is not there.
	 * A flag rather than a getpid() per call, a system call since glibc
	 * 2.25 stopped caching it.
	 */
	atomic_bool forked;
	/* The I/O thread's own. */
	struct tokenbucket_redis_async *a;
	struct watched *fds;
	size_t nfds;
	struct pollfd *poll; /* the loop's array, kept here so that a fork()ed child frees it */
	size_t npoll;
	int64_t timer_at; /* tokenbucket_now() to fire at, or -1 */
	/*
	 * The futex words the callers sleep on, each with the bits of its 32
	 * slots: a waiter reads its word, then its done, and sleeps only if
	 * the word is unchanged.  The I/O thread adds 1 to a word after the
	 * done stores it covers (seq_cst, so a waiter that reads the new value
	 * sees them), then wakes the bits it answered.
	 */
	_Atomic uint32_t gen[BRIDGE_WORDS];
	uint32_t answered[BRIDGE_WORDS]; /* bits answered and not yet woken (I/O thread's) */
};

/* ---- fork() --------------------------------------------------------------- */

static pthread_mutex_t bridges_lock = PTHREAD_MUTEX_INITIALIZER;
static struct tbr__bridge *bridges; /* every open bridge of the process */
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
static int atfork_err;

/* Lock order: bridges_lock, then each engine; the I/O threads take theirs alone. */
static void fork_prepare(void)
{
	pthread_mutex_lock(&bridges_lock);
	for (struct tbr__bridge *b = bridges; b != NULL; b = b->next_bridge)
		pthread_mutex_lock(&b->engine);
}

/* Parent and child alike: the thread that forked holds the locks in both. */
static void fork_done(void)
{
	for (struct tbr__bridge *b = bridges; b != NULL; b = b->next_bridge)
		pthread_mutex_unlock(&b->engine);
	pthread_mutex_unlock(&bridges_lock);
}

static void fork_child(void)
{
	for (struct tbr__bridge *b = bridges; b != NULL; b = b->next_bridge)
		atomic_store_explicit(&b->forked, true, memory_order_relaxed);
	fork_done();
}

static void atfork_register(void)
{
	atfork_err = -pthread_atfork(fork_prepare, fork_done, fork_child);
}

static void bridges_remove(struct tbr__bridge *b)
{
	pthread_mutex_lock(&bridges_lock);
	struct tbr__bridge **at = &bridges;
	while (*at != NULL && *at != b)
		at = &(*at)->next_bridge;
	if (*at != NULL)
		*at = b->next_bridge;
	pthread_mutex_unlock(&bridges_lock);
}

/* ---- The I/O thread's loop ------------------------------------------------ */

static void loop_watch(void *data, int fd, unsigned events)
{
	struct tbr__bridge *b = data;
	size_t i = 0;
	while (i < b->nfds && b->fds[i].fd != fd)
		i++;
	if (events == 0) {
		if (i < b->nfds)
			b->fds[i] = b->fds[--b->nfds];
		return;
	}
	if (i == b->nfds) {
		struct watched *more = realloc(b->fds, (b->nfds + 1) * sizeof(*more));
		if (more == NULL)
			return; /* unwatched: its calls end at the command timeout */
		b->fds = more;
		b->nfds++;
	}
	b->fds[i] = (struct watched){ .fd = fd, .events = events };
}

static void loop_timer(void *data, int64_t ns)
{
	struct tbr__bridge *b = data;
	b->timer_at = ns < 0 ? -1 : tokenbucket_now() + ns;
}

/* Gives q's answer, in its fields, to the thread that waits for it. */
static void publish(struct breq *q)
{
	/* Read first: once done is 1 the waiter may return and its stack be reused. */
	struct tbr__bridge *b = q->b;
	unsigned slot = q->slot;
	atomic_store_explicit(&q->done, 1, memory_order_release);
	b->answered[slot / 32] |= 1u << (slot % 32);
}

/* Wakes the threads answered since the last call: the I/O thread's, once a turn. */
static void wake_answered(struct tbr__bridge *b)
{
	for (unsigned w = 0; w < BRIDGE_WORDS; w++) {
		if (b->answered[w] == 0)
			continue;
		atomic_fetch_add_explicit(&b->gen[w], 1, memory_order_seq_cst);
		syscall(SYS_futex, &b->gen[w], FUTEX_WAKE_BITSET_PRIVATE, INT32_MAX, NULL, NULL,
			b->answered[w]);
		b->answered[w] = 0;
	}
}

static void answered(void *arg, int err, const struct tokenbucket_result *res,
		     const struct tokenbucket_reservation *rv, double tokens)
{
	struct breq *q = arg;
	q->res = *res;
	if (rv != NULL)
		q->rv = *rv;
	q->tokens = tokens;
	q->err = err;
	publish(q);
}

/* Starts q's call on the engine: 0, or what the engine refused it with. */
static int start(struct tbr__bridge *b, struct breq *q)
{
	return tbr__async_start_call(b->a, q->call, answered, q);
}

/* Starts every queued call on the engine, in the order they were pushed. */
static void take_queue(struct tbr__bridge *b)
{
	uint64_t n;
	if (read(b->wake, &n, sizeof(n)) < 0 && errno != EAGAIN)
		return;
	struct breq *taken = atomic_exchange_explicit(&b->queue, NULL, memory_order_acquire);
	struct breq *q = NULL;
	while (taken != NULL) {
		struct breq *next = taken->next;
		taken->next = q;
		q = taken;
		taken = next;
	}
	if (q == NULL)
		return;
	/* All appended, then written together (or held for the replies awaited). */
	tbr__async_batch_begin(b->a);
	while (q != NULL) {
		struct breq *next = q->next;
		int err = start(b, q);
		if (err != 0) {
			q->err = err;
			publish(q);
		}
		q = next;
	}
	tbr__async_batch_end(b->a);
}

static void *io_thread(void *arg)
{
	struct tbr__bridge *b = arg;
	/* Signals are the application's: delivered to its threads, never here. */
	sigset_t all;
	sigfillset(&all);
	pthread_sigmask(SIG_BLOCK, &all, NULL);
	pthread_mutex_lock(&b->engine);
	for (;;) {
		wake_answered(b); /* every answer of the last turn, before the loop sleeps or ends */
		if (atomic_load_explicit(&b->stop, memory_order_acquire))
			break;
		size_t n = b->nfds + 1;
		if (n > b->npoll) {
			struct pollfd *more = realloc(b->poll, n * sizeof(*more));
			if (more == NULL) {
				n = b->npoll; /* the descriptors that fit, this turn */
			} else {
				b->poll = more;
				b->npoll = n;
			}
		}
		struct pollfd *p = b->poll;
		p[0] = (struct pollfd){ .fd = b->wake, .events = POLLIN };
		for (size_t i = 1; i < n; i++)
			p[i] = (struct pollfd){
				.fd = b->fds[i - 1].fd,
				.events = (short)(((b->fds[i - 1].events & TOKENBUCKET_REDIS_READ) ? POLLIN : 0) |
						  ((b->fds[i - 1].events & TOKENBUCKET_REDIS_WRITE) ? POLLOUT : 0)),
			};
		struct timespec ts, *tp = NULL;
		if (b->timer_at >= 0) {
			int64_t left = b->timer_at - tokenbucket_now();
			if (left < 0)
				left = 0;
			ts = (struct timespec){ .tv_sec = left / 1000000000, .tv_nsec = left % 1000000000 };
			tp = &ts;
		}
		pthread_mutex_unlock(&b->engine); /* a fork() may go on meanwhile */
		int ready = ppoll(p, n, tp, NULL);
		pthread_mutex_lock(&b->engine);
		if (ready < 0 && errno != EINTR)
			continue;
		/*
		 * The connections first: one its server closed is noticed before
		 * new calls could be written to it.  The set of descriptors may
		 * change under the engine's calls: p is a snapshot.
		 */
		for (size_t i = 1; ready > 0 && i < n; i++) {
			if (p[i].revents == 0)
				continue;
			unsigned ev = ((p[i].revents & (POLLIN | POLLHUP | POLLERR)) ? TOKENBUCKET_REDIS_READ : 0u) |
				      ((p[i].revents & (POLLOUT | POLLERR)) ? TOKENBUCKET_REDIS_WRITE : 0u);
			tokenbucket_redis_async_ready(b->a, p[i].fd, ev);
		}
		if (ready > 0 && (p[0].revents & POLLIN))
			take_queue(b);
		if (b->timer_at >= 0 && tokenbucket_now() >= b->timer_at) {
			b->timer_at = -1;
			tokenbucket_redis_async_timeout(b->a);
		}
	}
	pthread_mutex_unlock(&b->engine);
	return NULL;
}

/* ---- The calling threads' side -------------------------------------------- */

int tbr__bridge_open(struct tbr__bridge **bp, const struct tbr__async_config *cfg)
{
	pthread_once(&atfork_once, atfork_register);
	if (atfork_err != 0)
		return atfork_err;
	struct tbr__bridge *b = calloc(1, sizeof(*b));
	if (b == NULL)
		return -ENOMEM;
	b->timer_at = -1;
	atomic_init(&b->forked, false);
	atomic_init(&b->queue, NULL);
	atomic_init(&b->stop, false);
	for (unsigned w = 0; w < BRIDGE_WORDS; w++)
		atomic_init(&b->gen[w], 0);
	/* Room for the eventfd at least: the loop never lacks it. */
	b->poll = malloc(sizeof(*b->poll));
	b->npoll = 1;
	b->wake = b->poll == NULL ? -1 : eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	if (b->wake < 0) {
		int err = b->poll == NULL ? -ENOMEM : -errno;
		free(b->poll);
		free(b);
		return err;
	}
	const struct tokenbucket_redis_loop loop = { .data = b, .watch = loop_watch,
						     .timer = loop_timer };
	int err = tbr__async_open(&b->a, cfg, &loop);
	if (err == 0) {
		pthread_mutex_init(&b->engine, NULL);
		/* Listed before the thread runs: a fork() from now on waits for it. */
		pthread_mutex_lock(&bridges_lock);
		b->next_bridge = bridges;
		bridges = b;
		pthread_mutex_unlock(&bridges_lock);
		err = -pthread_create(&b->thread, NULL, io_thread, b);
		if (err != 0) {
			bridges_remove(b);
			pthread_mutex_destroy(&b->engine);
			tokenbucket_redis_async_close(b->a);
		}
	}
	if (err != 0) {
		close(b->wake);
		free(b->poll);
		free(b);
		return err;
	}
	*bp = b;
	return 0;
}

bool tbr__bridge_here(const struct tbr__bridge *b)
{
	/* Relaxed: set before fork() returns in the only thread the child has. */
	return !atomic_load_explicit(&b->forked, memory_order_relaxed);
}

void tbr__bridge_close(struct tbr__bridge *b)
{
	if (b == NULL)
		return;
	if (!tbr__bridge_here(b)) {
		/*
		 * A fork()ed child: no I/O thread to stop, and the lock may have
		 * been held by a thread that is not here.  Its copy of the engine
		 * (whole: see fork() above), with the parent's calls in flight,
		 * and the descriptors are freed alone.
		 */
		bridges_remove(b);
		tbr__async_forget(b->a);
		free(b->fds);
		free(b->poll);
		close(b->wake);
		free(b);
		return;
	}
	atomic_store_explicit(&b->stop, true, memory_order_release);
	uint64_t one = 1;
	while (write(b->wake, &one, sizeof(one)) < 0 && errno == EINTR)
		;
	pthread_join(b->thread, NULL);
	bridges_remove(b);
	/* No caller waits now (close never runs beside calls). */
	tokenbucket_redis_async_close(b->a);
	free(b->fds);
	free(b->poll);
	close(b->wake);
	pthread_mutex_destroy(&b->engine);
	free(b);
}

int tbr__bridge_call(struct tbr__bridge *b, const struct tokenbucket_redis_call *call,
		     struct tokenbucket_result *res, struct tokenbucket_reservation *rv,
		     double *tokens)
{
	/* 0: not dealt yet; else 1 + the slot. */
	static _Thread_local unsigned my_slot;
	static _Atomic unsigned next_slot;
	if (my_slot == 0)
		my_slot = 1 + atomic_fetch_add_explicit(&next_slot, 1, memory_order_relaxed) %
				      BRIDGE_SLOTS;
	struct breq q = { .call = call, .slot = my_slot - 1, .b = b };
	atomic_init(&q.done, 0);
	struct breq *top = atomic_load_explicit(&b->queue, memory_order_relaxed);
	do
		q.next = top;
	while (!atomic_compare_exchange_weak_explicit(&b->queue, &top, &q, memory_order_release,
						      memory_order_relaxed));
	if (top == NULL) {
		uint64_t one = 1;
		while (write(b->wake, &one, sizeof(one)) < 0 && errno == EINTR)
			;
	}
	/*
	 * The word before done: an answer published after this read changes
	 * the word before its wake, so the wait below returns at once.  A
	 * wake-up may be spurious (a slot shared, a signal): done decides.
	 */
	_Atomic uint32_t *word = &b->gen[q.slot / 32];
	uint32_t bit = 1u << (q.slot % 32);
	for (;;) {
		uint32_t seen = atomic_load_explicit(word, memory_order_seq_cst);
		if (atomic_load_explicit(&q.done, memory_order_acquire) != 0)
			break;
		syscall(SYS_futex, word, FUTEX_WAIT_BITSET_PRIVATE, seen, NULL, NULL, bit);
	}
	/* As a blocking round trip: res only when the script answered (or the fallback). */
	if (call->op == TOKENBUCKET_REDIS_ALLOW_ALL)
		return q.err; /* the engine wrote the call_all's res on success */
	bool answered_by_script = q.err == 0 || q.err == -ETIMEDOUT || q.err == -E2BIG ||
				  q.err == -EOVERFLOW;
	if (res != NULL && answered_by_script)
		*res = q.res;
	if (rv != NULL && q.err == 0 && call->op == TOKENBUCKET_REDIS_RESERVE)
		*rv = q.rv;
	if (tokens != NULL && q.err == 0 && call->op == TOKENBUCKET_REDIS_TOKENS)
		*tokens = q.tokens;
	return q.err;
}
