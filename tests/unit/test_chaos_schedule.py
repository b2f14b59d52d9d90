"""The chaos soak's fault schedule (tests/reliability/chaos.py) keeps its promises for any
seed: replayable, every kind in a CI-length run, never more down than the deployment is
built to survive."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.reliability.chaos import WORKER_KINDS, FaultKind, Limits, schedule


def test_a_seed_replays_the_same_schedule() -> None:
    assert schedule(7, 90) == schedule(7, 90)
    assert schedule(7, 90) != schedule(8, 90)


@settings(max_examples=300, deadline=None, database=None)
@given(st.integers(0, 2**32), st.floats(90, 900))
def test_every_schedule_stays_inside_what_the_cluster_survives(seed: int, duration: float) -> None:
    lim = Limits()
    faults = schedule(seed, duration, workers=3, limits=lim)
    assert {f.kind for f in faults} == set(FaultKind)  # all kinds, even in 90 s
    assert [f.at_s for f in faults] == sorted(f.at_s for f in faults)
    assert all(f.end_s <= duration for f in faults)
    brokers = [f for f in faults if f.kind is FaultKind.broker_kill]
    for a, b in itertools.pairwise(brokers):  # one broker down at a time
        assert b.at_s >= a.end_s + lim.broker_settle_s
    redis = [f for f in faults if f.kind in (FaultKind.redis_master_kill, FaultKind.redis_slow)]
    for a, b in itertools.pairwise(redis):
        assert b.at_s >= a.end_s
        if a.kind is FaultKind.redis_master_kill:
            assert b.at_s >= a.end_s + lim.redis_settle_s  # the failover settled first
    workers = [f for f in faults if f.kind in WORKER_KINDS]
    for f in workers:  # never every worker down together (checked where downs begin)
        down = {g.target for g in workers if g.at_s <= f.at_s < g.end_s}
        assert len(down) <= 2
    assert brokers[0].target == 0  # the first broker killed is a leader
    stops = [f for f in faults if f.kind is FaultKind.worker_stop]
    assert all(f.hold_s > lim.session_timeout_s for f in stops)  # a real zombie


@pytest.mark.parametrize("workers", [2, 3, 5])
def test_targets_are_in_range(workers: int) -> None:
    for seed in range(50):
        for f in schedule(seed, 300, workers=workers):
            if f.kind in WORKER_KINDS:
                assert 0 <= f.target < workers
            elif f.kind is FaultKind.broker_kill:
                assert 0 <= f.target <= 3  # 0: the partition leader
            else:
                assert 0 <= f.target < 3
