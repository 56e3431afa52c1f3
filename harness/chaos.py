"""A chaos run: faults on a seeded schedule against harness/chaos_bed.py, the invariants checked after each.

Each fault first changes `steady`'s chunk size (a rollout starts), waits a random moment (so the fault
lands at a random point of that rollout and of whatever trial the tuner is in), then injects one of
KINDS and, once what it broke is back, checks:

- converged: each InferenceService's Deployment runs its spec's engine, the rollout is complete with
  every replica ready and only pods of that engine left, and status (observedGeneration, Ready,
  replica counts) matches the children, within CONVERGE_S (polled); the time this takes is reported;
- never zero ready: no Deployment write, replayed in order from a watch kept through the restarts,
  shows zero ready replicas once it had some (a node removal that took every ready pod is excused);
- each engine applied once, none lost: no Deployment generation rewrites the engine already in force,
  and every engine a trial was measured on was rolled out;
- no trial lost or measured twice: each trial cut by a fault is measured again (source `resume`), no
  trial that was told is measured again, no trial is started or told twice (its Events);
- no traceback in any operator or tuner log.
"""

from __future__ import annotations

import random
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.chaos_bed import (
    DEPLOYMENTS,
    EVENTS,
    ISVCS,
    PODS,
    SERVICES,
    TUNED,
    ChaosBed,
    engine_of_spec,
    engine_of_template,
)
from harness.history import History

KINDS = ("etcd-restart", "apiserver-restart", "operator-kill", "tuner-kill", "prometheus-down", "api-errors",
         "node-removed")
STEADY_TOKENS = (1024, 2048, 3072, 4096, 8192)
CONVERGE_S = 240.0
HISTORY_CATCH_UP_S = 60.0
SETTLE_FIRST_S = 60.0  # the bed's first convergence takes seconds; past this, kwok is started again once


@dataclass(frozen=True)
class Fault:
    number: int
    kind: str
    tokens: int  # steady's new chunk size, the rollout in flight
    delay_s: float  # from that change to the fault
    seconds: float = 0.0  # how long an outage or a burst lasts
    fraction: float = 0.0  # a burst's share of refused requests

    def describe(self) -> str:
        extra = {"prometheus-down": f" for {self.seconds:.1f} s",
                 "api-errors": f" for {self.seconds:.1f} s, {self.fraction:.0%} of requests"}.get(self.kind, "")
        return f"#{self.number} {self.kind}{extra}, {self.delay_s:.1f} s into a rollout to {self.tokens} tokens"


def schedule(faults: int, seed: int, kinds: tuple[str, ...] = KINDS) -> list[Fault]:
    """`faults` faults from `seed`: the kinds in shuffled rounds (each kind once per round), so a short
    schedule still mixes them; the moments, durations and rollouts drawn from the same generator."""
    rng = random.Random(seed)
    plan: list[Fault] = []
    tokens = 2048
    while len(plan) < faults:
        round_ = list(kinds)
        rng.shuffle(round_)
        for kind in round_[:faults - len(plan)]:
            tokens = rng.choice([t for t in STEADY_TOKENS if t != tokens])
            delay = rng.uniform(0.0, 4.0)  # a rollout of 2 pods, each Ready 1-4 s after binding
            seconds = rng.uniform(5.0, 20.0) if kind == "prometheus-down" else rng.uniform(2.0, 8.0)
            fraction = rng.uniform(0.5, 1.0) if kind == "api-errors" else 0.0
            plan.append(Fault(len(plan) + 1, kind, tokens, delay, seconds, fraction))
    return plan


@dataclass
class Violation:
    at_s: float  # since the run began
    fault: str
    what: str


@dataclass
class Report:
    seed: int
    faults: list[Fault] = field(default_factory=list)
    injected: int = 0  # faults injected: all of `faults` unless the run was interrupted
    interrupted: bool = False
    converge_s: list[float] = field(default_factory=list)
    violations: list[Violation] = field(default_factory=list)
    excused: list[str] = field(default_factory=list)
    proxy: dict[str, Any] = field(default_factory=dict)
    trials: Counter[str] = field(default_factory=Counter)
    watch_reconnects: int = 0
    wall_s: float = 0.0


class DeploymentLedger:
    """Deployment writes, replayed in the API server's order: zero ready replicas once there were some
    (unless excused: a node went with every ready pod), and a generation that applies the engine already
    in force (the operator writing the same engine twice). Pure: fed the watched events."""

    def __init__(self, services: tuple[str, ...] = SERVICES) -> None:
        self._ready: dict[str, int] = {}  # deployment -> readyReplicas last seen
        self._applied: dict[str, tuple[int, tuple[Any, ...]]] = {}  # deployment -> (generation, engine)
        self.engines_applied: dict[str, set[tuple[float, ...]]] = {s: set() for s in services}
        # deployment -> (why its zero ready is not a rollout's doing, the resourceVersion it holds from)
        self.excused: dict[str, tuple[str, int]] = {}

    def excuse(self, deployment: str, why: str, after_version: int = 0) -> None:
        """Excuse the next zero-ready write of `deployment` after resourceVersion `after_version` (the
        Deployment as it was when the fault struck: writes up to it came before, and their ready
        replicas must not spend the excuse, since the watch delivers them later)."""
        self.excused[deployment] = (why, after_version)

    def feed(self, events: list[tuple[str, dict[str, Any]]]) -> tuple[list[str], list[str]]:
        """(violations, excused zero-ready windows) in `events`, (type, Deployment) in write order."""
        problems: list[str] = []
        excused: list[str] = []
        for type_, dep in events:
            name = dep["metadata"]["name"]
            if type_ == "DELETED":
                continue
            template = dep["spec"]["template"]
            engine = (template["spec"]["containers"][0].get("image"), *engine_of_template(template))
            generation = int(dep["metadata"]["generation"])
            self.engines_applied.setdefault(name, set()).add(engine_of_template(template))
            last = self._applied.get(name)
            if last is not None and generation > last[0] and engine == last[1]:
                problems.append(f"Deployment {name} generation {generation} applied again the engine already in "
                                f"force at generation {last[0]}: {engine}")
            if last is None or generation > last[0]:
                self._applied[name] = (generation, engine)
            ready = int((dep.get("status") or {}).get("readyReplicas") or 0)
            had = self._ready.get(name, 0)
            version = int(dep["metadata"].get("resourceVersion") or 0)
            excuse = self.excused.get(name)
            if excuse is not None and version <= excuse[1]:
                excuse = None  # a write from before the fault
            if ready == 0 and had > 0 and int(dep["spec"].get("replicas", 1)) > 0:
                if excuse is not None:
                    excused.append(f"Deployment {name} at zero ready replicas after {excuse[0]}")
                else:
                    problems.append(f"Deployment {name} at zero ready replicas (resourceVersion "
                                    f"{dep['metadata'].get('resourceVersion')}, generation {generation}, had {had})")
            if ready > 0 and excuse is not None:
                self.excused.pop(name, None)
            self._ready[name] = ready
        return problems, excused


class Invariants:
    """The checks on a live bed; each returns what broke since its last call."""

    def __init__(self, bed: ChaosBed) -> None:
        self.bed = bed
        self.deployments = History(bed.cp, DEPLOYMENTS)
        self.ledger = DeploymentLedger()
        self._seen = 0
        self._log_offsets: dict[str, int] = {}

    def stop(self) -> None:
        self.deployments.stop()

    def check_history(self) -> tuple[list[str], list[str]]:
        """(violations, excused) from the Deployment writes since the last call, once the watch has
        caught up with them (so that the trial check after it sees every engine rolled out)."""
        try:
            self.deployments.wait_caught_up(HISTORY_CATCH_UP_S)
        except TimeoutError as exc:
            return [str(exc)], []
        events = self.deployments.events[self._seen:]
        self._seen += len(events)
        problems, excused = self.ledger.feed([(type_, obj) for _, type_, obj in events])
        problems += [f"the Deployment watch lost history at {at:.0f}: {message}"
                     for at, message in self.deployments.gaps]
        self.deployments.gaps.clear()
        return problems, excused

    def converged(self) -> list[str]:
        """What still differs from each service's spec; [] when all have converged."""
        cp = self.bed.cp
        problems: list[str] = []
        pods = cp.get(PODS)["items"]
        for name in SERVICES:
            obj = cp.get(f"{ISVCS}/{name}")
            dep = cp.get(f"{DEPLOYMENTS}/{name}")
            st, ds = obj.get("status") or {}, dep.get("status") or {}
            want = engine_of_spec(obj["spec"]["engine"])
            replicas = int(obj["spec"].get("replicas", 1))
            generation = obj["metadata"]["generation"]
            if st.get("observedGeneration") != generation:
                problems.append(f"{name}: status.observedGeneration {st.get('observedGeneration')} != {generation}")
            ready = {c["type"]: c for c in st.get("conditions") or []}.get("Ready", {})
            if ready.get("status") != "True":
                problems.append(f"{name}: Ready {ready.get('status')} ({ready.get('reason')}: {ready.get('message')})")
            have = engine_of_template(dep["spec"]["template"])
            if have != want:
                problems.append(f"{name}: the Deployment runs {have}, the spec says {want}")
            rollout = (ds.get("observedGeneration"), ds.get("replicas"), ds.get("updatedReplicas"),
                       ds.get("readyReplicas"))
            if rollout != (dep["metadata"]["generation"], replicas, replicas, replicas):
                problems.append(f"{name}: rollout not complete (observedGeneration, replicas, updated, ready) = "
                                f"{rollout}, generation {dep['metadata']['generation']}, replicas {replicas}")
            mine = [p for p in pods if p["metadata"].get("labels", {}).get("app.kubernetes.io/instance") == name
                    and not p["metadata"].get("deletionTimestamp")]
            stale = [p["metadata"]["name"] for p in mine if engine_of_template(p) != want]
            if len(mine) != replicas or stale:
                problems.append(f"{name}: {len(mine)} pods for {replicas} replicas, not of the spec's engine: {stale}")
            counts = tuple(st.get(k) for k in ("replicas", "readyReplicas", "updatedReplicas"))
            children = tuple(ds.get(k) for k in ("replicas", "readyReplicas", "updatedReplicas"))
            if counts != children:
                problems.append(f"{name}: status (replicas, ready, updated) {counts} != the Deployment's {children}")
        return problems

    def tracebacks(self) -> list[str]:
        found: list[str] = []
        for name, text in self.bed.logs().items():
            start = self._log_offsets.get(name, 0)
            new = text[start:]
            self._log_offsets[name] = len(text)
            at = new.find("Traceback")
            if at >= 0:
                found.append(f"a traceback in {name}'s log: {new[at:at + 600]!r}")
        return found

    def trials(self) -> tuple[list[str], Counter[str]]:
        """No trial lost or measured twice, from the tuner's study and its Events; and the study's states."""
        import optuna

        tuning = (self.bed.cp.get(f"{ISVCS}/{TUNED}").get("status") or {}).get("tuning") or {}
        if not tuning.get("study"):
            return [], Counter()
        trials = optuna.load_study(study_name=tuning["study"], storage=self.bed.storage).trials
        events = [e for e in self.bed.cp.get(EVENTS)["items"] if e["involvedObject"].get("name") == TUNED]
        return (check_trials(trials, events, self.ledger.engines_applied[TUNED]),
                Counter(t.state.name for t in trials))


def check_trials(trials: list[Any], events: list[dict[str, Any]], applied: set[tuple[float, ...]]) -> list[str]:
    """What a study (its FrozenTrials, in order) and the tuner's Events show lost or measured twice:
    a cut (FAIL) trial with later trials but its config never measured again; a `resume` trial whose
    config's last trial was told, not cut; a told trial on an engine never rolled out (`applied`);
    a trial number started or told in more than one Event."""
    from optuna.trial import TrialState

    def config(t: Any) -> Any:
        # The engine a trial applied, as rendered: a cut trial is queued again by that engine, whose
        # fraction (0.81) may differ from the sampler's float (0.8099999999999999) for the same flag.
        engine = t.user_attrs.get("engine")
        return engine_of_spec(engine) if engine is not None else t.params

    problems: list[str] = []
    for i, t in enumerate(trials):
        # A WAITING trial is queued, not started: its params are empty until it is asked for.
        later = [u for u in trials[i + 1:] if u.state is not TrialState.WAITING]
        # A trial just asked for may hold neither params nor engine yet: it may be the re-measurement.
        pending = any(not config(u) for u in later)
        if t.state is TrialState.FAIL and later and not pending and not any(config(u) == config(t) for u in later):
            problems.append(f"trial {t.number} was cut ({t.params}) and never measured again")
        if t.user_attrs.get("source") == "resume":
            before = [u for u in trials[:i] if config(u) == config(t)]
            if before and before[-1].state is not TrialState.FAIL:
                problems.append(f"trial {t.number} measured again trial {before[-1].number}'s config, "
                                f"which was {before[-1].state.name}, not cut")
        engine = t.user_attrs.get("engine")
        if t.state is TrialState.COMPLETE and engine is not None and engine_of_spec(engine) not in applied:
            problems.append(f"trial {t.number} was measured on {engine_of_spec(engine)}, an engine never rolled out")
    started: Counter[int] = Counter()
    told: Counter[int] = Counter()
    for e in events:
        if not e.get("reason", "").startswith("Trial"):
            continue
        number = int(e["message"].split()[1].rstrip(":"))
        (started if e["reason"] == "TrialStarted" else told)[number] += int(e.get("count") or 1)
    problems += [f"trial {n} started {c} times (Events)" for n, c in sorted(started.items()) if c > 1]
    problems += [f"trial {n} told {c} times (Events)" for n, c in sorted(told.items()) if c > 1]
    return problems


def inject(bed: ChaosBed, fault: Fault, invariants: Invariants, rng: random.Random,
           wait: Callable[[float], object]) -> str:
    """Inject `fault`; return once what it broke is back (what was done, for the report)."""
    if fault.kind == "etcd-restart":
        bed.restart_etcd()
    elif fault.kind == "apiserver-restart":
        bed.restart_apiserver()
    elif fault.kind == "operator-kill":
        bed.kill_operator()
    elif fault.kind == "tuner-kill":
        bed.kill_tuner()
    elif fault.kind == "prometheus-down":
        bed.prometheus.down()
        wait(fault.seconds)  # the outage's length, by design
        bed.prometheus.up()
    elif fault.kind == "api-errors":
        bed.proxy.burst(fault.seconds, fault.fraction)
        wait(fault.seconds)  # the burst's length, by design
    elif fault.kind == "node-removed":
        versions = {d["metadata"]["name"]: int(d["metadata"]["resourceVersion"])
                    for d in bed.cp.get(DEPLOYMENTS)["items"]}
        node, taken, left = bed.remove_node(rng.choice)
        for deployment, pods in taken.items():
            # Counted from the pods, not the Deployment's status, which lags the deletions.
            if deployment and not left.get(deployment):
                invariants.ledger.excuse(deployment, f"node {node} went with all its ready pods {pods}",
                                         versions.get(deployment, 0))
        return f"removed node {node} (ready pods on it: {taken}; ready elsewhere: {left})"
    else:
        raise ValueError(f"unknown fault kind {fault.kind!r}; known: {', '.join(KINDS)}")
    return ""


def run(faults: int, seed: int, workdir: Path, *, converge_s: float = CONVERGE_S,
        kinds: tuple[str, ...] = KINDS, progress: Callable[[str], None] = lambda _: None) -> Report:
    report = Report(seed=seed, faults=schedule(faults, seed, kinds))
    rng = random.Random(seed + 1)
    began = time.monotonic()
    with ChaosBed(workdir, seed) as bed:
        invariants = Invariants(bed)
        try:
            try:
                wait_converged(invariants, SETTLE_FIRST_S, "the bed to settle")
            except TimeoutError:
                # Before any fault: kwok 0.7.0 once never played a pod's delayed Ready stage (CI, no error
                # logged), as it drops a stage after a restart; started again it plays every pod's afresh.
                bed.resync_kwok()
                wait_converged(invariants, converge_s, "the bed to settle (kwok started again)")
            try:
                for fault in report.faults:
                    _one(bed, fault, invariants, rng, report, began, converge_s, progress)
            except (KeyboardInterrupt, SystemExit):
                # Stopped (Ctrl-C, SIGTERM at a deadline): what ran so far is still reported.
                report.interrupted = True
            if not report.interrupted:
                bed.tuner.stop()
                problems, report.trials = invariants.trials()
                report.violations += [Violation(time.monotonic() - began, "end", p) for p in problems]
        finally:
            report.proxy = bed.proxy.stats()
            report.watch_reconnects = invariants.deployments.reconnects
            invariants.stop()
    report.wall_s = time.monotonic() - began
    return report


def _one(bed: ChaosBed, fault: Fault, invariants: Invariants, rng: random.Random, report: Report,
         began: float, converge_s: float, progress: Callable[[str], None]) -> None:
    import threading

    pause = threading.Event().wait
    bed.set_steady_tokens(fault.tokens)
    pause(fault.delay_s)  # the random point of the rollout the fault lands at
    detail = inject(bed, fault, invariants, rng, pause)
    report.injected += 1
    recovered = time.monotonic()
    bed.cp.check_alive()  # a control-plane process that died is the bed's failure, not kvpilot's
    found: list[str] = []
    try:
        wait_converged(invariants, converge_s, fault.describe())
        report.converge_s.append(time.monotonic() - recovered)
    except TimeoutError as exc:
        found.append(str(exc))
    problems, excused = invariants.check_history()
    found += problems
    report.excused += [f"{fault.describe()}: {e}" for e in excused]
    found += invariants.tracebacks()
    trial_problems, report.trials = invariants.trials()
    found += trial_problems
    if bed.tuner.exited() is not None:
        found.append(f"the tuner exited {bed.tuner.exited()}")
        bed.tuner.start()
    now = time.monotonic() - began
    report.violations += [Violation(now, fault.describe(), what) for what in found]
    conv = f"{report.converge_s[-1]:.1f} s" if not found and report.converge_s else "-"
    progress(f"[{now:7.1f} s] {fault.describe()}{': ' + detail if detail else ''}: converged in {conv}, "
             f"{len(found)} violations" + "".join(f"\n    {w}" for w in found))


def wait_converged(invariants: Invariants, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    last: list[str] = ["never checked"]
    while time.monotonic() < deadline:
        try:
            last = invariants.converged()
        except Exception as exc:  # noqa: BLE001 - the API server may still be coming back
            last = [f"{type(exc).__name__}: {exc}"]
        if not last:
            return
        time.sleep(0.5)
    raise TimeoutError(f"not converged {timeout:.0f} s after {what}: " + "; ".join(last))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def render(report: Report) -> str:
    kinds = Counter(f.kind for f in report.faults[:report.injected])
    lines = [f"chaos run, seed {report.seed}: {len(report.faults)} faults scheduled on a real control plane "
             f"(etcd, kube-apiserver, controllers, kwok) with the real operator and tuner, in {report.wall_s:.0f} s",
             f"faults injected: {report.injected} (" + ", ".join(f"{k} {kinds[k]}" for k in KINDS if kinds[k]) + ")"
             + (f"; interrupted after {report.injected} of {len(report.faults)}" if report.interrupted else ""),
             f"API requests through the proxy: {report.proxy.get('forwarded', 0)} forwarded, refused on purpose: "
             + (", ".join(f"{c}: {n}" for c, n in report.proxy.get("injected", {}).items()) or "none"),
             "trials in the study: " + (", ".join(f"{s} {n}" for s, n in sorted(report.trials.items())) or "none"),
             f"history watch reconnects: {report.watch_reconnects}"]
    if report.converge_s:
        c = report.converge_s
        lines.append(f"time to converge after a fault: p50 {statistics.median(c):.1f} s, p99 {percentile(c, 99):.1f} s, "
                     f"max {max(c):.1f} s (n={len(c)})")
    else:
        lines.append("time to converge after a fault: none converged")
    lines.append(f"zero-ready windows excused (a node removed with every ready pod of a Deployment): "
                 f"{len(report.excused)}")
    lines += [f"  {e}" for e in report.excused]
    lines.append(f"invariant violations: {len(report.violations)}")
    lines += [f"  [{v.at_s:.1f} s] after {v.fault}: {v.what}" for v in report.violations]
    return "\n".join(lines)
