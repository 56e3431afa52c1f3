# Over 500 lines: enqueue, resume, heartbeats and the incumbent must agree on the trial attributes defined here.
"""The Optuna study: naming, storage, ask-and-tell, and resuming after a restart.

`TunerStudy` (open, ask, tell, recover; `workers` and `joined` for several processes on one study).
Resume, workers and heartbeats: docs/architecture.md, "The Optuna study".
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import platform
import re
import threading
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from kvpilot.tuner.core.objective import SLO, Goal, Measurement, Outcome, better
from kvpilot.tuner.core.polish import pick_neighbour, polish_turn
from kvpilot.tuner.core.sampler import make_sampler, startup_trials
from kvpilot.tuner.core.space import PARAM_GPU_UTIL, EngineParams, SearchSpace
from kvpilot.tuner.core.startup import (
    MemoryFailure,
    StartupMemory,
    UtilFloor,
    memory_report,
    read_memory_failure,
)

log = logging.getLogger(__name__)

# Trial user attrs (camelCase like the rest of kvpilot's wire names).
ATTR_ENGINE = "engine"  # the applied engine (after clamping), camelCase dict
ATTR_CONSTRAINTS = "constraints"
ATTR_REASON = "reason"
ATTR_MESSAGE = "message"
ATTR_MEMORY = "memory"  # the numbers of a start-up failure for lack of memory (core.startup.StartupMemory)
ATTR_MEASUREMENT = "measurement"
ATTR_SOURCE = "source"  # sampler | polish | current | vllmDefaults | warmStart | resume | remeasure
ATTR_RAISED_FROM = "raisedFrom"  # the drawn fraction, where a memory failure ruled it out
ATTR_KIND = "kind"  # trial | remeasure
ATTR_REMEASURE_OF = "remeasureOf"
ATTR_WORKER = "worker"  # host/pid of the process that measured the trial (a pod's name in a Job)
# Study user attrs.
STUDY_INCUMBENT = "incumbent"
STUDY_STARTING = "startingEngine"  # the engine in force when the study began (camelCase dict)

# A drawn config another worker already has (several workers on one study); drawn again at most
# _DRAWS times before it is measured anyway.
REASON_DUPLICATE = "Duplicate"
_DRAWS = 20
# A trial asked in a race with a sibling after the study's budget was taken (joined workers); given back.
REASON_BUDGET_SPENT = "BudgetSpent"

KIND_TRIAL = "trial"
KIND_REMEASURE = "remeasure"


def study_name(namespace: str, name: str, space: SearchSpace, goal: Goal | str) -> str:
    """`<namespace>.<name>.<goal>.<space hash>`: a changed space or goal starts a new study."""
    goal_s = goal.value if isinstance(goal, Goal) else str(goal)
    safe = re.sub(r"[^A-Za-z0-9_.-]", "-", f"{namespace}.{name}")
    return f"{safe}.{goal_s}.{space.digest()}"


# Constraint names, as Optuna stores them (`Trial.set_constraint`, Optuna >= 5; its samplers read
# them from every trial, so no `constraints_func` is needed).
CONSTRAINT_NAMES = ("slo",)


def memory_failure_of(trial: FrozenTrial) -> MemoryFailure | None:
    """What a completed trial that could not start for lack of memory says (None: any other trial)."""
    engine = trial.user_attrs.get(ATTR_ENGINE)
    if trial.state != TrialState.COMPLETE or not engine or not any(c > 0 for c in constraints_of(trial)):
        return None
    if ATTR_MEMORY in trial.user_attrs:
        memory: StartupMemory | None = StartupMemory.from_dict(trial.user_attrs[ATTR_MEMORY])
    else:  # a study written before the numbers were kept: read them from the message
        memory = memory_report(str(trial.user_attrs.get(ATTR_MESSAGE) or ""))
    p = EngineParams.from_spec(engine)
    return read_memory_failure(p.max_num_batched_tokens, p.gpu_memory_utilization, p.max_num_seqs, memory)


def _was_drawn(trial: FrozenTrial) -> bool:
    """Whether the sampler drew this trial's config (every enqueued one carries its source)."""
    return trial.user_attrs.get(ATTR_SOURCE, "sampler") == "sampler"


def _is_memory_failure(trial: FrozenTrial) -> bool:
    return memory_failure_of(trial) is not None


def constraints_of(trial: FrozenTrial) -> tuple[float, ...]:
    """The constraints told with a trial (empty for a trial not yet told)."""
    return tuple(float(v) for v in trial.constraints.values())


def worker_id() -> str:
    """This process, as the trials it measures name it: host (a pod's name) and pid."""
    return f"{platform.node()}/{os.getpid()}"


def cut_config(trial: FrozenTrial) -> dict[str, Any] | None:
    """The whole config a trial cut off (a kill, a dead worker) was to measure, as trial params; None
    when its draw was never whole (cut between two knobs: nothing of it was measured, and the
    sampler draws again).  A queued config is the one queued, whatever part of it was written; a
    drawn one is the engine it applied (the fraction a memory floor raised, not the one drawn)."""
    fixed = trial.system_attrs.get("fixed_params")
    if fixed:
        return dict(fixed)
    engine = trial.user_attrs.get(ATTR_ENGINE)
    if not engine:
        return None
    return {**trial.params, PARAM_GPU_UTIL: engine[PARAM_GPU_UTIL]}


def requeue_stale(study: optuna.Study, trial: FrozenTrial) -> None:
    """The storage's `heartbeat_stale_trial_callback`: a trial whose worker stopped heart-beating was
    failed; queue its whole config again so that it is measured rather than lost (as `recover` does)."""
    params = cut_config(trial)
    if params is None:  # its draw was never whole: nothing to measure again
        return
    attrs = {ATTR_SOURCE: "resume", ATTR_KIND: trial.user_attrs.get(ATTR_KIND, KIND_TRIAL)}
    if ATTR_REMEASURE_OF in trial.user_attrs:
        attrs[ATTR_REMEASURE_OF] = trial.user_attrs[ATTR_REMEASURE_OF]
    study.enqueue_trial(params, user_attrs=attrs)
    log.warning("trial %d stopped heart-beating (its worker %s is gone); its config is queued to be measured again",
                trial.number, trial.user_attrs.get(ATTR_WORKER, "?"))


def heartbeat_storage(url: str, interval: int, grace: int) -> optuna.storages.RDBStorage:
    """An RDB storage whose trials carry a heartbeat, a stale one failed and its config queued again."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.storages.RDBStorage(url, heartbeat_interval=interval, grace_period=grace,
                                          heartbeat_stale_trial_callback=requeue_stale)


@dataclass(frozen=True)
class Incumbent:
    """The best config known so far and the load it was measured under; `value` is the mean of
    `windows` measurement windows at that load."""

    params: EngineParams
    value: float
    request_rate: float
    trial: int
    windows: int = 1

    def as_dict(self) -> dict[str, Any]:
        return {
            "params": self.params.as_spec(), "value": self.value,
            "requestRate": self.request_rate, "trial": self.trial, "windows": self.windows,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Incumbent:
        return cls(EngineParams.from_spec(d["params"]), float(d["value"]), float(d["requestRate"]), int(d["trial"]),
                   int(d.get("windows", 1)))


@dataclass(frozen=True)
class Guidance:
    """What the tuner adds to TPE from what it knows of vLLM (each one measured on/off in
    benchmarks/README-tuner.md).  Random search gets none: it is the benchmark's baseline."""

    memory_floor: bool = True  # raise a draw's fraction past what memory failures rule out (core.startup)
    redo_startup: bool = True  # a start-up draw that could not start gives its strata back (core.sampler)
    polish: bool = True  # every few trials, a neighbour of the best config (core.polish)
    claim_strata: bool = True  # start-up draws skip the strata enqueued trials already measure (core.sampler)
    bound_startup: bool = True  # start-up draws keep the sequence cap within the token budget (core.sampler)

    @classmethod
    def none(cls) -> Guidance:
        return cls(memory_floor=False, redo_startup=False, polish=False, claim_strata=False, bound_startup=False)


class TunerStudy:
    """One InferenceService's study."""

    def __init__(
        self,
        *,
        storage: str | optuna.storages.BaseStorage | None,
        name: str,
        goal: Goal,
        space: SearchSpace,
        slo: SLO,
        seed: int | None = 0,
        n_trials: int = 30,
        sampler: str = "tpe",
        guidance: Guidance | None = None,
        workers: int = 1,
        recover: bool = True,
        joined: bool = False,
        adopt: bool = False,
    ) -> None:
        self.goal, self.space, self.slo, self.name = goal, space, slo, name
        self.seed = seed
        self.guidance = guidance if guidance is not None else (Guidance() if sampler == "tpe" else Guidance.none())
        self.n_startup = startup_trials(n_trials)
        self.study = optuna.create_study(
            storage=storage,
            study_name=name,
            direction=goal.direction,
            sampler=make_sampler(seed, n_trials, sampler,
                                 redo=_is_memory_failure if self.guidance.redo_startup else None,
                                 drawn=_was_drawn, constant_liar=workers > 1 or joined,
                                 claim=self.guidance.claim_strata,
                                 bounds=space.bounds() if self.guidance.bound_startup else None),
            load_if_exists=True,
        )
        self.workers = workers
        attrs = self.study.user_attrs
        if "space" not in attrs:
            self.study.set_user_attr("space", space.as_spec())
            self.study.set_user_attr("goal", goal.value)
            self.study.set_user_attr("slo", {"ttftSeconds": slo.ttft_seconds, "itlSeconds": slo.itl_seconds})
        self.distributions = space.distributions()
        self._open: dict[int, optuna.Trial] = {}
        self.adopt = adopt
        self._adopted: list[int] = []  # cut trials this process measures first, under their own numbers
        self._constrained: dict[int, set[str]] = {}
        self.joined = joined
        # Optuna wraps an RDB storage in a cache; the heartbeat settings are the RDB storage's.
        backend = getattr(self.study._storage, "_backend", self.study._storage)
        self._heartbeat = backend if isinstance(backend, optuna.storages.RDBStorage) \
            and backend.heartbeat_interval is not None else None
        if joined:
            if self._heartbeat is None:
                raise ValueError("a joined study needs a storage with a heartbeat (heartbeat_storage)")
            self.resumed = self.fail_stale()
        else:
            self.resumed = self.recover() if recover else []

    # -- resume ---------------------------------------------------------------------------
    def recover(self) -> list[int]:
        """Trials cut off mid-window (RUNNING, their process gone).  Adopting (`adopt`), each is
        measured again first under its own number, its missing knobs drawn as they would have been
        (the sampler seeds each trial by its number): the study ends as an uninterrupted one would.
        Else each is failed and its whole config queued again (`cut_config`).  Returns their numbers."""
        cut: list[int] = []
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            if self.adopt:
                self._adopted.append(t.number)
                cut.append(t.number)
                log.info("trial %d was cut off; it is measured again first, with its whole config", t.number)
                continue
            self.study.tell(t.number, state=TrialState.FAIL, skip_if_finished=True)
            params = cut_config(t)
            if params is None:  # its draw was never whole: nothing to measure again
                continue
            attrs = {ATTR_SOURCE: "resume", ATTR_KIND: t.user_attrs.get(ATTR_KIND, KIND_TRIAL)}
            if ATTR_REMEASURE_OF in t.user_attrs:
                attrs[ATTR_REMEASURE_OF] = t.user_attrs[ATTR_REMEASURE_OF]
            self.study.enqueue_trial(params, user_attrs=attrs)
            cut.append(t.number)
            log.info("trial %d was cut off mid-window; its config is queued to be measured again", t.number)
        return cut

    def take_over(self, numbers: Iterable[int]) -> None:
        """Measure these cut trials first, under their own numbers (a worker given its share of the
        trials the opening process adopted)."""
        self._adopted.extend(numbers)

    def hand_out(self) -> list[int]:
        """The adopted trials not measured yet, no longer this process's (for its workers to take over)."""
        out, self._adopted = self._adopted, []
        return out

    # -- several independent workers (joined) ----------------------------------------------
    def fail_stale(self) -> list[int]:
        """Fail the RUNNING trials whose worker stopped heart-beating, queueing their configs again
        (`requeue_stale`).  A trial with no heartbeat at all (its worker died between creating it and
        its first beat) counts as stale once it is older than the grace period.  Returns their numbers."""
        assert self._heartbeat is not None
        before = {t.number for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(self.study)
        grace = datetime.timedelta(seconds=self._heartbeat.grace_period or 2 * (self._heartbeat.heartbeat_interval or 1))
        now = datetime.datetime.now()
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            if t.datetime_start is None or now - t.datetime_start <= grace or t.number in self._open \
                    or self._beats(t._trial_id):
                continue
            storage = self.study._storage
            with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError):
                if storage.set_trial_state_values(t._trial_id, state=TrialState.FAIL):
                    requeue_stale(self.study, storage.get_trial(t._trial_id))
        # Failed since, and not given back by their own worker (a sibling's Duplicate or BudgetSpent).
        return sorted(t.number for t in self.study.get_trials(deepcopy=False, states=(TrialState.FAIL,))
                      if t.number in before and t.number not in self._open
                      and t.user_attrs.get(ATTR_REASON) not in (REASON_DUPLICATE, REASON_BUDGET_SPENT))

    def _beats(self, trial_id: int) -> bool:
        """Whether the trial has ever recorded a heartbeat."""
        from optuna.storages._rdb import models

        assert self._heartbeat is not None
        session = self._heartbeat.scoped_session()
        try:
            return models.TrialHeartbeatModel.where_trial_id(trial_id, session) is not None
        finally:
            session.close()

    def running_count(self) -> int:
        """Trials of kind trial being measured (by any worker)."""
        return sum(1 for t in self.trials() if t.state == TrialState.RUNNING)

    def budget_left(self, n_trials: int) -> int:
        """Trials still to ask for: the budget less what is finished and what is being measured."""
        return n_trials - self.finished_count() - self.running_count()

    def over_budget(self, number: int, n_trials: int) -> bool:
        """Whether as many trials as the budget, finished or running, precede this one: two workers
        that both saw one trial left both asked for it, and the later one gives its trial back."""
        ahead = sum(1 for t in self.trials() if t.number < number
                    and t.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING))
        return ahead >= n_trials

    def give_back(self, number: int) -> None:
        """Fail a trial asked beyond the budget (reason BudgetSpent); a queued config it popped is
        queued again, so that it is not lost."""
        trial = self._open.pop(number)
        frozen = self.study.get_trials(deepcopy=False)[number]
        trial.set_user_attr(ATTR_REASON, REASON_BUDGET_SPENT)
        self.study.tell(number, state=TrialState.FAIL, skip_if_finished=True)
        params = cut_config(frozen)
        if frozen.user_attrs.get(ATTR_SOURCE, "sampler") != "sampler" and params is not None:
            attrs = {k: v for k, v in frozen.user_attrs.items() if k in (ATTR_SOURCE, ATTR_KIND, ATTR_REMEASURE_OF)}
            self.study.enqueue_trial(params, user_attrs=attrs)

    def _beat(self, number: int) -> None:
        if self._heartbeat is not None:
            self._heartbeat.record_heartbeat(self.study.get_trials(deepcopy=False)[number]._trial_id)

    @contextlib.contextmanager
    def heartbeat(self, number: int) -> Iterator[None]:
        """While the trial is measured, record its heartbeat every interval (a thread), so that only a
        trial whose worker is gone goes stale.  Nothing without a heartbeat storage."""
        if self._heartbeat is None:
            yield
            return
        interval = float(self._heartbeat.heartbeat_interval or 1)
        trial_id = self.study.get_trials(deepcopy=False)[number]._trial_id
        stop = threading.Event()
        storage = self._heartbeat

        def beat() -> None:
            while True:
                try:
                    storage.record_heartbeat(trial_id)
                except Exception:  # a database hiccup: the next beat tries again
                    log.warning("trial %d: recording its heartbeat failed", number, exc_info=True)
                if stop.wait(interval):
                    return

        thread = threading.Thread(target=beat, name=f"kvpilot-heartbeat-{number}", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    # -- seeding --------------------------------------------------------------------------
    def enqueue(self, params: EngineParams, source: str) -> bool:
        """Queue a known config (clipped into the space).  False if it was already tried or queued: a
        trial holds it that is not FAIL (a failed one measured nothing, e.g. vLLM's defaults cut off
        by a kill: queued again, so that the defaults are always measured)."""
        raw = self.space.raw_params(params)
        wanted = self.space.resolve(raw)
        for t in self.study.get_trials(deepcopy=False):
            fixed = t.system_attrs.get("fixed_params")
            if t.state != TrialState.FAIL and (self.space.resolve(fixed) if fixed else self._config_of(t)) == wanted:
                return False
        self.study.enqueue_trial(raw, user_attrs={ATTR_SOURCE: source, ATTR_KIND: KIND_TRIAL})
        return True

    # -- ask and tell ---------------------------------------------------------------------
    def ask(self) -> tuple[int, EngineParams]:
        g = self.guidance
        floor = self.util_floor() if g.memory_floor else UtilFloor([], self.space.util_step)
        if self._adopted:  # asked before the kill: its polish turn, if any, was taken then
            trial = self._readopt(self._adopted.pop(0))
        else:
            if g.polish and polish_turn(self.finished_count(), self.n_startup) and not self._queued():
                self._enqueue_polish(floor)
            trial = self._ask()
        params = self.space.resolve(trial.params)
        for _ in range(_DRAWS):
            if not self._shared or not self._taken(params, trial.number):
                break
            # Another worker drew, queued (two polish turns at once) or is measuring this config:
            # measuring it twice is a trial lost.
            trial.set_user_attr(ATTR_REASON, REASON_DUPLICATE)
            self.study.tell(trial.number, state=TrialState.FAIL)
            trial = self._ask()
            params = self.space.resolve(trial.params)
        if trial.user_attrs.get(ATTR_SOURCE, "sampler") == "sampler":  # drawn; enqueued configs as given
            # A draw the memory failures so far rule out would waste a trial (live: a rollout)
            # on a known start-up failure: map the fraction onto what is still possible.
            raised = self.space.above_floor(params, floor(params.max_num_batched_tokens, params.max_num_seqs))
            if raised != params:
                trial.set_user_attr(ATTR_RAISED_FROM, params.gpu_memory_utilization)
                params = raised
            trial.set_user_attr(ATTR_SOURCE, "sampler")
        trial.set_user_attr(ATTR_ENGINE, params.as_spec())
        if ATTR_KIND not in trial.user_attrs:
            trial.set_user_attr(ATTR_KIND, KIND_TRIAL)
        if self._shared:
            trial.set_user_attr(ATTR_WORKER, worker_id())
        self._open[trial.number] = trial
        return trial.number, params

    @property
    def _shared(self) -> bool:
        """Whether other processes measure trials of this study at the same time."""
        return self.workers > 1 or self.joined

    def _ask(self) -> optuna.Trial:
        """Optuna's ask, the trial's first heartbeat recorded at once (a trial with none goes stale
        only by its age).  Optuna warns that heartbeats are meant for `optimize`: kvpilot asks and
        tells, and beats for the trial itself (`heartbeat`)."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")
            trial = self.study.ask(self.distributions)
        self._beat(trial.number)
        return trial

    def _readopt(self, number: int) -> optuna.Trial:
        """A cut trial, open again under its number with every knob: those written before the kill, a
        queued config's from the queue, the rest drawn now (as they would have been: see `recover`)."""
        # Optuna syncs its trial cache on each ask; this is an ask too (TPE reads the cache).
        self.study._thread_local.cached_all_trials = None
        trial = optuna.Trial(self.study, self.study.get_trials(deepcopy=False)[number]._trial_id)
        for name, distribution in self.distributions.items():
            trial._suggest(name, distribution)  # what `Study.ask(fixed_distributions)` does
        self._beat(number)
        return trial

    def _taken(self, params: EngineParams, number: int) -> bool:
        """Whether another trial, not failed, has these params (measured, being measured, or queued)."""
        return any(self._config_of(t) == params for t in self.study.get_trials(deepcopy=False)
                   if t.number != number and t.state != TrialState.FAIL)

    def _config_of(self, trial: FrozenTrial) -> EngineParams | None:
        """A trial's config, None while it has none yet: another worker's trial being drawn holds
        only the params drawn so far."""
        if ATTR_ENGINE in trial.user_attrs or set(self.distributions) <= set(trial.params):
            return self.engine_of(trial)
        return None

    def _tried(self) -> set[EngineParams]:
        """Configs of every trial that drew one, in any state."""
        return {p for t in self.study.get_trials(deepcopy=False) if (p := self._config_of(t)) is not None}

    def util_floor(self) -> UtilFloor:
        """What the memory failures told so far rule out (see `core.startup`)."""
        failures = [f for t in self.study.get_trials(deepcopy=False) if (f := memory_failure_of(t)) is not None]
        return UtilFloor(failures, self.space.util_step)

    def _queued(self) -> bool:
        return bool(self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))

    def _enqueue_polish(self, floor: UtilFloor) -> None:
        best = self.best_engine()
        if best is None:
            return
        done = self.finished_count()
        q = pick_neighbour(best[0], self.space, self._tried(), util_floor=floor, seed=f"{self.seed}/{done}")
        if q is not None:
            self.study.enqueue_trial(self.space.raw_params(q), user_attrs={ATTR_SOURCE: "polish", ATTR_KIND: KIND_TRIAL})

    def record(self, params: EngineParams, outcome: Outcome, *, kind: str, source: str,
               attrs: dict[str, Any] | None = None) -> FrozenTrial:
        """Add an already measured config as a finished trial (used for re-measuring the incumbent:
        it must not pop whatever else is queued, and a crash mid-way loses nothing worth keeping)."""
        raw = self.space.raw_params(params)
        user_attrs = {ATTR_ENGINE: params.as_spec(), ATTR_KIND: kind, ATTR_SOURCE: source,
                      ATTR_REASON: outcome.reason, ATTR_MESSAGE: outcome.message, **(attrs or {})}
        if outcome.measurement is not None:
            user_attrs[ATTR_MEASUREMENT] = outcome.measurement.as_dict()
        if outcome.memory is not None:
            user_attrs[ATTR_MEMORY] = outcome.memory.as_dict()
        trial = optuna.trial.create_trial(
            params=raw, distributions={k: self.distributions[k] for k in raw}, value=outcome.value,
            user_attrs=user_attrs, constraints=_constraints(outcome.constraints),
        )
        self.study.add_trial(trial)
        return self.study.get_trials(deepcopy=False)[-1]

    def _trial(self, number: int) -> optuna.Trial:
        """A trial this study asked for and has not told yet.  A trial left RUNNING by another
        process was failed by `recover` when this one opened the study, so none other is open."""
        try:
            return self._open[number]
        except KeyError:
            raise KeyError(f"trial {number} was not asked by this tuner (or was already told)") from None

    def tell(self, number: int, outcome: Outcome) -> FrozenTrial:
        """Record an outcome.  Idempotent: a second tell of a finished trial changes nothing."""
        frozen = self.study.get_trials(deepcopy=False)[number]
        if frozen.state.is_finished():
            return frozen
        trial = self._trial(number)
        try:
            self._set_constraints(trial, outcome.constraints)
            trial.set_user_attr(ATTR_REASON, outcome.reason)
            trial.set_user_attr(ATTR_MESSAGE, outcome.message)
            if outcome.memory is not None:
                trial.set_user_attr(ATTR_MEMORY, outcome.memory.as_dict())
            if outcome.measurement is not None:
                trial.set_user_attr(ATTR_MEASUREMENT, outcome.measurement.as_dict())
            done = self.study.tell(number, outcome.value, skip_if_finished=True)
        except optuna.exceptions.UpdateFinishedTrialError:
            # Finished by another process since the read above (the storage's cached view lagged):
            # the stored outcome stands, as for a second tell.
            done = self.study._storage.get_trial(self.study._storage.get_trial_id_from_study_id_trial_number(
                self.study._study_id, number))
        self._open.pop(number, None)
        self._constrained.pop(number, None)
        return done

    def prune(self, number: int, reason: str, message: str, constraints: Iterable[float] = (1.0,)) -> FrozenTrial:
        frozen = self.study.get_trials(deepcopy=False)[number]
        if frozen.state.is_finished():
            return frozen
        trial = self._trial(number)
        self._set_constraints(trial, tuple(constraints))
        trial.set_user_attr(ATTR_REASON, reason)
        trial.set_user_attr(ATTR_MESSAGE, message)
        done = self.study.tell(number, state=TrialState.PRUNED, skip_if_finished=True)
        self._open.pop(number, None)
        self._constrained.pop(number, None)
        return done

    def _set_constraints(self, trial: optuna.Trial, values: tuple[float, ...]) -> None:
        # Telling twice is harmless: a constraint already set on this trial is not set again.
        done = self._constrained.setdefault(trial.number, set())
        for key, value in _constraints(values).items():
            if key not in done:
                trial.set_constraint(key, value)
                done.add(key)

    # -- reading --------------------------------------------------------------------------
    def trials(self, kinds: tuple[str, ...] = (KIND_TRIAL,)) -> list[FrozenTrial]:
        return [t for t in self.study.get_trials(deepcopy=False) if t.user_attrs.get(ATTR_KIND, KIND_TRIAL) in kinds]

    def finished_count(self) -> int:
        """Trials that count towards the budget: COMPLETE or PRUNED, kind trial."""
        return sum(1 for t in self.trials() if t.state in (TrialState.COMPLETE, TrialState.PRUNED))

    def feasible(self) -> list[FrozenTrial]:
        return [
            t for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if all(c <= 0 for c in constraints_of(t))
        ]

    def best_trial(self) -> FrozenTrial | None:
        """Best feasible completed trial by value (ignores load drift; see `incumbent`)."""
        best: FrozenTrial | None = None
        for t in self.feasible():
            if t.value is not None and (best is None or better(self.goal, t.value, best.value or 0.0)):
                best = t
        return best

    def engine_of(self, trial: FrozenTrial) -> EngineParams:
        if ATTR_ENGINE in trial.user_attrs:
            return EngineParams.from_spec(trial.user_attrs[ATTR_ENGINE])
        return self.space.resolve(trial.params)

    def measurement_of(self, trial: FrozenTrial) -> Measurement | None:
        raw = trial.user_attrs.get(ATTR_MEASUREMENT)
        return Measurement.from_dict(raw) if raw else None

    @property
    def incumbent(self) -> Incumbent | None:
        raw = self.study.user_attrs.get(STUDY_INCUMBENT)
        return Incumbent.from_dict(raw) if raw else None

    @incumbent.setter
    def incumbent(self, inc: Incumbent | None) -> None:
        self.study.set_user_attr(STUDY_INCUMBENT, inc.as_dict() if inc else None)

    def starting_engine(self, in_force: EngineParams) -> EngineParams:
        """The engine in force when the study began; recorded by the first tuner to open it.  A tuner
        restarted while a trial's engine was in force must not take that engine for the starting one:
        it is what the loop puts back while no trial has beaten it."""
        raw = self.study.user_attrs.get(STUDY_STARTING)
        if raw:
            return EngineParams.from_spec(raw)
        self.study.set_user_attr(STUDY_STARTING, in_force.as_spec())
        return in_force

    def best_engine(self) -> tuple[EngineParams, float] | None:
        """The recommendation: the incumbent if one is recorded, else the best feasible trial."""
        inc = self.incumbent
        if inc is not None:
            return inc.params, inc.value
        best = self.best_trial()
        if best is None or best.value is None:
            return None
        return self.engine_of(best), best.value


def _constraints(values: tuple[float, ...]) -> dict[str, float]:
    """Named constraints, as Optuna's samplers read them (> 0 means violated)."""
    return {CONSTRAINT_NAMES[i] if i < len(CONSTRAINT_NAMES) else f"c{i}": float(v) for i, v in enumerate(values)}
