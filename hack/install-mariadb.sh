#!/usr/bin/env bash
# Install Debian's mariadb-server for the MySQL sink's tests (as root: CI), without leaving a service running: the
# tests start their own mariadbd on loopback in a temporary directory (controller/demo/servers.py,
# MariaDBServer) and always stop it. Idempotent: nothing happens when mariadbd and mariadb-install-db are there.
set -euo pipefail

if command -v mariadbd >/dev/null 2>&1 || [ -x /usr/sbin/mariadbd ]; then
  if command -v mariadb-install-db >/dev/null 2>&1; then
    echo "mariadb: $(/usr/sbin/mariadbd --version 2>/dev/null || mariadbd --version)"
    exit 0
  fi
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "install-mariadb: mariadbd not found; install Debian's mariadb-server (as root), or set CFM_MARIADB_BIN_DIR" >&2
  exit 2
fi

# No service may start during the install: a policy-rc.d that denies every start (removed after, if ours).
ours=""
if [ ! -e /usr/sbin/policy-rc.d ]; then
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
  chmod 755 /usr/sbin/policy-rc.d
  ours=1
fi
cleanup() { if [ -n "$ours" ]; then rm -f /usr/sbin/policy-rc.d; fi; }
trap cleanup EXIT

if ! apt-cache policy mariadb-server 2>/dev/null | grep -q 'Candidate: [0-9]'; then
  apt-get update -qq
fi
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mariadb-server >/dev/null

# Whatever the policy, no system mariadbd is left running.
if pgrep -x mariadbd >/dev/null 2>&1; then
  (service mariadb stop || systemctl stop mariadb || pkill -x mariadbd) >/dev/null 2>&1 || true
fi
echo "mariadb: $(/usr/sbin/mariadbd --version)"
