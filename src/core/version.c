/* SPDX-License-Identifier: MIT */
#include "core.h"

unsigned tokenbucket_version_number(void)
{
	return TOKENBUCKET_VERSION_NUMBER;
}

const char *tokenbucket_version_string(void)
{
	return TOKENBUCKET_VERSION_STRING;
}

double tokenbucket_every(int64_t interval_ns)
{
	return interval_ns <= 0 ? TOKENBUCKET_INF : 1e9 / (double)interval_ns;
}
