#!/usr/bin/env bash
# Builds prometheus-adapter's adapter (cmd/adapter of sigs.k8s.io/prometheus-adapter, pinned in
# tools/prometheus-adapter/go.mod), which serves external.metrics.k8s.io from Prometheus for the real-HPA
# test (tests/cluster/test_hpa.py). The binary is cached by version under $KVPILOT_PROMETHEUS_ADAPTER_CACHE
# (default ~/.cache/kvpilot/prometheus-adapter/<version>/adapter), so a second run only checks that it is
# there. Prints the directory on stdout (last line) and the build time on stderr.
#
# A module of its own, as helm has: v0.12.0 is written against k8s.io/* v0.30 and
# sigs.k8s.io/custom-metrics-apiserver v1.30, which do not compile at the control plane's v0.35.4.
#
# `--print-dir` prints that directory and builds nothing (the tests use it to find the binary).
# Needs Go >= 1.26 (GO, or `go` on PATH, or /usr/local/go/bin/go) and the Go module proxy.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
MOD="$ROOT/tools/prometheus-adapter"

VERSION="$(awk '$1 == "sigs.k8s.io/prometheus-adapter" && $2 ~ /^v/ { print $2; exit }' "$MOD/go.mod")"
if [ -z "$VERSION" ]; then
  echo "build-prometheus-adapter: no sigs.k8s.io/prometheus-adapter version in $MOD/go.mod" >&2
  exit 2
fi
CACHE="${KVPILOT_PROMETHEUS_ADAPTER_CACHE:-$HOME/.cache/kvpilot/prometheus-adapter}"
OUT="$CACHE/$VERSION"
if [ "${1:-}" = "--print-dir" ]; then echo "$OUT"; exit 0; fi

if [ -x "$OUT/adapter" ]; then
  echo "prometheus-adapter: warm, cached binary in $OUT" >&2
  echo "$OUT"
  exit 0
fi

GO="${GO:-$(command -v go || true)}"
if [ -z "$GO" ] && [ -x /usr/local/go/bin/go ]; then GO=/usr/local/go/bin/go; fi
if [ -z "$GO" ]; then
  echo "build-prometheus-adapter: Go not found (set GO=/path/to/go); the HPA cluster test needs Go >= 1.26" >&2
  exit 2
fi
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="-mod=readonly -buildvcs=false"

start=$(date +%s)
mkdir -p "$OUT.tmp"
echo "prometheus-adapter: building sigs.k8s.io/prometheus-adapter/cmd/adapter $VERSION with $("$GO" env GOVERSION)" >&2
# The adapter reports component-base's version (/version, its log); without -X it says v0.0.0.
pkg=k8s.io/component-base/version
ldflags="-s -w -X $pkg.gitVersion=$VERSION -X $pkg.gitTreeState=clean"
(cd "$MOD" && "$GO" build -trimpath -ldflags "$ldflags" -o "$OUT.tmp/adapter" sigs.k8s.io/prometheus-adapter/cmd/adapter)
mkdir -p "$OUT"
mv -f "$OUT.tmp/adapter" "$OUT/adapter"
rmdir "$OUT.tmp"
echo "prometheus-adapter: built in $(( $(date +%s) - start ))s into $OUT" >&2
echo "$OUT"
