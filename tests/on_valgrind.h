/* SPDX-License-Identifier: MIT */
/*
 * TBT_ON_VALGRIND: true while the test runs under valgrind (memcheck runs
 * one thread at a time, 20-50x slower), for the few tests that must pace
 * themselves there; 0 where valgrind's header is not installed.
 */
#ifndef TBT_ON_VALGRIND_H
#define TBT_ON_VALGRIND_H

#if defined(__has_include)
#if __has_include(<valgrind/valgrind.h>)
#include <valgrind/valgrind.h>
#define TBT_ON_VALGRIND RUNNING_ON_VALGRIND
#endif
#endif
#ifndef TBT_ON_VALGRIND
#define TBT_ON_VALGRIND 0
#endif

#endif
