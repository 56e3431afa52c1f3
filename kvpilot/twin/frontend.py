"""vLLM's serving frontend (its API server) as one queueing server in virtual time, for `offline.drive`.

`ServingFrontend` admits requests and streams each engine step's output in rounds; its costs are the
`frontend_*` constants of `StepTimeParams` (a device profile fitted through vLLM's HTTP API).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from kvpilot.twin.scheduler import StepOutcome
from kvpilot.twin.steptime import StepTimeParams


class ServingFrontend:
    """vLLM's API server as one queueing server in virtual time (`StepTimeParams.frontend_request_s`
    and the other frontend costs: a device profile fitted through vLLM's HTTP API).

    It admits requests in send order (`admit_until`: `frontend_request_s` and `frontend_prompt_token_s`
    per prompt token of its time each; a request reaches the scheduler at `ready[i]`, `frontend_s`
    after its admission) and streams each step's output (`stream`).  vLLM's API server takes each
    step's output from the engine core as it comes, but a request's stream merges the outputs it has
    not yet sent (RequestOutputCollector), and the client reads what has arrived in one go: a
    frontend behind the engine streams several steps' tokens in one event per request.  So a step
    that ends while the server is busy waits, with every later step that ends before the server
    frees (a round from `round_start`), and the round costs `frontend_step_s` a step but
    `frontend_token_s` once per request with tokens in it.  `delivered[k]` is when step k's tokens
    reached the clients, `seen_gaps[k]` the gap a client read before them (see Trace.step_gaps).
    """

    __slots__ = (
        "arrivals", "prompts", "ready", "delay", "request_s", "prompt_token_s", "step_s", "token_s",
        "num_admitted", "free_at", "pending", "silent", "pending_reqs", "pending_obs", "round_start",
        "last_round", "delivered", "seen_gaps", "observe",
    )

    def __init__(self, params: StepTimeParams, arrivals: list[float], prompts: list[int]) -> None:
        self.arrivals, self.prompts = arrivals, prompts
        self.ready = [0.0] * len(arrivals)  # set as each request is admitted
        self.delay = params.frontend_s
        self.request_s, self.prompt_token_s = params.frontend_request_s, params.frontend_prompt_token_s
        self.step_s, self.token_s = params.frontend_step_s, params.frontend_token_s
        self.num_admitted = 0  # the first requests, in send order, have had their admission service
        self.free_at = 0.0  # when the server is next idle
        self.pending: list[int] = []  # steps of the waiting round that sampled tokens
        self.silent: list[int] = []  # steps in it that sampled none (they deliver nothing, but keep step order)
        self.pending_reqs: set[int] = set()
        self.pending_obs: list[tuple[int, StepOutcome]] = []  # steps whose misses are counted once streamed
        self.round_start = 0.0
        self.last_round = 0.0  # when the server last delivered tokens
        # Indexed by engine step; steps count from 1, so index 0 is a placeholder.
        self.delivered = [0.0]
        self.seen_gaps = [0.0]
        self.observe: Callable[[int, StepOutcome], None] | None = None  # the early stop's, once delivered

    def admit_until(self, t: float) -> None:
        """Give every request sent by `t` its admission service."""
        arrivals, num_requests = self.arrivals, len(self.arrivals)
        i, free_at = self.num_admitted, self.free_at
        while i < num_requests and arrivals[i] <= t:
            a = arrivals[i]
            free_at = (a if a > free_at else free_at) + self.request_s + self.prompt_token_s * self.prompts[i]
            self.ready[i] = free_at + self.delay
            i += 1
        self.num_admitted, self.free_at = i, free_at

    def catch_up(self, now: float) -> None:
        """Stream a waiting round whose start has come; with none waiting, admit what was sent by `now`
        (requests sent after a waiting round's first output queue behind it)."""
        if self.pending and self.round_start <= now:
            self.close_round(self.round_start)
        if not self.pending:
            self.admit_until(now)

    def close_round(self, start: float, num_events: int | None = None) -> None:
        """Stream the waiting round from `start`: `num_events` events (default: one per request in it)."""
        pending = self.pending
        # frontend_s is counted once, on the way in (ready): it is a latency, not server time.
        t = start + self.step_s * len(pending) + self.token_s * (
            len(self.pending_reqs) if num_events is None else num_events)
        share = (t - self.last_round) / len(pending)
        delivered, seen_gaps = self.delivered, self.seen_gaps
        for k in pending:
            delivered[k] = t
            seen_gaps[k] = share
        for k in self.silent:
            delivered[k] = t
        self.free_at = self.last_round = t
        pending.clear()
        self.silent.clear()
        self.pending_reqs.clear()
        if self.pending_obs:
            assert self.observe is not None
            for k, outcome in self.pending_obs:
                self.observe(k, outcome)
            self.pending_obs.clear()

    def stream(self, k: int, now: float, outcome: StepOutcome) -> None:
        """Step k ended at `now`: stream its tokens, in a round of its own or in the waiting one."""
        self.catch_up(now)  # requests sent during the step are admitted before its output is streamed
        self.delivered.append(math.nan)
        self.seen_gaps.append(0.0)
        pending = self.pending
        if outcome.num_sampled:
            pending.append(k)
            if self.free_at > now:  # the server is busy: the output waits, in a round that starts when it frees
                self.pending_reqs.update(id(r) for r in outcome.scheduled if r.sched < 0)
                if len(pending) == 1:
                    self.round_start = self.free_at
            else:  # a round of this step alone (the common case)
                self.close_round(now, outcome.num_sampled)
        elif pending:
            self.silent.append(k)
        else:
            self.delivered[k] = self.delivered[k - 1]

    def finish(self) -> None:
        """Stream the round still waiting, if any."""
        if self.pending:
            self.close_round(self.round_start)
