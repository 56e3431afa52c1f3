"""What the kopf handlers call, kept out of kopf's decorators so each step reads (and tests) plainly.

`reconcile_service` (a created, changed or resumed InferenceService: service.py), `track_rollout`
(each event of a managed Deployment: rollout.py), `track_pod` (each engine pod whose engine failed:
pods.py; both judge by tracking.py), and the canary track's handlers (canary_events.py); `Runtime`
(runtime.py) is what they share in one process.  Locks, retries and status writes: docs/architecture.md, "The reconcile and its
status writes".
"""

from kvpilot.operator.reconcile.canary import CanaryView, with_canary
from kvpilot.operator.reconcile.canary_events import canary_deleted, track_canary, track_canary_pod
from kvpilot.operator.reconcile.common import image_refusal, render_options, usable_last_good
from kvpilot.operator.reconcile.pods import track_pod
from kvpilot.operator.reconcile.rollout import track_rollout
from kvpilot.operator.reconcile.runtime import Emit, EmitOn, HandleAgain, Logger, Runtime
from kvpilot.operator.reconcile.service import reconcile_service
from kvpilot.operator.reconcile.status import (
    STATUS_CONFLICT_ATTEMPTS,
    ComputeStatus,
    isvc_path,
    update_status,
)

__all__ = [
    "STATUS_CONFLICT_ATTEMPTS",
    "CanaryView",
    "ComputeStatus",
    "Emit",
    "EmitOn",
    "HandleAgain",
    "Logger",
    "Runtime",
    "canary_deleted",
    "image_refusal",
    "isvc_path",
    "reconcile_service",
    "render_options",
    "track_canary",
    "track_canary_pod",
    "track_pod",
    "track_rollout",
    "update_status",
    "usable_last_good",
    "with_canary",
]
