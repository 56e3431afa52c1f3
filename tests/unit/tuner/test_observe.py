"""The tuner's own metrics, driven through the observer hooks the loop calls."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from kvpilot.api.vocabulary import TrialStrategy
from kvpilot.tuner.core.loop import TrialEvent
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


def test_trials_started_promoted_pruned_and_rolled_back_by_strategy() -> None:
    reg = CollectorRegistry()
    obs = TunerMetrics(reg).observer("prod", "llama")
    text = generate_latest(reg).decode()
    # Every strategy's series exists at 0 before any trial (rate() and absent() alerts need one).
    assert 'kvpilot_tuning_promotions_total{name="llama",namespace="prod",strategy="canary"} 0.0' in text
    for event in (TrialEvent.STARTED, TrialEvent.PRUNED, TrialEvent.ROLLED_BACK):
        obs.trial_event(3, TrialStrategy.CANARY, event)
    obs.trial_event(4, TrialStrategy.CANARY, TrialEvent.STARTED)
    obs.trial_event(4, TrialStrategy.CANARY, TrialEvent.PROMOTED)
    obs.trial_event(5, TrialStrategy.ROLLING, TrialEvent.STARTED)
    text = generate_latest(reg).decode()
    assert 'kvpilot_tuning_trials_started_total{name="llama",namespace="prod",strategy="canary"} 2.0' in text
    assert 'kvpilot_tuning_trials_started_total{name="llama",namespace="prod",strategy="rolling"} 1.0' in text
    assert 'kvpilot_tuning_promotions_total{name="llama",namespace="prod",strategy="canary"} 1.0' in text
    assert 'kvpilot_tuning_pruned_total{name="llama",namespace="prod",strategy="canary"} 1.0' in text
    assert 'kvpilot_tuning_rollbacks_total{name="llama",namespace="prod",strategy="canary"} 1.0' in text
    assert 'kvpilot_tuning_rollbacks_total{name="llama",namespace="prod",strategy="rolling"} 0.0' in text
