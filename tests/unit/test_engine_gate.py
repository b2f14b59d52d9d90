"""`worker.engine_gate`: worse lanes stay under the engine's capacity less a reserve (slots
and KV tokens) while the best lane is about, under the whole capacity otherwise; the best
lane is never held; held requests go in best priority first as others finish; a cancelled
job's held requests can be taken out. Time is injected."""

from __future__ import annotations

from worker.engine_gate import Capacity, EngineGate, Reserve
from worker.engines.base import EngineRequest, SamplingSpec


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def req(key: str, priority: int = 10) -> EngineRequest:
    return EngineRequest(key, "p", None, SamplingSpec(max_tokens=16), priority=priority)


def bulk(*keys: str, cost: int = 1) -> list[tuple[EngineRequest, bool, int]]:
    return [(req(k), False, cost) for k in keys]


def test_while_the_best_lane_is_about_worse_lanes_keep_a_reserve() -> None:
    clock = Clock()
    gate = EngineGate(Capacity(slots=64), Reserve(slots=8, fraction=0, hold_s=60), clock)
    assert [r.key for r in gate.offer([(req("i0", 0), True, 1)])] == ["i0"]
    now = gate.offer(bulk(*(f"b{i}" for i in range(70))))
    assert len(now) == 62 and len(gate.held()) == 8  # 64 less a 32nd
    assert gate.done("i0") == []  # the best lane's requests are not counted
    assert [r.key for r in gate.done("b0")] == ["b62"]
    clock.now += 61  # the best lane quiet for hold_s: the whole engine is bulk's
    assert [r.key for r in gate.done("b1")] == ["b63", "b64", "b65"]


def test_bulk_alone_may_fill_the_engine_and_the_reserve_comes_back_as_it_drains() -> None:
    clock = Clock()
    gate = EngineGate(Capacity(slots=64), Reserve(slots=8, fraction=0, hold_s=60), clock)
    assert len(gate.offer(bulk(*(f"b{i}" for i in range(70))))) == 64
    assert [r.key for r in gate.offer([(req("i0", 0), True, 1)])] == ["i0"]  # never held
    assert gate.done("b0") == []  # 63 inside, the limit now 62: nothing goes in
    gate.done("b1")
    assert [r.key for r in gate.done("b2")] == ["b64"]  # down to 61: one goes in


def test_held_requests_go_in_best_priority_first() -> None:
    gate = EngineGate(Capacity(slots=1), Reserve(slots=0, fraction=0))
    assert [r.key for r in gate.offer([(req("a", 5), False, 1)])] == ["a"]
    gate.offer([(req("late", 9), False, 1), (req("soon", 1), False, 1), (req("next", 5), False, 1)])
    assert [r.key for r in gate.held()] == ["soon", "next", "late"]
    assert [r.key for r in gate.done("a")] == ["soon"]
    assert [r.key for r in gate.done("soon")] == ["next"]


def test_kv_tokens_bound_worse_lanes_but_an_empty_engine_takes_one() -> None:
    clock = Clock()
    gate = EngineGate(Capacity(slots=None, tokens=1000), Reserve(slots=0, fraction=0.1), clock)
    gate.offer([(req("i", 0), True, 1)])
    now = gate.offer([(req("x"), False, 400), (req("y"), False, 400), (req("z"), False, 400)])
    assert [r.key for r in now] == ["x", "y"]  # 800 of 900; z would pass it
    assert [r.key for r in gate.done("x")] == ["z"]
    gate.done("y")
    gate.done("z")
    assert [r.key for r in gate.offer([(req("huge"), False, 5000)])] == ["huge"]  # alone: fits


def test_an_unbounded_engine_holds_nothing() -> None:
    gate = EngineGate(Capacity(), Reserve())
    assert len(gate.offer(bulk(*(f"b{i}" for i in range(100)), cost=10**9))) == 100
    assert gate.held() == [] and not gate.bounded


def test_a_cancelled_jobs_held_requests_are_taken_out() -> None:
    gate = EngineGate(Capacity(slots=1), Reserve(slots=0, fraction=0))
    gate.offer(bulk("a1", "c1", "a2"))
    gone = gate.drop(lambda r: r.key.startswith("c"))
    assert [r.key for r in gone] == ["c1"] and [r.key for r in gate.held()] == ["a2"]
    assert [r.key for r in gate.done("a1")] == ["a2"]
