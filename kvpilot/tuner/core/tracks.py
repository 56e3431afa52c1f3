"""Per-track readings of a canary trial, in the service's terms.

In a cluster the canary is one pod beside the stable Deployment's N, in the same Service: a
Service's random spread gives each pod the same load, so the canary takes 1/(N+1) of the requests,
a share that shrinks as an autoscaler grows the fleet.  The paired comparison does not need that
share to stay put: both tracks are read at the same load per pod, whatever N is (and with
autoscaling the planner keeps that load near its target, so the canary's samples per window do
not thin out either).  The canary is kept at one pod: following the fleet would cost one GPU more
per few replicas for every trial, and measure nothing the one pod does not.

What the share does change is a track's request rate: the canary's is 1/(N+1) of the service's,
the stable track's N/(N+1).  The loop reads `request_rate` as the load the service was offered
(the incumbent's, against which load drift is judged), so each track's reading is put back in those
terms: divided by the share in force, measured in the same window (the track's rate over both
tracks' rates: it also holds what a Service's spread by connection does to the share).
"""

from __future__ import annotations

from dataclasses import replace

from kvpilot.tuner.core.objective import Measurement


def service_load(stable: Measurement, canary: Measurement) -> tuple[Measurement, Measurement]:
    """(stable, canary), each with `request_rate` the service's offered load over the window (its
    own rate over its share of the requests) and its own rate and share in `extra`
    (`trackRequestRate`, `trackShare`).  Unchanged when neither track served a request."""
    total = stable.request_rate + canary.request_rate
    if total <= 0:
        return stable, canary

    def of(m: Measurement) -> Measurement:
        share = m.request_rate / total
        return replace(m, request_rate=total,
                       extra={**m.extra, "trackRequestRate": m.request_rate, "trackShare": share})
    return of(stable), of(canary)
