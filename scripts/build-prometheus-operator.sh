#!/usr/bin/env bash
# Builds Prometheus Operator's operator binary (cmd/operator of
# github.com/prometheus-operator/prometheus-operator, pinned in tools/prometheus-operator/go.mod), the
# Prometheus it was built against (cmd/prometheus of github.com/prometheus/prometheus, same go.mod:
# Debian's prometheus is built without Kubernetes service discovery), and copies the operator's CRDs
# (monitoring.coreos.com_*.yaml, from the module's example/prometheus-operator-crd) next to them, cached
# by version under $KVPILOT_PROMETHEUS_OPERATOR_CACHE (default ~/.cache/kvpilot/prometheus-operator/<version>/),
# so a second run only checks they are there.
# Prints the directory on stdout (last line) and the build time on stderr.
#
# `--print-dir` prints that directory and builds nothing (the tests use it to find the binary).
# Needs Go >= 1.26 (GO, or `go` on PATH, or /usr/local/go/bin/go) and the Go module proxy.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
MOD="$ROOT/tools/prometheus-operator"
PKG=github.com/prometheus-operator/prometheus-operator
PROM=github.com/prometheus/prometheus

modver() { awk -v m="$1" '$1 == m && $2 ~ /^v/ { print $2; exit }' "$MOD/go.mod"; }
VERSION="$(modver "$PKG")"
PROM_MODULE_VERSION="$(modver "$PROM")"
# Prometheus 3.x is published as module versions v0.3XX.Y.
PROM_VERSION="3.$(echo "${PROM_MODULE_VERSION#v0.3}" | sed 's/^0*\([0-9]\)/\1/')"
CACHE="${KVPILOT_PROMETHEUS_OPERATOR_CACHE:-$HOME/.cache/kvpilot/prometheus-operator}"
OUT="$CACHE/$VERSION"
STAMP="operator $VERSION prometheus $PROM_MODULE_VERSION"
if [ "${1:-}" = "--print-dir" ]; then echo "$OUT"; exit 0; fi

if [ -x "$OUT/operator" ] && [ -x "$OUT/prometheus" ] && [ "$(cat "$OUT/versions" 2>/dev/null)" = "$STAMP" ] \
    && compgen -G "$OUT/crds/monitoring.coreos.com_*.yaml" >/dev/null; then
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
echo "prometheus-operator: cold build of $PKG/cmd/operator $VERSION and $PROM/cmd/prometheus $PROM_MODULE_VERSION (Prometheus $PROM_VERSION) with $("$GO" env GOVERSION)" >&2

# Without these the operator reports an empty version, and it puts its version into the objects it writes.
ver="github.com/prometheus/common/version"
ldflags="-s -w -X $ver.Version=${VERSION#v} -X $ver.Revision=$VERSION -X $ver.Branch=$VERSION"
ldflags+=" -X $ver.BuildUser=kvpilot -X $ver.BuildDate=19700101-00:00:00"
(cd "$MOD" && "$GO" build -trimpath -ldflags "$ldflags" -o "$OUT.tmp/operator" "$PKG/cmd/operator")
ldflags="-s -w -X $ver.Version=$PROM_VERSION -X $ver.Revision=$PROM_MODULE_VERSION -X $ver.Branch=$PROM_MODULE_VERSION"
ldflags+=" -X $ver.BuildUser=kvpilot -X $ver.BuildDate=19700101-00:00:00"
# Only Kubernetes service discovery (Prometheus's own build tags): the other mechanisms' cloud SDKs
# (AWS, Azure, GCE, ...) would double the build. Without the builtinassets tag the web UI is not
# embedded; the HTTP API, all the tests use, is whole.
(cd "$MOD" && "$GO" build -trimpath -tags remove_all_sd,enable_kubernetes_sd -ldflags "$ldflags" \
  -o "$OUT.tmp/prometheus" "$PROM/cmd/prometheus")

src="$(cd "$MOD" && "$GO" list -m -f '{{.Dir}}' "$PKG")"
cp "$src"/example/prometheus-operator-crd/monitoring.coreos.com_*.yaml "$OUT.tmp/crds/"
chmod u+w "$OUT.tmp/crds/"*

mkdir -p "$OUT"
rm -rf "$OUT/crds"
mv -f "$OUT.tmp/crds" "$OUT/crds"
mv -f "$OUT.tmp/operator" "$OUT.tmp/prometheus" "$OUT/"
echo "$STAMP" > "$OUT/versions"
rmdir "$OUT.tmp"
echo "prometheus-operator: built in $(( $(date +%s) - start ))s into $OUT" >&2
"$OUT/operator" --version >&2 || true
echo >&2  # its version text ends without a newline
"$OUT/prometheus" --version >&2
echo "$OUT"
