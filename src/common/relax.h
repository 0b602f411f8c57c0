/* SPDX-License-Identifier: MIT */
/*
 * A spin-wait hint, for the few loops that read a word a bounded number of
 * times waiting for another thread's short step (a table's slot claim, a
 * set's give-back).  Header-only, libc-free; a no-op where the CPU has no
 * such hint.
 */
#ifndef TOKENBUCKET_RELAX_H
#define TOKENBUCKET_RELAX_H

static inline void tb__cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
	__builtin_ia32_pause();
#elif defined(__aarch64__)
	__asm__ __volatile__("yield");
#endif
}

#endif /* TOKENBUCKET_RELAX_H */
