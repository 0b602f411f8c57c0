#!/bin/bash
# SPDX-License-Identifier: MIT
# Builds ngx_http_tokenbucket_module.so against Debian's nginx-dev the way
# Debian builds its own libnginx-mod-* packages: nginx's configure with the
# flags the installed nginx was built with (conf_flags, --with-compat),
# --add-dynamic-module, then "make modules".  Everything lands in BUILDDIR.
#
# LIB_DIR holds libtokenbucket.so, REDIS_LIB_DIR libtokenbucket-redis.so.
#
#   build.sh NGINX_SRC BUILDDIR INCLUDE_DIR LIB_DIR REDIS_LIB_DIR [CFLAGS [LDFLAGS]]
set -euo pipefail
ngx_src=$1 bld=$2 inc=$3 lib=$4 redis_lib=$5 cflags=${6:-} ldflags=${7:-}
mod=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mkdir -p "$bld"
bld=$(cd "$bld" && pwd)
export TOKENBUCKET_INCS="$inc" TOKENBUCKET_LIBS="-L$redis_lib -L$lib -ltokenbucket-redis -ltokenbucket"
cd "$ngx_src"
# shellcheck disable=SC1091
. ./conf_flags
stamp="$bld/configured"
if [ ! -e "$stamp" ] || [ "$mod/config" -nt "$stamp" ]; then
	./configure --with-cc-opt="$cflags -fPIC" --with-ld-opt="$ldflags -fPIC" \
		"${NGX_CONF_FLAGS[@]}" --add-dynamic-module="$mod" --builddir="$bld" \
		>"$bld/configure.log" 2>&1 || { tail -30 "$bld/configure.log" >&2; exit 1; }
	touch "$stamp"
fi
make -s -f "$bld/Makefile" -C "$ngx_src" modules
