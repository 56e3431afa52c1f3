#!/usr/bin/env bash
# Builds the test control plane the `cluster` tests start: kube-apiserver, kube-controller-manager,
# kube-scheduler and kubectl from the k8s.io/kubernetes module, etcd from go.etcd.io/etcd/server/v3
# (both pinned in tools/controlplane/go.mod), and kwok. Binaries are cached by version under
# $KVPILOT_CONTROLPLANE_CACHE (default ~/.cache/kvpilot/controlplane/<versions>/), so a second run
# only checks that they are there. Prints the directory on stdout (last line) and the build time on stderr.
#
# `--print-dir` prints that directory and builds nothing (the tests use it to find the binaries).
# Needs Go >= 1.25 (GO, or `go` on PATH, or /usr/local/go/bin/go) and the Go module proxy.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
MOD="$ROOT/tools/controlplane"
KWOK_VERSION="v0.7.0"


modver() { awk -v m="$1" '$1 == m && $2 ~ /^v/ { print $2; exit }' "$MOD/go.mod"; }
K8S_VERSION="$(modver k8s.io/kubernetes)"
ETCD_VERSION="$(modver go.etcd.io/etcd/server/v3)"
CACHE="${KVPILOT_CONTROLPLANE_CACHE:-$HOME/.cache/kvpilot/controlplane}"
OUT="$CACHE/k8s-$K8S_VERSION-etcd-$ETCD_VERSION-kwok-$KWOK_VERSION"
BINARIES=(kube-apiserver kube-controller-manager kube-scheduler kubectl etcd kwok)
if [ "${1:-}" = "--print-dir" ]; then echo "$OUT"; exit 0; fi

missing=()
for b in "${BINARIES[@]}"; do [ -x "$OUT/$b" ] || missing+=("$b"); done
if [ ${#missing[@]} -eq 0 ]; then
  echo "control plane: warm, cached binaries in $OUT" >&2
  echo "$OUT"
  exit 0
fi

GO="${GO:-$(command -v go || true)}"
if [ -z "$GO" ] && [ -x /usr/local/go/bin/go ]; then GO=/usr/local/go/bin/go; fi
if [ -z "$GO" ]; then
  echo "build-control-plane: Go not found (set GO=/path/to/go); the cluster tests need Go >= 1.25" >&2
  exit 2
fi
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="-mod=readonly -buildvcs=false"

start=$(date +%s)
mkdir -p "$OUT.tmp"
echo "control plane: cold build of ${missing[*]} (k8s $K8S_VERSION, etcd $ETCD_VERSION, kwok $KWOK_VERSION) with $("$GO" env GOVERSION)" >&2

# Without these the binaries report v0.0.0-master and kubectl warns about version skew.
minor="${K8S_VERSION#v1.}"; minor="${minor%%.*}"
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
  ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done

k8s_pkgs=()
for b in kube-apiserver kube-controller-manager kube-scheduler kubectl; do
  [[ " ${missing[*]} " == *" $b "* ]] && k8s_pkgs+=("k8s.io/kubernetes/cmd/$b")
done
if [ ${#k8s_pkgs[@]} -gt 0 ]; then
  (cd "$MOD" && "$GO" build -trimpath -ldflags "$ldflags" -o "$OUT.tmp/" "${k8s_pkgs[@]}")
fi
if [[ " ${missing[*]} " == *" etcd "* ]]; then
  (cd "$MOD" && "$GO" build -trimpath -ldflags "-s -w" -o "$OUT.tmp/etcd" go.etcd.io/etcd/server/v3)
fi
if [[ " ${missing[*]} " == *" kwok "* ]]; then
  GOBIN="$OUT.tmp" GOFLAGS=-buildvcs=false "$GO" install -trimpath -ldflags "-s -w" "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
fi

mkdir -p "$OUT"
for b in "$OUT.tmp"/*; do mv -f "$b" "$OUT/"; done
rmdir "$OUT.tmp"
echo "control plane: built in $(( $(date +%s) - start ))s into $OUT" >&2
"$OUT/kube-apiserver" --version >&2
echo "$OUT"
