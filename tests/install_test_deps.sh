#!/bin/sh
# The test suite's system packages (Debian/Ubuntu; root or sudo), each installed if missing:
#   nginx-light          the real HTTP cache server tests/test_remote_cache.py runs on 127.0.0.1
#   gcc-aarch64-linux-gnu  the cross compiler that links aarch64 bundles (tests/test_aarch64.py)
#   qemu-user            runs those aarch64 modules here
set -e
missing=""
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || missing="$missing nginx-light"
command -v aarch64-linux-gnu-gcc >/dev/null 2>&1 || missing="$missing gcc-aarch64-linux-gnu"
command -v qemu-aarch64 >/dev/null 2>&1 || missing="$missing qemu-user"
[ -n "$missing" ] || exit 0
SUDO=""
[ "$(id -u)" = 0 ] || SUDO=sudo
# shellcheck disable=SC2086 # (one word per package)
$SUDO apt-get install -y -q $missing >/dev/null 2>&1 ||
    { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q $missing >/dev/null; }
