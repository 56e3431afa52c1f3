#!/usr/bin/env bash
# Installs the LOWEST versions pyproject.toml declares for kvpilot's runtime dependencies (and the
# report extra's) into a venv of its own, then imports every kvpilot module and runs the tuner's unit
# tests with them: a `>=` that the code has outgrown (an API the floor version lacks) fails here,
# not at a user's.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV_MIN:-.venv-lowest}
PYTHON=${PYTHON:-python3}
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
"$PYTHON" - "$constraints" <<'PY'
import re, sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
# The runtime dependencies, and the report extra's (the tuner's tests write reports with plots).
deps = project["dependencies"] + project["optional-dependencies"]["report"]
lines = []
for dep in deps:
    m = re.fullmatch(r"\s*([A-Za-z0-9_.\-\[\]]+)\s*>=\s*([0-9][^,;\s]*)\s*(,.*)?", dep)
    if not m:
        sys.exit(f"lowest-deps: {dep!r} has no '>=' floor to test")
    name = re.sub(r"\[.*\]", "", m.group(1))
    lines.append(f"{name}=={m.group(2)}")
open(sys.argv[1], "w").write("\n".join(lines) + "\n")
print("lowest declared versions:", ", ".join(lines))
PY
if [ ! -x "$VENV/bin/python" ] || ! cmp -s "$constraints" "$VENV/.constraints"; then
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip -q --disable-pip-version-check install --upgrade pip
  # The floors of our dependencies, and test tools at any version (they are not ours to floor).
  "$VENV/bin/python" -m pip -q --disable-pip-version-check install -c "$constraints" -e '.[report]' pytest pytest-timeout hypothesis
  cp "$constraints" "$VENV/.constraints"
fi
"$VENV/bin/python" - <<'PY'
import importlib, pkgutil
import kvpilot
names = [m.name for m in pkgutil.walk_packages(kvpilot.__path__, "kvpilot.")]
for name in names:
    importlib.import_module(name)
print(f"imported {len(names)} kvpilot modules with the lowest declared dependencies")
# The settings the operator gives kopf at start-up exist in the lowest kopf too.
import kopf
from kvpilot.operator.handlers import configure_kopf
configure_kopf(kopf.OperatorSettings(), 8, exact_namespaces=True)
print("kopf settings configured with the lowest kopf")
PY
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/unit/tuner
