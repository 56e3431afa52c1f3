"""The tuner: SLO-constrained Optuna search over vLLM's chunk size and KV-cache fraction.

`kvpilot.tuner.core` holds the search space, scoring, constraints, the study and the trial
loop; it imports neither kopf nor kubernetes.  `kvpilot.tuner.adapters` holds where a trial is
applied (kubernetes, a local process, the twin offline) and where its signals come from.
"""
