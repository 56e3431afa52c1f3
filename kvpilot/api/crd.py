"""The InferenceService CustomResourceDefinition, generated from the pydantic models.

Pydantic emits JSON Schema 2020-12; Kubernetes wants a *structural* OpenAPI v3 schema: no
`$ref`, `nullable: true` instead of `anyOf` with null, boolean `exclusiveMinimum`, every node
typed.  `structural()` does that translation; the cross-field rules CEL can express ride along
as `x-kubernetes-validations`.  crds/ in git is this output and nothing else (a test diffs it).
"""

from __future__ import annotations

import copy
from typing import Any

import yaml

from kvpilot.api import rules, tracing, tuned, vllm
from kvpilot.api.models import InferenceServiceSpec, InferenceServiceStatus
from kvpilot.api.vocabulary import GROUP, KIND, PLURAL, SHORT_NAMES, SINGULAR, VERSION

CRD_NAME = f"{PLURAL}.{GROUP}"
CRD_FILENAME = f"{CRD_NAME}.yaml"

_DROP = frozenset({"title", "discriminator"})

# Rules that CEL can express cheaply, keyed by the path of the object they sit on.
# The same rules live in rules.py for `kvpilot validate` and the operator; keep the messages alike.
_CEL_RULES: dict[tuple[str, ...], list[dict[str, str]]] = {
    ("spec",): [
        {
            "rule": "self.replicas != 1 || self.rollout.maxSurge != 0 || self.rollout.allowDowntime",
            "message": "with replicas 1, rollout.maxSurge 0 takes the service down on every rollout; "
            "use maxSurge >= 1 or set rollout.allowDowntime: true",
            "fieldPath": ".rollout.maxSurge",
        },
        {
            "rule": "self.engine.kind != 'vllm' || self.resources.gpus >= self.engine.tensorParallelSize",
            "message": "resources.gpus must be at least engine.tensorParallelSize",
            "fieldPath": ".resources.gpus",
        },
    ],
    ("spec", "engine"): [
        {
            "rule": "self.maxNumBatchedTokens >= self.maxNumSeqs",
            "message": "maxNumBatchedTokens must be at least maxNumSeqs (vLLM refuses to start otherwise)",
            "fieldPath": ".maxNumBatchedTokens",
        },
        {
            "rule": "!(has(self.gpuMemoryUtilization) && has(self.kvCacheMemoryBytes))",
            "message": "set either gpuMemoryUtilization or kvCacheMemoryBytes, not both",
            "fieldPath": ".kvCacheMemoryBytes",
        },
    ],
    # Quantities: the pattern already holds them to resource.ParseQuantity's grammar; these say what
    # a pattern cannot (Kubernetes' CEL quantity library, 1.29+), as kube.py does.
    ("spec", "resources"): [
        *(
            {
                "rule": f"quantity(self.{name}).isGreaterThan(quantity('0')) && quantity(self.{name}).isInteger() "
                f"&& quantity(self.{name}).compareTo(quantity('1Pi')) <= 0",
                "message": f"{name} must be a whole, positive number of bytes, at most 1Pi",
                "fieldPath": f".{name}",
            }
            for name in ("memory", "shmSize")
        ),
        {
            "rule": "!has(self.cpu) || (quantity(self.cpu).compareTo(quantity('1m')) >= 0 "
            "&& quantity(self.cpu).compareTo(quantity('4096')) <= 0)",
            "message": "cpu must be between 1m and 4096",
            "fieldPath": ".cpu",
        },
        {
            "rule": "!self.gpuResource.matches('^([^/]*[.])?kubernetes[.]io/')",
            "message": "gpuResource must be an extended resource such as nvidia.com/gpu, not one in kubernetes.io",
            "fieldPath": ".gpuResource",
        },
    ],
    ("spec", "autoscaling"): [
        {
            "rule": "self.maxReplicas >= self.minReplicas",
            "message": "maxReplicas must be at least minReplicas",
            "fieldPath": ".maxReplicas",
        },
    ],
    ("spec", "rollout"): [
        {
            "rule": "self.progressDeadlineSeconds > self.startupTimeoutSeconds",
            "message": "progressDeadlineSeconds must be longer than startupTimeoutSeconds",
            "fieldPath": ".progressDeadlineSeconds",
        },
    ],
    ("spec", "slo"): [
        {
            "rule": "double(self.ttftSeconds) in [" + ", ".join(f"{e!r}" for e in vllm.TTFT_BUCKETS) + "]",
            "message": "ttftSeconds must be a bucket edge of vllm:time_to_first_token_seconds: "
            + ", ".join(f"{e:g}" for e in vllm.TTFT_BUCKETS),
            "fieldPath": ".ttftSeconds",
        },
        {
            "rule": "double(self.itlSeconds) in [" + ", ".join(f"{e!r}" for e in vllm.ITL_BUCKETS) + "]",
            "message": "itlSeconds must be a bucket edge of vllm:inter_token_latency_seconds: "
            + ", ".join(f"{e:g}" for e in vllm.ITL_BUCKETS),
            "fieldPath": ".itlSeconds",
        },
    ],
    ("spec", "observability", "tracing"): [
        {
            "rule": "self.otlpTracesProtocol != 'http/protobuf' || self.otlpTracesEndpoint.matches('^[a-z]+://[^/]+/.+')",
            "message": f"otlpTracesEndpoint: {tracing.HTTP_PATH_RULE}",
            "fieldPath": ".otlpTracesEndpoint",
        },
    ],
    ("spec", "tuning"): [
        {
            "rule": "!has(self.storage)",
            "message": f"removed: {rules.STORAGE_REMOVED}",
            "fieldPath": ".storage",
        },
    ],
    # The size test first: minItems/maxItems already refuse a range that is not a pair, but the
    # API server runs the rule anyway, and self.x[1] of a one-item list adds a confusing
    # "index out of bounds" error to the plain "should have at least 2 items".
    ("spec", "tuning", "space"): [
        {
            "rule": f"size(self.{name}) != 2 || self.{name}[0] < self.{name}[1]",
            "message": f"{name}: min must be less than max",
            "fieldPath": f".{name}",
        }
        for name in tuned.TUNED_ENGINE_FIELDS
    ],
}


def _inside_space(name: str, value: str) -> str:
    space = f"self.tuning.space.{name}"
    return f"size({space}) != 2 || ({space}[0] <= {value} && {value} <= {space}[1])"


def _cel(declared: tuned.TunedField, value: float) -> str:
    return repr(declared.type(value))


def _in_force(declared: tuned.TunedField) -> str:
    """CEL for the field's value in force: vLLM's own when spec.engine leaves it unset."""
    field = f"self.engine.{declared.name}"
    if declared.unset_means is None:
        return field
    return f"(has({field}) ? {field} : {declared.unset_means!r})"


def _space_limits(f: tuned.TunedField) -> dict[str, str]:
    """The range of tuning.space.<f.name> lies inside the field's legal limits."""
    above, below = (">", "<") if f.exclusive else (">=", "<=")
    return {
        "rule": f"size(self.{f.name}) != 2 || "
        f"(self.{f.name}[0] {above} {_cel(f, f.low)} && self.{f.name}[1] {below} {_cel(f, f.high)})",
        "message": f"{f.name} must lie inside {f.limits_text}",
        "fieldPath": f".{f.name}",
    }


def _unset_inside_space(f: tuned.TunedField) -> list[dict[str, str]]:
    """The rules of a field vLLM fills in when unset (and another field may override)."""
    overridden = f"has(self.engine.{f.overridden_by}) || " if f.overridden_by else ""
    out = [{
        "rule": f"!self.tuning.enabled || {overridden}{_inside_space(f.name, _in_force(f))}",
        "message": f"engine.{f.name} (vLLM's default {f.unset_means:g} when unset) is outside tuning.space.{f.name}",
        "fieldPath": f".engine.{f.name}",
    }]
    if f.overridden_by:
        out.append({
            "rule": f"!self.tuning.enabled || !has(self.engine.{f.overridden_by})",
            "message": f"the tuner adjusts {f.name}, which {f.overridden_by} overrides; "
            f"unset {f.overridden_by} or disable tuning",
            "fieldPath": f".engine.{f.overridden_by}",
        })
    return out


# Tuning starts from the current engine, so the engine must sit inside the space it searches
# (vLLM's default stands in for a field left unset). These cross engine and tuning, so they sit
# on spec; the size tests leave a malformed range to its schema error alone.
_CEL_RULES[("spec",)] += [
    *(
        {
            "rule": f"!self.tuning.enabled || {_inside_space(f.name, _in_force(f))}",
            "message": f"engine.{f.name} is outside tuning.space.{f.name}; the tuner starts from the current value",
            "fieldPath": f".engine.{f.name}",
        }
        for f in tuned.ALWAYS_SET
    ),
    *(rule for f in tuned.MAY_BE_UNSET for rule in _unset_inside_space(f)),
]
_CEL_RULES[("spec",)] += [
    {
        "rule": "!has(self.tuning.trialStrategy) || self.tuning.trialStrategy != 'canary' || self.replicas >= 2",
        "message": "tuning.trialStrategy canary needs replicas >= 2; use rolling, or leave it unset",
        "fieldPath": ".tuning.trialStrategy",
    },
]
# An autoscaler's floor must be a count the rules above admit: a scale write is validated as the whole object.
_CEL_RULES[("spec",)] += [
    {
        "rule": "!has(self.autoscaling) || self.autoscaling.minReplicas >= 2 || self.rollout.maxSurge != 0 "
        "|| self.rollout.allowDowntime",
        "message": "autoscaling.minReplicas must be at least 2 with rollout.maxSurge 0 (a scale to 1 is refused); "
        "use maxSurge >= 1 or set rollout.allowDowntime: true",
        "fieldPath": ".autoscaling.minReplicas",
    },
    {
        "rule": "!has(self.autoscaling) || self.autoscaling.minReplicas >= 2 || !has(self.tuning.trialStrategy) "
        "|| self.tuning.trialStrategy != 'canary'",
        "message": "autoscaling.minReplicas must be at least 2 with tuning.trialStrategy canary (a scale below 2 "
        "is refused); or leave trialStrategy unset",
        "fieldPath": ".autoscaling.minReplicas",
    },
]
_CEL_RULES[("spec", "tuning")] += [
    {
        "rule": "self.warmupSeconds < self.trialSeconds",
        "message": "warmupSeconds must be shorter than trialSeconds so a trial measures anything",
        "fieldPath": ".warmupSeconds",
    },
]
_CEL_RULES[("spec", "tuning", "budgetGate")] = [
    {
        "rule": "!has(self.windows) || self.windows.all(w, w.start != w.end)",
        "message": rules.WINDOW_EMPTY,
        "fieldPath": ".windows",
    },
]
_CEL_RULES[("spec", "tuning", "space")] += [
    # Inclusive limits first, then exclusive ones (a fraction), each group in declaration order.
    *(_space_limits(f) for f in sorted(tuned.TUNED, key=lambda f: f.exclusive)),
    {
        "rule": "size(self.maxNumBatchedTokens) != 2 || size(self.maxNumSeqs) != 2 || "
        "self.maxNumBatchedTokens[1] >= self.maxNumSeqs[0]",
        "message": "maxNumBatchedTokens: max is below the smallest maxNumSeqs; no point of the space "
        "satisfies maxNumBatchedTokens >= maxNumSeqs",
        "fieldPath": ".maxNumBatchedTokens",
    },
]

# What kvpilot checks that the API server does not, because CEL cannot say it at a cost the API
# server accepts. These stay with `kvpilot validate`, the operator (InvalidSpec) and the webhook.
NOT_IN_CEL: dict[str, str] = {
    "spec.engine.extraArgs": "an argument is resolved the way vLLM's parser resolves it (unambiguous "
    "prefixes of any of vLLM's ~200 serve flags, '_' for '-', '=' or a separate value); a CEL rule "
    "would need vLLM's whole flag table and argparse's abbreviation rule in every evaluation",
    "spec.tuning.budgetGate.timeZone": "a name must be in the IANA time zone database, which CEL does not "
    "have (kvpilot reads it through zoneinfo, from the system or the tzdata package)",
}

# Replica columns as `kubectl get deployments` reads (READY, UP-TO-DATE, AVAILABLE), with the desired count
# apart (a column cannot print "2/3"); UP-TO-DATE and AVAILABLE only with -o wide, to keep the line short.
PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Desired", "type": "integer", "jsonPath": ".spec.replicas",
     "description": "Replicas asked for (spec.replicas: you, kubectl scale or an autoscaler)"},
    {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas", "description": "Replicas ready"},
    {"name": "Up-To-Date", "type": "integer", "jsonPath": ".status.updatedReplicas", "priority": 1,
     "description": "Replicas running the current engine"},
    {"name": "Available", "type": "integer", "jsonPath": ".status.availableReplicas", "priority": 1,
     "description": "Replicas ready for at least minReadySeconds"},
    {"name": "Chunk", "type": "integer", "jsonPath": ".spec.engine.maxNumBatchedTokens",
     "description": "--max-num-batched-tokens (chunked-prefill token budget)"},
    {"name": "KV%", "type": "number", "jsonPath": ".spec.engine.gpuMemoryUtilization",
     "description": "--gpu-memory-utilization (empty: vLLM's default)"},
    {"name": "P99-TTFT", "type": "number", "jsonPath": ".status.slo.ttftP99Seconds",
     "description": "p99 time to first token, seconds"},
    {"name": "Burn", "type": "number", "jsonPath": ".status.slo.burnRate.1h",
     "description": "Worst SLO burn rate over 1h"},
    {"name": "Tuning", "type": "string", "jsonPath": ".status.tuning.phase", "description": "Tuner phase"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


# `kubectl scale kvis/NAME` and any HorizontalPodAutoscaler or KEDA target an InferenceService through it.
# status.selector covers the stable engine's pods only: an HPA averages a per-pod metric over the pods the
# selector matches and multiplies by their count to size spec.replicas, which is the stable Deployment's;
# counting the canary's pod would size the stable fleet for one pod too many.
SCALE_SUBRESOURCE: dict[str, str] = {
    "specReplicasPath": ".spec.replicas",
    "statusReplicasPath": ".status.replicas",
    "labelSelectorPath": ".status.selector",
}


def structural(schema: dict[str, Any]) -> dict[str, Any]:
    """Translate a pydantic JSON schema (with $defs) into a structural OpenAPI v3 schema."""
    defs = schema.get("$defs", {})

    def walk(node: dict[str, Any]) -> dict[str, Any]:
        if "$ref" in node:
            target = defs[node["$ref"].rsplit("/", 1)[-1]]
            merged = {**walk(copy.deepcopy(target)), **{k: v for k, v in node.items() if k != "$ref"}}
            return walk_keys(merged)
        return walk_keys(node)

    def walk_keys(node: dict[str, Any]) -> dict[str, Any]:
        node = dict(node)
        nullable = False
        if "anyOf" in node:
            options = [o for o in node.pop("anyOf") if o.get("type") != "null"]
            if len(options) != 1:
                raise ValueError(f"cannot express a union of {len(options)} types structurally: {options}")
            node = {**walk(options[0]), **node}
            nullable = True
        if node.get("default", 0) is None:
            del node["default"]
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key in _DROP or key == "$defs":
                continue
            if key == "properties":
                out["properties"] = {name: walk(sub) for name, sub in value.items()}
            elif key == "items":
                out["items"] = walk(value)
            elif key == "additionalProperties" and isinstance(value, dict):
                out["additionalProperties"] = walk(value)
            elif key == "additionalProperties" and value is False:
                continue  # structural schemas prune unknown fields already
            elif key == "additionalProperties" and value is True:
                # dict[str, Any]: `additionalProperties: true` would give each value the empty
                # schema, and the API server prunes nested objects to {} under it (a stored
                # lastGoodEngine lost engine.twin's fields); preserving unknown fields keeps them.
                continue
            elif key in ("exclusiveMinimum", "exclusiveMaximum") and not isinstance(value, bool):
                bound = "minimum" if key == "exclusiveMinimum" else "maximum"
                out[bound] = value
                out[key] = True
            elif key == "const":
                out["enum"] = [value]
            else:
                out[key] = value
        if "enum" in out and "type" not in out:
            kinds = {type(v) for v in out["enum"]}
            out["type"] = "integer" if kinds == {int} else "string" if kinds == {str} else "number"
        if out.get("type") == "object" and "properties" not in out and "additionalProperties" not in out:
            out["x-kubernetes-preserve-unknown-fields"] = True
        if nullable:
            out["nullable"] = True
        return out

    return walk(schema)


def _object_defaults(node: dict[str, Any]) -> None:
    """Give nested objects a default so the API server fills their fields' defaults too.

    The default is spelled out (every field's own default), not `{}`: kube-apiserver validates a
    default as written, CEL rules included, without defaulting inside it first, so `{}` fails a
    rule like `self.maxNumBatchedTokens >= self.maxNumSeqs` with "no such key" and the whole CRD
    is refused."""
    required = set(node.get("required", ()))
    for key, sub in node.get("properties", {}).items():
        _object_defaults(sub)  # the children's defaults first: a parent's default holds them
        # A required object has no default: one holding only its fields' defaults may lack the
        # required ones, and the API server refuses a CRD whose default fails its own schema.
        if key not in required and sub.get("type") == "object" and "properties" in sub and not sub.get("nullable"):
            filled = {k: copy.deepcopy(v["default"]) for k, v in sub["properties"].items() if "default" in v}
            given = sub.get("default")
            sub["default"] = {**filled, **given} if isinstance(given, dict) else filled


def _attach_rules(spec_schema: dict[str, Any]) -> None:
    for path, cel in _CEL_RULES.items():
        node = spec_schema
        for part in path[1:]:
            node = node["properties"][part]
        node["x-kubernetes-validations"] = cel


def openapi_schema() -> dict[str, Any]:
    spec = structural(InferenceServiceSpec.model_json_schema(by_alias=True, mode="validation"))
    _object_defaults(spec)
    _attach_rules(spec)
    spec["description"] = "Desired state: the model, the engine and its flags, rollout, SLOs and tuning."
    status = structural(InferenceServiceStatus.model_json_schema(by_alias=True, mode="serialization"))
    status["description"] = "Observed state, written by the operator and the tuner."
    conditions = status["properties"]["conditions"]
    conditions["x-kubernetes-list-type"] = "map"
    conditions["x-kubernetes-list-map-keys"] = ["type"]
    return {
        "type": "object",
        "description": "An InferenceService runs a model on vLLM with chunked prefill, rolls out changes "
        "without downtime, and lets kvpilot tune the engine against its SLOs.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
    }


def crd() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": CRD_NAME,
            "labels": {"app.kubernetes.io/name": "kvpilot", "app.kubernetes.io/component": "crd"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": list(SHORT_NAMES),
                "categories": ["all", "kvpilot"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": openapi_schema()},
                    "subresources": {"status": {}, "scale": SCALE_SUBRESOURCE},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                }
            ],
        },
    }


def crd_yaml() -> str:
    header = "# Generated by `kvpilot crd --write` from kvpilot/api/models.py. Do not edit by hand.\n"
    return header + yaml.safe_dump(crd(), sort_keys=False, width=120, allow_unicode=True)
