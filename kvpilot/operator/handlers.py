"""kopf handlers, kept thin: each turns kopf's arguments into a call into `reconcile`.

Handlers are registered on a registry built per operator run (no module-level state), so the
settings and the shared runtime reach them as closures.
"""

from __future__ import annotations

import logging
from typing import Any, cast

import kopf

from kvpilot.api.vocabulary import ANNOTATION_CANARY, GROUP, PLURAL, VERSION
from kvpilot.operator.builders.canary import is_canary
from kvpilot.operator.builders.common import LABEL_ISVC, LABEL_MANAGED_BY, MANAGED_BY
from kvpilot.operator.reconcile import (
    Runtime,
    canary_deleted,
    reconcile_service,
    track_canary,
    track_canary_pod,
    track_pod,
    track_rollout,
)

Logger = logging.Logger | logging.LoggerAdapter[Any]

# kopf keeps its bookkeeping annotations under our group.
ANNOTATION_PREFIX = GROUP
# The engine pods of every InferenceService (a label selector, as the API server reads it).
ENGINE_POD_SELECTOR = f"{LABEL_MANAGED_BY}={MANAGED_BY},{LABEL_ISVC}"


# The annotations under kopf's storage prefix (ours, the group) that kopf must still see change: kopf
# leaves every annotation under that prefix out of the essence it diffs (its progress storage clears
# them, its diff-base storage drops them), so a change of the tuner's kvpilot.dev/canary alone would
# run no update handler.  The two storages below put these back; with them, a change of the annotation
# (alone, or with spec in one patch) runs `reconcile`, which reads it itself (level-triggered).
OBSERVED_ANNOTATIONS: tuple[str, ...] = (ANNOTATION_CANARY,)


def _put_back(essence: Any, source: Any) -> Any:
    """`essence` with the OBSERVED_ANNOTATIONS that `source` (an object or an essence) carries."""
    annotations = ((source or {}).get("metadata") or {}).get("annotations") or {}
    kept = {key: annotations[key] for key in OBSERVED_ANNOTATIONS if key in annotations}
    if kept:
        essence.setdefault("metadata", {}).setdefault("annotations", {}).update(kept)
    return essence


class ProgressStorage(kopf.AnnotationsProgressStorage):
    """kopf's annotation progress storage, but leaving OBSERVED_ANNOTATIONS in the essence."""

    def clear(self, *, essence: Any) -> Any:
        return _put_back(super().clear(essence=essence), essence)


class DiffBaseStorage(kopf.AnnotationsDiffBaseStorage):
    """kopf's annotation diff-base storage, but keeping OBSERVED_ANNOTATIONS in the essence."""

    def build(self, *, body: Any, extra_fields: Any = None) -> Any:
        return _put_back(super().build(body=body, extra_fields=extra_fields), body)


def configure_kopf(settings: kopf.OperatorSettings, max_workers: int | None = None, *,
                   exact_namespaces: bool = False) -> None:
    # Keep kopf's bookkeeping in annotations: a structural CRD schema would prune status.kopf,
    # and status belongs to what users and the tuner read.
    settings.persistence.progress_storage = ProgressStorage(prefix=ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = DiffBaseStorage(prefix=ANNOTATION_PREFIX, key="last-handled-configuration")
    # Only the Events we post ourselves (create, change, skip, rollback), not every handler log line.
    settings.posting.loggers = False
    settings.posting.level = logging.INFO
    settings.queueing.worker_limit = max_workers
    # A worker holds its slot until idle this long; kopf's 5 s would cap a burst at workers/5 per second.
    settings.queueing.idle_timeout = 0.5
    # Watch only the engine pods kvpilot made (server-side: a namespace's other pods never reach the
    # operator); the pod handler's own label filter is the same, for an API that ignores selectors.
    settings.watching.label_selectors["v1", "pods"] = ENGINE_POD_SELECTOR
    # Standalone: no peering objects to watch or write.
    settings.peering.standalone = True
    # Watching namespaces by exact name there is nothing to discover: kopf then neither lists and
    # watches Namespaces (to match patterns) nor watches CRDs (to notice new resources), so the
    # operator needs no cluster-scoped read at all (rbac.rules_for).  Left on, kopf would read
    # both and, where a namespaced Role forbids them, retry the 403s for about a minute first.
    settings.scanning.disabled = exact_namespaces


class CredentialsError(Exception):
    """No usable Kubernetes credentials: retrying does not help."""


def credentials(**kwargs: Any) -> kopf.ConnectionInfo:
    """kopf's own pure-Python logins (not via the kubernetes client): in-cluster first, then kubeconfig."""
    kwargs.setdefault("settings", kopf.OperatorSettings())
    try:
        info = kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CredentialsError(f"cannot read Kubernetes credentials: {exc}") from None
    if info is None:
        raise CredentialsError("no Kubernetes credentials: no in-cluster service account and no kubeconfig "
                               "(set KUBECONFIG, or run in a pod with a service account)")
    return info


def emit_on(obj: dict[str, Any], type_: str, reason: str, message: str) -> None:
    """An Event on `obj` (kopf posts it)."""
    kopf.event(kopf.Body(cast(kopf.RawBody, obj)), type=type_, reason=reason, message=message)


def build_registry(rt: Runtime) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()
    _register_lifecycle(registry, rt)
    _register_reconcile(registry, rt)
    _register_children(registry, rt)
    return registry


def _register_lifecycle(registry: kopf.OperatorRegistry, rt: Runtime) -> None:
    """Start-up settings, the login, and the shutdown."""

    @kopf.on.startup(registry=registry, id="configure")
    def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        configure_kopf(settings, rt.settings.max_workers, exact_namespaces=rt.settings.exact_namespaces)

    # Async so that it runs in the event loop that owns the client's session (kopf runs sync
    # handlers in threads); reading a kubeconfig is quick.
    @kopf.on.login(registry=registry, id="login")
    async def login(**kwargs: Any) -> kopf.ConnectionInfo:
        try:
            info = credentials(**kwargs)
        except CredentialsError as exc:
            raise kopf.PermanentError(str(exc)) from None
        rt.client.set_credentials(info)
        return info

    @kopf.on.cleanup(registry=registry, id="cleanup")
    async def cleanup(**_: Any) -> None:
        await rt.close()
        await rt.client.close()


def _register_reconcile(registry: kopf.OperatorRegistry, rt: Runtime) -> None:
    """The InferenceService: reconciled when created, changed or resumed; forgotten when deleted."""
    retry_delay = rt.settings.handler_retry_delay_seconds

    @kopf.on.resume(GROUP, VERSION, PLURAL, registry=registry, id="reconcile", backoff=retry_delay)
    @kopf.on.create(GROUP, VERSION, PLURAL, registry=registry, id="reconcile", backoff=retry_delay)
    @kopf.on.update(GROUP, VERSION, PLURAL, registry=registry, id="reconcile", backoff=retry_delay)
    async def reconcile(body: kopf.Body, logger: Logger, **_: Any) -> None:
        def emit(type_: str, reason: str, message: str) -> None:
            kopf.event(body, type=type_, reason=reason, message=message)

        # The status is written inside (not through kopf's patch after the handler): see the reconcile
        # package.  A transient failure raises kopf.TemporaryError with its delay (Runtime.retry_later).
        await reconcile_service(rt, dict(body), emit, logger)

    # No finalizer (a delete handler would add one): the children go with the garbage collector,
    # and all that is left to do is to stop exporting the object's engine and drop its lock.
    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry, id="forget-deleted")
    async def service_event(body: kopf.Body, type: str, **_: Any) -> None:
        if type == "DELETED" and body.metadata.namespace and body.metadata.name:
            rt.forget(body.metadata.namespace, body.metadata.name)


def _register_children(registry: kopf.OperatorRegistry, rt: Runtime) -> None:
    """The managed Deployments (stable and canary) and the engine pods."""

    @kopf.on.event("apps", "v1", "deployments", registry=registry, id="track-rollout",
                   labels={LABEL_MANAGED_BY: MANAGED_BY})
    async def deployment_event(body: kopf.Body, type: str, logger: Logger, **_: Any) -> None:
        if is_canary(dict(body)):
            # The canary track: its own status (status.canary), never the stable rollout's.
            if type == "DELETED":
                await canary_deleted(rt, dict(body), emit_on, logger)
            else:
                await track_canary(rt, dict(body), logger)
            return
        if type == "DELETED":
            parent = (body.metadata.labels or {}).get(LABEL_ISVC)
            if parent and body.metadata.namespace:
                rt.forget(body.metadata.namespace, parent)  # no engine runs any more
            return
        await track_rollout(rt, dict(body), emit_on, logger)

    # The engine pods: a new revision whose vLLM cannot start (or crash-loops) is rolled back at
    # once, not at the Deployment's progress deadline.  kopf filters by label in the operator (its
    # watch is of every pod in the namespace); `track_pod` calls the API only for a failed engine.
    @kopf.on.event("", "v1", "pods", registry=registry, id="track-engine-pods",
                   labels={LABEL_MANAGED_BY: MANAGED_BY, LABEL_ISVC: kopf.PRESENT})
    async def pod_event(body: kopf.Body, type: str, logger: Logger, **_: Any) -> None:
        if type == "DELETED":
            return
        if is_canary(dict(body)):
            # A canary pod's failure is the trial's: it says so in status.canary, never rolls back.
            await track_canary_pod(rt, dict(body), emit_on, logger)
            return
        await track_pod(rt, dict(body), emit_on, logger)
