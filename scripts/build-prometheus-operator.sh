#!/usr/bin/env bash
# Builds Prometheus Operator's operator binary (cmd/operator of
# github.com/prometheus-operator/prometheus-operator, pinned in tools/prometheus-operator/go.mod) and
# copies its CRDs (monitoring.coreos.com_*.yaml, from the module's example/prometheus-operator-crd)
# next to it, cached by version under $KVPILOT_PROMETHEUS_OPERATOR_CACHE (default
# ~/.cache/kvpilot/prometheus-operator/<version>/), so a second run only checks they are there.
# Prints the directory on stdout (last line) and the build time on stderr.
#
# `--print-dir` prints that directory and builds nothing (the tests use it to find the binary).
# Needs Go >= 1.26 (GO, or `go` on PATH, or /usr/local/go/bin/go) and the Go module proxy.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
MOD="$ROOT/tools/prometheus-operator"
PKG=github.com/prometheus-operator/prometheus-operator

VERSION="$(awk -v m="$PKG" '$1 == m && $2 ~ /^v/ { print $2; exit }' "$MOD/go.mod")"
CACHE="${KVPILOT_PROMETHEUS_OPERATOR_CACHE:-$HOME/.cache/kvpilot/prometheus-operator}"
OUT="$CACHE/$VERSION"
if [ "${1:-}" = "--print-dir" ]; then echo "$OUT"; exit 0; fi

if [ -x "$OUT/operator" ] && compgen -G "$OUT/crds/monitoring.coreos.com_*.yaml" >/dev/null; then
  echo "prometheus-operator: warm, cached binary and CRDs in $OUT" >&2
  echo "$OUT"
  exit 0
fi

GO="${GO:-$(command -v go || true)}"
if [ -z "$GO" ] && [ -x /usr/local/go/bin/go ]; then GO=/usr/local/go/bin/go; fi
if [ -z "$GO" ]; then
  echo "build-prometheus-operator: Go not found (set GO=/path/to/go); the test needs Go >= 1.26" >&2
  exit 2
fi
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="-mod=readonly -buildvcs=false"

start=$(date +%s)
rm -rf "$OUT.tmp"
mkdir -p "$OUT.tmp/crds"
echo "prometheus-operator: cold build of $PKG/cmd/operator $VERSION with $("$GO" env GOVERSION)" >&2

# Without these the operator reports an empty version, and it puts its version into the objects it writes.
ver="github.com/prometheus/common/version"
ldflags="-s -w -X $ver.Version=${VERSION#v} -X $ver.Revision=$VERSION -X $ver.Branch=$VERSION"
ldflags+=" -X $ver.BuildUser=kvpilot -X $ver.BuildDate=19700101-00:00:00"
(cd "$MOD" && "$GO" build -trimpath -ldflags "$ldflags" -o "$OUT.tmp/operator" "$PKG/cmd/operator")

src="$(cd "$MOD" && "$GO" list -m -f '{{.Dir}}' "$PKG")"
cp "$src"/example/prometheus-operator-crd/monitoring.coreos.com_*.yaml "$OUT.tmp/crds/"
chmod u+w "$OUT.tmp/crds/"*

mkdir -p "$OUT"
rm -rf "$OUT/crds"
mv -f "$OUT.tmp/crds" "$OUT/crds"
mv -f "$OUT.tmp/operator" "$OUT/operator"
rmdir "$OUT.tmp"
echo "prometheus-operator: built in $(( $(date +%s) - start ))s into $OUT" >&2
"$OUT/operator" --version >&2 || true
echo >&2  # its version text ends without a newline
echo "$OUT"
