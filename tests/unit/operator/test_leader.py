"""The Lease rules of kvpilot.operator.leader, one try at a time, against KMock (a real HTTP API with
resourceVersion conflicts) through the operator's own client, with the elector's monotonic clock in
the test's hands: nothing here sleeps, so every wait the rules ask for is exact.

The processes that use these rules are tested in tests/integration/operator/test_leader_election.py
(KMock) and tests/cluster/test_leader_election.py (a real API server).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

import kopf
import pytest

from harness.kmock_api import KMockAPI
from kvpilot.operator.kube import KubeClient
from kvpilot.operator.leader import LeaseElector, LeaseTimings, lease_path
from tests.unit.operator.test_commands import run

NS, NAME = "kvpilot-system", "kvpilot-operator"
PATH = lease_path(NS, NAME)
TIMINGS = LeaseTimings(lease_duration_seconds=15, renew_deadline_seconds=10, retry_period_seconds=2)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def api() -> Iterator[KMockAPI]:
    with KMockAPI() as server:
        yield server


@pytest.fixture(autouse=True)
def no_lease(api: KMockAPI) -> Iterator[None]:
    yield
    with contextlib.suppress(Exception):
        api.delete(PATH)


def elector(api: KMockAPI, identity: str, clock: Clock) -> tuple[LeaseElector, KubeClient]:
    client = KubeClient()
    client.set_credentials(kopf.ConnectionInfo(server=api.url, token="t0ken"))
    return LeaseElector(client, namespace=NS, name=NAME, identity=identity, timings=TIMINGS,
                        monotonic=clock), client


def tries(api: KMockAPI, identity: str, clock: Clock, *steps: Any) -> list[bool]:
    """Run the elector's tries in one event loop: each step is a number of seconds to advance the
    clock by before the next try, or a callable run (between tries) instead."""
    async def main() -> list[bool]:
        candidate, client = elector(api, identity, clock)
        results = []
        try:
            for step in steps:
                if callable(step):
                    await asyncio.to_thread(step)
                    continue
                clock.now += step
                results.append(await candidate.try_acquire_or_renew())
        finally:
            await client.close()
        return results
    return asyncio.run(main())


def held_by(holder: str, renew_time: str = "2000-01-01T00:00:00.000000Z") -> dict[str, Any]:
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": NAME, "namespace": NS},
            "spec": {"holderIdentity": holder, "leaseDurationSeconds": 15, "acquireTime": renew_time,
                     "renewTime": renew_time, "leaseTransitions": 4}}


def spec(api: KMockAPI) -> dict[str, Any]:
    return dict(api.get(PATH)["spec"])


def test_the_first_candidate_creates_the_lease_and_renewing_keeps_its_acquire_time(api: KMockAPI) -> None:
    clock = Clock()
    assert tries(api, "a", clock, 0) == [True]
    first = spec(api)
    assert (first["holderIdentity"], first["leaseDurationSeconds"], first["leaseTransitions"]) == ("a", 15, 0)
    assert first["acquireTime"] == first["renewTime"] and first["renewTime"].endswith("Z")
    assert tries(api, "a", clock, 2) == [True]
    renewed = spec(api)
    assert renewed["acquireTime"] == first["acquireTime"] and renewed["leaseTransitions"] == 0
    assert renewed["renewTime"] >= first["renewTime"]


def test_a_candidate_waits_out_the_lease_on_its_own_clock_whatever_the_holders_timestamps_say(
        api: KMockAPI) -> None:
    """The holder's renewTime is from the year 2000 (a skewed clock): a candidate still waits a whole
    lease duration, from when it first saw the record, before it takes over."""
    api.create(lease_path(NS), held_by("old"))
    clock = Clock()
    assert tries(api, "new", clock, 0, 14.9) == [False, False]
    assert spec(api)["holderIdentity"] == "old"
    # A new elector (a restarted process) has seen nothing yet: its wait starts with its first read.
    assert tries(api, "new", clock, 0.2) == [False]
    assert spec(api)["holderIdentity"] == "old"
    assert tries(api, "new", Clock(), 0, 15.1) == [False, True]
    taken = spec(api)
    assert (taken["holderIdentity"], taken["leaseTransitions"]) == ("new", 5)
    assert taken["acquireTime"] == taken["renewTime"] != "2000-01-01T00:00:00.000000Z"


def test_a_holder_that_renews_restarts_the_candidates_wait(api: KMockAPI) -> None:
    api.create(lease_path(NS), held_by("old"))

    def renew() -> None:
        api.patch(PATH, {"spec": {"renewTime": "2000-01-01T00:00:10.000000Z"}})

    assert tries(api, "new", Clock(), 0, 10, renew, 10, 14.9, 0.2) == [False, False, False, False, True]


def test_a_released_lease_is_taken_at_once(api: KMockAPI) -> None:
    api.create(lease_path(NS), held_by(""))
    assert tries(api, "new", Clock(), 0) == [True]
    assert spec(api)["holderIdentity"] == "new" and spec(api)["leaseTransitions"] == 5


def test_of_two_candidates_writing_the_same_record_the_second_gets_the_conflict_and_stays_a_follower(
        api: KMockAPI) -> None:
    """Between the candidate's read and its write someone else takes the Lease: the write carries
    the resourceVersion it read, the API server answers 409, and the candidate does not lead."""
    api.create(lease_path(NS), held_by(""))
    api.after("GET", PATH + "$", lambda: api.patch(PATH, {"spec": {"holderIdentity": "quicker"}}))
    assert tries(api, "slower", Clock(), 0) == [False]
    assert spec(api)["holderIdentity"] == "quicker"


def test_release_empties_the_holder_only_when_it_is_ours(api: KMockAPI) -> None:
    async def release(identity: str) -> None:
        candidate, client = elector(api, identity, Clock())
        try:
            await candidate.release()
        finally:
            await client.close()

    api.create(lease_path(NS), held_by("someone"))
    asyncio.run(release("me"))
    assert spec(api)["holderIdentity"] == "someone"
    asyncio.run(release("someone"))
    released = spec(api)
    assert (released["holderIdentity"], released["leaseDurationSeconds"], released["leaseTransitions"]) == ("", 1, 4)


@pytest.mark.parametrize(("flags", "complaint"), [
    (["--leader-elect-lease-duration", "10"],
     "--leader-elect-renew-deadline (10 s) must be shorter than --leader-elect-lease-duration (10 s)"),
    (["--leader-elect-retry-period", "9"],
     "--leader-elect-renew-deadline (10 s) must be longer than 1.2 x --leader-elect-retry-period (9 s)"),
    (["--leader-elect-lease-duration", "1.5"], "--leader-elect-lease-duration: must be a whole number of seconds"),
    (["--leader-elect-lease-duration", "0s"], "--leader-elect-lease-duration: must be a whole number of seconds"),
    (["--leader-elect-retry-period", "-1"], "--leader-elect-retry-period: must be a number of seconds > 0"),
], ids=["deadline-past-lease", "one-try", "fraction", "zero", "negative"])
def test_bad_election_timings_are_refused_naming_the_flags(flags: list[str], complaint: str) -> None:
    code, _, err = run(["operator", "--leader-elect", *flags])
    assert code == 2
    assert complaint in err and "Traceback" not in err


def test_timings_take_seconds_as_kubernetes_components_write_them() -> None:
    from kvpilot.cli import build_parser

    args = build_parser().parse_args(["operator", "--leader-elect", "--leader-elect-lease-duration=30s",
                                      "--leader-elect-renew-deadline=20s", "--leader-elect-retry-period=2.5"])
    assert (args.leader_elect, args.leader_elect_lease_duration, args.leader_elect_renew_deadline,
            args.leader_elect_retry_period) == (True, 30, 20.0, 2.5)
    code, out, _ = run(["operator", "--help"])
    for option in ("--leader-elect", "--leader-elect-lease-duration", "--leader-elect-renew-deadline",
                   "--leader-elect-retry-period", "--leader-elect-resource-name",
                   "--leader-elect-resource-namespace"):
        assert option in out


def test_the_renew_deadline_runs_from_when_a_try_began_not_from_its_slow_answer(api: KMockAPI) -> None:
    """The renewal lands, but its answer comes 9 s later: a follower's wait began when the write
    landed, so of the 10 s renew deadline 1 s is left, not 10."""
    clock = Clock()

    async def main() -> float:
        candidate, client = elector(api, "me", clock)
        try:
            assert await candidate._try(10)  # creates the Lease
            began = clock.now
            api.after("PATCH", PATH + "$", lambda: setattr(clock, "now", clock.now + 9))
            assert await candidate._try(10)
            assert candidate.renewed_at == began
            return candidate.renewed_at + TIMINGS.renew_deadline_seconds - clock.now
        finally:
            await client.close()

    assert asyncio.run(main()) == 1.0
