"""The lane rule, under made-up loads (no Kafka)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.lanes import LaneGate, LaneLoad, LanePolicy

INTERACTIVE = LanePolicy("interactive", "t.i", 0, max_inflight=2048)
BULK = LanePolicy("bulk", "t.b", 1, max_inflight=1536, min_inflight=128)


def gate(**kw: int) -> LaneGate:
    return LaneGate([INTERACTIVE, BULK], **kw)


def test_idle_interactive_lets_bulk_fetch() -> None:
    assert gate().paused({"interactive": LaneLoad(), "bulk": LaneLoad(500, 10_000)}) == set()


def test_waiting_interactive_records_pause_bulk_above_its_floor() -> None:
    g = gate()
    loads = {"interactive": LaneLoad(0, 3), "bulk": LaneLoad(500, 10_000)}
    assert g.paused(loads) == {"bulk"}
    # the floor: below min_inflight bulk keeps fetching, whatever interactive does
    loads["bulk"] = LaneLoad(127, 10_000)
    assert g.paused(loads) == set()


def test_interactive_in_flight_above_the_share_pauses_bulk() -> None:
    g = gate(yield_above=10)
    assert g.paused({"interactive": LaneLoad(10, 0), "bulk": LaneLoad(500, 1)}) == set()
    assert g.paused({"interactive": LaneLoad(11, 0), "bulk": LaneLoad(500, 1)}) == {"bulk"}


def test_bulk_cap_with_hysteresis_leaves_room_for_interactive() -> None:
    g = gate()
    assert g.paused({"bulk": LaneLoad(1536, 1)}) == {"bulk"}
    assert g.paused({"bulk": LaneLoad(1300, 1)}) == {"bulk"}  # above 75 % of the cap
    assert g.paused({"bulk": LaneLoad(1152, 1)}) == set()
    assert g.paused({"interactive": LaneLoad(0, 0), "bulk": LaneLoad(1535, 1)}) == set()


def test_the_best_lane_never_yields() -> None:
    loads = {"interactive": LaneLoad(2000, 50), "bulk": LaneLoad(0, 0)}
    assert "interactive" not in gate().paused(loads)


def test_three_lanes_yield_in_rank_order() -> None:
    batch = LanePolicy("batch", "t.x", 2, max_inflight=512, min_inflight=8)
    g = LaneGate([INTERACTIVE, BULK, batch])
    loads = {"interactive": LaneLoad(), "bulk": LaneLoad(200, 5), "batch": LaneLoad(100, 5)}
    assert g.paused(loads) == {"batch"}  # bulk has work: batch yields to it
    loads["batch"] = LaneLoad(4, 5)
    assert g.paused(loads) == set()  # ... down to its floor


def test_lanes_must_come_best_first() -> None:
    with pytest.raises(ValueError):
        LaneGate([BULK, INTERACTIVE])


@settings(max_examples=300, deadline=None, database=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 1500), st.integers(0, 50), st.integers(0, 3000), st.integers(0, 50)
        ),
        min_size=1,
        max_size=40,
    )
)
def test_bulk_is_never_starved_and_never_over_its_cap(
    steps: list[tuple[int, int, int, int]],
) -> None:
    """Whatever interactive does (below its own cap): bulk below its floor always fetches,
    bulk at or over its cap never does, and interactive is never held back."""
    g = gate(yield_above=0)
    for i_flight, i_wait, b_flight, b_wait in steps:
        paused = g.paused(
            {"interactive": LaneLoad(i_flight, i_wait), "bulk": LaneLoad(b_flight, b_wait)}
        )
        if b_flight < BULK.min_inflight:
            assert "bulk" not in paused
        if b_flight >= BULK.max_inflight:
            assert "bulk" in paused
        assert "interactive" not in paused


def test_a_poll_never_carries_a_fetching_lane_past_its_cap() -> None:
    g = gate()
    loads = {"interactive": LaneLoad(10, 0), "bulk": LaneLoad(1500, 5000)}
    # bulk fetching with 36 left under its cap: the poll takes at most 36 records
    assert g.poll_room(loads, frozenset(), room=2048 - 1510) == 36
    # bulk held: only the global room and interactive's own cap count
    assert g.poll_room(loads, frozenset({"bulk"}), room=538) == 538
    # never zero: a poll of one keeps the consumer's position moving
    assert g.poll_room({"bulk": LaneLoad(1536, 1)}, frozenset(), room=500) == 1


def test_the_dispatch_queue_serves_the_best_lane_first() -> None:
    from worker.batching import Batch
    from worker.records import DispatchQueue

    q = DispatchQueue()
    batches = [Batch([name], 0.0, 0.0, "size") for name in ("bulk-1", "bulk-2", "live", "bulk-3")]
    for batch, rank in zip(batches, (1, 1, 0, 1), strict=True):
        q.put(batch, rank)  # type: ignore[arg-type]
    q.close()
    order = []
    while (batch := q.get()) is not None:
        order.append(batch.items[0])
    assert order == ["live", "bulk-1", "bulk-2", "bulk-3"]
