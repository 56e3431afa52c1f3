#!/usr/bin/env bash
# Installs the system tools the integration tests use: Debian's Prometheus server and promtool.
# Needs root and apt; elsewhere it says what is missing, and the tests that need it skip with a reason.
set -euo pipefail
if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing Debian's prometheus (server + promtool) for the SLO and tuner integration tests" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
  # The package starts a system service; the tests start their own servers on free ports.
  (service prometheus stop || systemctl stop prometheus || pkill -x prometheus) >/dev/null 2>&1 || true
else
  echo "note: prometheus/promtool not found and cannot apt-get install here; tests that need them will skip" >&2
fi
