#!/usr/bin/env bash
# Builds every Go program the tests run, one after another in one job: the test control plane
# first (the others reuse its module and build caches: the same GOMODCACHE and GOCACHE, and
# where their go.mod allows, the same module versions), then each `scripts/build-<name>.sh` listed
# below that exists. One at a time because each `go build` already uses every core. Each script
# caches its output by version under ~/.cache/kvpilot/ and prints its directory as its last line;
# this prints one "name: directory" line per program and the total time.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
for name in control-plane helm prometheus-operator otelcol prometheus-adapter; do
  script="scripts/build-$name.sh"
  [ -x "$script" ] || continue
  t0=$(date +%s)
  dir=$("$script" | tail -n 1)
  echo "go-programs: $name in $(( $(date +%s) - t0 )) s: $dir" >&2
done
echo "go-programs: all built in $(( $(date +%s) - start )) s"
