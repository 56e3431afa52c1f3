"""Malformed InferenceServices, each with the field path its error must name.

Each case starts from a valid manifest and breaks one thing, so a passing test proves the
one rule fired (and nothing unrelated did).
"""

from __future__ import annotations

import copy
from typing import Any

BASE: dict[str, Any] = {
    "apiVersion": "kvpilot.dev/v1alpha1",
    "kind": "InferenceService",
    "metadata": {"name": "svc", "namespace": "ml"},
    "spec": {"model": "meta-llama/Llama-3.1-8B-Instruct", "replicas": 2},
}


def _with(path: str, value: Any) -> dict[str, Any]:
    doc = copy.deepcopy(BASE)
    node: Any = doc
    parts = path.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return doc


def _without(path: str) -> dict[str, Any]:
    doc = copy.deepcopy(BASE)
    node: Any = doc
    parts = path.split(".")
    for part in parts[:-1]:
        node = node[part]
    del node[parts[-1]]
    return doc


def _merge(**spec: Any) -> dict[str, Any]:
    doc = copy.deepcopy(BASE)
    doc["spec"].update(spec)
    return doc


# (id, document, expected path in the first message, a word the message must carry)
CASES: list[tuple[str, Any, str, str]] = [
    ("replicas-wrong-type", _with("spec.replicas", "two"), "spec.replicas", "integer"),
    ("replicas-negative", _with("spec.replicas", -1), "spec.replicas", "greater than or equal"),
    ("model-missing", _without("spec.model"), "spec.model", "required"),
    ("model-empty", _with("spec.model", ""), "spec.model", "at least 1"),
    ("unknown-spec-field", _with("spec.modle", "x"), "spec.modle", "unknown field"),
    ("unknown-engine-field", _with("spec.engine", {"maxBatchedTokens": 4096}), "spec.engine.maxBatchedTokens",
     "maxNumBatchedTokens"),
    ("engine-kind-unknown", _with("spec.engine", {"kind": "tgi"}), "spec.engine.kind", "'vllm' or 'twin'"),
    ("gpu-util-above-one", _with("spec.engine", {"gpuMemoryUtilization": 1.5}), "spec.engine.gpuMemoryUtilization",
     "less than 1"),
    ("gpu-util-zero", _with("spec.engine", {"gpuMemoryUtilization": 0}), "spec.engine.gpuMemoryUtilization",
     "greater than 0"),
    ("gpu-util-string", _with("spec.engine", {"gpuMemoryUtilization": "high"}), "spec.engine.gpuMemoryUtilization",
     "number"),
    ("kv-conflict", _with("spec.engine", {"gpuMemoryUtilization": 0.9, "kvCacheMemoryBytes": 8 << 30}),
     "spec.engine.kvCacheMemoryBytes", "not both"),
    ("batched-below-seqs", _with("spec.engine", {"maxNumBatchedTokens": 128, "maxNumSeqs": 256}),
     "spec.engine.maxNumBatchedTokens", "at least maxNumSeqs"),
    ("block-size-odd", _with("spec.engine", {"blockSize": 12}), "spec.engine.blockSize", "16"),
    ("kv-dtype-unknown", _with("spec.engine", {"kvCacheDtype": "int4"}), "spec.engine.kvCacheDtype", "fp8"),
    ("typed-flag-in-extra", _with("spec.engine", {"extraArgs": ["--max-num-seqs", "64"]}),
     "spec.engine.extraArgs[0]", "engine.maxNumSeqs"),
    ("typed-flag-equals-form", _with("spec.engine", {"extraArgs": ["--enforce-eager", "--gpu-memory-utilization=0.8"]}),
     "spec.engine.extraArgs[1]", "engine.gpuMemoryUtilization"),
    ("tp-alias-in-extra", _with("spec.engine", {"extraArgs": ["-tp", "2"]}), "spec.engine.extraArgs[0]",
     "tensorParallelSize"),
    ("removed-flag", _with("spec.engine", {"extraArgs": ["--max-num-partial-prefills", "2"]}),
     "spec.engine.extraArgs[0]", "removed in vLLM 0.33"),
    ("typed-flag-prefix", _with("spec.engine", {"extraArgs": ["--enforce-eager", "--max-num-se=512"]}),
     "spec.engine.extraArgs[1]", "vLLM reads it as --max-num-seqs"),
    ("typed-flag-underscores", _with("spec.engine", {"extraArgs": ["--gpu_memory_utilization", "0.5"]}),
     "spec.engine.extraArgs[0]", "engine.gpuMemoryUtilization"),
    ("ambiguous-flag-prefix", _with("spec.engine", {"extraArgs": ["--max-num=8"]}), "spec.engine.extraArgs[0]",
     "ambiguous option: --max-num=8 could match"),
    ("config-file-flag", _with("spec.engine", {"extraArgs": ["--config", "/etc/vllm.yaml"]}),
     "spec.engine.extraArgs[0]", "--config reads flags from a YAML file"),
    ("model-is-a-flag", _with("spec.model", "--help"), "spec.model", "must not start with '-'"),
    ("served-name-is-a-flag", _with("spec.servedModelName", "-x"), "spec.servedModelName", "must not start with '-'"),
    ("owned-port-flag", _with("spec.engine", {"extraArgs": ["--port=9000"]}), "spec.engine.extraArgs[0]",
     "set by kvpilot"),
    ("extra-args-not-list", _with("spec.engine", {"extraArgs": "--enforce-eager"}), "spec.engine.extraArgs",
     "list"),
    ("ttft-not-edge", _with("spec.slo", {"ttftSeconds": 0.3}), "spec.slo.ttftSeconds", "0.25, 0.5"),
    ("itl-not-edge", _with("spec.slo", {"itlSeconds": 0.04}), "spec.slo.itlSeconds", "0.025, 0.05"),
    ("objective-one", _with("spec.slo", {"objective": 1.0}), "spec.slo.objective", "less than or equal to 0.999999"),
    ("period-bad", _with("spec.slo", {"period": "a month"}), "spec.slo.period", "pattern"),
    ("space-min-ge-max", _with("spec.tuning", {"space": {"maxNumBatchedTokens": [4096, 1024]}}),
     "spec.tuning.space.maxNumBatchedTokens", "min must be less than max"),
    ("space-util-min-ge-max", _with("spec.tuning", {"space": {"gpuMemoryUtilization": [0.9, 0.8]}}),
     "spec.tuning.space.gpuMemoryUtilization", "min must be less than max"),
    ("space-seqs-min-ge-max", _with("spec.tuning", {"space": {"maxNumSeqs": [512, 512]}}),
     "spec.tuning.space.maxNumSeqs", "min must be less than max"),
    ("space-out-of-range", _with("spec.tuning", {"space": {"gpuMemoryUtilization": [0.5, 1.2]}}),
     "spec.tuning.space.gpuMemoryUtilization", "inside (0, 1)"),
    ("space-tokens-below-one", _with("spec.tuning", {"space": {"maxNumBatchedTokens": [0, 1024]}}),
     "spec.tuning.space.maxNumBatchedTokens", "inside [1,"),
    ("space-seqs-above-limit", _with("spec.tuning", {"space": {"maxNumSeqs": [64, 1 << 17]}}),
     "spec.tuning.space.maxNumSeqs", "inside [1,"),
    ("space-tokens-below-seqs", _with("spec.tuning", {"space": {"maxNumBatchedTokens": [64, 128],
                                                                "maxNumSeqs": [256, 1024]}}),
     "spec.tuning.space.maxNumBatchedTokens", "below the smallest maxNumSeqs"),
    ("seqs-outside-space", _merge(engine={"maxNumSeqs": 2048}, tuning={"enabled": True}),
     "spec.engine.maxNumSeqs", "outside tuning.space"),
    ("util-outside-space", _merge(engine={"gpuMemoryUtilization": 0.5}, tuning={"enabled": True}),
     "spec.engine.gpuMemoryUtilization", "outside tuning.space"),
    ("space-wrong-arity", _with("spec.tuning", {"space": {"maxNumSeqs": [64]}}), "spec.tuning.space.maxNumSeqs",
     "at least 2"),
    ("current-outside-space", _merge(engine={"maxNumBatchedTokens": 32768},
                                     tuning={"enabled": True, "space": {"maxNumBatchedTokens": [256, 16384]}}),
     "spec.engine.maxNumBatchedTokens", "outside tuning.space"),
    ("tuning-with-kv-bytes", _merge(engine={"kvCacheMemoryBytes": 1 << 34}, tuning={"enabled": True}),
     "spec.engine.kvCacheMemoryBytes", "disable tuning"),
    ("goal-unknown", _with("spec.tuning", {"goal": "throughput"}), "spec.tuning.goal", "'latency' or 'capacity'"),
    # Removed: a tenant chose which database (or file) the cluster-wide tuner opened.
    ("tuning-storage-removed", _with("spec.tuning", {"enabled": True, "storage": "sqlite:////var/lib/kvpilot/x.db"}),
     "spec.tuning.storage", "the tuner's own configuration"),
    ("budget-gate-empty-window",
     _with("spec.tuning", {"budgetGate": {"windows": [{"days": ["Sat"], "start": "02:00", "end": "02:00"}]}}),
     "spec.tuning.budgetGate.windows", "empty window"),
    ("budget-gate-unknown-time-zone", _with("spec.tuning", {"budgetGate": {"timeZone": "Europe/Atlantis"}}),
     "spec.tuning.budgetGate.timeZone", "IANA time zone"),
    ("canary-with-one-replica", _merge(replicas=1, tuning={"trialStrategy": "canary"}),
     "spec.tuning.trialStrategy", "replicas >= 2"),
    ("trial-strategy-unknown", _with("spec.tuning", {"trialStrategy": "blue-green"}), "spec.tuning.trialStrategy",
     "'canary' or 'rolling'"),
    ("warmup-ge-trial", _with("spec.tuning", {"trialSeconds": 60, "warmupSeconds": 60}), "spec.tuning.warmupSeconds",
     "shorter than trialSeconds"),
    ("autoscaling-max-below-min", _with("spec.autoscaling", {"minReplicas": 4, "maxReplicas": 2}),
     "spec.autoscaling.maxReplicas", "minReplicas"),
    ("autoscaling-max-missing", _with("spec.autoscaling", {"minReplicas": 2}), "spec.autoscaling.maxReplicas",
     "required"),
    ("autoscaling-actor-unknown", _with("spec.autoscaling", {"maxReplicas": 4, "actor": "hpa"}),
     "spec.autoscaling.actor", "'kvpilot' or 'external'"),
    ("autoscaling-hpa-v1-field", _with("spec.autoscaling", {"maxReplicas": 4, "targetCPUUtilizationPercentage": 80}),
     "spec.autoscaling.targetCPUUtilizationPercentage", "behavior"),
    ("autoscaling-policy-type-unknown", _with("spec.autoscaling", {"maxReplicas": 4, "behavior": {"scaleUp": {
        "policies": [{"type": "Replicas", "value": 1, "periodSeconds": 60}]}}}),
     "spec.autoscaling.behavior.scaleUp.policies[0].type", "'Pods' or 'Percent'"),
    ("autoscaling-no-policies", _with("spec.autoscaling", {"maxReplicas": 4, "behavior": {"scaleDown": {
        "policies": []}}}), "spec.autoscaling.behavior.scaleDown.policies", "at least 1"),
    ("autoscaling-period-above-30-minutes", _with("spec.autoscaling", {"maxReplicas": 4, "behavior": {"scaleUp": {
        "policies": [{"type": "Pods", "value": 1, "periodSeconds": 3600}]}}}),
     "spec.autoscaling.behavior.scaleUp.policies[0].periodSeconds", "less than or equal to 1800"),
    ("autoscaling-window-above-an-hour", _with("spec.autoscaling", {"maxReplicas": 4, "behavior": {"scaleDown": {
        "stabilizationWindowSeconds": 7200}}}),
     "spec.autoscaling.behavior.scaleDown.stabilizationWindowSeconds", "less than or equal to 3600"),
    ("autoscaling-floor-one-without-surge", _merge(rollout={"maxSurge": 0}, autoscaling={"maxReplicas": 4}),
     "spec.autoscaling.minReplicas", "maxSurge 0"),
    ("autoscaling-floor-one-with-canary", _merge(tuning={"trialStrategy": "canary"},
                                                 autoscaling={"minReplicas": 1, "maxReplicas": 4}),
     "spec.autoscaling.minReplicas", "trialStrategy canary"),
    ("downtime-rollout", _merge(replicas=1, rollout={"maxSurge": 0}), "spec.rollout.maxSurge", "allowDowntime"),
    ("deadline-below-startup", _with("spec.rollout", {"startupTimeoutSeconds": 1800, "progressDeadlineSeconds": 600}),
     "spec.rollout.progressDeadlineSeconds", "startupTimeoutSeconds"),
    ("gpus-below-tp", _merge(engine={"tensorParallelSize": 4}, resources={"gpus": 2}), "spec.resources.gpus",
     "tensorParallelSize"),
    ("memory-not-quantity", _with("spec.resources", {"memory": "lots"}), "spec.resources.memory", "Kubernetes quantity"),
    # Quantities the pattern admits and a CEL quantity rule (and kvpilot's own check) refuses.
    ("memory-milli-bytes", _with("spec.resources", {"memory": "1500m"}), "spec.resources.memory", "whole"),
    ("shm-above-1pi", _with("spec.resources", {"shmSize": "2Pi"}), "spec.resources.shmSize", "at most 1Pi"),
    ("cpu-above-4096", _with("spec.resources", {"cpu": "5000"}), "spec.resources.cpu", "4096"),
    ("gpu-resource-in-kubernetes-io", _with("spec.resources", {"gpuResource": "kubernetes.io/gpu"}),
     "spec.resources.gpuResource", "not one in kubernetes.io"),
    ("list-where-object", _with("spec.engine", ["vllm"]), "spec.engine", "dictionary"),
    ("spec-is-string", _with("spec", "model: x"), "spec", "dictionary"),
    ("name-uppercase", _with("metadata.name", "Llama"), "metadata.name", "pattern"),
    ("name-missing", _with("metadata", {"namespace": "ml"}), "metadata.name", "required"),
    ("wrong-kind", _with("kind", "Deployment"), "kind", "InferenceService"),
    ("wrong-api-version", _with("apiVersion", "kvpilot.dev/v1"), "apiVersion", "kvpilot.dev/v1alpha1"),
    ("hf-secret-no-name", _with("spec.hfTokenSecret", {"key": "TOKEN"}), "spec.hfTokenSecret.name", "required"),
    ("twin-gpu-empty", _with("spec.engine", {"kind": "twin", "twin": {"gpu": ""}}), "spec.engine.twin.gpu",
     "at least 1"),
    ("document-is-list", [BASE], "", "mapping"),
    ("monitor-unknown", _with("spec.observability", {"monitor": "Probe"}), "spec.observability.monitor",
     "'ServiceMonitor', 'PodMonitor' or 'None'"),
    ("tracing-endpoint-missing", _with("spec.observability", {"tracing": {"samplingRatio": 0.5}}),
     "spec.observability.tracing.otlpTracesEndpoint", "required"),
    ("tracing-endpoint-not-a-url", _with("spec.observability", {"tracing": {"otlpTracesEndpoint": "collector:4317"}}),
     "spec.observability.tracing.otlpTracesEndpoint", "http:// or https:// URL"),
    ("tracing-endpoint-credentials", _with("spec.observability", {"tracing": {
        "otlpTracesEndpoint": "https://user:secret@collector:4318/v1/traces"}}),
     "spec.observability.tracing.otlpTracesEndpoint", "user:password@"),
    ("tracing-http-endpoint-without-path", _with("spec.observability", {"tracing": {
        "otlpTracesEndpoint": "http://collector:4318"}}), "spec.observability.tracing.otlpTracesEndpoint",
     "include the path"),
    ("tracing-protocol-unknown", _with("spec.observability", {"tracing": {
        "otlpTracesEndpoint": "http://collector:4317", "otlpTracesProtocol": "http"}}),
     "spec.observability.tracing.otlpTracesProtocol", "'grpc' or 'http/protobuf'"),
    ("tracing-ratio-above-one", _with("spec.observability", {"tracing": {
        "otlpTracesEndpoint": "http://collector:4318/v1/traces", "samplingRatio": 1.5}}),
     "spec.observability.tracing.samplingRatio", "less than or equal to 1"),
    ("tracing-ratio-negative", _with("spec.observability", {"tracing": {
        "otlpTracesEndpoint": "http://collector:4318/v1/traces", "samplingRatio": -0.1}}),
     "spec.observability.tracing.samplingRatio", "greater than or equal to 0"),
    ("tracing-detailed-unknown", _with("spec.observability", {"tracing": {
        "otlpTracesEndpoint": "http://collector:4318/v1/traces", "collectDetailedTraces": ["gpu"]}}),
     "spec.observability.tracing.collectDetailedTraces[0]", "'model', 'worker' or 'all'"),
    ("tracing-detailed-twice", _with("spec.observability", {"tracing": {
        "otlpTracesEndpoint": "http://collector:4318/v1/traces", "collectDetailedTraces": ["all", "all"]}}),
     "spec.observability.tracing.collectDetailedTraces", "at most once"),
]
