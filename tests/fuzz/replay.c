/* SPDX-License-Identifier: MIT */
/* Replay without libFuzzer: see replay.h. */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "replay.h"

static int replay_file(const char *path, bool trace)
{
	FILE *f = fopen(path, "rb");
	if (f == NULL) {
		fprintf(stderr, "%s: %s\n", path, strerror(errno));
		return -1;
	}
	uint8_t *buf = NULL;
	size_t len = 0, cap = 0, got;
	do {
		if (len == cap) {
			cap = cap ? 2 * cap : 4096;
			buf = realloc(buf, cap);
			if (buf == NULL)
				abort();
		}
		got = fread(buf + len, 1, cap - len, f);
		len += got;
	} while (got > 0);
	fclose(f);
	if (trace)
		fprintf(stderr, "== %s\n", path);
	LLVMFuzzerTestOneInput(buf, len);
	free(buf);
	return 0;
}

static int cmp_names(const void *a, const void *b)
{
	return strcmp(*(char *const *)a, *(char *const *)b);
}

int fuzz_replay(const char *path, int *count, bool trace)
{
	DIR *d = opendir(path);
	if (d == NULL) {
		int err = replay_file(path, trace); /* a file, or reports why not */
		if (err == 0)
			(*count)++;
		return err;
	}
	char **names = NULL;
	size_t n = 0, cap = 0;
	struct dirent *e;
	while ((e = readdir(d)) != NULL) {
		if (e->d_name[0] == '.')
			continue;
		if (n == cap) {
			cap = cap ? 2 * cap : 64;
			names = realloc(names, cap * sizeof(*names));
			if (names == NULL)
				abort();
		}
		names[n++] = strdup(e->d_name);
	}
	closedir(d);
	qsort(names, n, sizeof(*names), cmp_names);
	int err = 0;
	for (size_t i = 0; i < n; i++) {
		char full[4096];
		snprintf(full, sizeof(full), "%s/%s", path, names[i]);
		if (replay_file(full, trace) < 0)
			err = -1;
		else
			(*count)++;
		free(names[i]);
	}
	free(names);
	return err;
}

int fuzz_replay_main(int argc, char **argv, int (*make_seeds)(const char *dir), bool trace,
		     const char *done)
{
	if (argc == 3 && make_seeds != NULL && strcmp(argv[1], "--make-seeds") == 0)
		return make_seeds(argv[2]);
	if (argc < 2) {
		fprintf(stderr, "usage: %s FILE|DIR...\n       %s --make-seeds DIR\n", argv[0],
			argv[0]);
		return 2;
	}
	int count = 0, err = 0;
	for (int i = 1; i < argc; i++)
		if (fuzz_replay(argv[i], &count, trace) < 0)
			err = 1;
	printf("%d input(s) replayed%s\n", count, done);
	return err;
}
