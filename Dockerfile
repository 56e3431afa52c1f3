# syntax=docker/dockerfile:1
#
# kvpilot: one image for the operator (`kvpilot operator`), the tuner (`kvpilot tuner`) and the
# engine twin (`kvpilot twin serve`): the chart runs the first two from it, and the operator
# starts `engine.kind: twin` pods from it too (the chart passes its own image as --twin-image).
#
# Build:   docker build -t ghcr.io/kvpilot/kvpilot:0.1.0 .
# Base:    pinned by exact version tag AND by the digest of its multi-arch index, so a rebuild
#          gets byte-identical bases. To move to a newer patch release, update both together:
#            docker buildx imagetools inspect python:3.11.14-slim-bookworm --format '{{json .Manifest.Digest}}'
ARG PYTHON_BASE=python:3.11.14-slim-bookworm@sha256:65a93d69fa75478d554f4ad27c85c1e69fa184956261b4301ebaf6dbb0a3543d

# ---------------------------------------------------------------------------------------------
# builder: build the kvpilot wheel and install it with its dependencies into a self-contained
# virtual environment. Every dependency ships manylinux wheels, so no compiler is needed here
# either; pip refuses source builds (--only-binary) so a missing wheel fails loudly instead of
# silently needing gcc.
# ---------------------------------------------------------------------------------------------
FROM ${PYTHON_BASE} AS builder

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

WORKDIR /src
RUN python3 -m venv /opt/kvpilot

COPY pyproject.toml README.md ./
COPY kvpilot ./kvpilot

# The postgresql extra is the driver SQLAlchemy uses for the tuner's `postgresql://` Optuna storage
# (the chart's tuner.storage.type=postgresql); SQLite needs nothing beyond the standard library.
# The tracing extra is the OpenTelemetry SDK and its OTLP/HTTP exporter, for the twin's request spans
# (`kvpilot twin serve --otlp-traces-endpoint`); the OTLP/gRPC exporter (tracing-grpc, grpcio ~27 MB)
# stays out, so a twin pod traces with otlpTracesProtocol http/protobuf.
# Report plotting (the `report` extra, matplotlib) stays out: neither the operator nor the tuner plots.
# pip and setuptools go at the end: nothing installs at run time, and they are 20 MB of the venv.
RUN /opt/kvpilot/bin/pip wheel --no-deps --wheel-dir /wheels . \
 && /opt/kvpilot/bin/pip install --only-binary=:all: "$(ls /wheels/kvpilot-*.whl)[postgresql,tracing]" \
 && /opt/kvpilot/bin/kvpilot --version \
 && /opt/kvpilot/bin/python -c "import psycopg, optuna, kopf, opentelemetry.exporter.otlp.proto.http.trace_exporter" \
 && /opt/kvpilot/bin/pip uninstall -q -y pip setuptools

# ---------------------------------------------------------------------------------------------
# final: the slim base plus the virtual environment; no compilers, no pip cache, no sources.
# ---------------------------------------------------------------------------------------------
FROM ${PYTHON_BASE} AS final

LABEL org.opencontainers.image.title="kvpilot" \
      org.opencontainers.image.description="Kubernetes operator, SLO-constrained tuner and engine twin for vLLM with chunked prefill" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0"

# The same path as in the builder: a venv's scripts hard-code their interpreter path.
COPY --from=builder /opt/kvpilot /opt/kvpilot

# HOME points at /tmp because the chart mounts the root filesystem read-only and gives the pod an
# emptyDir at /tmp (kopf wants a writable home).
ENV PATH=/opt/kvpilot/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp

# A fixed numeric UID/GID (the distroless "nonroot" id): Kubernetes can only prove
# runAsNonRoot for a numeric USER. The chart sets the same id in its securityContext.
USER 65532:65532
WORKDIR /tmp

ENTRYPOINT ["kvpilot"]
CMD ["--help"]
