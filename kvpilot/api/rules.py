"""Cross-field rules of the InferenceService spec.

Plain functions over already-typed models: each returns the issues it finds as
(location, message, offending value), the location relative to the model checked and
spelled as on the wire.  The models' after-validators raise them all at once, so a user
sees every problem in one pass, each under its own field path.

The checks are ordered cheapest-first and allocate nothing when all is well: they run on
every validation (the operator, the webhook, `kvpilot validate`), so they must cost next to nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import ValidationError
from pydantic.alias_generators import to_snake
from pydantic_core import InitErrorDetails, PydanticCustomError

from kvpilot.api import engine as engine_codec
from kvpilot.api import tracing, tuned, vllm

if TYPE_CHECKING:
    from kvpilot.api.models import (
        AutoscalingSpec,
        BudgetGate,
        EngineSpec,
        InferenceServiceSpec,
        RolloutSpec,
        SLOSpec,
        TracingSpec,
        TuningSpace,
        TuningSpec,
    )

Issue = tuple[tuple[str | int, ...], str, Any]

_TTFT_EDGES = frozenset(vllm.TTFT_BUCKETS)
_ITL_EDGES = frozenset(vllm.ITL_BUCKETS)
_TTFT_EDGES_TEXT = ", ".join(f"{e:g}" for e in vllm.TTFT_BUCKETS)
_ITL_EDGES_TEXT = ", ".join(f"{e:g}" for e in vllm.ITL_BUCKETS)


def raise_issues(title: str, issues: list[Issue]) -> None:
    if not issues:
        return
    raise ValidationError.from_exception_data(
        title,
        [
            InitErrorDetails(
                type=PydanticCustomError("kvpilot_rule", "{rule}", {"rule": message}),
                loc=loc,
                input=value,
            )
            for loc, message, value in issues
        ],
    )


# spec.tuning.storage is gone from the resource (v1alpha1 promises no compatibility, and a field
# that silently stopped working would leave a user looking for their study in the wrong database).
# The CRD's rule says the same (crd.py).
STORAGE_REMOVED = (
    "where studies are stored is the tuner's own configuration, not the resource's: the Helm value "
    "tuner.storage, or `kvpilot tuner --storage` / $KVPILOT_TUNER_STORAGE; delete spec.tuning.storage"
)

_NONE: list[Issue] = []  # shared, never mutated: the common case allocates nothing


def engine_issues(engine: EngineSpec) -> list[Issue]:
    # extraArgs are read as vLLM reads them (prefixes, `_` for `-`, ...); the answer is cached per list.
    extra = engine_codec.extra_args_problems(tuple(engine.extra_args)) if engine.extra_args else ()
    if (
        engine.max_num_batched_tokens >= engine.max_num_seqs
        and (engine.gpu_memory_utilization is None or engine.kv_cache_memory_bytes is None)
        and not extra
    ):
        return _NONE
    issues: list[Issue] = []
    if engine.max_num_batched_tokens < engine.max_num_seqs:
        issues.append(
            (
                ("maxNumBatchedTokens",),
                f"must be at least maxNumSeqs ({engine.max_num_seqs}); vLLM refuses to start otherwise "
                f"(got {engine.max_num_batched_tokens})",
                engine.max_num_batched_tokens,
            )
        )
    if engine.gpu_memory_utilization is not None and engine.kv_cache_memory_bytes is not None:
        issues.append(
            (
                ("kvCacheMemoryBytes",),
                "set either gpuMemoryUtilization or kvCacheMemoryBytes, not both "
                "(vLLM ignores gpuMemoryUtilization when kvCacheMemoryBytes is given)",
                engine.kv_cache_memory_bytes,
            )
        )
    issues += [(("extraArgs", i), message, engine.extra_args[i]) for i, message in extra]
    return issues


def slo_issues(slo: SLOSpec) -> list[Issue]:
    if slo.ttft_seconds in _TTFT_EDGES and slo.itl_seconds in _ITL_EDGES:
        return _NONE
    issues: list[Issue] = []
    if slo.ttft_seconds not in _TTFT_EDGES:
        issues.append(
            (
                ("ttftSeconds",),
                f"must be a bucket edge of vllm:time_to_first_token_seconds (a latency SLO read from buckets is "
                f"exact only there); allowed: {_TTFT_EDGES_TEXT}",
                slo.ttft_seconds,
            )
        )
    if slo.itl_seconds not in _ITL_EDGES:
        issues.append(
            (
                ("itlSeconds",),
                f"must be a bucket edge of vllm:inter_token_latency_seconds; allowed: {_ITL_EDGES_TEXT}",
                slo.itl_seconds,
            )
        )
    return issues


def _range_ok(declared: tuned.TunedField, bounds: list[Any]) -> bool:
    low, high = bounds
    return low < high and declared.legal(low) and declared.legal(high)


def tuning_issues(tuning: TuningSpec) -> list[Issue]:
    space = tuning.space
    if (
        all(_range_ok(f, getattr(space, f.attr)) for f in tuned.TUNED)
        and space.max_num_batched_tokens[1] >= space.max_num_seqs[0]
        and tuning.warmup_seconds < tuning.trial_seconds
        and tuning.storage is None
        and tuning.budget_gate is None
    ):
        return _NONE
    # Checked here, not in the gate's own validator, so they are reported with the rest of tuning's.
    issues: list[Issue] = [(("budgetGate", *loc), message, value) for loc, message, value in
                           budget_gate_issues(tuning.budget_gate)] if tuning.budget_gate is not None else []
    if tuning.storage is not None:
        issues.append((("storage",), f"removed: {STORAGE_REMOVED}", tuning.storage))
    for f in tuned.TUNED:
        bounds = getattr(space, f.attr)
        low, high = bounds
        if not low < high:
            issues.append((("space", f.name), f"min must be less than max (got [{low}, {high}])", bounds))
        elif not (f.legal(low) and f.legal(high)):
            issues.append((("space", f.name), f"must lie inside {f.limits_text} (got [{low}, {high}])", bounds))
    if space.max_num_batched_tokens[1] < space.max_num_seqs[0]:
        issues.append(
            (
                ("space", "maxNumBatchedTokens"),
                f"max ({space.max_num_batched_tokens[1]}) is below the smallest maxNumSeqs "
                f"({space.max_num_seqs[0]}): no point of the space satisfies maxNumBatchedTokens >= maxNumSeqs",
                space.max_num_batched_tokens,
            )
        )
    if tuning.warmup_seconds >= tuning.trial_seconds:
        issues.append(
            (
                ("warmupSeconds",),
                f"must be shorter than trialSeconds ({tuning.trial_seconds}) so a trial measures anything",
                tuning.warmup_seconds,
            )
        )
    return issues


WINDOW_EMPTY = "a window's end must differ from its start (an empty window never opens)"


def budget_gate_issues(gate: BudgetGate) -> list[Issue]:
    issues: list[Issue] = _NONE
    empty = [i for i, w in enumerate(gate.windows) if w.start == w.end]
    if empty:
        issues = [(("windows",), f"{WINDOW_EMPTY}: windows {empty}", [gate.windows[i].start for i in empty])]
    # zoneinfo reads the system's tz database, or the tzdata package where there is none (the image).
    try:
        zone(gate.time_zone)
    except ValueError as exc:
        issues = [*issues, (("timeZone",), str(exc), gate.time_zone)]
    return issues


def zone(name: str) -> Any:
    """The ZoneInfo of an IANA name; ValueError saying what is allowed."""
    from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

    if name != name.strip() or name.startswith(("/", ".")) or ".." in name:
        raise ValueError("must be an IANA time zone name such as UTC or Europe/Berlin")
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        raise ValueError(
            f"unknown time zone {name!r}: must be an IANA time zone name such as UTC, Europe/Berlin or America/New_York"
        ) from None


def rollout_issues(rollout: RolloutSpec) -> list[Issue]:
    # On the rollout itself, not the spec, so it is reported even when another part of the spec
    # fails (a spec-level check runs only once every part has validated), as the API server does.
    if rollout.progress_deadline_seconds > rollout.startup_timeout_seconds:
        return _NONE
    return [
        (
            ("progressDeadlineSeconds",),
            f"must be longer than startupTimeoutSeconds ({rollout.startup_timeout_seconds}), or every "
            "slow model load would count as a failed rollout and be rolled back",
            rollout.progress_deadline_seconds,
        )
    ]


def autoscaling_issues(autoscaling: AutoscalingSpec) -> list[Issue]:
    # Named at maxReplicas, as a HorizontalPodAutoscaler's validation names it.
    if autoscaling.max_replicas >= autoscaling.min_replicas:
        return _NONE
    return [
        (
            ("maxReplicas",),
            f"must be at least minReplicas ({autoscaling.min_replicas}); got {autoscaling.max_replicas}",
            autoscaling.max_replicas,
        )
    ]


def replicas_outside_bounds(spec: InferenceServiceSpec) -> str | None:
    """A warning, not an error, for spec.replicas outside [minReplicas, maxReplicas]: HPA users set the
    count and the bounds apart (`kubectl scale`, a GitOps manifest), and the autoscaler moves it inside
    at its next decision. Refused, a scale write racing a lowered maxReplicas would fail, and every later
    write of the object with it."""
    bounds = spec.autoscaling
    if bounds is None or bounds.min_replicas <= spec.replicas <= bounds.max_replicas:
        return None
    outside = (f"{spec.replicas} is outside autoscaling [minReplicas {bounds.min_replicas}, maxReplicas "
               f"{bounds.max_replicas}]")
    if bounds.actor == "external":
        return f"{outside}; the external autoscaler moves it inside at its next decision, as a HorizontalPodAutoscaler does"
    # The planner in the tuner clamps its decision to the bounds (kvpilot.fleet.planner); with no demand
    # data it holds the count where it is, so "next decision", not "at once".
    return f"{outside}; kvpilot's planner (actor: kvpilot) moves it inside at its next decision"


def _engine_inside_space(spec: InferenceServiceSpec) -> bool:
    engine, space = spec.engine, spec.tuning.space
    for f in tuned.TUNED:
        value = engine.in_force(f)
        low, high = getattr(space, f.attr)
        if value is None or not low <= value <= high:
            return False
    return True


def tracing_issues(t: TracingSpec) -> list[Issue]:
    modules = t.collect_detailed_traces
    http_ok = t.otlp_traces_protocol != "http/protobuf" or tracing.has_http_path(t.otlp_traces_endpoint)
    if http_ok and len(set(modules)) == len(modules):
        return _NONE
    issues: list[Issue] = []
    if not http_ok:
        issues.append((("otlpTracesEndpoint",), tracing.HTTP_PATH_RULE, t.otlp_traces_endpoint))
    if len(set(modules)) != len(modules):
        issues.append((("collectDetailedTraces",), "each of model, worker, all at most once", list(modules)))
    return issues


def spec_issues(spec: InferenceServiceSpec) -> list[Issue]:
    rollout = spec.rollout
    engine = spec.engine
    if (
        (spec.replicas != 1 or rollout.max_surge != 0 or rollout.allow_downtime)
        and (engine.kind != "vllm" or spec.resources.gpus >= engine.tensor_parallel_size)
        and (not spec.tuning.enabled or _engine_inside_space(spec))
        and (spec.tuning.trial_strategy != "canary" or spec.replicas >= 2)
        and (spec.autoscaling is None or spec.autoscaling.min_replicas >= 2)
    ):
        return _NONE
    issues: list[Issue] = _autoscaling_floor_issues(spec)
    if spec.replicas == 1 and rollout.max_surge == 0 and not rollout.allow_downtime:
        issues.append(
            (
                ("rollout", "maxSurge"),
                "with replicas 1, maxSurge 0 takes the service down on every rollout; use maxSurge >= 1 "
                "(one spare GPU during rollouts), more replicas, or set rollout.allowDowntime: true",
                rollout.max_surge,
            )
        )
    if engine.kind == "vllm" and spec.resources.gpus < engine.tensor_parallel_size:
        issues.append(
            (
                ("resources", "gpus"),
                f"must be at least engine.tensorParallelSize ({engine.tensor_parallel_size}); got {spec.resources.gpus}",
                spec.resources.gpus,
            )
        )
    tuning = spec.tuning
    if tuning.trial_strategy == "canary" and spec.replicas < 2:
        issues.append(
            (
                ("tuning", "trialStrategy"),
                f"canary needs replicas >= 2 (a one-pod canary beside one stable pod would take half the "
                f"requests); got replicas {spec.replicas}: use rolling, or leave it unset",
                tuning.trial_strategy,
            )
        )
    if tuning.enabled:
        issues += _engine_space_issues(engine, tuning.space)
    return issues


def _autoscaling_floor_issues(spec: InferenceServiceSpec) -> list[Issue]:
    """A minReplicas that lets the autoscaler reach a count the rules above refuse: its scale write would
    be refused by the API server (the scale subresource validates the whole object), so the autoscaler
    would be stuck above it, failing every try."""
    bounds = spec.autoscaling
    if bounds is None or bounds.min_replicas >= 2:
        return []
    issues: list[Issue] = []
    rollout = spec.rollout
    if rollout.max_surge == 0 and not rollout.allow_downtime:
        issues.append(
            (
                ("autoscaling", "minReplicas"),
                f"must be at least 2 with rollout.maxSurge 0: at 1 replica every rollout takes the service down, "
                f"so a scale to 1 is refused; use minReplicas >= 2, maxSurge >= 1 or rollout.allowDowntime: true "
                f"(got {bounds.min_replicas})",
                bounds.min_replicas,
            )
        )
    if spec.tuning.trial_strategy == "canary":
        issues.append(
            (
                ("autoscaling", "minReplicas"),
                f"must be at least 2 with tuning.trialStrategy canary (a canary needs replicas >= 2, so a scale "
                f"below 2 is refused); use minReplicas >= 2, or leave trialStrategy unset (got {bounds.min_replicas})",
                bounds.min_replicas,
            )
        )
    return issues


def _engine_space_issues(engine: EngineSpec, space: TuningSpace) -> list[Issue]:
    """Each tuned field of the engine outside its range (the tuner starts from the current value), or
    overridden by a field the tuner does not adjust.  Fields left to vLLM last: their messages say more."""
    issues: list[Issue] = []
    for f in (*tuned.ALWAYS_SET, *tuned.MAY_BE_UNSET):
        value = engine.in_force(f)
        if value is None and f.overridden_by is not None:
            issues.append(
                (
                    ("engine", f.overridden_by),
                    f"the tuner adjusts {f.name}, which {f.overridden_by} overrides; "
                    f"unset {f.overridden_by} or disable tuning",
                    getattr(engine, to_snake(f.overridden_by)),
                )
            )
            continue
        low, high = getattr(space, f.attr)
        if value is not None and not low <= value <= high:
            unset = " (vLLM's default, as the field is unset)" if getattr(engine, f.attr) is None else ""
            issues.append(
                (
                    ("engine", f.name),
                    f"{value} is outside tuning.space.{f.name} [{low}, {high}]{unset}; "
                    "the tuner starts from the current value",
                    value,
                )
            )
    return issues
