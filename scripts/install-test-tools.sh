#!/usr/bin/env bash
# Installs the system tools the integration tests use: Debian's Prometheus server and promtool.
# Needs root and apt; elsewhere it says what is missing, and the tests that need it skip with a reason.
# Waits for a busy apt/dpkg lock (another apt run on a shared host) instead of failing.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib/apt.sh
. scripts/lib/apt.sh
if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
  exit 0
fi
if can_apt; then
  echo "installing Debian's prometheus (server + promtool) for the SLO and tuner integration tests" >&2
  # The package would start a system service; the tests start their own servers on free ports.  Debian's
  # policy-rc.d (exit 101: "action forbidden") keeps the maintainer scripts from starting it at all, so
  # nothing needs stopping afterwards -- and no other Prometheus on the host is touched.
  policy=/usr/sbin/policy-rc.d
  ours=
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && ours=1
    trap 'rm -f "$policy"' EXIT
  fi
  apt_install prometheus
  if [ -n "$ours" ]; then rm -f "$policy"; trap - EXIT; fi
else
  echo "note: prometheus/promtool not found and cannot apt-get install here; tests that need them will skip" >&2
fi
