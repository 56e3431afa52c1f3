# kvpilot developer entry points.  `make tune` and `make test` work on a fresh machine:
# each creates the virtual environment it needs first.
VENV    ?= .venv
PYTHON  ?= python3
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip -q --disable-pip-version-check

.PHONY: setup tools control-plane tune test test-unit test-cluster lint crd clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install -e '.[test,dev]'
	touch $@

tools:
	./scripts/install-test-tools.sh

## The `cluster` tests' control plane (etcd, kube-apiserver, -controller-manager, -scheduler, kubectl,
## kwok), built from pinned Go modules (tools/controlplane) and cached by version under ~/.cache.
control-plane:
	./scripts/build-control-plane.sh

## The main job: tune the engine offline on the twin (SQLite study, report, recommended engine block).
tune: setup
	$(VENV)/bin/kvpilot tune --offline

## Everything CI runs: lint, types, the import-layering contract, and the whole test suite.
test: setup tools control-plane lint
	$(PY) -m pytest

test-cluster: setup control-plane
	$(PY) -m pytest -m cluster tests/cluster

test-unit: setup
	$(PY) -m pytest tests/unit

lint: setup
	$(VENV)/bin/ruff check kvpilot tests benchmarks
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

## Regenerate what is generated (CRD, its copy in the chart, the chart's dashboard); tests diff them.
crd: setup
	$(VENV)/bin/kvpilot crd --write
	cp crds/*.yaml charts/kvpilot/crds/
	$(VENV)/bin/kvpilot slo dashboard --all -o charts/kvpilot/dashboards/kvpilot.json

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache .import_linter_cache
