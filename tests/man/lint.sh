#!/bin/sh
# SPDX-License-Identifier: MIT
#
# usage: lint.sh SRCDIR
#
# Checks the manual pages in SRCDIR/man:
#   - man --warnings prints nothing for any page, at 80 and at 60 columns;
#   - a one-line ".so" page points at a page that exists and names it in
#     its NAME section;
#   - every other section-3 page has the sections NAME, LIBRARY, SYNOPSIS,
#     DESCRIPTION, RETURN VALUE, ERRORS, ATTRIBUTES, VERSIONS and SEE ALSO,
#     in that order, and every function in its NAME has a file of its own;
#   - every section-1 page (the tools) has NAME, SYNOPSIS, DESCRIPTION,
#     OPTIONS, EXIT STATUS and SEE ALSO, in that order;
#   - every page's NAME line is one lexgrog can read (for whatis and apropos).
# Skips (tests/skip.sh) when man(1) is not installed.
set -eu

if [ $# -ne 1 ]; then
	echo "usage: $0 SRCDIR" >&2
	exit 2
fi
src=$1
. "$(dirname "$0")/../skip.sh"
if ! command -v man >/dev/null 2>&1; then
	skip "man pages: man (package man-db) is not installed"
fi
status=0
fail() {
	echo "man pages: FAIL: $*" >&2
	status=1
}

required="NAME
LIBRARY
SYNOPSIS
DESCRIPTION
RETURN VALUE
ERRORS
ATTRIBUTES
VERSIONS
SEE ALSO"
required1="NAME
SYNOPSIS
DESCRIPTION
OPTIONS
EXIT STATUS
SEE ALSO"
pages=0
for page in "$src"/man/man1/*.1 "$src"/man/man3/*.3 "$src"/man/man5/*.5 "$src"/man/man7/*.7; do
	[ -f "$page" ] || continue
	pages=$((pages + 1))
	name=$(basename "$page")
	name=${name%.*}
	if head -n 1 "$page" | grep -q '^\.so '; then
		[ "$(wc -l <"$page")" -eq 1 ] || fail "$page: a .so page has one line only"
		target=$(sed -n 's/^\.so //p' "$page")
		if [ ! -f "$src/man/$target" ]; then
			fail "$page: .so target $target does not exist"
		elif ! sed -n '/^\.SH NAME/,/^\.SH/p' "$src/man/$target" | grep -q "\\b$name\\b"; then
			fail "$page: $target does not name $name in its NAME section"
		fi
		continue
	fi
	for width in 80 60; do
		warnings=$(MANWIDTH=$width LC_ALL=C.UTF-8 man --warnings -l "$page" 2>&1 >/dev/null) ||
			fail "$page: man -l failed"
		[ -z "$warnings" ] || fail "$page (MANWIDTH=$width): $warnings"
	done
	if command -v lexgrog >/dev/null 2>&1; then
		lexgrog "$page" >/dev/null 2>&1 || fail "$page: lexgrog cannot parse the NAME section"
	fi
	case $page in
	*.1)
		found=$(sed -n 's/^\.SH "\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' "$page" | grep -Fx "$required1" || true)
		[ "$found" = "$required1" ] ||
			fail "$page: sections are [$(echo $found)], need [$(echo $required1)] in that order"
		;;
	*.3)
		found=$(sed -n 's/^\.SH "\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' "$page" | grep -Fx "$required" || true)
		[ "$found" = "$required" ] ||
			fail "$page: sections are [$(echo $found)], need [$(echo $required)] in that order"
		for fn in $(sed -n '/^\.SH NAME/,/\\-/p' "$page" | grep -o 'tokenbucket_[a-z0-9_]*'); do
			[ -f "$src/man/man3/$fn.3" ] || fail "$page names $fn, which has no man3/$fn.3"
		done
		;;
	esac
done
[ $pages -gt 0 ] || fail "no pages in $src/man"
[ $status -ne 0 ] || echo "man pages: $pages pages checked"
exit $status
