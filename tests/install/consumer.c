/* SPDX-License-Identifier: MIT */
/* Uses an installed libtokenbucket through its public header only. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <tokenbucket.h>

static void fail(const char *what)
{
	fprintf(stderr, "consumer: %s\n", what);
	exit(1);
}

int main(void)
{
	struct tokenbucket *tb = NULL;
	int i;

	if (tokenbucket_version_number() != TOKENBUCKET_VERSION_NUMBER)
		fail("tokenbucket_version_number() differs from the header");
	if (strcmp(tokenbucket_version_string(), TOKENBUCKET_VERSION_STRING) != 0)
		fail("tokenbucket_version_string() differs from the header");

	if (tokenbucket_create(&tb, 10.0, 3, 0) != 0 || tb == NULL)
		fail("tokenbucket_create failed");
	for (i = 0; i < 3; i++)
		if (!tokenbucket_allow_at(tb, 0, 1))
			fail("a full bucket of 3 refused one of its tokens");
	if (tokenbucket_allow_at(tb, 0, 1))
		fail("an empty bucket allowed a fourth token");
	tokenbucket_free(tb);

	printf("consumer ok\n");
	return 0;
}
