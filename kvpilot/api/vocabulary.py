"""The words kvpilot's parts use to talk to each other and to Kubernetes and Prometheus.

The operator writes these labels, annotations and conditions; the tuner, the SLO rules and the
dashboard read them.  Each is written here once, so a writer and its readers cannot drift apart.
"""

from __future__ import annotations

import re
from enum import StrEnum

# The engine fields the tuner owns, camelCase as in spec.engine (and in a trial's params); kvpilot.api.tuned
# declares them with their flags, types and limits.
from kvpilot.api.tuned import TUNED
from kvpilot.api.tuned import TUNED_ENGINE_FIELDS as TUNED_ENGINE_FIELDS

# ---- the resource -------------------------------------------------------------------------------
GROUP = "kvpilot.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceService"
PLURAL = "inferenceservices"
SINGULAR = "inferenceservice"
SHORT_NAMES = ("kvis",)

# ---- labels and annotations ---------------------------------------------------------------------
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "kvpilot"
# On every child, and the Deployment's selector: which InferenceService a pod serves.
LABEL_INFERENCESERVICE = f"{GROUP}/{SINGULAR}"
# NVIDIA GPU feature discovery's node label naming the GPU model (spec.resources.gpuType selects on it).
LABEL_GPU_PRODUCT = "nvidia.com/gpu.product"

# On the pod template: changes exactly when what the pods run changes.
ANNOTATION_CONFIG_HASH = f"{GROUP}/config-hash"
# On the Deployment: the engine spec (wire form) it was rendered from, for lastGoodEngine and rollback.
ANNOTATION_ENGINE = f"{GROUP}/engine"
# On the InferenceService, written by the tuner with the tuned fields: the trial they belong to.
ANNOTATION_TUNING_TRIAL = f"{GROUP}/tuning-trial"

# On canary trials' pods (and the stable ones beside them): which track a pod serves.  The monitor turns it
# into the series label SERIES_LABEL_TRACK, so the tuner reads each track's latency and burn apart.
LABEL_TRACK = f"{GROUP}/track"


class Track(StrEnum):
    """The two tracks of a canary trial: the incumbent's pods and the trial engine's."""

    STABLE = "stable"
    CANARY = "canary"


class TrialStrategy(StrEnum):
    """spec.tuning.trialStrategy: how a live trial is put in front of traffic.  `rolling` rolls the whole
    fleet to the trial engine; `canary` runs it beside the stable track and compares the two paired."""

    ROLLING = "rolling"
    CANARY = "canary"


TRACK_STABLE = Track.STABLE.value
TRACK_CANARY = Track.CANARY.value
# On the InferenceService, written by the tuner to ask for a canary trial and removed to end it:
# compact JSON {"trial": <int>, "engine": {"maxNumBatchedTokens": int, "gpuMemoryUtilization": float,
# "maxNumSeqs": int}} (the tuned fields only; every other engine field comes from spec.engine).
ANNOTATION_CANARY = f"{GROUP}/canary"
# The canary Deployment's name: <InferenceService name> + this suffix.
CANARY_SUFFIX = "-canary"

# The tuner's server-side-apply field manager: a GitOps tool ignores exactly this manager's fields.
FIELD_MANAGER_TUNER = "kvpilot-tuner"
# The tuner's replica planner writes spec.replicas (scale subresource) and the Scaling condition under its
# own name, so the operator's Scaled Event says who scaled: the planner, not a trial.
FIELD_MANAGER_PLANNER = "kvpilot-planner"

# ---- configuration from the environment ---------------------------------------------------------
# The tuner's study storage URL.  A PostgreSQL URL carries a password: the chart puts it here from a
# Secret, never on the command line (where `ps` and /proc/PID/cmdline show it to the whole pod).
ENV_TUNER_STORAGE = "KVPILOT_TUNER_STORAGE"
# The operator's image allowlist: patterns separated by commas (the chart writes --allowed-image flags).
ENV_ALLOWED_IMAGES = "KVPILOT_ALLOWED_IMAGES"
# The operator's validating admission webhook: its HTTPS port (unset: no webhook), and the PEM
# serving certificate and key (the chart writes --webhook-* flags).
ENV_WEBHOOK_PORT = "KVPILOT_WEBHOOK_PORT"
ENV_WEBHOOK_CERT_FILE = "KVPILOT_WEBHOOK_CERT_FILE"
ENV_WEBHOOK_KEY_FILE = "KVPILOT_WEBHOOK_KEY_FILE"
# Where the API server POSTs AdmissionReviews for InferenceServices (the chart's clientConfig path).
WEBHOOK_PATH = "/validate-inferenceservices"

_NOT_LABEL_CHAR = re.compile(r"[^a-zA-Z0-9_]")


def prometheus_label(kubernetes_label: str) -> str:
    """The series label Prometheus makes of a Kubernetes label key, as the Prometheus Operator
    writes it for a monitor's podTargetLabels/targetLabels (its `sanitizeLabelName`) and Kubernetes
    service discovery for `__meta_kubernetes_pod_label_<key>`: every character outside
    [a-zA-Z0-9_] becomes `_` (`kvpilot.dev/inferenceservice` -> `kvpilot_dev_inferenceservice`)."""
    return _NOT_LABEL_CHAR.sub("_", kubernetes_label)


# The pod labels the operator's ServiceMonitor or PodMonitor copies onto every engine series
# (`podTargetLabels`): a scraped series carries no other pod label, so whatever the SLO rules, the
# dashboard and the tuner select on beyond the monitor's own labels (namespace, pod, ...) is here.
SERIES_POD_LABELS: tuple[str, ...] = (LABEL_INFERENCESERVICE, LABEL_TRACK)
# The series label of LABEL_INFERENCESERVICE: `kvpilot_dev_inferenceservice`.
SERIES_LABEL_INFERENCESERVICE = prometheus_label(LABEL_INFERENCESERVICE)
# The series label of LABEL_TRACK: `kvpilot_dev_track` (stable|canary), what per-track queries select on.
SERIES_LABEL_TRACK = prometheus_label(LABEL_TRACK)


class MonitorKind(StrEnum):
    """spec.observability.monitor: which Prometheus Operator object scrapes the engine's /metrics."""

    SERVICE_MONITOR = "ServiceMonitor"
    POD_MONITOR = "PodMonitor"
    NONE = "None"


# ---- status conditions --------------------------------------------------------------------------
class ConditionType(StrEnum):
    READY = "Ready"
    PROGRESSING = "Progressing"
    DEGRADED = "Degraded"
    SLO_BURNING = "SLOBurning"
    TUNING = "Tuning"
    # Only while a canary is asked for (ANNOTATION_CANARY): True once its pod is ready; False with
    # CanaryProgressing, Unschedulable, EngineStartupFailed, CrashLoopBackOff, ProgressDeadlineExceeded or
    # InvalidCanary.
    CANARY = "Canary"
    # Written by the tuner's planner for spec.autoscaling.actor kvpilot: True while it sizes the fleet from
    # live demand (reason: its last decision's, e.g. LoadRising, AtDemand); False while it holds the count
    # (NoDemandData, NoCapacityModel, ScaleFailed).
    SCALING = "Scaling"


class Reason(StrEnum):
    """The CamelCase reasons the operator writes on its conditions."""

    ROLLOUT_COMPLETE = "RolloutComplete"
    ROLLED_BACK = "RolledBack"
    # The rollback's patch failed (the API kept failing); the operator tries it again until it holds.
    ROLLBACK_FAILED = "RollbackFailed"
    INVALID_SPEC = "InvalidSpec"
    APPLY_FAILED = "ApplyFailed"
    PROGRESS_DEADLINE_EXCEEDED = "ProgressDeadlineExceeded"
    AS_EXPECTED = "AsExpected"
    # A pod of the new revision: its engine exited with vLLM's start-up failure text.
    ENGINE_STARTUP_FAILED = "EngineStartupFailed"
    # A pod of the new revision: its engine restarted past the operator's --crash-loop-restarts
    # (the kubelet's own word for a container it is backing off from restarting).
    CRASH_LOOP_BACK_OFF = "CrashLoopBackOff"
    # spec.engine.image matches none of the operator's allowed image patterns: nothing is applied.
    IMAGE_NOT_ALLOWED = "ImageNotAllowed"
    # The canary track (ANNOTATION_CANARY); its engine failures reuse EngineStartupFailed/CrashLoopBackOff.
    CANARY_READY = "CanaryReady"
    CANARY_PROGRESSING = "CanaryProgressing"
    # The annotation is not the JSON the contract says: no canary runs.
    INVALID_CANARY = "InvalidCanary"
    # The canary pod cannot be placed (pod condition PodScheduled False, reason Unschedulable): it
    # needs one replica's resources beyond the stable replicas.
    UNSCHEDULABLE = "Unschedulable"
    # An Event's: spec.replicas changed and the Deployment followed (from, to, and who wrote it).
    SCALED = "Scaled"


class CanaryPhase(StrEnum):
    """status.canary.phase."""

    PROGRESSING = "Progressing"
    READY = "Ready"
    FAILED = "Failed"


class TuningPhase(StrEnum):
    """status.tuning.phase: where the tuner is with a service.  The loop reports these phases, with a
    reason that says why (e.g. Measuring/LoadDrift while it re-measures the incumbent)."""

    IDLE = "Idle"
    WARM_START = "WarmStart"
    APPLYING = "Applying"
    WARMING_UP = "WarmingUp"
    MEASURING = "Measuring"
    PAUSED = "Paused"
    DONE = "Done"
    FAILED = "Failed"


# ---- kvpilot's own metrics ----------------------------------------------------------------------
# Counters are named with their `_total`, as they are exposed and queried.
METRIC_RECONCILES_TOTAL = "kvpilot_reconciles_total"
METRIC_RECONCILE_DURATION = "kvpilot_reconcile_duration_seconds"
METRIC_ROLLBACKS_TOTAL = "kvpilot_rollbacks_total"
METRIC_ENGINE_INFO = "kvpilot_engine_info"
METRIC_ADMISSION_REVIEWS_TOTAL = "kvpilot_admission_reviews_total"
METRIC_OPERATOR_LEADER = "kvpilot_operator_leader"
# kvpilot_engine_info's labels, as the dashboard reads them.
# The tuned fields' labels are their snake_case names (max_num_batched_tokens, ...).
ENGINE_INFO_LABELS: tuple[str, ...] = ("namespace", "name", *(f.attr for f in TUNED), "config_hash")
METRIC_TUNING_TRIALS_TOTAL = "kvpilot_tuning_trials_total"
METRIC_TUNING_BEST_VALUE = "kvpilot_tuning_best_value"
METRIC_TUNING_CURRENT_TRIAL = "kvpilot_tuning_current_trial"
METRIC_TUNING_PAUSED = "kvpilot_tuning_paused"
# The planner's replica count for an InferenceService with spec.autoscaling (a contract: an HPA reads it
# through prometheus-adapter), and its last decision's reason as an enum (1 on the reason in force).
METRIC_DESIRED_REPLICAS = "kvpilot_desired_replicas"
METRIC_AUTOSCALING_DECISION = "kvpilot_autoscaling_decision"
# GPUs one replica of the service holds (its tensor-parallel size): replicas times this is the bill.
METRIC_REPLICA_GPUS = "kvpilot_replica_gpus"
# Trials by strategy (rolling|canary): started; promoted (the trial engine became the stable one); pruned
# (a fast burn cut it short); rolled back (its engine taken out of service unpromoted after a failure).
METRIC_TUNING_TRIALS_STARTED_TOTAL = "kvpilot_tuning_trials_started_total"
METRIC_TUNING_PROMOTIONS_TOTAL = "kvpilot_tuning_promotions_total"
METRIC_TUNING_PRUNED_TOTAL = "kvpilot_tuning_pruned_total"
METRIC_TUNING_ROLLBACKS_TOTAL = "kvpilot_tuning_rollbacks_total"
METRIC_TWIN_STEPS_TOTAL = "kvpilot_twin_engine_steps_total"
METRIC_TWIN_SIMULATED_SECONDS_TOTAL = "kvpilot_twin_simulated_seconds_total"
METRIC_TWIN_BEHIND_SECONDS_TOTAL = "kvpilot_twin_behind_seconds_total"
METRIC_TWIN_ABORTED_REQUESTS_TOTAL = "kvpilot_twin_aborted_requests_total"
