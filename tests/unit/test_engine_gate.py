"""`worker.engine_gate`: worse lanes stay under the engine's capacity less a reserve (slots
and KV tokens), the best lane is never held, held requests go in best priority first as
others finish, and a cancelled job's held requests can be taken out."""

from __future__ import annotations

from worker.engine_gate import Capacity, EngineGate, Reserve
from worker.engines.base import EngineRequest, SamplingSpec


def req(key: str, priority: int = 10) -> EngineRequest:
    return EngineRequest(key, "p", None, SamplingSpec(max_tokens=16), priority=priority)


def test_worse_lanes_keep_a_reserve_of_slots_and_the_best_lane_is_never_held() -> None:
    gate = EngineGate(Capacity(slots=8), Reserve(slots=16, fraction=0))
    now = gate.offer([(req(f"b{i}"), False, 1) for i in range(10)])
    assert [r.key for r in now] == [f"b{i}" for i in range(7)]  # 8 less an eighth
    assert [r.key for r in gate.held()] == ["b7", "b8", "b9"]
    assert [r.key for r in gate.offer([(req("i0", 0), True, 1)])] == ["i0"]  # goes in at once
    assert gate.done("i0") == []  # the best lane's requests are not counted
    assert [r.key for r in gate.done("b0")] == ["b7"] and gate.inside == 7


def test_held_requests_go_in_best_priority_first() -> None:
    gate = EngineGate(Capacity(slots=2), Reserve(slots=1, fraction=0))
    assert [r.key for r in gate.offer([(req("a", 5), False, 1)])] == ["a"]
    gate.offer([(req("late", 9), False, 1), (req("soon", 1), False, 1), (req("next", 5), False, 1)])
    assert [r.key for r in gate.done("a")] == ["soon"]
    assert [r.key for r in gate.done("soon")] == ["next"]


def test_kv_tokens_bound_worse_lanes_but_an_empty_engine_takes_one() -> None:
    gate = EngineGate(Capacity(slots=None, tokens=1000), Reserve(slots=0, fraction=0.1))
    now = gate.offer([(req("x"), False, 400), (req("y"), False, 400), (req("z"), False, 400)])
    assert [r.key for r in now] == ["x", "y"]  # 800 of 900; z would pass it
    assert [r.key for r in gate.done("x")] == ["z"]
    gate.done("y")
    gate.done("z")
    assert [r.key for r in gate.offer([(req("huge"), False, 5000)])] == ["huge"]  # alone: fits


def test_an_unbounded_engine_holds_nothing() -> None:
    gate = EngineGate(Capacity(), Reserve())
    assert len(gate.offer([(req(f"b{i}"), False, 10**9) for i in range(100)])) == 100
    assert gate.held() == [] and not gate.bounded


def test_a_cancelled_jobs_held_requests_are_taken_out() -> None:
    gate = EngineGate(Capacity(slots=1), Reserve(slots=0, fraction=0))
    gate.offer([(req("a1"), False, 1), (req("c1"), False, 1), (req("a2"), False, 1)])
    gone = gate.drop(lambda r: r.key.startswith("c"))
    assert [r.key for r in gone] == ["c1"]
    assert [r.key for r in gate.held()] == ["a2"]
    assert [r.key for r in gate.done("a1")] == ["a2"]
