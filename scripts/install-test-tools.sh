#!/usr/bin/env bash
# Installs the system tools the integration tests use: Debian's Prometheus server and promtool, and
# Debian's PostgreSQL server (the tuner's study storage; harness/postgres.py runs initdb and
# postgres itself on a free port).
# Needs root and apt; elsewhere it says what is missing, and the tests that need it skip with a reason.
# Waits for a busy apt/dpkg lock (another apt run on a shared host) instead of failing.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib/apt.sh
. scripts/lib/apt.sh
have_prometheus() { command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; }
# Debian keeps the server binaries out of PATH, in /usr/lib/postgresql/<major>/bin.
have_postgres() { compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null || command -v initdb >/dev/null 2>&1; }
missing=()
have_prometheus || missing+=(prometheus)
have_postgres || missing+=(postgresql)
if [ "${#missing[@]}" = 0 ]; then
  exit 0
fi
if can_apt; then
  echo "installing Debian's ${missing[*]} for the SLO and tuner integration tests" >&2
  # The packages would start system services; the tests start their own servers on free ports.  Debian's
  # policy-rc.d (exit 101: "action forbidden") keeps the maintainer scripts from starting them at all, so
  # nothing needs stopping afterwards -- and no other Prometheus or PostgreSQL on the host is touched.
  policy=/usr/sbin/policy-rc.d
  ours=
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && ours=1
    trap 'rm -f "$policy"' EXIT
  fi
  # postgresql-common would also create a "main" cluster under /var/lib/postgresql; the tests make
  # their own in a temporary directory.  Its documented switch, set only where no config exists yet.
  createcluster=/etc/postgresql-common/createcluster.conf
  if [[ " ${missing[*]} " == *" postgresql "* ]] && [ ! -e "$createcluster" ]; then
    mkdir -p "$(dirname "$createcluster")" && echo "create_main_cluster = false" >"$createcluster"
  fi
  apt_install "${missing[@]}"
  if [ -n "$ours" ]; then rm -f "$policy"; trap - EXIT; fi
else
  echo "note: ${missing[*]} not found and cannot apt-get install here; tests that need them will skip" >&2
fi
