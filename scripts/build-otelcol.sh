#!/usr/bin/env bash
# Builds the OpenTelemetry Collector the tracing tests export to: tools/otelcol/main.go (what the
# collector builder would generate: the core distribution's OTLP receiver, batch processor and
# debug/OTLP/OTLP-HTTP exporters, plus contrib's file exporter), every collector module at the one
# release pinned in tools/otelcol/go.mod. The binary is cached by that release under
# $KVPILOT_OTELCOL_CACHE (default ~/.cache/kvpilot/otelcol/<version>/), so a second run only checks
# that it is there. Prints the directory on stdout (last line) and the build time on stderr.
#
# `--print-dir` prints that directory and builds nothing (the tests use it to find the binary).
# Needs Go >= 1.26 (GO, or `go` on PATH, or /usr/local/go/bin/go) and the Go module proxy.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
MOD="$ROOT/tools/otelcol"

modver() { awk -v m="$1" '$1 == m && $2 ~ /^v/ { print $2; exit }' "$MOD/go.mod"; }
VERSION="$(modver go.opentelemetry.io/collector/otelcol)"
CACHE="${KVPILOT_OTELCOL_CACHE:-$HOME/.cache/kvpilot/otelcol}"
OUT="$CACHE/$VERSION"
if [ "${1:-}" = "--print-dir" ]; then echo "$OUT"; exit 0; fi

if [ -x "$OUT/otelcol" ]; then
  echo "otelcol: warm, cached binary in $OUT" >&2
  echo "$OUT"
  exit 0
fi

GO="${GO:-$(command -v go || true)}"
if [ -z "$GO" ] && [ -x /usr/local/go/bin/go ]; then GO=/usr/local/go/bin/go; fi
if [ -z "$GO" ]; then
  echo "build-otelcol: Go not found (set GO=/path/to/go); the collector tests need Go >= 1.26" >&2
  exit 2
fi
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="-mod=readonly -buildvcs=false"

start=$(date +%s)
mkdir -p "$OUT"
echo "otelcol: building (collector $VERSION, contrib fileexporter $(modver github.com/open-telemetry/opentelemetry-collector-contrib/exporter/fileexporter)) with $("$GO" env GOVERSION)" >&2
# Built beside the final name and moved into place, so an interrupted build never leaves a binary
# that looks cached.
(cd "$MOD" && "$GO" build -trimpath -ldflags "-s -w -X main.version=${VERSION#v}" -o "$OUT/otelcol.tmp" .)
mv -f "$OUT/otelcol.tmp" "$OUT/otelcol"
echo "otelcol: built in $(( $(date +%s) - start ))s into $OUT" >&2
"$OUT/otelcol" --version >&2
echo "$OUT"
