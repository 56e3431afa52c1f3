"""Whether a pod's engine failed to start, read from the pod's status as the kubelet writes it.

Pure: the handlers pass in a pod and the operator's crash-loop threshold; `engine_failure` says
whether the engine container failed, why, and in whose words.  Two ways a new revision's engine is
known to be bad long before the Deployment's progress deadline (an hour by default):

- EngineStartupFailed: the container terminated with vLLM's start-up failure text (the engine
  container's terminationMessagePolicy is FallbackToLogsOnError, so the kubelet keeps the tail of
  its log as `terminated.message`): one termination is enough, vLLM refuses the same config the
  same way every time.
- CrashLoopBackOff: the container restarted `crash_loop_restarts` times or more, whatever it said.

The kubelet shows the instance that died as `state.terminated` until it restarts the container,
then as `lastState.terminated` (while the new one waits in CrashLoopBackOff or runs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpilot.api.startup import StartupFailure, cause_line, startup_failure
from kvpilot.api.vocabulary import ANNOTATION_CONFIG_HASH, Reason
from kvpilot.operator.builders.deployment import CONTAINER_NAME

REASON_STARTUP_FAILED = Reason.ENGINE_STARTUP_FAILED.value
REASON_CRASH_LOOP = Reason.CRASH_LOOP_BACK_OFF.value


@dataclass(frozen=True, slots=True)
class EngineFailure:
    reason: str  # EngineStartupFailed | CrashLoopBackOff
    pod: str
    config_hash: str | None  # the pod template's, from the pod's annotation
    restarts: int
    exit_code: int | None
    cause: str  # the engine's own line saying why ("" when the container said nothing)
    # The message named no root cause but said it was further up the log: the dead instance's log
    # (`previous` says which instance: kubectl logs --previous) may hold it.
    cause_above: bool = False
    previous: bool = False

    def describe(self, container: str = CONTAINER_NAME) -> str:
        """One sentence: which pod, how it failed, and the engine's own words."""
        exit_ = f"exit code {self.exit_code}" if self.exit_code is not None else "no exit code"
        if self.reason == REASON_CRASH_LOOP:
            how = f"container {container} restarted {self.restarts} times ({REASON_CRASH_LOOP}), last {exit_}"
        else:
            how = f"container {container} could not start ({exit_})"
        return f"pod {self.pod}: {how}: {self.cause}" if self.cause else f"pod {self.pod}: {how}"

    def with_log(self, log: str) -> EngineFailure:
        """This failure with its cause read from the dead instance's log instead, where that holds
        vLLM's start-up failure with a root cause (then it is an EngineStartupFailed)."""
        found = startup_failure(log)
        if found is None or found.cause_above:
            return self
        return EngineFailure(REASON_STARTUP_FAILED, self.pod, self.config_hash, self.restarts, self.exit_code, found.cause,
                             cause_above=False, previous=self.previous)


def _container_status(pod: dict[str, Any], name: str) -> dict[str, Any] | None:
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        if cs.get("name") == name:
            return dict(cs)
    return None


def pod_config_hash(pod: dict[str, Any]) -> str | None:
    value = ((pod.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_CONFIG_HASH)
    return str(value) if value is not None else None


def engine_failure(pod: dict[str, Any], *, crash_loop_restarts: int,
                   container: str = CONTAINER_NAME) -> EngineFailure | None:
    """The engine container's failure this pod shows, or None while it has shown none."""
    cs = _container_status(pod, container)
    if cs is None:
        return None
    restarts = int(cs.get("restartCount") or 0)
    now_terminated = (cs.get("state") or {}).get("terminated")
    terminated = now_terminated or (cs.get("lastState") or {}).get("terminated")
    name = str((pod.get("metadata") or {}).get("name", ""))
    if terminated is None:
        return None  # never died (a restart count alone, without a dead instance, is not read)
    exit_code = terminated.get("exitCode")
    exit_code = int(exit_code) if exit_code is not None else None
    message = str(terminated.get("message") or "")
    previous = not now_terminated
    found: StartupFailure | None = startup_failure(message) if exit_code != 0 else None
    if found is not None:
        return EngineFailure(REASON_STARTUP_FAILED, name, pod_config_hash(pod), restarts, exit_code, found.cause,
                             cause_above=found.cause_above, previous=previous)
    if restarts >= crash_loop_restarts:
        cause = cause_line(message) if message.strip() else str(terminated.get("reason") or "")
        return EngineFailure(REASON_CRASH_LOOP, name, pod_config_hash(pod), restarts, exit_code, cause,
                             cause_above=not message.strip(), previous=previous)
    return None
