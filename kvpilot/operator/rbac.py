"""The RBAC the operator needs, exactly: the Helm chart renders its ClusterRole from this list,
and an integration test compares it with every call the operator makes against KMock."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Rule:
    api_groups: tuple[str, ...]
    resources: tuple[str, ...]
    verbs: tuple[str, ...]

    def as_manifest(self) -> dict[str, list[str]]:
        return {"apiGroups": list(self.api_groups), "resources": list(self.resources), "verbs": list(self.verbs)}


RULES: tuple[Rule, ...] = (
    # The custom resource: watched by kopf; kopf keeps its progress in annotations (patch).
    Rule(("kvpilot.dev",), ("inferenceservices",), ("get", "list", "watch", "patch")),
    Rule(("kvpilot.dev",), ("inferenceservices/status",), ("get", "patch")),
    # Children: create-or-patch; Deployments are watched to map rollout progress back to the parent.
    Rule(("apps",), ("deployments",), ("get", "list", "watch", "create", "patch")),
    Rule(("",), ("services",), ("get", "create", "patch")),
    # A PDB is deleted again when replicas drop to 1.
    Rule(("policy",), ("poddisruptionbudgets",), ("get", "create", "patch", "delete")),
    Rule(("monitoring.coreos.com",), ("servicemonitors", "prometheusrules"), ("get", "create", "patch")),
    # Events on InferenceServices (kopf.event posts core/v1 Events).
    Rule(("",), ("events",), ("create",)),
    Rule(("events.k8s.io",), ("events",), ("create",)),
    # kopf notices CRDs being (re)installed while it runs.
    Rule(("apiextensions.k8s.io",), ("customresourcedefinitions",), ("get", "list", "watch")),
)


# Not required: with --namespace, kopf lists and watches namespaces (cluster-scoped) to follow
# glob patterns, and falls back to the exact names it was given when that is forbidden (403).
OPTIONAL_RULES: tuple[Rule, ...] = (
    Rule(("",), ("namespaces",), ("list", "watch")),
)


def cluster_role_rules() -> list[dict[str, list[str]]]:
    return [rule.as_manifest() for rule in RULES]


def allows(api_group: str, resource: str, verb: str) -> bool:
    return any(api_group in r.api_groups and resource in r.resources and verb in r.verbs for r in RULES)
