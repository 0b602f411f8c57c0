/* SPDX-License-Identifier: MIT */
/*
 * A double rate becomes the same exact ratio in the library as in the
 * model, whose continued fraction is expanded with integers on its own:
 * 10^5 doubles spread over every exponent the conversion expands (1e-10 to
 * 1e28 tokens per second), half of them short decimals, half arbitrary
 * bits.  The ratio is read from the bucket's regime (src/core/core.h).
 */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>

#include "model.h"
#include "core.h"

static uint64_t rng = 0x9e3779b97f4a7c15u;

static uint64_t next(void)
{
	rng ^= rng << 13;
	rng ^= rng >> 7;
	rng ^= rng << 17;
	return rng;
}

static double pick(int i)
{
	if (i & 1) {
		/* A decimal with up to 6 digits after the point, as people write rates. */
		double whole = (double)(next() % 1000000000);
		return (whole + (double)(next() % 1000000) / 1e6) / pow(10.0, (double)(next() % 12));
	}
	/* Any mantissa, an exponent from 2^-34 to 2^93. */
	double m = 1.0 + (double)(next() >> 11) / 9007199254740992.0;
	return ldexp(m, (int)(next() % 128) - 34);
}

int main(void)
{
	int failures = 0;
	for (int i = 0; i < 100000; i++) {
		double rate = pick(i);
		uint64_t mp, mq;
		enum model_kind kind = model_ratio_from_rate(rate, &mp, &mq);
		struct tokenbucket *tb = NULL;
		if (tokenbucket_create(&tb, rate, 1, 0) != 0) {
			fprintf(stderr, "rate %.17g: create failed\n", rate);
			return 1;
		}
		struct tb__view v;
		tb__view(tb, &v);
		if (kind != MODEL_FINITE || v.kind != TB__FINITE || v.p != mp || v.q != mq) {
			if (failures++ < 10)
				fprintf(stderr,
					"rate %.17g: library %" PRIu64 "/%" PRIu64
					", model %" PRIu64 "/%" PRIu64 "\n",
					rate, v.p, v.q, mp, mq);
		}
		tokenbucket_free(tb);
	}
	if (failures)
		fprintf(stderr, "%d of 100000 rates differ\n", failures);
	return failures != 0;
}
