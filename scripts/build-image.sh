#!/usr/bin/env bash
# Builds the kvpilot image with podman, with no registry: the base is a Debian bookworm rootfs made by
# debootstrap (cached under ~/.cache by suite, package set and month) and imported into podman; the Dockerfile
# builds on it through its PYTHON_BASE build argument, the same file that builds on the pinned
# python:3.11-slim-bookworm base anywhere a registry is reachable.
#
#   scripts/build-image.sh            # builds localhost/kvpilot:dev, prints the image's and its venv's size
#   IMAGE=localhost/kvpilot:x scripts/build-image.sh
#
# Needs root (debootstrap, podman's rootful storage); installs podman, runc and debootstrap with apt when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib/apt.sh
. scripts/lib/apt.sh

IMAGE=${IMAGE:-localhost/kvpilot:dev}
SUITE=bookworm
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
# python3-venv for the builder stage's `python3 -m venv`; nothing that compiles.
BASE_PACKAGES=python3,python3-venv,ca-certificates
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/kvpilot/image
export CONTAINERS_CONF=$PWD/scripts/podman/containers.conf

if [ "$(id -u)" != 0 ]; then
  echo "build-image.sh: needs root (debootstrap and podman's rootful storage)" >&2
  exit 2
fi

missing=()
command -v podman >/dev/null 2>&1 || missing+=(podman)
command -v runc >/dev/null 2>&1 || missing+=(runc)
command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
if [ "${#missing[@]}" -gt 0 ]; then
  can_apt || { echo "build-image.sh: missing ${missing[*]} and no apt-get to install them" >&2; exit 2; }
  echo "installing ${missing[*]} (Debian packages) to build the image" >&2
  # fuse-overlayfs/uidmap are podman's recommends that rootful builds here do not need.
  apt_install "${missing[@]}"
fi

# The base is rebuilt monthly (security updates) or when its package set changes.
key="$SUITE-minbase-$(date -u +%Y%m)-$(printf %s "$BASE_PACKAGES" | sha256sum | cut -c1-8)"
base="localhost/kvpilot-base:$key"
tarball="$CACHE/$key.tar"
mkdir -p "$CACHE"
if [ ! -s "$tarball" ]; then
  rootfs=$(mktemp -d "$CACHE/rootfs.XXXXXX")
  trap 'rm -rf "$rootfs"' EXIT
  echo "debootstrap --variant=minbase $SUITE (with $BASE_PACKAGES) -> $tarball" >&2
  debootstrap --variant=minbase --include="$BASE_PACKAGES" "$SUITE" "$rootfs" "$MIRROR" >"$CACHE/debootstrap.log" 2>&1 \
    || { tail -n 30 "$CACHE/debootstrap.log" >&2; exit 1; }
  # apt's package cache and lists are not part of an image.
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" -cf "$tarball.partial" .
  mv "$tarball.partial" "$tarball"
  rm -rf "$rootfs"
  # Earlier months' bases are superseded.
  find "$CACHE" -maxdepth 1 -name "$SUITE-minbase-*.tar" ! -name "$key.tar" -delete
  trap - EXIT
fi
if ! podman image exists "$base"; then
  podman import --quiet "$tarball" "$base" >/dev/null
fi

# The host reaches PyPI through a TLS-inspecting proxy whose CA is in the host's bundle: pip in the builder
# needs that bundle. Mounted at build time only, it never lands in a layer.
certs=$(dirname "$(readlink -f "${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}")")
echo "podman build $IMAGE on $base" >&2
podman build --quiet --network host --runtime runc \
  -v "$certs:/etc/ssl/certs:ro" \
  --build-arg "PYTHON_BASE=$base" \
  -t "$IMAGE" -f Dockerfile . >/dev/null

image_mb=$(podman image inspect --format '{{.Size}}' "$IMAGE" | awk '{printf "%.0f", $1/1e6}')
venv_mb=$(podman run --rm --runtime runc --entrypoint du "$IMAGE" -sm /opt/kvpilot | cut -f1)
echo "built $IMAGE: image ${image_mb} MB, venv /opt/kvpilot ${venv_mb} MiB"
