"""The dispatcher's engine gate and cancels, with a fake engine and store (no Kafka or
Redis): bulk requests past the engine's room wait in the worker and go in as others
finish, an interactive one goes in at once; a cancel answers the held requests
`cancelled` and aborts those in the engine, while a request that finished before the
abort keeps its answer; every request gets exactly one outcome; and each request's
stage timings come back in its result."""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Sequence
from typing import Any

from kafka.structs import TopicPartition

from schemas import Status, WorkerInfo, decode_request
from worker.dispatch import Dispatcher
from worker.engine_gate import Reserve
from worker.engines.base import Engine, EngineOutput, EngineRequest, OnDone
from worker.engines.echo import echo_output
from worker.records import DispatchQueue, Finished, Inbound, Reply
from worker.rendering import PromptRenderer
from worker.results import finished_result
from worker.sinks.base import Admission, ReplySink, SinkHealth

TP = TopicPartition("t", 0)
RANKS = {"interactive": 0, "bulk": 1}


class HeldEngine(Engine):
    """Runs nothing until told: `finish(key)` answers one; `abort` answers "abort"."""

    name = "held"

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.inside: dict[str, tuple[EngineRequest, OnDone]] = {}
        self.order: list[str] = []
        self.aborted: list[str] = []

    @classmethod
    def from_settings(cls, settings: Any) -> Engine:
        raise NotImplementedError

    def capacity(self) -> tuple[int | None, int | None]:
        return self.slots, None

    def submit(self, batch: Sequence[EngineRequest], on_done: OnDone) -> None:
        for request in batch:
            self.inside[request.key] = (request, on_done)
            self.order.append(request.key)

    def finish(self, key: str) -> None:
        request, on_done = self.inside.pop(key)
        output = echo_output(request)
        output.scheduled_ms, output.first_token_ms = 5, 7
        on_done(output)

    def abort(self, keys: Sequence[str]) -> None:
        for key in keys:
            self.aborted.append(key)
            if key in self.inside:
                _request, on_done = self.inside.pop(key)
                on_done(EngineOutput(key, "", 0, 0, "abort"))


class CancelStore(ReplySink):
    name = "redis"
    dedupes = True

    def __init__(self) -> None:
        self.cancelled: set[str] = set()

    def admission(self, envelopes: Sequence[Any]) -> Admission:
        return Admission({}, frozenset(self.cancelled))

    def cancelled_jobs(self, job_ids: Sequence[str]) -> frozenset[str]:
        return frozenset(j for j in job_ids if j in self.cancelled)

    def write(self, replies: Sequence[Reply], now_ms: int, **_: Any) -> list[Any]:
        return []


def inbound(rid: str, job: str | None, lane: str, offset: int) -> Inbound:
    doc: dict[str, Any] = {
        "request_id": rid,
        "body": {"messages": [{"role": "user", "content": "hi"}]},
    }
    if job:
        doc["job_id"] = job
    env = decode_request(json.dumps(doc).encode(), rid.encode())
    return Inbound(TP, offset, f"rec-{offset}", env, 1_000, lane=lane)  # type: ignore[arg-type]


def make(slots: int = 8) -> tuple[Dispatcher, HeldEngine, CancelStore, queue.SimpleQueue[Any]]:
    engine, store = HeldEngine(slots), CancelStore()
    out: queue.SimpleQueue[Any] = queue.SimpleQueue()
    renderer = PromptRenderer(None, max_model_len=4096, served_names={"m"})
    dispatcher = Dispatcher(
        engine,
        lambda: renderer,
        store,
        DispatchQueue(),
        out,
        worker_id="w",
        worker_info=lambda batch, size: WorkerInfo(id="w"),
        lane_rank=RANKS.__getitem__,
        stopping=threading.Event(),
        health=SinkHealth(),
        dead_letter=lambda item, error: None,
        reserve=Reserve(slots=8, fraction=0.02),
        cancel_poll_s=0,
    )
    return dispatcher, engine, store, out


def drain(out: queue.SimpleQueue[Any]) -> list[Any]:
    items = []
    while not out.empty():
        items.append(out.get())
    return items


def test_bulk_past_the_engines_room_waits_and_interactive_goes_in_at_once() -> None:
    dispatcher, engine, _store, out = make(slots=8)
    dispatcher.admit_and_submit([inbound("i0", None, "interactive", 100)])  # lane about
    dispatcher.admit_and_submit([inbound(f"b{i}", "job", "bulk", i) for i in range(10)])
    assert len(engine.inside) == 8 and len(dispatcher.gate.held()) == 3  # 7 bulk, 1 kept
    dispatcher.admit_and_submit([inbound("i1", None, "interactive", 101)])
    assert len(engine.inside) == 9  # no bulk request had to finish first
    engine.finish("0")  # the first interactive request
    engine.finish(engine.order[1])  # a bulk one: one held goes in
    assert len(dispatcher.gate.held()) == 2
    assert [o.output.finish for o in drain(out)] == ["stop", "stop"]


def test_a_cancel_answers_held_lines_and_aborts_the_engines() -> None:
    dispatcher, engine, store, out = make(slots=8)
    # no interactive request about: bulk may fill all 8 slots
    dispatcher.admit_and_submit([inbound(f"c{i}", "cx", "bulk", i) for i in range(10)])
    dispatcher.admit_and_submit([inbound("k0", "keep", "bulk", 50)])
    engine.finish(engine.order[0])  # finished before the cancel: its answer stands
    store.cancelled.add("cx")
    dispatcher.stop_jobs(store.cancelled_jobs(["cx", "keep"]))
    outcomes = drain(out)
    finished = [o for o in outcomes if isinstance(o, Finished)]
    cancelled = [o for o in outcomes if isinstance(o, Reply)]
    assert len(finished) == 1 and finished[0].output.finish == "stop"
    # c0 finished and let c8 in: 8 in the engine aborted, c9 held answered
    assert len(cancelled) == 9
    assert {r.result.status for r in cancelled} == {Status.cancelled}
    assert {r.result.error.code.value for r in cancelled} == {"cancelled"}
    assert len(engine.aborted) == 8 and not dispatcher.gate.held()
    (left,) = engine.inside.values()  # the other job's request went in as they left
    assert left[0].key not in engine.aborted and dispatcher.running == 1


def test_a_cancelled_job_meets_admission_too() -> None:
    dispatcher, engine, store, out = make()
    store.cancelled.add("late")
    dispatcher.admit_and_submit([inbound("l0", "late", "bulk", 0)])
    (reply,) = drain(out)
    assert reply.result.status is Status.cancelled and not engine.inside


def test_stage_timings_reach_the_result() -> None:
    dispatcher, engine, _store, out = make()
    dispatcher.admit_and_submit([inbound("t0", None, "interactive", 0)])
    engine.finish(engine.order[0])
    (done,) = drain(out)
    result = finished_result(done, model="m", worker=WorkerInfo(id="w"))
    t = result.timings
    assert t.dequeued == 1_000 and t.dispatched is not None and t.admitted is not None
    assert t.engine_submitted is not None and t.scheduled == 5 and t.first_token == 7
    assert t.admission_ms == t.admitted - t.dispatched
    assert t.render_ms == t.engine_submitted - t.admitted and t.prefill_ms == 2.0
    assert set(t.stages_ms()) >= {"batch_wait", "admission", "render", "engine_wait", "prefill"}


def test_only_the_best_lanes_requests_are_marked_first_lane() -> None:
    dispatcher, engine, _store, _out = make()
    dispatcher.admit_and_submit([inbound("i0", None, "interactive", 0)])
    dispatcher.admit_and_submit([inbound("b0", "job", "bulk", 1)])
    marks = {request.key: request.first_lane for request, _ in engine.inside.values()}
    assert marks == {engine.order[0]: True, engine.order[1]: False}
