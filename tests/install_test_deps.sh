#!/bin/sh
# The test suite's one system package: nginx (with WebDAV PUT), the real HTTP cache server
# that tests/test_remote_cache.py runs on 127.0.0.1. Debian/Ubuntu; root or sudo.
set -e
if command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ]; then exit 0; fi
SUDO=""
[ "$(id -u)" = 0 ] || SUDO=sudo
$SUDO apt-get install -y -q nginx-light >/dev/null 2>&1 ||
    { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q nginx-light >/dev/null; }
