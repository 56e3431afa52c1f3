"""Whether an offline study's recommendation survives the twin's own error: its best finished
configs re-priced with every engine step slower and faster by the twin's measured step-time error
for the GPU (`kvpilot.twin.accuracy`), and re-ranked."""

from __future__ import annotations

from dataclasses import dataclass, replace

from optuna.trial import FrozenTrial, TrialState

from kvpilot.tuner.adapters.offline import TwinEvaluator
from kvpilot.tuner.core.space import EngineParams
from kvpilot.tuner.core.study import ATTR_ENGINE, constraints_of
from kvpilot.twin.accuracy import MeasuredError, measured_error, step_scale_multipliers


@dataclass(frozen=True)
class Rerank:
    error: MeasuredError
    on_this_gpu: bool
    # Per step-time factor (e.g. 0.9 and 1.1): the configs' values, best first.
    ranks: dict[float, list[tuple[EngineParams, float]]]

    def lines(self, recommended: EngineParams, value: float, unit: str) -> list[str]:
        where = "" if self.on_this_gpu else " (no serving runs on this GPU: the H100's figures; it may be larger)"
        out = [f"twin accuracy against real vLLM: {self.error.describe()}{where}"]
        for factor, ranked in sorted(self.ranks.items()):
            how = f"step time {abs(factor - 1) * 100:.0f}% {'slower' if factor > 1 else 'faster'}"
            mine = next((v for p, v in ranked if p == recommended), None)
            top, top_value = ranked[0]
            if top == recommended:
                out.append(f"  with every {how}: the recommended config stays the best of the top {len(ranked)} "
                           f"({top_value:.3f} {unit}; as simulated {value:.3f})")
            else:
                mine_text = f"{mine:.3f}" if mine is not None else "infeasible"
                out.append(f"  with every {how}: {_label(top)} would be best ({top_value:.3f} {unit}) over the "
                           f"recommended config ({mine_text})")
        return out


def _label(p: EngineParams) -> str:
    return f"{p.max_num_batched_tokens}/{p.gpu_memory_utilization:g}/{p.max_num_seqs}"


def best_finished(trials: list[FrozenTrial], top: int, maximize: bool = True) -> list[tuple[EngineParams, float]]:
    """The `top` best feasible finished trials' configs and values, distinct configs."""
    seen: dict[EngineParams, float] = {}
    for t in trials:
        if (t.state != TrialState.COMPLETE or t.value is None or any(c > 0 for c in constraints_of(t))
                or not t.user_attrs.get(ATTR_ENGINE)):
            continue
        p = EngineParams.from_spec(t.user_attrs[ATTR_ENGINE])
        seen.setdefault(p, float(t.value))
    return sorted(seen.items(), key=lambda kv: kv[1], reverse=maximize)[:top]


def rerank_within_error(evaluator: TwinEvaluator, candidates: list[tuple[EngineParams, float]]) -> Rerank:
    """Each candidate's capacity with the step time scaled by 1 -/+ the measured step-time error."""
    error, on_gpu = measured_error(evaluator.target.gpu_spec())
    ranks = {}
    for factor in (1.0 - error.step_time, 1.0 + error.step_time):
        target = replace(evaluator.target, perturb=step_scale_multipliers(factor))
        scaled = TwinEvaluator(target, evaluator.workload, evaluator.slo, seed=evaluator.seed,
                               probe_s=evaluator.probe_s, warmup_s=evaluator.warmup_s, paths=evaluator.paths)
        values = []
        for params, _ in candidates:
            out = scaled.evaluate(params)
            values.append((params, out.value if out.feasible else float("-inf")))
        ranks[round(factor, 4)] = sorted(values, key=lambda kv: kv[1], reverse=True)
    return Rerank(error, on_gpu, ranks)


__all__ = ["Rerank", "best_finished", "rerank_within_error"]
