/* SPDX-License-Identifier: MIT */
/* SipHash-1-3 out of line (siphash.h has it inline). */
#include "siphash.h"

uint64_t tb__siphash13(uint64_t k0, uint64_t k1, const void *data, size_t len)
{
	return tb__siphash13_inline(k0, k1, data, len);
}
