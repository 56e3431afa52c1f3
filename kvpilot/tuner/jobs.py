# Over 500 lines: the tuner's jobs (offline, local, in-cluster) share study opening, the trials table and the report.
"""What `kvpilot tune` runs: the offline job on the twin, and the live job against a local engine."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import re
import shlex
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from optuna.trial import FrozenTrial, TrialState

from kvpilot.api.tuned import TUNED
from kvpilot.api.vocabulary import TrialStrategy
from kvpilot.tuner.core.objective import SLO, Goal, Measurement, Outcome, infeasible, score
from kvpilot.tuner.core.space import EngineParams, SearchSpace
from kvpilot.tuner.core.study import (
    ATTR_ENGINE,
    ATTR_MESSAGE,
    ATTR_RAISED_FROM,
    ATTR_REASON,
    ATTR_SOURCE,
    TunerStudy,
    study_name,
    worker_id,
)
from kvpilot.tuner.identity import StudyMismatch, digest, identity
from kvpilot.tuner.iofailure import IO_EXIT_CODES
from kvpilot.tuner.storage import redacted

log = logging.getLogger(__name__)


class UsageError(ValueError):
    """Bad command-line input: printed as one line, exit code 2."""


def parse_range(text: str, flag: str, kind: type) -> tuple[Any, Any]:
    lo, sep, hi = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return kind(lo), kind(hi)
    except ValueError:
        raise UsageError(f"{flag}: expected MIN:MAX, got {text!r}") from None


def space_from_args(args: argparse.Namespace) -> SearchSpace:
    kw: dict[str, Any] = {}
    for f in TUNED:
        text = getattr(args, f.short)
        if text:
            kw[f.attr] = parse_range(text, f"--{f.short}", f.type)
    try:
        return SearchSpace(**kw)
    except ValueError as exc:
        raise UsageError(str(exc).replace("spec.tuning.space.", "space ")) from None


def engine_yaml(params: EngineParams, comment: str, assumed: dict[str, Any] | None = None) -> str:
    """The engine block as it sits in an InferenceService (`spec:` then `engine:`), ready to paste or
    merge: the tuned fields, then what the study assumed (e.g. maxModelLen, tensorParallelSize),
    which the recommendation holds only together with."""
    engine = {**params.as_spec(), **(assumed or {})}
    body = yaml.safe_dump({"spec": {"engine": engine}}, sort_keys=False)
    return f"# {comment}\n{body}"


def trials_table(st: TunerStudy, limit: int = 12) -> str:
    """Best trials first: number, params, value, p99s, reason, and where the config came from."""
    rows = []
    maximize = st.goal.direction == "maximize"
    for t in st.trials():
        if t.value is None:
            continue
        p = st.engine_of(t)
        m = st.measurement_of(t)
        rows.append((t, p, m))
    feasible = {t.number for t in st.feasible()}
    rows.sort(key=lambda r: (r[0].number not in feasible, -(r[0].value or 0) if maximize else (r[0].value or 0)))
    head = (f"{'#':>3} {'tokens':>7} {'util':>5} {'seqs':>5} {'value':>9} {'p99 TTFT':>9} {'p99 ITL':>8}  "
            f"{'reason':<16} source")
    lines = [head, "-" * len(head)]
    for t, p, m in rows[:limit]:
        ttft = f"{m.ttft_p99:.3f}" if m else "-"
        itl = f"{m.itl_p99:.4f}" if m else "-"
        lines.append(
            f"{t.number:>3} {p.max_num_batched_tokens:>7} {p.gpu_memory_utilization:>5.2f} {p.max_num_seqs:>5} "
            f"{t.value:>9.3f} {ttft:>9} {itl:>8}  {t.user_attrs.get('reason', ''):<16} {_source(t)}"
        )
    if len(rows) > limit:
        lines.append(f"... {len(rows) - limit} more in the study")
    return "\n".join(lines)


def _source(t: FrozenTrial) -> str:
    """sampler | polish | vllmDefaults | current | warmStart | resume, and a fraction the memory floor raised."""
    source = str(t.user_attrs.get(ATTR_SOURCE, ""))
    raised = t.user_attrs.get(ATTR_RAISED_FROM)
    return f"{source} (util raised from {raised:.2f})" if raised is not None else source


def sqlite_url(storage: str) -> str:
    """The storage URL, checked (a clear error for a path, an unknown scheme or a missing driver);
    the directory of a SQLite file is made (Optuna does not)."""
    from kvpilot.tuner.storage import StorageError, check_storage_url

    try:
        return check_storage_url(storage)
    except StorageError as exc:
        raise UsageError(str(exc)) from None


def is_sqlite(url: str) -> bool:
    from sqlalchemy.engine import make_url

    return make_url(url).get_backend_name() == "sqlite"


def study_storage(url: str, args: argparse.Namespace) -> Any:
    """What a study opens: a database server's URL as an RDB storage whose trials carry a heartbeat
    (so that joined workers tell a dead worker's trial from a live one), SQLite's one whose writes
    wait for the file's lock (forked workers take turns on it: `sqlite_storage`).  Each process makes
    its own (a storage holds a connection pool, which a fork must not share)."""
    if is_sqlite(url):
        from kvpilot.tuner.storage import sqlite_storage

        return sqlite_storage(url)
    import time

    from sqlalchemy.exc import IntegrityError, ProgrammingError

    from kvpilot.tuner.core.study import heartbeat_storage

    # The pods of a Job start together on an empty database, and each creates Optuna's tables:
    # PostgreSQL refuses all but one CREATE TYPE/TABLE (a unique violation); the others, retried,
    # find the tables made.
    for attempt in range(6):
        try:
            return heartbeat_storage(url, args.heartbeat_interval, args.grace_period)
        except (IntegrityError, ProgrammingError):
            if attempt == 5:
                raise
            time.sleep(0.2 * (attempt + 1))
    raise AssertionError("unreachable")


def open_study(*, storage: Any, name: str, inputs: dict[str, Any], **kw: Any) -> TunerStudy:
    """Open (or resume) a study, refusing one that was made for other inputs (kvpilot.tuner.identity)."""
    import optuna

    from kvpilot.tuner.identity import bind

    try:
        existing = optuna.load_study(study_name=name, storage=storage)
    except KeyError:
        existing = None
    try:
        if existing is not None:
            bind(existing, inputs)  # checked before TunerStudy touches the study
        st = TunerStudy(storage=storage, name=name, **kw)
        bind(st.study, inputs)
    except StudyMismatch as exc:
        raise UsageError(str(exc)) from None
    return st


def report_path(flag: str | None, study: str) -> Path | None:
    """--report: None (the default) is out/<study>.html, so runs of other studies keep their reports."""
    from kvpilot.tuner.report import check_report_path

    if flag == "":
        return None
    path = Path(flag) if flag is not None else Path("out") / f"{study}.html"
    try:
        return check_report_path(path)
    except ValueError as exc:
        raise UsageError(f"--report: {exc}") from None


def no_answer(st: TunerStudy) -> str:
    """Why no config was recommended: the start-up failure when every trial failed to start (its
    message says what to change, e.g. --tensor-parallel-size), else the SLO was out of reach."""
    done = [t for t in st.trials() if t.value is not None]
    failed = [t for t in done if t.user_attrs.get(ATTR_REASON) == "StartupFailed"]
    if done and len(failed) == len(done):
        message = str(failed[0].user_attrs.get(ATTR_MESSAGE) or "").strip()
        return (f"no config could start on the twin ({len(failed)} of {len(done)} trials failed at start-up): "
                f"{message}")
    note = f" ({len(failed)} of {len(done)} trials failed at start-up)" if failed else ""
    return f"no config met the SLO on the twin{note}: relax the SLO, or try a larger GPU"


def twin_target(args: argparse.Namespace) -> Any:
    """The twin the flags describe (--model, --gpu or --device-profile, --max-model-len, -tp).  A device
    profile that cannot be used is a UsageError naming the file and the field."""
    from kvpilot.tuner.adapters.offline import TwinTarget
    from kvpilot.twin.profiles import DeviceProfile, DeviceProfileError

    profile = None
    if getattr(args, "device_profile", None):
        try:
            profile = DeviceProfile.load(args.device_profile)
        except DeviceProfileError as exc:
            raise UsageError(f"--device-profile {args.device_profile}: {exc}") from None
    return TwinTarget(model=args.model, gpu=args.gpu, max_model_len=args.max_model_len,
                      tensor_parallel_size=args.tensor_parallel_size, device_profile=profile)


def _target_label(target: Any) -> str:
    """Model and device as a study's name shows them, by what they resolve to (a Hugging Face id as its
    preset, `H100` as H100-80GB): a local model directory by its own name, a measured device by its
    profile's name (not the --gpu default it stands in for)."""
    model = Path(target.model).name if Path(target.model).exists() else target.model_spec().name
    if target.device_profile is None:
        return f"{model}.{target.gpu_spec().name}"
    return f"{model}.{'-'.join(re.findall(r'[A-Za-z0-9.]+', target.device_profile.device.name))}"


def _workload_label(workload: Any, goal: Goal) -> str:
    """The workload as a study's name shows it: a trace by its file name; a spec without the rate that
    the capacity search does not use."""
    if workload.arrival == "trace":
        return Path(workload.trace_path).name
    base, _, keys = workload.name.partition(":")
    kept = [k for k in keys.split(",") if k and not (goal is Goal.CAPACITY and k.startswith("rate="))]
    return base + (":" + ",".join(kept) if kept else "")


def _question(target: Any, workload: Any, goal: Goal) -> dict[str, Any]:
    """Model, GPU and workload as a study's inputs: what the names resolve to, so that another spelling
    of the same question finds the same study and only a different question makes another.  A trace
    is its resolved path and its content's digest."""
    shown = dataclasses.replace(workload, name=_workload_label(workload, goal),
                                rate=None if goal is Goal.CAPACITY else workload.rate)
    trace = None
    if workload.arrival == "trace":
        path = Path(workload.trace_path).resolve()
        shown = dataclasses.replace(shown, trace_path=str(path))
        trace = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    return {"model": target.model_spec(),
            "gpu": target.gpu_spec() if target.device_profile is None else None,
            "workload": shown, "traceSha256": trace}


def _device_input(target: Any) -> dict[str, Any] | None:
    """A measured device is part of a study's inputs (another profile is another study)."""
    return target.device_profile.as_dict() if target.device_profile is not None else None


# --- offline ----------------------------------------------------------------------------


def shares(remaining: int, workers: int) -> list[int]:
    """The trials each worker runs: the remaining budget split as evenly as it goes."""
    return [remaining // workers + (1 if i < remaining % workers else 0) for i in range(workers)]


def run_workers(st: TunerStudy, evaluate: Callable[[EngineParams], Outcome], args: argparse.Namespace,
                bar: Any, ctrl_c: Any = None) -> None:
    """Run the rest of the budget in `args.workers` forked processes on the same storage.

    This process opened the study (recovering a killed run and queueing vLLM's defaults) before
    any worker starts, so the workers open it without recovering: a RUNNING trial is a sibling's.
    The trials a kill cut off are shared out among them, each measured first by one worker.  Each
    runs a fixed share, so together they run the budget and no more.  A worker dies with this
    process (`die_with_parent`): one left running would go on measuring the trials a rerun measures."""
    import multiprocessing
    import time

    from kvpilot.tuner.core.search import run_joined, run_offline
    from kvpilot.tuner.iofailure import IOFailure, storage_failure
    from kvpilot.tuner.orphans import die_with_parent

    parent = os.getpid()

    def work(share: int, cut: list[int]) -> None:
        die_with_parent(parent)
        # Ctrl-C reaches the whole process group: the parent decides, and stops the workers itself.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            measure(share, cut)
        except Exception as exc:  # a full disk, say: one line and its exit status, which the parent reads
            failure = storage_failure(exc, url, redacted(url))
            if failure is None:
                raise
            print(f"kvpilot tune: {multiprocessing.current_process().name}: {failure}", file=sys.stderr)
            sys.exit(failure.exit_code)

    def measure(share: int, cut: list[int]) -> None:
        mine = TunerStudy(storage=study_storage(url, args), name=st.name, goal=st.goal, space=st.space,
                          slo=st.slo, seed=args.seed, n_trials=args.trials, workers=args.workers,
                          recover=False, joined=args.join)
        mine.take_over(cut)
        if args.join:  # the budget is the study's, shared with the other processes' workers
            run_joined(mine, evaluate, args.trials, wait=_poll_wait(args))
        else:
            run_offline(mine, evaluate, args.trials, limit=share)

    url = sqlite_url(args.storage)
    # Joined, every worker runs until the study's budget is finished; else each a fixed share.
    remaining = args.workers if args.join else max(0, args.trials - st.finished_count())
    sizes = [n for n in shares(remaining, args.workers) if n]
    cut = st.hand_out()  # round the workers that run: each measures its cut trials first, in its share
    given = [cut[i::len(sizes)] for i in range(len(sizes))] if sizes else []
    ctx = multiprocessing.get_context("fork")  # the evaluator is a closure: forked, not pickled
    procs = [ctx.Process(target=work, args=(max(n, len(mine)), mine), name=f"kvpilot-tune-worker-{i}")
             for i, (n, mine) in enumerate(zip(sizes, given, strict=True))]
    for p in procs:
        p.start()
    try:
        while any(p.is_alive() for p in procs):
            bar.update(min(st.finished_count(), args.trials) - bar.n)
            if ctrl_c is not None and ctrl_c.asked:
                raise _Stopped  # the workers are stopped below; the trials they cut are measured again on resume
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join()
    bar.update(min(st.finished_count(), args.trials) - bar.n)
    failed = [p.name for p in procs if p.exitcode != 0]
    named = sorted({p.exitcode for p in procs if p.exitcode in IO_EXIT_CODES})
    if named:  # each worker said what stopped it
        raise IOFailure(f"{len(failed)} of {len(procs)} workers stopped ({', '.join(failed)}); see above", named[0])
    if failed:
        raise UsageError(f"{len(failed)} of {len(procs)} workers failed ({', '.join(failed)}); rerun to resume")


def _poll_wait(args: argparse.Namespace) -> Callable[[], None]:
    """How a joined worker waits while siblings hold every place left in the budget: a heartbeat
    interval at most, so that a dead sibling's trial is taken over soon after its grace period."""
    import time

    pause = min(1.0, float(args.heartbeat_interval))
    return lambda: time.sleep(pause)


def _twin_accuracy(target: Any, evaluator: Any, st: TunerStudy, params: EngineParams, value: float) -> list[str]:
    """The twin's measured error on this GPU and whether the recommendation stays the best of the
    top finished configs when every step is that much slower or faster; printed and reported.
    Nothing for a measured device profile (its own calibration, not the GPU's)."""
    if target.device_profile is not None:
        return []
    from kvpilot.tuner.adapters.robustness import best_finished, rerank_within_error

    lines = rerank_within_error(evaluator, best_finished(st.trials(), 3)).lines(params, value, "req/s")
    for line in lines:
        print(line, file=sys.stderr)
    return lines


def _offline_inputs(args: argparse.Namespace) -> tuple[SLO, Any, Any, EngineParams]:
    """The flags checked: the SLO, the workload, the twin (`TwinTarget`) and vLLM's defaults on it,
    which `vllm serve` would start; a UsageError for anything else."""
    from kvpilot.tuner.adapters.offline import parse_workload
    from kvpilot.twin.memory import EngineStartupError

    slo = SLO.parse(args.slo)
    try:
        workload = parse_workload(args.workload)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if not 10.0 <= args.probe_seconds <= 3600.0:
        raise UsageError(f"--probe-seconds: must be between 10 and 3600, got {args.probe_seconds:g}")
    if args.tensor_parallel_size < 1:
        raise UsageError(f"--tensor-parallel-size: must be >= 1, got {args.tensor_parallel_size}")
    target = twin_target(args)
    try:
        defaults = target.vllm_defaults()
        target.engine_config(defaults).validate()  # what `vllm serve` refuses before loading
    except ValueError as exc:  # unknown model or GPU: the twin's message names what it knows
        raise UsageError(str(exc)) from None
    except EngineStartupError as exc:  # e.g. heads not divisible by --tensor-parallel-size
        raise UsageError(str(exc)) from None
    return slo, workload, target, defaults


# What the gpus goal's value is (the answer, the report).
GPUS_UNIT = ("GPUs: the replicas' GPUs the load needs within the SLO, from each config's capacity at the workload's "
             "mix, at the planner's target utilization (80%), times the tensor-parallel size, before rounding up "
             "to whole replicas")


def _offline_objective(args: argparse.Namespace, goal: Goal, slo: SLO,
                       evaluator: Any) -> Callable[[EngineParams], Outcome]:
    """A trial's outcome on the twin: the capacity search, the GPUs it needs for --rate, or the SLO
    ratio at --rate."""
    from kvpilot.tuner.adapters.offline import StartupFailed
    from kvpilot.twin.memory import EngineStartupError

    def evaluate(params: EngineParams) -> Outcome:
        if goal is Goal.CAPACITY:
            return evaluator.evaluate(params)
        if goal is Goal.GPUS:
            return evaluator.gpus(params, args.rate)
        try:
            s = evaluator.run(params, args.rate)
        except EngineStartupError as exc:
            failed = StartupFailed.of(exc)
            return infeasible(goal, "StartupFailed", failed.message.splitlines()[0], memory=failed.memory)
        except ValueError as exc:
            return infeasible(goal, "StartupFailed", str(exc).splitlines()[0])
        m = Measurement(ttft_p99=s.ttft_p99, itl_p99=s.itl_p99, request_rate=args.rate)
        return score(goal, m, slo)

    return evaluate


def _open_offline_study(args: argparse.Namespace, target: Any, workload: Any, slo: SLO, goal: Goal,
                        space: SearchSpace, defaults: EngineParams) -> tuple[TunerStudy, str, Path | None, int]:
    """The study these inputs name (opened or resumed, vLLM's defaults queued first), its name, the
    report's path and the trials finished before; printed: what is tuned and where the study is."""
    inputs = identity(**_question(target, workload, goal), device=_device_input(target),
                      maxModelLen=target.max_model_len, tensorParallelSize=target.tensor_parallel_size,
                      slo={"ttftSeconds": slo.ttft_seconds, "itlSeconds": slo.itl_seconds},
                      goal=goal.value, rate=None if goal is Goal.CAPACITY else args.rate, seed=args.seed,
                      probeSeconds=args.probe_seconds, space=space.as_spec())
    name = args.study_name or (
        f"{study_name('offline', f'{_target_label(target)}.{_workload_label(workload, goal)}', space, goal)}"
        f".{digest(inputs)}")
    report = report_path(args.report, name)
    url = sqlite_url(args.storage)
    if args.join and is_sqlite(url):
        raise UsageError("--join: several independent processes on one study need a database server "
                         "(postgresql://...); a SQLite file is locked by one writer at a time and no other "
                         "machine sees its heartbeats: use --workers N on one machine instead")
    # Owning its study, a run measures a trial a kill cut off again under its own number (`adopt`), so
    # that a rerun ends with the study, and the answer, of a run never killed; joined, a dead worker's
    # trial is failed and queued again (another process's trials are not this one's to finish).
    st = open_study(storage=study_storage(url, args), name=name, inputs=inputs, goal=goal, space=space,
                    slo=slo, seed=args.seed, n_trials=args.trials, workers=args.workers, joined=args.join,
                    adopt=not args.join)
    st.enqueue(defaults, "vllmDefaults")
    already = st.finished_count()
    print(f"kvpilot tune --offline: {target.model} on {target.gpu}, workload {workload.name} "
          f"({workload.prompt} prompt / {workload.output} output tokens), "
          f"SLO p99 TTFT <= {slo.ttft_seconds:g}s, ITL <= {slo.itl_seconds:g}s; goal {goal.value}", file=sys.stderr)
    print(f"study {name!r} in {redacted(args.storage)}" + (f" (resuming: {already} trials done)" if already else ""),
          file=sys.stderr)
    if args.join:
        print(f"joined as worker {worker_id()}: the study's budget is {args.trials} trials, whichever process "
              f"measures them; a trial without a heartbeat for {args.grace_period} s is measured again",
              file=sys.stderr)
    return st, name, report, already


class _Stopped(Exception):
    """The run stopped at a trial boundary because the user asked (Ctrl-C)."""


class _CtrlC:
    """Ctrl-C as a request: the first stops the run where a trial ends, the second at once.  Raised
    anywhere, KeyboardInterrupt lands in SQLAlchemy's cleanup callbacks, which print it and go on: the
    run then carried on with a traceback on the screen."""

    def __init__(self) -> None:
        self.asked = False

    def __enter__(self) -> _CtrlC:
        self.previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGINT, self.previous)

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if self.asked:
            raise KeyboardInterrupt
        self.asked = True
        print("\nkvpilot tune: stopping where the trial in progress ends (Ctrl-C again to stop at once)",
              file=sys.stderr, flush=True)


class _LineProgress:
    """The progress bar where stderr is a log, not a terminal: a line per finished trial, no carriage returns."""

    def __init__(self, total: int, initial: int, quiet: bool) -> None:
        self.total, self.n, self.quiet, self.postfix = total, initial, quiet, ""

    def update(self, k: int) -> None:
        if k > 0:
            self.n += k
            if not self.quiet:
                print(f"kvpilot tune: {self.n}/{self.total} trials{self.postfix}", file=sys.stderr, flush=True)

    def set_postfix_str(self, text: str) -> None:
        self.postfix = f", {text}"

    def close(self) -> None:
        pass


def _run_offline_study(args: argparse.Namespace, st: TunerStudy, evaluate: Callable[[EngineParams], Outcome],
                       already: int) -> None:
    """Run the budget (in this process, or in --workers forked ones) behind a progress bar."""
    from tqdm import tqdm

    from kvpilot.tuner.core.search import run_joined, run_offline

    initial = min(already, args.trials)
    bar: Any = tqdm(total=args.trials, initial=initial, unit="trial", file=sys.stderr, disable=args.quiet,
                    dynamic_ncols=True) if sys.stderr.isatty() else _LineProgress(args.trials, initial, args.quiet)

    ctrl_c = _CtrlC()

    def on_trial(frozen: Any, params: EngineParams, outcome: Outcome) -> None:
        best = st.best_trial()
        if best is not None and best.value is not None:
            bar.set_postfix_str(f"best {best.value:.3f}")
        bar.update(min(st.finished_count(), args.trials) - bar.n)  # the study's, siblings' trials too
        if ctrl_c.asked:
            raise _Stopped

    try:
        with ctrl_c:
            if args.workers == 1 and args.join:
                run_joined(st, evaluate, args.trials, _poll_wait(args), on_trial)
            elif args.workers == 1:
                run_offline(st, evaluate, args.trials, on_trial)
            else:
                run_workers(st, evaluate, args, bar, ctrl_c)
    finally:
        bar.close()


def _offline_report_facts(args: argparse.Namespace, target: Any, workload: Any, slo: SLO, goal: Goal, name: str,
                          accuracy: list[str]) -> list[tuple[str, str]]:
    """The report's facts: what was tuned, for what, and what the value means."""
    value_is = {
        Goal.CAPACITY: f"capacity: the highest arrival rate (req/s) sustained in steady state with both p99s within "
                       f"the SLO ({args.probe_seconds:g} s of arrivals per rate, the first {args.probe_seconds / 5:g} s "
                       "not measured, two request sequences; higher is better)",
        Goal.GPUS: f"{GPUS_UNIT} for {args.rate:g} req/s (lower is better)",
        Goal.LATENCY: f"the worse of p99 TTFT / SLO and p99 ITL / SLO at {args.rate:g} req/s (lower is better)",
    }[goal]
    return [
        ("Model and GPU", f"{target.model} on {target.gpu}, tensor parallel size {target.tensor_parallel_size}, "
                          f"max model length {target.max_model_len}"),
        ("Workload", f"{workload.name}: {workload.prompt} prompt / {workload.output} output "
                     f"tokens, {workload.arrival} arrivals (cv {workload.cv:g})"),
        ("SLO", f"p99 TTFT <= {slo.ttft_seconds:g} s, p99 ITL <= {slo.itl_seconds:g} s"),
        ("Goal", goal.value),
        ("Value", value_is),
        ("Study", f"{name} in {redacted(args.storage)}"),
        *([("Twin accuracy", " ".join(line.strip() for line in accuracy))] if accuracy else []),
    ]


def _offline_answer(args: argparse.Namespace, st: TunerStudy, target: Any, workload: Any, slo: SLO, goal: Goal,
                    evaluator: Any, name: str, report: Path | None) -> int:
    """Print the trials, the twin's accuracy and the recommended engine block (and write the report);
    1 when no config is recommended."""
    table = trials_table(st)
    print(table, file=sys.stderr)  # stdout is the answer alone (-o yaml|json), for a file or a pipe
    if goal is Goal.CAPACITY:
        print(f"\nvalue: capacity, the highest arrival rate (req/s) each config sustains in steady state with "
              f"both p99s within the SLO ({args.probe_seconds:g} s of arrivals per rate, the first "
              f"{args.probe_seconds / 5:g} s not measured, on two request sequences)", file=sys.stderr)
    best = st.best_engine()
    if best is None:
        print(f"\n{no_answer(st)}", file=sys.stderr)
        return 1
    params, value = best
    accuracy = _twin_accuracy(target, evaluator, st, params, value) if goal is Goal.CAPACITY else []
    if goal is Goal.GPUS:
        print(f"\nvalue: {GPUS_UNIT} for {args.rate:g} req/s", file=sys.stderr)
    dflt = next((t for t in st.trials() if t.user_attrs.get(ATTR_SOURCE) == "vllmDefaults"
                 and t.state is TrialState.COMPLETE), None)
    unit = {Goal.CAPACITY: "req/s sustained within SLO", Goal.GPUS: f"GPUs for {args.rate:g} req/s (lower is better)",
            Goal.LATENCY: "x SLO (lower is better)"}[goal]
    comment = f"kvpilot tune --offline: {value:.3f} {unit}"
    baseline: dict[str, Any] | None = None
    if dflt is not None and dflt.value is not None and goal is not Goal.LATENCY:
        # Named with its values: vLLM's own defaults on this GPU (what `vllm serve` runs without the flags),
        # which are not an InferenceService's (kvpilot renders 2048 tokens and 256 seqs when the spec is silent).
        engine = dflt.user_attrs.get(ATTR_ENGINE, {})
        shown = "/".join(f"{engine[f.name]:g}" for f in TUNED if f.name in engine)
        comment += f" (vLLM defaults: {dflt.value:.3f} at {shown}, `vllm serve` without these flags)"
        baseline = {"engine": engine, "value": dflt.value}
    extra = {"maxModelLen": target.max_model_len, "tensorParallelSize": target.tensor_parallel_size}
    yml = engine_yaml(params, comment, extra)
    if args.output == "json":
        print(json.dumps({"study": name, "goal": goal.value, "value": value, "unit": unit,
                          "engine": {**params.as_spec(), **extra}, "vllmDefaults": baseline,
                          "twinAccuracy": accuracy}, indent=2), flush=True)
    else:
        print_answer(yml)
    if report is not None:
        facts = _offline_report_facts(args, target, workload, slo, goal, name, accuracy)
        write_report_after(st, report, f"kvpilot tune: {target.model} on {target.gpu}, {workload.name}",
                           yml, table, facts)
    return 0


def print_answer(yml: str) -> None:
    """The recommended block, last on stdout, and out before the report is written: a report that
    cannot be written (a full disk, say) must not cost the answer the run paid for."""
    print()
    print(yml, end="", flush=True)


def write_report_after(st: TunerStudy, path: Path, title: str, yml: str, table: str,
                       facts: list[tuple[str, str]]) -> None:
    """Write the report once the answer is printed; an IOFailure naming what stopped it."""
    from kvpilot.tuner.iofailure import report_failure
    from kvpilot.tuner.report import write_report

    try:
        out = write_report(st, path, title, yml, table, facts=facts)
    except OSError as exc:
        raise report_failure(exc, path) from exc
    print(f"\nreport: {out}", file=sys.stderr)


def tune_offline(args: argparse.Namespace) -> int:
    """`kvpilot tune --offline`: the flags checked, the study opened, its budget run on the twin, the answer printed."""
    import optuna

    from kvpilot.tuner.adapters.offline import TwinEvaluator

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    slo, workload, target, defaults = _offline_inputs(args)
    space = space_from_args(args)
    goal = Goal(args.goal)
    if goal is not Goal.CAPACITY and not args.rate > 0:
        raise UsageError(f"--rate: the {goal.value} goal is scored at an offered load in req/s > 0; got {args.rate:g}")
    evaluator = TwinEvaluator(target, workload, slo, seed=args.seed, probe_s=args.probe_seconds,
                              warmup_s=args.probe_seconds / 5)
    evaluate = _offline_objective(args, goal, slo, evaluator)
    st, name, report, already = _open_offline_study(args, target, workload, slo, goal, space, defaults)
    evaluator.resume(m.capacity for t in st.trials() if t.state is TrialState.COMPLETE
                     and (m := st.measurement_of(t)) is not None)
    try:
        _run_offline_study(args, st, evaluate, already)
    except (_Stopped, KeyboardInterrupt):
        done = st.finished_count()
        print(f"kvpilot tune: interrupted: {done} of {args.trials} trials are kept in study {name!r} "
              f"({redacted(args.storage)}); run the same command again to resume (a trial cut off is "
              "measured again)", file=sys.stderr)
        return 130
    return _offline_answer(args, st, target, workload, slo, goal, evaluator, name, report)


# --- local, live ------------------------------------------------------------------------


def tune_local(args: argparse.Namespace) -> int:
    import optuna

    from kvpilot.tuner.adapters.local import LocalApplier, parse_engine_command
    from kvpilot.tuner.adapters.prometheus import PrometheusSignals
    from kvpilot.tuner.core.loop import LiveSettings, LiveTuner
    from kvpilot.tuner.observe import LogObserver
    from kvpilot.tuner.watchdog import FirstSignalsWatchdog, SignalsNeverCame
    from kvpilot.twin.hardware import serve_defaults

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if not args.engine_command:
        raise UsageError("--local needs the engine command after `--`, e.g. -- kvpilot twin serve --port 8000")
    if not args.prometheus:
        raise UsageError("--local needs --prometheus URL (the server that scrapes the engine)")
    slo = SLO.parse(args.slo)
    space = space_from_args(args)
    target = twin_target(args)  # a bad --device-profile fails here, before any engine starts
    try:
        # vLLM's defaults on the device: the profile's when one is given (a CPU, say), else --gpu's.
        defaults = serve_defaults(target.gpu_spec())
        command, port, start = parse_engine_command(args.engine_command, defaults)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    inputs = identity(engine=command, gpu=target.gpu_spec().name if target.device_profile is None else None,
                      device=_device_input(target),
                      slo={"ttftSeconds": slo.ttft_seconds, "itlSeconds": slo.itl_seconds},
                      objective=args.objective, selector=args.selector, goal=Goal.LATENCY.value, seed=args.seed,
                      space=space.as_spec())
    name = args.study_name or f"{study_name('local', f'port{port}', space, Goal.LATENCY)}.{digest(inputs)}"
    report = report_path(args.report, name)
    st = open_study(storage=sqlite_url(args.storage), name=name, inputs=inputs, goal=Goal.LATENCY, space=space,
                    slo=slo, seed=args.seed, n_trials=args.trials)
    strategy = TrialStrategy(getattr(args, "trial_strategy", None) or TrialStrategy.ROLLING)
    weight = getattr(args, "canary_weight", 0.25)
    if not 0.0 < weight < 1.0:
        raise UsageError(f"--canary-weight: the canary's share of new connections, in (0, 1); got {weight:g}")
    confirm = getattr(args, "confirm_windows", 1)
    if confirm < 0:
        raise UsageError(f"--confirm-windows: windows more for a would-be best trial, 0 or more; got {confirm}")
    settings = LiveSettings(warmup_s=args.warmup, window_s=args.window, poll_s=args.poll,
                            fast_burn_window_s=args.fast_burn_window, pause_poll_s=args.poll,
                            max_trials=args.trials, strategy=strategy, confirm_windows=confirm)
    signals = FirstSignalsWatchdog(
        PrometheusSignals(args.prometheus, selector=args.selector, slo=slo, objective=args.objective,
                          min_window_s=min(args.poll, args.window) if strategy is TrialStrategy.CANARY else 0.0),
        args.signals_timeout,
        f"check --prometheus {args.prometheus}, that it scrapes the engine on port {port}, and that it has traffic")
    # Engines run on two backend ports behind the forwarder on the public port; Prometheus may
    # scrape either the public port (the engine in force) or both backend ports.
    slots = (port + 1, port + 2)
    if args.slots:
        a, b = parse_range(args.slots.replace(",", ":"), "--slots", int)
        slots = (a, b)
    applier = LocalApplier(command, port=port, start=start, slots=slots,
                           canary_port=getattr(args, "canary_port", None) or port + 3, canary_weight=weight)
    if strategy is TrialStrategy.CANARY:
        log.info("canary trials: Prometheus must scrape both tracks, e.g. scrape_configs: %s",
                 json.dumps(applier.scrape_configs("vllm")))
    # SIGTERM (a service manager, `kill`, a CI timeout) ends the run as Ctrl-C does: through the
    # `finally` below, so the engine this run started does not outlive it on its port.
    previous = signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        applier.start()
        tuner = LiveTuner(st, applier, signals, settings, observer=LogObserver())
        warm = WarmStart(target, warmup_s=args.warmup, trials=args.warm_start_trials,
                         seed=args.seed) if args.warm_start else None
        best = run_live_study(st, tuner, signals, start=start, defaults=EngineParams.vllm_defaults(defaults),
                              warm=warm)
    except SignalsNeverCame as exc:
        raise UsageError(str(exc)) from None
    finally:
        if not args.keep_running:
            applier.stop()
        signal.signal(signal.SIGTERM, previous)
    table = trials_table(st)
    print(table, file=sys.stderr)
    yml = engine_yaml(best, "kvpilot tune --local")
    if args.output == "json":
        print(json.dumps({"study": st.name, "engine": best.as_spec()}, indent=2), flush=True)
    else:
        print_answer(yml)
    if report is not None:
        facts = [
            ("Engine", shlex.join(command)),
            ("Workload", f"the live traffic Prometheus at {args.prometheus} saw"
                         + (f" ({args.selector})" if args.selector else "")),
            ("SLO", f"p99 TTFT <= {slo.ttft_seconds:g} s, p99 ITL <= {slo.itl_seconds:g} s, "
                    f"objective {args.objective:g}"),
            ("Goal", Goal.LATENCY.value),
            ("Value", f"the worse of p99 TTFT / SLO and p99 ITL / SLO over a {args.window:g} s window "
                      "(lower is better)"),
            ("Study", f"{name} in {redacted(args.storage)}"),
        ]
        write_report_after(st, report, f"kvpilot tune --local: port {port}", yml, table, facts)
    return 0


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


@dataclass(frozen=True)
class WarmStart:
    """How a live study's warm start searches the twin: the target (model, device), the seconds of
    traffic watched before the workload is read from Prometheus, the twin trials, the seed."""

    target: Any  # adapters.offline.TwinTarget
    warmup_s: float = 120.0
    trials: int = 20
    seed: int = 0


def run_live_study(st: TunerStudy, tuner: Any, signals: Any, *, start: EngineParams, defaults: EngineParams,
                   warm: WarmStart | None = None) -> EngineParams:
    """A live study's order of trials, then the loop: the engine in force first (measuring it costs
    no restart); with a warm start, the twin's best 3 under the measured workload next; then vLLM's
    defaults (after the twin's picks: the twin ranked them too, so they come first only where the
    twin put them); then Optuna's draws.  A resumed study (trials done) is not warm-started again."""
    fresh = st.finished_count() == 0
    st.enqueue(start, "current")
    if warm is not None and fresh:
        warm_start_live(st, tuner, signals, warm, start=start, defaults=defaults)
    st.enqueue(defaults, "vllmDefaults")
    best: EngineParams = tuner.run()
    return best


def warm_start_live(st: TunerStudy, tuner: Any, signals: Any, warm: WarmStart, *, start: EngineParams,
                    defaults: EngineParams | None = None) -> list[tuple[EngineParams, float]]:
    """Watch the starting engine's traffic for a warm-up, search the twin under it for the study's
    goal (latency at the measured rate; the study's space, so each pick is a config the study can
    draw), queue its best 3; returns them (config, the twin's value), or [] when skipped (no traffic to read, or a start config the twin cannot
    model), which is logged."""
    from kvpilot.tuner.adapters.offline import TwinEvaluator, workload_from_estimate
    from kvpilot.tuner.adapters.prometheus import estimate_workload
    from kvpilot.tuner.core.loop import SignalsUnavailable
    from kvpilot.tuner.core.warmstart import enqueue_warm_start, twin_best

    tuner._wait_for_signals()
    tuner.clock.sleep(warm.warmup_s)
    try:
        est = estimate_workload(signals, window_s=max(warm.warmup_s, 10.0))
        warm.target.engine_config(start)
    except (SignalsUnavailable, ValueError) as exc:
        log.warning("warm start skipped: %s", exc)
        return []
    log.info("warm start: %.2f req/s, prompt ~%.0f tokens, output ~%.0f tokens; searching the twin",
             est.request_rate, est.prompt_median, est.output_median)
    ev = TwinEvaluator(warm.target, workload_from_estimate(est), st.slo, seed=warm.seed)
    first = [start] + ([defaults] if defaults is not None else [])
    picks = twin_best(st.space, st.slo, ev.evaluator(st.goal, est.request_rate), goal=st.goal, trials=warm.trials,
                      k=3, seed=warm.seed, first=first)
    log.info("warm start: the twin's best at %.2f req/s: %s", est.request_rate,
             ", ".join(f"{p.label()} ({st.goal.value} {v:.3f})" for p, v in picks))
    enqueue_warm_start(st, picks)
    return picks
