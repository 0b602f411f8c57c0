#!/bin/sh
# SPDX-License-Identifier: MIT
#
# usage: function-library.sh SCRIPT FUNCTION
#
# Writes the Redis 7 function library of libtokenbucket-redis on stdout:
# the script (tokenbucket.lua) as the local function script(KEYS, ARGV),
# the script's local function muldiv (its arithmetic past 2^53) once more at
# the library's top level, for FUNCTION's own paths, then FUNCTION
# (tokenbucket-function.lua), then the registration of the
# function call as tokenbucket_<the first 16 hex digits of the SHA-1 of
# what precedes>, which is also the library's name: a changed library is a
# new name, so that clients of two versions never replace each other's.
set -eu
body=$(mktemp)
trap 'rm -f "$body"' EXIT
{
	printf 'local function script(KEYS, ARGV)\n'
	cat "$1"
	printf 'end\n'
	sed -n '/^local function muldiv(/,/^end$/p' "$1" | grep . ||
		{ echo "function-library.sh: no local function muldiv in $1" >&2; exit 1; }
	cat "$2"
} >"$body"
name=tokenbucket_$(sha1sum "$body" | cut -c1-16)
printf '#!lua name=%s\n' "$name"
cat "$body"
printf 'redis.register_function("%s", call)\n' "$name"
