#!/usr/bin/env bash
# Builds the helm CLI the `cluster` tests run (tests/cluster/test_helm_cli.py) from helm.sh/helm/v4,
# pinned in tools/helm/go.mod. The binary is cached by version under $KVPILOT_HELM_CACHE (default
# ~/.cache/kvpilot/helm/<version>/helm), so a second run only checks that it is there. Prints the
# directory on stdout (last line) and the build time on stderr.
#
# `--print-dir` prints that directory and builds nothing (the tests use it to find the binary).
# Needs Go >= 1.26 (GO, or `go` on PATH, or /usr/local/go/bin/go) and the Go module proxy.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
MOD="$ROOT/tools/helm"

HELM_VERSION="$(awk '$1 == "helm.sh/helm/v4" && $2 ~ /^v/ { print $2; exit }' "$MOD/go.mod")"
if [ -z "$HELM_VERSION" ]; then
  echo "build-helm: no helm.sh/helm/v4 version in $MOD/go.mod" >&2
  exit 2
fi
CACHE="${KVPILOT_HELM_CACHE:-$HOME/.cache/kvpilot/helm}"
OUT="$CACHE/$HELM_VERSION"
if [ "${1:-}" = "--print-dir" ]; then echo "$OUT"; exit 0; fi

if [ -x "$OUT/helm" ]; then
  echo "helm: warm, cached binary in $OUT" >&2
  echo "$OUT"
  exit 0
fi

GO="${GO:-$(command -v go || true)}"
if [ -z "$GO" ] && [ -x /usr/local/go/bin/go ]; then GO=/usr/local/go/bin/go; fi
if [ -z "$GO" ]; then
  echo "build-helm: Go not found (set GO=/path/to/go); the helm cluster test needs Go >= 1.26" >&2
  exit 2
fi
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="-mod=readonly -buildvcs=false"

start=$(date +%s)
mkdir -p "$OUT.tmp"
echo "helm: building helm $HELM_VERSION with $("$GO" env GOVERSION)" >&2
# Without -X the binary says v4.3 (the source's default); helm's own Makefile sets these for a release.
pkg=helm.sh/helm/v4/internal/version
ldflags="-s -w -X $pkg.version=$HELM_VERSION -X $pkg.metadata= -X $pkg.gitTreeState=clean"
(cd "$MOD" && "$GO" build -trimpath -ldflags "$ldflags" -o "$OUT.tmp/helm" helm.sh/helm/v4/cmd/helm)
mkdir -p "$OUT"
mv -f "$OUT.tmp/helm" "$OUT/helm"
rmdir "$OUT.tmp"
echo "helm: built in $(( $(date +%s) - start ))s into $OUT" >&2
"$OUT/helm" version >&2
echo "$OUT"
