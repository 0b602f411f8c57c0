#!/bin/sh
# SPDX-License-Identifier: MIT
#
# usage: function-library.sh --script DIR
#        function-library.sh SCRIPT FUNCTION
#
# With --script, writes the script (tokenbucket.lua) on stdout: DIR's
# files script-*.lua in name order, one after the other, which is what
# the build installs, compiles in and hashes for EVALSHA.  Otherwise:
#
# Writes the Redis 7 function library of libtokenbucket-redis on stdout:
# the script (tokenbucket.lua) as the local function script(KEYS, ARGV),
# then FUNCTION (tokenbucket-function.lua) with each of its lines
# "-- @shared NAME" replaced by the script's lines between
# "-- @shared begin NAME" and "-- @shared end", indented as the line they
# replace, so that the library's arithmetic is the script's text and
# nowhere else; then the registration of the function call as
# tokenbucket_<the first 16 hex digits of the SHA-1 of what precedes>,
# which is also the library's name: a changed library is a new name, so
# that clients of two versions never replace each other's.  A region
# never used, unknown or left open fails the build.
set -eu
if [ "${1:-}" = --script ]; then
	set -- "${2:?--script wants a directory}"/script-*.lua
	[ -f "$1" ] || { echo "function-library.sh: no script-*.lua" >&2; exit 1; }
	cat "$@"
	exit 0
fi
body=$(mktemp)
trap 'rm -f "$body"' EXIT
{
	printf 'local function script(KEYS, ARGV)\n'
	cat "$1"
	printf 'end\n'
	awk '
	function fail(msg) {
		print "function-library.sh: " msg >"/dev/stderr"
		failed = 1
		exit 1
	}
	# The script: the regions, each line without the indentation of its begin.
	FNR == NR {
		if ($0 ~ /^[ \t]*-- @shared begin [a-z0-9-]+$/) {
			if (name != "")
				fail(FILENAME ":" FNR ": region " name " is still open")
			name = $NF
			if (name in text)
				fail(FILENAME ":" FNR ": region " name " twice")
			indent = $0
			sub(/--.*/, "", indent)
			text[name] = ""
			next
		}
		if ($0 ~ /^[ \t]*-- @shared end$/) {
			if (name == "")
				fail(FILENAME ":" FNR ": an end with no begin")
			name = ""
			next
		}
		if (name != "") {
			line = $0
			if (substr(line, 1, length(indent)) == indent)
				line = substr(line, length(indent) + 1)
			text[name] = text[name] line "\n"
		}
		next
	}
	FNR == 1 && name != "" {
		fail("region " name " is never closed")
	}
	# The function library: each use, indented as it.
	/^[ \t]*-- @shared [a-z0-9-]+$/ {
		if (!($NF in text))
			fail(FILENAME ":" FNR ": no region " $NF " in the script")
		used[$NF] = 1
		indent = $0
		sub(/--.*/, "", indent)
		n = split(text[$NF], lines, "\n")
		for (i = 1; i < n; i++)
			print (lines[i] == "" ? "" : indent lines[i])
		next
	}
	{ print }
	END {
		if (failed)
			exit 1
		for (r in text)
			if (!(r in used))
				fail("region " r " of the script is never used")
	}
	' "$1" "$2"
} >"$body"
name=tokenbucket_$(sha1sum "$body" | cut -c1-16)
printf '#!lua name=%s\n' "$name"
cat "$body"
printf 'redis.register_function("%s", call)\n' "$name"
