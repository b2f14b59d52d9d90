"""Tests for the micro-batching rule, all under a fake clock.

Times are dyadic (multiples of 1/64 s) and waits are 125/250/500 ms so that float sums are
exact and boundary cases ("exactly at the deadline") mean what they say.
"""

from __future__ import annotations

import functools
from dataclasses import FrozenInstanceError

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.batching import Batch, MicroBatcher
from worker.kafka_io import time_in_kafka_s


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


def make(max_size: int = 4, max_wait_ms: float = 250) -> tuple[MicroBatcher[str], FakeClock]:
    clock = FakeClock()
    return MicroBatcher[str](max_size=max_size, max_wait_ms=max_wait_ms, clock=clock), clock


# -- construction ---------------------------------------------------------------------------


def test_defaults() -> None:
    b: MicroBatcher[int] = MicroBatcher()
    assert b.max_size == 64
    assert b.max_wait_s == pytest.approx(0.05)
    assert len(b) == 0


@pytest.mark.parametrize("max_size", [0, -1])
def test_rejects_bad_max_size(max_size: int) -> None:
    with pytest.raises(ValueError):
        MicroBatcher[int](max_size=max_size)


def test_rejects_non_int_max_size() -> None:
    with pytest.raises(TypeError):
        MicroBatcher[int](max_size=2.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        MicroBatcher[int](max_size=True)


@pytest.mark.parametrize("max_wait_ms", [-1, -0.001, float("nan")])
def test_rejects_bad_max_wait(max_wait_ms: float) -> None:
    with pytest.raises(ValueError):
        MicroBatcher[int](max_wait_ms=max_wait_ms)


# -- size trigger ---------------------------------------------------------------------------


def test_size_trigger_exactly_at_max_size() -> None:
    b, clock = make(max_size=3)
    assert b.add("a") is None
    assert b.add("b") is None
    assert len(b) == 2
    batch = b.add("c")
    assert batch is not None
    assert batch.items == ["a", "b", "c"]
    assert batch.reason == "size"
    assert batch.opened_at == batch.closed_at == clock.t
    assert batch.wait_s == 0
    assert len(batch) == 3
    assert len(b) == 0
    assert b.poll() is None


def test_max_size_one_dispatches_every_add() -> None:
    b, _ = make(max_size=1, max_wait_ms=1000)
    for x in "abc":
        batch = b.add(x)
        assert batch is not None
        assert batch.items == [x]
        assert batch.reason == "size"
    assert len(b) == 0


def test_many_batches_in_sequence() -> None:
    b, clock = make(max_size=3)
    out = []
    for i in range(10):
        clock.advance(1 / 64)
        batch = b.add(str(i))
        if batch is not None:
            out.append(batch.items)
    assert out == [["0", "1", "2"], ["3", "4", "5"], ["6", "7", "8"]]
    assert len(b) == 1
    rest = b.flush()
    assert rest is not None and rest.items == ["9"]


# -- timeout trigger ------------------------------------------------------------------------


def test_timeout_measured_from_first_item_not_last() -> None:
    b, clock = make(max_size=10, max_wait_ms=250)
    opened = clock.t
    b.add("a")
    clock.advance(0.125)
    b.add("b")
    clock.advance(0.0625)
    b.add("c")
    assert b.poll() is None
    clock.advance(0.0625)  # exactly 250 ms after "a", only 62.5 ms after "c"
    batch = b.poll()
    assert batch is not None
    assert batch.items == ["a", "b", "c"]
    assert batch.reason == "timeout"
    assert batch.opened_at == opened
    assert batch.closed_at == clock.t
    assert batch.wait_s == 0.25


def test_not_due_just_before_deadline() -> None:
    b, clock = make(max_wait_ms=250)
    b.add("a")
    assert b.poll(now=clock.t + 0.25 - 2**-20) is None
    assert b.poll(now=clock.t + 0.25) is not None


def test_poll_on_empty_is_none() -> None:
    b, clock = make()
    assert b.poll() is None
    clock.advance(100)
    assert b.poll() is None


def test_late_item_joins_overdue_batch_at_next_poll() -> None:
    # The batch is overdue but nobody polled yet; the newcomer rides along, and only the
    # poll that follows the adds closes the batch by age.
    b, clock = make(max_size=10, max_wait_ms=250)
    opened = clock.t
    b.add("a")
    clock.advance(1.0)
    assert b.add("late") is None
    batch = b.poll()
    assert batch is not None
    assert batch.items == ["a", "late"]
    assert batch.reason == "timeout"
    assert batch.opened_at == opened
    assert len(b) == 0


def test_late_item_filling_batch_reports_size() -> None:
    b, clock = make(max_size=2, max_wait_ms=250)
    b.add("a")
    clock.advance(1.0)
    batch = b.add("b")
    assert batch is not None and batch.reason == "size"


def test_new_batch_opens_at_first_item_after_dispatch() -> None:
    b, clock = make(max_size=2, max_wait_ms=250)
    b.add("a")
    b.add("b")  # dispatched by size
    clock.advance(0.125)
    b.add("c")
    assert b.opened_at == clock.t
    clock.advance(0.125)
    assert b.poll() is None  # 250 ms since "a", but "a" is in an earlier batch
    clock.advance(0.125)
    batch = b.poll()
    assert batch is not None and batch.items == ["c"]


def test_max_wait_zero_batches_what_arrived_together() -> None:
    # One fetch of three records: one batch at the poll after the adds, no waiting.
    b, clock = make(max_size=8, max_wait_ms=0)
    for x in "abc":
        assert b.add(x) is None
    assert b.time_until_due() == 0
    batch = b.poll()
    assert batch is not None
    assert batch.items == ["a", "b", "c"]
    assert batch.reason == "timeout"
    assert batch.wait_s == 0
    assert len(b) == 0
    assert b.time_until_due() is None
    # A lone record is dispatched alone, at once.
    clock.advance(1.0)
    b.add("d")
    lone = b.poll()
    assert lone is not None and lone.items == ["d"] and lone.wait_s == 0


def test_max_wait_zero_still_splits_by_size() -> None:
    b, _ = make(max_size=2, max_wait_ms=0)
    assert b.add("a") is None
    full = b.add("b")
    assert full is not None and full.items == ["a", "b"] and full.reason == "size"
    assert b.add("c") is None
    rest = b.poll()
    assert rest is not None and rest.items == ["c"]


# -- waits brought along (time in Kafka) -----------------------------------------------------


def test_wait_brought_along_counts_against_the_window() -> None:
    b, clock = make(max_wait_ms=250)
    assert b.add("a", waited_s=0.125) is None
    assert b.opened_at == clock.t - 0.125
    assert b.time_until_due() == 0.125
    clock.advance(0.125)
    batch = b.poll()
    assert batch is not None and batch.reason == "timeout"
    assert batch.wait_s == 0.25  # the whole window, half of it spent before the batcher


def test_wait_brought_along_is_capped_at_the_window() -> None:
    # A record that sat in Kafka for minutes (consumer lag) makes its batch due at once,
    # but not by add: records of the same fetch still join it before the poll.
    b, clock = make(max_wait_ms=250)
    assert b.add("old", waited_s=300.0) is None
    assert b.opened_at == clock.t - 0.25
    assert b.time_until_due() == 0.0
    assert b.add("same-fetch") is None
    batch = b.poll()
    assert batch is not None and batch.items == ["old", "same-fetch"]
    assert batch.wait_s == 0.25


@pytest.mark.parametrize("waited", [-5.0, float("nan"), 0.0])
def test_negative_or_unknown_wait_brought_along_is_no_wait(waited: float) -> None:
    b, clock = make(max_wait_ms=250)
    b.add("a", waited_s=waited)
    assert b.opened_at == clock.t
    assert b.time_until_due() == 0.25


def test_an_item_that_waited_longer_moves_the_deadline_earlier() -> None:
    b, clock = make(max_wait_ms=250)
    b.add("fresh")
    clock.advance(0.0625)
    b.add("stale", waited_s=0.25)  # waited the whole window before it got here
    assert b.opened_at == clock.t - 0.25
    batch = b.poll()
    assert batch is not None and batch.items == ["fresh", "stale"]


@pytest.mark.parametrize(
    ("timestamp_ms", "dequeued_ms", "expected_s"),
    [(1_000, 1_250, 0.25), (None, 1_250, 0.0), (-1, 1_250, 0.0), (2_000, 1_250, 0.0)],
)
def test_time_in_kafka(timestamp_ms: int | None, dequeued_ms: int, expected_s: float) -> None:
    # no timestamp (-1 in old message formats) or one from the future (skew): no wait
    assert time_in_kafka_s(timestamp_ms, dequeued_ms) == expected_s


# -- time_until_due -------------------------------------------------------------------------


def test_time_until_due_none_when_empty() -> None:
    b, _ = make()
    assert b.time_until_due() is None
    assert b.deadline() is None
    assert b.opened_at is None


def test_time_until_due_decreases_and_is_never_negative() -> None:
    b, clock = make(max_wait_ms=500)
    b.add("a")
    assert b.time_until_due() == 0.5
    clock.advance(0.125)
    b.add("b")  # later items do not move the deadline
    assert b.time_until_due() == 0.375
    clock.advance(0.375)
    assert b.time_until_due() == 0.0
    clock.advance(10)
    assert b.time_until_due() == 0.0
    assert b.poll() is not None
    assert b.time_until_due() is None


def test_explicit_now_overrides_clock() -> None:
    b, clock = make(max_wait_ms=500)
    b.add("a", now=5.0)
    assert b.opened_at == 5.0
    assert b.time_until_due(now=5.25) == 0.25
    assert b.poll(now=5.25) is None
    batch = b.poll(now=5.5)
    assert batch is not None and batch.closed_at == 5.5
    assert clock.t == 1000.0


# -- priority -------------------------------------------------------------------------------


def test_priority_orders_within_batch_lower_first_stable_on_ties() -> None:
    b, _ = make(max_size=6)
    b.add("a", priority=1)
    b.add("b", priority=0)
    b.add("c", priority=1)
    b.add("d", priority=-5)
    b.add("e", priority=0)
    batch = b.add("f", priority=1)
    assert batch is not None
    assert batch.items == ["d", "b", "e", "a", "c", "f"]


def test_priority_does_not_change_membership() -> None:
    # The first max_size arrivals form the batch; an urgent late arrival waits for the next.
    b, _ = make(max_size=2)
    b.add("a", priority=5)
    first = b.add("b", priority=5)
    second_pending = b.add("urgent", priority=-100)
    assert first is not None and first.items == ["a", "b"]
    assert second_pending is None
    assert len(b) == 1


def test_all_equal_priorities_keep_arrival_order() -> None:
    b, _ = make(max_size=5)
    batch = None
    for x in "vwxyz":
        batch = b.add(x, priority=3)
    assert batch is not None and batch.items == list("vwxyz")


# -- flush / drop ---------------------------------------------------------------------------


def test_flush_on_empty_is_none() -> None:
    b, _ = make()
    assert b.flush() is None


def test_flush_returns_pending_sorted_and_resets() -> None:
    b, clock = make(max_size=10)
    opened = clock.t
    b.add("a", priority=2)
    clock.advance(0.0625)
    b.add("b", priority=1)
    batch = b.flush()
    assert batch is not None
    assert batch.items == ["b", "a"]
    assert batch.reason == "flush"
    assert batch.opened_at == opened
    assert batch.closed_at == clock.t
    assert len(b) == 0
    assert b.flush() is None
    assert b.time_until_due() is None


def test_drop_removes_matching_and_returns_them_in_arrival_order() -> None:
    b, _ = make(max_size=10)
    for x in ["p0:1", "p1:1", "p0:2", "p2:1", "p0:3"]:
        b.add(x)
    dropped = b.drop(lambda s: s.startswith("p0:"))
    assert dropped == ["p0:1", "p0:2", "p0:3"]
    assert len(b) == 2
    batch = b.flush()
    assert batch is not None and batch.items == ["p1:1", "p2:1"]


def test_drop_nothing_matching() -> None:
    b, clock = make(max_size=10)
    b.add("a")
    opened = b.opened_at
    clock.advance(0.125)
    assert b.drop(lambda s: False) == []
    assert len(b) == 1
    assert b.opened_at == opened


def test_drop_all_empties_and_clears_deadline() -> None:
    b, clock = make(max_size=10)
    b.add("a")
    b.add("b")
    assert b.drop(lambda s: True) == ["a", "b"]
    assert len(b) == 0
    assert b.time_until_due() is None
    clock.advance(10)
    assert b.poll() is None
    assert b.flush() is None


def test_drop_of_oldest_moves_deadline_to_oldest_remaining() -> None:
    b, clock = make(max_size=10, max_wait_ms=250)
    b.add("old")
    clock.advance(0.125)
    b.add("young")
    b.drop(lambda s: s == "old")
    assert b.opened_at == clock.t
    assert b.time_until_due() == 0.25
    clock.advance(0.125)
    assert b.poll() is None
    clock.advance(0.125)
    batch = b.poll()
    assert batch is not None and batch.items == ["young"]


def test_drop_on_empty() -> None:
    b, _ = make()
    assert b.drop(lambda s: True) == []


# -- Batch ----------------------------------------------------------------------------------


def test_batch_is_frozen() -> None:
    batch = Batch(items=[1], opened_at=1.0, closed_at=2.0, reason="flush")
    with pytest.raises(FrozenInstanceError):
        batch.reason = "size"  # type: ignore[misc]
    assert batch.wait_s == 1.0


# -- property-based -------------------------------------------------------------------------


def _divisible(i: int, modulus: int) -> bool:
    return i % modulus == 0


_op = st.one_of(
    st.tuples(st.just("add"), st.integers(min_value=-3, max_value=3)),
    st.tuples(st.just("advance"), st.integers(min_value=0, max_value=48)),  # 1/64 s steps
    st.tuples(st.just("poll"), st.just(0)),
    st.tuples(st.just("drop"), st.integers(min_value=2, max_value=5)),
    # an item that already waited arg/64 s elsewhere (negative: a skewed clock)
    st.tuples(st.just("add_waited"), st.integers(min_value=-8, max_value=48)),
)


@settings(max_examples=300, deadline=None)
@given(
    max_size=st.integers(min_value=1, max_value=6),
    max_wait_ms=st.sampled_from([0, 125, 250, 500]),
    ops=st.lists(_op, max_size=80),
)
def test_property_every_item_once_bounded_and_timely(
    max_size: int, max_wait_ms: int, ops: list[tuple[str, int]]
) -> None:
    clock = FakeClock(t=0.0)
    b = MicroBatcher[int](max_size=max_size, max_wait_ms=max_wait_ms, clock=clock)
    wait = max_wait_ms / 1000
    arrival: dict[int, float] = {}
    priority: dict[int, int] = {}
    batches: list[Batch[int]] = []
    dropped: list[int] = []
    pending_model: list[int] = []  # arrival order
    next_id = 0

    def emitted(batch: Batch[int] | None) -> None:
        if batch is None:
            return
        batches.append(batch)
        # Membership: exactly the items pending, i.e. the earliest arrivals still waiting.
        assert sorted(batch.items) == sorted(pending_model)
        pending_model.clear()
        assert 1 <= len(batch.items) <= max_size
        # Order within: by priority, ties by arrival.
        assert batch.items == sorted(batch.items, key=lambda i: (priority[i], i))
        assert batch.opened_at == min(arrival[i] for i in batch.items)
        assert batch.closed_at == clock.t
        # Not earlier than necessary.
        if batch.reason == "size":
            assert len(batch.items) == max_size
        else:
            assert batch.reason == "timeout"
            assert batch.closed_at >= batch.opened_at + wait

    for kind, arg in ops:
        if kind == "add":
            i = next_id
            next_id += 1
            arrival[i] = clock.t
            priority[i] = arg
            pending_model.append(i)
            emitted(b.add(i, priority=arg))
        elif kind == "add_waited":
            i = next_id
            next_id += 1
            arrival[i] = clock.t - min(max(arg / 64, 0.0), wait)
            priority[i] = 0
            pending_model.append(i)
            emitted(b.add(i, waited_s=arg / 64))
        elif kind == "advance":
            clock.advance(arg / 64)
        elif kind == "poll":
            emitted(b.poll())
            # Not later than necessary: whatever is still pending is not yet overdue.
            if pending_model:
                assert min(arrival[i] for i in pending_model) + wait > clock.t
        else:
            gone = b.drop(functools.partial(_divisible, modulus=arg))
            assert gone == [i for i in pending_model if i % arg == 0]
            dropped.extend(gone)
            pending_model[:] = [i for i in pending_model if i % arg != 0]

        # Invariants between calls.
        assert len(b) == len(pending_model) < max_size
        due_in = b.time_until_due()
        if pending_model:
            assert due_in is not None and due_in >= 0
            assert b.opened_at == min(arrival[i] for i in pending_model)
        else:
            assert due_in is None

    final = b.flush()
    if final is not None:
        assert final.reason == "flush"
        assert sorted(final.items) == sorted(pending_model)
        batches.append(final)
    assert len(b) == 0

    seen = [i for batch in batches for i in batch.items] + dropped
    assert sorted(seen) == list(range(next_id))  # every item exactly once


@settings(max_examples=200, deadline=None)
@given(
    max_size=st.integers(min_value=1, max_value=8),
    steps=st.lists(st.integers(min_value=0, max_value=20), max_size=60),
)
def test_property_batches_are_contiguous_runs_of_arrivals(max_size: int, steps: list[int]) -> None:
    # Without drop, each batch is the next run of arrivals: membership is by arrival.
    clock = FakeClock(t=0.0)
    b = MicroBatcher[int](max_size=max_size, max_wait_ms=250, clock=clock)
    batches: list[list[int]] = []
    for i, step in enumerate(steps):
        clock.advance(step / 64)
        for batch in (b.poll(), b.add(i, priority=-i)):
            if batch is not None:
                batches.append(sorted(batch.items))
    last = b.flush()
    if last is not None:
        batches.append(sorted(last.items))
    flat = [i for batch in batches for i in batch]
    assert flat == list(range(len(steps)))
