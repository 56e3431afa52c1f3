"""The tuner's own metrics, driven through the observer hooks the loop calls."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from kvpilot.tuner.core.objective import Outcome
from kvpilot.tuner.core.space import EngineParams
from kvpilot.tuner.core.study import Incumbent
from kvpilot.tuner.observe import TunerMetrics


def test_trials_by_state_best_value_and_current_trial() -> None:
    reg = CollectorRegistry()
    m = TunerMetrics(reg)
    obs = m.observer("prod", "llama")
    p = EngineParams(2048, 0.9, 256)
    obs.trial_started(4, p, "trial")
    text = generate_latest(reg).decode()
    assert 'kvpilot_tuning_current_trial{name="llama",namespace="prod"} 4.0' in text
    obs.trial_finished(4, p, "complete", Outcome(0.8, (-0.5,), True, "WithinSLO"))
    obs.trial_started(5, p, "trial")
    obs.trial_finished(5, p, "pruned", None)
    obs.best_changed(Incumbent(p, 0.8, 3.0, 4))
    text = generate_latest(reg).decode()
    assert 'kvpilot_tuning_trials_total{name="llama",namespace="prod",state="complete"} 1.0' in text
    assert 'kvpilot_tuning_trials_total{name="llama",namespace="prod",state="pruned"} 1.0' in text
    assert 'kvpilot_tuning_best_value{name="llama",namespace="prod"} 0.8' in text
    assert 'kvpilot_tuning_current_trial{name="llama",namespace="prod"} -1.0' in text
