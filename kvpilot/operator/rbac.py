"""The RBAC the operator needs, exactly: the Helm chart renders its (Cluster)Roles from these lists,
and tests compare them with every call a real operator run makes against KMock.

What kopf itself reads depends on how the operator is scoped (`rules_for`):
- `--namespace NS` with exact names: only RULES, all namespaced (kopf's scanning is off, see
  handlers.configure_kopf), so per-namespace Roles are enough;
- `--all-namespaces`: RULES plus CRD_WATCH (kopf watches CRDs to notice resources being installed);
- `--namespace` with glob patterns: also NAMESPACE_WATCH (kopf lists and watches Namespaces to
  match the patterns against).

With `--leader-elect`, LEADER_ELECTION too, in the namespace of the Lease only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvpilot.operator.settings import is_exact_namespace


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
    # Status: read-modify-write reads the object itself, and patches the status subresource.
    Rule(("kvpilot.dev",), ("inferenceservices/status",), ("patch",)),
    # Children: create-or-patch; Deployments are watched to map rollout progress back to the parent.
    # delete: the canary Deployment (<name>-canary) once its trial ends.
    Rule(("apps",), ("deployments",), ("get", "list", "watch", "create", "patch", "delete")),
    Rule(("",), ("services",), ("get", "create", "patch")),
    # The engine pods are watched (kopf lists and watches them) to roll a revision back as soon as
    # its engine fails to start; the dead container's log is read when its termination message
    # names no root cause (vLLM's "See root cause above").
    Rule(("",), ("pods",), ("list", "watch")),
    Rule(("",), ("pods/log",), ("get",)),
    # A PDB is deleted again when replicas drop to 1.
    Rule(("policy",), ("poddisruptionbudgets",), ("get", "create", "patch", "delete")),
    Rule(("monitoring.coreos.com",), ("prometheusrules",), ("get", "create", "patch")),
    # Monitors: spec.observability.monitor picks one kind; the other kind's monitor, if ours, is deleted.
    Rule(("monitoring.coreos.com",), ("servicemonitors", "podmonitors"), ("get", "create", "patch", "delete")),
    # Events on InferenceServices (kopf.event posts core/v1 Events).
    Rule(("",), ("events",), ("create",)),
    Rule(("events.k8s.io",), ("events",), ("create",)),
)

# Cluster-wide, kopf lists and watches CRDs to notice the InferenceService (or Prometheus Operator)
# CRDs being (re)installed while it runs.
CRD_WATCH: tuple[Rule, ...] = (
    Rule(("apiextensions.k8s.io",), ("customresourcedefinitions",), ("list", "watch")),
)

# Leader election (--leader-elect), in the Lease's namespace only (the operator's own): read the Lease,
# create it the first time, renew and take it over with resourceVersion-checked merge patches.
LEADER_ELECTION: tuple[Rule, ...] = (
    Rule(("coordination.k8s.io",), ("leases",), ("get", "create", "patch")),
)

# With glob patterns in --namespace, kopf lists and watches Namespaces to find the matching ones.
NAMESPACE_WATCH: tuple[Rule, ...] = (
    Rule(("",), ("namespaces",), ("list", "watch")),
)


def rules_for(*, all_namespaces: bool, namespaces: Sequence[str] = ()) -> tuple[Rule, ...]:
    """The rules an operator run with these flags needs (see the module docstring)."""
    if all_namespaces:
        return RULES + CRD_WATCH
    if all(is_exact_namespace(ns) for ns in namespaces):
        return RULES
    return RULES + CRD_WATCH + NAMESPACE_WATCH


def cluster_role_rules(*, all_namespaces: bool = True, namespaces: Sequence[str] = ()) -> list[dict[str, list[str]]]:
    return [rule.as_manifest() for rule in rules_for(all_namespaces=all_namespaces, namespaces=namespaces)]


def allows(api_group: str, resource: str, verb: str, rules: Iterable[Rule] | None = None) -> bool:
    """Whether `rules` (default: an --all-namespaces run's) grant the verb on the resource."""
    rules = rules_for(all_namespaces=True) if rules is None else rules
    return any(api_group in r.api_groups and resource in r.resources and verb in r.verbs for r in rules)
