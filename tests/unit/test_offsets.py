"""Tests for the per-partition offset tracker (at-least-once commit offsets)."""

from __future__ import annotations

import random
from itertools import accumulate
from typing import NamedTuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from worker.offsets import OffsetTracker


class TP(NamedTuple):
    """Stands in for kafka-python's TopicPartition (also a namedtuple)."""

    topic: str
    partition: int


P0 = TP("requests", 0)
P1 = TP("requests", 1)


def test_empty_tracker() -> None:
    t: OffsetTracker[TP] = OffsetTracker()
    assert t.in_flight == 0
    assert t.committable() == {}
    assert t.commit_offset(P0) is None
    assert t.in_flight_for(P0) == 0
    assert t.partitions == frozenset()
    assert P0 not in t


def test_commit_is_lowest_in_flight_then_highest_plus_one() -> None:
    t: OffsetTracker[TP] = OffsetTracker()
    for off in (10, 11, 12):
        assert t.track(P0, off)
    assert t.commit_offset(P0) == 10  # nothing done: "everything below 10" is safe
    assert t.in_flight == 3
    assert t.done(P0, 10)
    assert t.commit_offset(P0) == 11
    assert t.done(P0, 11)
    assert t.done(P0, 12)
    assert t.commit_offset(P0) == 13
    assert t.in_flight == 0


def test_out_of_order_completion_holds_commit_at_lowest_unfinished() -> None:
    t: OffsetTracker[TP] = OffsetTracker()
    for off in range(5):
        t.track(P0, off)
    for off in (4, 3, 1):
        assert t.done(P0, off)
        assert t.commit_offset(P0) == 0
    assert t.in_flight_for(P0) == 2
    assert t.done(P0, 0)
    assert t.commit_offset(P0) == 2  # 1 already done, 2 still in flight
    assert t.done(P0, 2)
    assert t.commit_offset(P0) == 5
    assert t.in_flight_for(P0) == 0


def test_gaps_in_offsets_are_not_waited_for() -> None:
    # Compaction and transaction markers leave holes; offsets never seen are not awaited.
    t: OffsetTracker[TP] = OffsetTracker()
    for off in (3, 7, 8, 20):
        t.track(P0, off)
    t.done(P0, 3)
    assert t.commit_offset(P0) == 7
    t.done(P0, 8)
    t.done(P0, 7)
    assert t.commit_offset(P0) == 20
    t.done(P0, 20)
    assert t.commit_offset(P0) == 21


def test_done_twice_counts_once() -> None:
    t: OffsetTracker[TP] = OffsetTracker()
    t.track(P0, 1)
    t.track(P0, 2)
    assert t.done(P0, 2) is True
    assert t.done(P0, 2) is False
    assert t.in_flight == 1
    assert t.done(P0, 1) is True
    assert t.done(P0, 1) is False  # also after the head moved past it
    assert t.in_flight == 0
    assert t.commit_offset(P0) == 3


def test_done_for_unknown_partition_or_offset_is_ignored() -> None:
    t: OffsetTracker[TP] = OffsetTracker()
    assert t.done(P1, 5) is False
    t.track(P0, 5)
    assert t.done(P0, 4) is False  # never tracked (below)
    assert t.done(P0, 6) is False  # never tracked (above)
    assert t.in_flight == 1
    assert t.commit_offset(P0) == 5
    assert P1 not in t


def test_redelivered_offset_is_rejected_within_an_assignment() -> None:
    t: OffsetTracker[TP] = OffsetTracker()
    assert t.track(P0, 5)
    assert t.track(P0, 6)
    assert t.track(P0, 6) is False  # still in flight
    t.done(P0, 5)
    assert t.track(P0, 5) is False  # already done
    assert t.track(P0, 4) is False  # below anything seen
    assert t.in_flight == 1
    assert t.commit_offset(P0) == 6


def test_negative_offset_rejected() -> None:
    t: OffsetTracker[TP] = OffsetTracker()
    with pytest.raises(ValueError):
        t.track(P0, -1)


def test_partitions_are_independent() -> None:
    t: OffsetTracker[TP] = OffsetTracker()
    t.track(P0, 100)
    t.track(P1, 0)
    t.track(P1, 1)
    t.done(P1, 0)
    assert t.committable() == {P0: 100, P1: 1}
    assert t.in_flight == 2
    assert t.in_flight_for(P0) == 1
    assert t.in_flight_for(P1) == 1


def test_committable_reports_only_advanced_partitions() -> None:
    t: OffsetTracker[TP] = OffsetTracker()
    t.track(P0, 0)
    t.track(P0, 1)
    t.track(P1, 0)
    t.done(P0, 0)
    t.done(P1, 0)
    assert t.committable() == {P0: 1, P1: 1}
    t.mark_committed({P0: 1, P1: 1})
    assert t.committable() == {}
    t.done(P0, 1)
    assert t.committable() == {P0: 2}
    t.mark_committed({P0: 2})
    assert t.committable() == {}


def test_partial_mark_leaves_others_offered() -> None:
    t: OffsetTracker[TP] = OffsetTracker()
    t.track(P0, 0)
    t.track(P1, 0)
    t.done(P0, 0)
    t.done(P1, 0)
    t.mark_committed({P0: 1})
    assert t.committable() == {P1: 1}


def test_mark_committed_never_moves_backwards_and_ignores_unknown() -> None:
    t: OffsetTracker[TP] = OffsetTracker()
    for off in range(3):
        t.track(P0, off)
        t.done(P0, off)
    t.mark_committed({P0: 3})
    t.mark_committed({P0: 1, P1: 9})  # a stale commit acknowledgement; P1 not held
    assert t.committable() == {}
    assert P1 not in t


def test_revoke_mid_flight_returns_safe_offset_and_forgets() -> None:
    t: OffsetTracker[TP] = OffsetTracker()
    for off in range(5):
        t.track(P0, off)
    t.track(P1, 0)
    t.done(P0, 0)
    t.done(P0, 1)
    t.done(P0, 3)
    final = t.revoke([P0])
    assert final == {P0: 2}  # 2 in flight: redelivered to the new owner
    assert P0 not in t
    assert t.in_flight == 1  # only P1's record
    assert t.in_flight_for(P0) == 0
    assert t.done(P0, 2) is False  # finished after revoke: ignored
    assert t.committable() == {P1: 0}


def test_revoke_omits_already_committed_and_unknown() -> None:
    t: OffsetTracker[TP] = OffsetTracker()
    t.track(P0, 0)
    t.done(P0, 0)
    t.mark_committed({P0: 1})
    assert t.revoke([P0, P1]) == {}
    assert t.partitions == frozenset()


def test_reassign_after_revoke_starts_fresh_from_lower_offset() -> None:
    t: OffsetTracker[TP] = OffsetTracker()
    for off in range(10, 15):
        t.track(P0, off)
    t.done(P0, 10)
    assert t.revoke([P0]) == {P0: 11}
    t.assign([P0])
    assert P0 in t
    assert t.commit_offset(P0) is None
    assert t.committable() == {}
    # The group resumes from the committed offset 11, below the 14 seen before.
    assert t.track(P0, 11)
    assert t.track(P0, 12)
    assert t.commit_offset(P0) == 11
    t.done(P0, 11)
    t.done(P0, 12)
    assert t.committable() == {P0: 13}


def test_assign_keeps_state_of_partition_already_held() -> None:
    t: OffsetTracker[TP] = OffsetTracker()
    t.track(P0, 0)
    t.track(P0, 1)
    t.done(P0, 1)
    t.assign([P0, P1])
    assert t.commit_offset(P0) == 0  # 0 still in flight: must not be forgotten
    assert t.in_flight == 1
    assert t.partitions == frozenset({P0, P1})
    assert t.commit_offset(P1) is None


def test_late_result_from_previous_assignment_counts_for_same_record() -> None:
    # A record processed by the old assignment finishes after re-assignment redelivered it:
    # its result is durable either way, so counting it once is correct.
    t: OffsetTracker[TP] = OffsetTracker()
    t.track(P0, 0)
    t.revoke([P0])
    t.track(P0, 0)
    assert t.done(P0, 0) is True  # the old run's result
    assert t.done(P0, 0) is False  # the new run's result
    assert t.commit_offset(P0) == 1


def test_many_records_head_advances_amortized() -> None:
    t: OffsetTracker[int] = OffsetTracker()
    n = 50_000
    for off in range(n):
        t.track(0, off)
    for off in range(n - 1, 0, -1):  # worst case: head finishes last
        t.done(0, off)
    assert t.commit_offset(0) == 0
    t.done(0, 0)
    assert t.commit_offset(0) == n
    assert t.in_flight == 0


# -- property-based: a single assignment ----------------------------------------------------


@st.composite
def _streams(draw: st.DrawFn) -> dict[int, list[int]]:
    """Per partition, increasing offsets with random gaps."""
    n_parts = draw(st.integers(min_value=1, max_value=4))
    out: dict[int, list[int]] = {}
    for p in range(n_parts):
        start = draw(st.integers(min_value=0, max_value=1000))
        gaps = draw(st.lists(st.integers(min_value=1, max_value=5), min_size=1, max_size=30))
        out[p] = list(accumulate(gaps, initial=start))[1:]
    return out


@settings(max_examples=300, deadline=None)
@given(streams=_streams(), seed=st.randoms(use_true_random=False))
def test_property_commits_monotonic_and_safe(
    streams: dict[int, list[int]], seed: random.Random
) -> None:
    t: OffsetTracker[int] = OffsetTracker()
    cursor = dict.fromkeys(streams, 0)
    in_flight: dict[int, set[int]] = {p: set() for p in streams}
    done: dict[int, set[int]] = {p: set() for p in streams}
    committed: dict[int, int] = {}

    def check_commit(partial: bool) -> None:
        offered = t.committable()
        for p, n in offered.items():
            assert n > committed.get(p, -1)  # monotonic, and only offered when advanced
            # Never covers a record that is not done.
            assert all(o in done[p] for o in streams[p] if o < n)
        chosen = {p: n for p, n in offered.items() if not partial or seed.random() < 0.5}
        t.mark_committed(chosen)
        committed.update(chosen)

    while any(cursor[p] < len(streams[p]) for p in streams) or t.in_flight:
        action = seed.random()
        receivable = [p for p in streams if cursor[p] < len(streams[p])]
        busy = [p for p in streams if in_flight[p]]
        if receivable and (action < 0.45 or not busy):
            p = seed.choice(receivable)
            off = streams[p][cursor[p]]
            cursor[p] += 1
            assert t.track(p, off)
            in_flight[p].add(off)
        elif busy and action < 0.9:
            p = seed.choice(busy)
            off = seed.choice(sorted(in_flight[p]))
            assert t.done(p, off)
            in_flight[p].remove(off)
            done[p].add(off)
        else:
            check_commit(partial=True)
        assert t.in_flight == sum(len(s) for s in in_flight.values())
        for p in streams:
            assert t.in_flight_for(p) == len(in_flight[p])

    check_commit(partial=False)
    for p, offsets in streams.items():
        assert t.commit_offset(p) == offsets[-1] + 1
        assert committed[p] == offsets[-1] + 1


# -- property-based: rebalances, redelivery and late results --------------------------------


class RebalancingConsumer(RuleBasedStateMachine):
    """Models a consumer against a broker log with gaps, through revokes and re-assigns.

    The at-least-once promise checked: whatever the broker ends up with as committed offset
    N for a partition, every log record below N had its result durably written.
    """

    def __init__(self) -> None:
        super().__init__()
        self.t: OffsetTracker[TP] = OffsetTracker()
        self.log: dict[TP, list[int]] = {}
        self.assigned: set[TP] = set()
        self.position: dict[TP, int] = {}  # index into log of the next record to fetch
        self.in_flight: dict[TP, set[int]] = {}  # current assignment's unfinished records
        self.stale: list[tuple[TP, int]] = []  # unfinished records of earlier assignments
        self.durable: dict[TP, set[int]] = {}  # records whose result was written
        self.broker: dict[TP, int] = {}  # committed offset per partition (broker side)
        self.marked: dict[TP, int] = {}  # what we told the tracker since last assign

    @initialize(streams=_streams())
    def setup(self, streams: dict[int, list[int]]) -> None:
        for i, offsets in streams.items():
            tp = TP("requests", i)
            self.log[tp] = offsets
            self.durable[tp] = set()
            self._assign(tp)

    def _assign(self, tp: TP) -> None:
        # Kafka resumes from the committed offset: the first log record at or above it.
        committed = self.broker.get(tp, 0)
        self.position[tp] = next(
            (i for i, o in enumerate(self.log[tp]) if o >= committed), len(self.log[tp])
        )
        self.in_flight[tp] = set()
        self.marked.pop(tp, None)
        self.assigned.add(tp)

    def _commit(self, offsets: dict[TP, int]) -> None:
        for tp, n in offsets.items():
            assert n >= self.broker.get(tp, 0)  # the broker's offset never moves back
            assert all(o in self.durable[tp] for o in self.log[tp] if o < n)
            self.broker[tp] = n

    @rule(data=st.data())
    def fetch(self, data: st.DataObject) -> None:
        ready = sorted(tp for tp in self.assigned if self.position[tp] < len(self.log[tp]))
        if not ready:
            return
        tp = data.draw(st.sampled_from(ready))
        off = self.log[tp][self.position[tp]]
        self.position[tp] += 1
        assert self.t.track(tp, off)
        self.in_flight[tp].add(off)

    @rule(data=st.data())
    def refetch_seen(self, data: st.DataObject) -> None:
        seen = sorted(
            (tp, o)
            for tp in self.assigned
            for o in self.log[tp][: self.position[tp]]
            if o >= self.broker.get(tp, 0)
        )
        if not seen:
            return
        tp, off = data.draw(st.sampled_from(seen))
        before = self.t.in_flight
        assert self.t.track(tp, off) is False
        assert self.t.in_flight == before

    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        busy = sorted((tp, o) for tp in self.assigned for o in self.in_flight[tp])
        if not busy:
            return
        tp, off = data.draw(st.sampled_from(busy))
        assert self.t.done(tp, off)
        self.in_flight[tp].remove(off)
        self.durable[tp].add(off)

    @precondition(lambda self: bool(self.stale))
    @rule(data=st.data())
    def finish_stale(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(min_value=0, max_value=len(self.stale) - 1))
        tp, off = self.stale.pop(i)
        counted = self.t.done(tp, off)
        # It counts only if the same record is in flight again in the current assignment.
        expected = tp in self.assigned and off in self.in_flight[tp]
        assert counted == expected
        if counted:
            self.in_flight[tp].remove(off)
            self.durable[tp].add(off)

    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        offered = self.t.committable()
        for tp, n in offered.items():
            assert tp in self.assigned
            assert n > self.marked.get(tp, -1)
        chosen = {
            tp: n for tp, n in sorted(offered.items()) if data.draw(st.booleans(), label="ok")
        }
        self._commit(chosen)
        self.t.mark_committed(chosen)
        self.marked.update(chosen)

    @rule(data=st.data())
    def rebalance(self, data: st.DataObject) -> None:
        held = sorted(self.assigned)
        if not held:
            return
        revoked = data.draw(st.lists(st.sampled_from(held), unique=True, min_size=1))
        final = self.t.revoke(revoked)
        assert set(final) <= set(revoked)
        self._commit(final)
        for tp in revoked:
            self.stale.extend((tp, o) for o in self.in_flight[tp])
            self.in_flight[tp] = set()
            self.assigned.discard(tp)
        back = data.draw(st.lists(st.sampled_from(sorted(revoked)), unique=True))
        if data.draw(st.booleans(), label="explicit assign"):
            self.t.assign(back)
        for tp in back:
            self._assign(tp)

    @rule()
    def assign_held(self) -> None:
        # An assignment callback naming partitions already held must not reset them.
        self.t.assign(sorted(self.assigned))

    @invariant()
    def counts_match(self) -> None:
        assert self.t.in_flight == sum(len(self.in_flight[tp]) for tp in self.assigned)
        for tp in self.log:
            expected = len(self.in_flight[tp]) if tp in self.assigned else 0
            assert self.t.in_flight_for(tp) == expected

    def teardown(self) -> None:
        if not self.log:
            return
        # Take everything back, drain it, and the broker must reach the end of every log.
        for tp in self.log:
            if tp not in self.assigned:
                self._assign(tp)
        while True:
            self.fetch_all()
            busy = sorted((tp, o) for tp in self.assigned for o in self.in_flight[tp])
            if not busy:
                break
            for tp, off in busy:
                assert self.t.done(tp, off)
                self.in_flight[tp].remove(off)
                self.durable[tp].add(off)
        offered = self.t.committable()
        self._commit(offered)
        for tp, offsets in self.log.items():
            assert self.broker[tp] == offsets[-1] + 1

    def fetch_all(self) -> None:
        for tp in sorted(self.assigned):
            while self.position[tp] < len(self.log[tp]):
                off = self.log[tp][self.position[tp]]
                self.position[tp] += 1
                assert self.t.track(tp, off)
                self.in_flight[tp].add(off)


RebalancingConsumer.TestCase.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None
)
test_rebalancing_consumer = RebalancingConsumer.TestCase


def test_uncommitted_from_is_the_last_commit_or_the_first_tracked() -> None:
    """With transactional results "done" is durable only once committed: a partition
    that comes back must be sought to its last commit (worker.intake.on_revoked)."""
    t: OffsetTracker[str] = OffsetTracker()
    assert t.uncommitted_from("p") is None
    for off in range(100, 150):
        t.track("p", off)
    assert t.uncommitted_from("p") == 100  # nothing committed yet: the first tracked
    for off in range(100, 150):
        t.done("p", off)
    assert t.resume_offset("p") is None  # nothing pending ...
    assert t.uncommitted_from("p") == 100  # ... but nothing committed either
    t.mark_committed({"p": 120})
    assert t.uncommitted_from("p") == 120
    t.mark_committed({"p": 150})
    assert t.uncommitted_from("p") is None  # all committed
