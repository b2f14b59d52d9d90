"""The writer's rules over sinks, without sockets: a refused result is found by halving
and answered alone, the dedupe store's verdict decides what other sinks get, and offsets
come back only when every sink holds the chunk. (The Redis and Kafka sinks themselves are
tested against the real servers in tests/integration.)"""

from __future__ import annotations

import json
import queue
import types
from collections.abc import Sequence
from typing import Any

from kafka.structs import TopicPartition

from schemas import ErrorCode, ResultEnvelope, Status, WorkerInfo
from schemas.ref import RequestRef
from schemas.replies import WriteReply, WriteStatus
from worker.records import Reply
from worker.sinks.base import ReplySink, SinkHealth, SinkRefused, SinkUnavailable
from worker.writer import Writer

TP = TopicPartition("t", 0)


class Store(ReplySink):
    """A dedupe store whose verdicts the test sets per request_id."""

    name = "store"
    dedupes = True

    def __init__(self) -> None:
        self.refuse: set[str] = set()
        self.wrong_type: set[str] = set()
        self.existing: dict[str, bytes] = {}
        self.other_job: set[str] = set()
        self.unavailable_for = 0
        self.calls: list[list[str]] = []
        self.written: dict[str, ResultEnvelope] = {}
        self.without_jobs: list[str] = []
        self.duplicates: list[ResultEnvelope] = []

    def write(
        self, replies: Sequence[Reply], now_ms: int, *, job_bookkeeping: bool = True
    ) -> list[WriteReply]:
        if self.unavailable_for:
            self.unavailable_for -= 1
            raise SinkUnavailable("down")
        ids = [r.result.request_id for r in replies if r.result]
        self.calls.append(ids)
        if job_bookkeeping and self.refuse & set(ids):
            raise SinkRefused("script error")
        out = []
        for r in replies:
            rid = r.result.request_id if r.result else ""
            if r.result is None or rid in self.existing:
                out.append(WriteReply(WriteStatus.existed))
            elif job_bookkeeping and rid in self.wrong_type:
                out.append(WriteReply(WriteStatus.wrong_type, "its job key holds a Redis string"))
            elif rid in self.other_job:
                out.append(WriteReply(WriteStatus.other_job))
            else:
                self.written[rid] = r.result
                if not job_bookkeeping:
                    self.without_jobs.append(rid)
                out.append(WriteReply(WriteStatus.written))
        return out

    def stored(self, request_ids: Sequence[str]) -> dict[str, bytes]:
        return {rid: self.existing[rid] for rid in request_ids if rid in self.existing}

    def record_duplicate(self, result: ResultEnvelope, ttl_s: int, now_ms: int) -> WriteReply:
        self.duplicates.append(result)
        return WriteReply(WriteStatus.written)


class Topic(ReplySink):
    name = "topic"

    def __init__(self) -> None:
        self.got: list[tuple[str | None, str | None, bytes | None]] = []
        self.flushes = 0

    def write(
        self, replies: Sequence[Reply], now_ms: int, *, job_bookkeeping: bool = True
    ) -> list[WriteReply]:
        for r in replies:
            status = r.result.status.value if r.result else None
            self.got.append((r.result.request_id if r.result else r.answered, status, r.stored))
        return [WriteReply(WriteStatus.written)] * len(replies)

    def flush(self) -> None:
        self.flushes += 1


class DeadLetters:
    def __init__(self) -> None:
        self.sent: list[tuple[Any, str]] = []

    def send(self, record: Any, error: Any) -> None:
        self.sent.append((record, error.message))


def reply(
    rid: str, offset: int, job: str | None = "j", *, epoch: int = 0, padding: int = 0
) -> Reply:
    """A succeeded result; `padding` characters of metadata make it that much larger."""
    metadata = {"x": "y" * padding} if padding else None
    result = ResultEnvelope.for_request(
        RequestRef(request_id=rid, job_id=job, metadata=metadata), Status.succeeded, timings=None
    )
    return Reply(TP, offset, f"record-{offset}", result, epoch=epoch)


def make(
    *sinks: ReplySink, **options: Any
) -> tuple[Writer, list[list[tuple[TopicPartition, int, int]]], DeadLetters]:
    """A writer over `sinks` (`options`: Writer's keyword settings), what it reports done,
    and its dead letters."""
    done: list[list[tuple[TopicPartition, int, int]]] = []
    dead = DeadLetters()
    writer = Writer(
        list(sinks),
        dead,  # type: ignore[arg-type]
        queue.SimpleQueue(),
        done.append,
        model=lambda: "m",
        worker_info=lambda: WorkerInfo(id="w"),
        chunk_max=64,
        stopping=lambda: False,
        drain_timeout_s=1,
        health=SinkHealth(),
        **options,
    )
    return writer, done, dead


def test_a_refused_result_is_found_by_halving_and_answered_alone() -> None:
    store = Store()
    store.refuse = {"r5"}
    writer, done, dead = make(store)
    writer.write([reply(f"r{i}", i) for i in range(10)])
    assert set(store.written) == {f"r{i}" for i in range(10)}
    assert store.written["r5"].status is Status.failed
    assert store.written["r5"].error is not None
    assert store.written["r5"].error.code is ErrorCode.internal_error
    assert store.without_jobs == ["r5"]  # its job's keys are what failed
    assert dead.sent == [("record-5", "store refused the result: script error")]
    assert done == [[(TP, i, 0) for i in range(10)]]
    assert max(len(c) for c in store.calls[1:]) < 10  # the chunk was split


def test_a_key_of_the_wrong_type_costs_only_its_result() -> None:
    store = Store()
    store.wrong_type = {"r1"}
    writer, done, dead = make(store)
    writer.write([reply("r0", 0), reply("r1", 1), reply("r2", 2)])
    assert store.written["r0"].ok and store.written["r2"].ok
    assert not store.written["r1"].ok and store.without_jobs == ["r1"]
    assert [r for r, _ in dead.sent] == ["record-1"]
    assert done == [[(TP, 0, 0), (TP, 1, 0), (TP, 2, 0)]]


def test_the_store_verdict_decides_what_the_topic_gets() -> None:
    store, topic = Store(), Topic()
    store.existing = {"old": b'{"stored": true}'}
    store.other_job = {"dup"}
    writer, done, _ = make(store, topic)
    answered = Reply(TP, 3, "record-3", None, answered="known")
    store.existing["known"] = b'{"known": 1}'
    writer.write([reply("new", 0), reply("old", 1), reply("dup", 2), answered])
    assert topic.got == [
        ("new", "succeeded", None),
        ("old", None, b'{"stored": true}'),  # the first answer stands, everywhere
        ("dup", "failed", None),
        ("known", None, b'{"known": 1}'),
    ]
    [dup] = store.duplicates
    assert dup.error is not None and dup.error.code is ErrorCode.duplicate_request_id
    assert topic.flushes == 1 and done == [[(TP, 0, 0), (TP, 1, 0), (TP, 2, 0), (TP, 3, 0)]]


def test_an_unavailable_sink_is_retried_and_offsets_wait_for_it() -> None:
    store = Store()
    store.unavailable_for = 2
    health_changes: list[bool] = []
    writer, done, _ = make(store)
    writer.health = SinkHealth(health_changes.append)
    writer.write([reply("r0", 0)])
    assert store.written["r0"].ok
    assert health_changes == [False, True]
    assert done == [[(TP, 0, 0)]]


def test_the_transactional_buffer_ignores_stale_results_and_refuses_oversized_ones() -> None:
    """KafkaResultsSink's buffering, with a stand-in producer (the transaction itself is
    tested against the broker in tests/reliability/test_results_topic.py)."""
    import pytest

    from worker.config import WorkerSettings
    from worker.sinks.kafka_sink import KafkaResultsSink

    class Producer:
        def init_transactions(self) -> None:
            return

    settings = WorkerSettings(
        engine="echo",
        results_topic="r",
        results_transactional=True,
        results_max_record_bytes=2048,
    )
    sink = KafkaResultsSink(settings, producer=Producer())
    sink.write([reply("a", 0), reply("b", 1)], 0)
    assert sink.pending() == 2
    sink.drop({TP}, {TP: 1})  # revoked: its held results go, the epoch moves on
    assert sink.pending() == 0
    late = reply("c", 2)  # taken before the revoke (epoch 0), answered after it
    sink.write([late], 0)
    assert sink.pending() == 0
    sink.write([reply("d", 3, epoch=1)], 0)
    assert sink.pending() == 1
    with pytest.raises(SinkRefused):
        sink.write([reply("e", 4, epoch=1, padding=4000)], 0)
    assert sink.pending() == 1
    # under the limit by its value alone, over it as a record (key, headers, framing):
    # kafka-python would refuse it inside every transaction after it
    near = reply("f", 5, epoch=1, padding=1500)
    assert 2048 - 512 < len(near.encoded()) < 2048
    with pytest.raises(SinkRefused, match="framing"):
        sink.write([near], 0)
    assert sink.pending() == 1


def test_a_failed_transaction_puts_back_only_the_current_assignments_results() -> None:
    from kafka.errors import KafkaError

    from worker.config import WorkerSettings
    from worker.sinks.kafka_sink import KafkaResultsSink

    class Producer:
        on_send: Any = None

        def init_transactions(self) -> None:
            return

        def begin_transaction(self) -> None:
            return

        def send(self, *_args: Any, **_kwargs: Any) -> Any:
            if self.on_send is not None:
                self.on_send()
            return types.SimpleNamespace(exception=None)

        def flush(self) -> None:
            return

        def send_offsets_to_transaction(self, *_args: Any) -> None:
            return

        def commit_transaction(self) -> None:
            raise KafkaError("IllegalGeneration")

        def abort_transaction(self) -> None:
            return

    settings = WorkerSettings(engine="echo", results_topic="r", results_transactional=True)
    producer = Producer()
    sink = KafkaResultsSink(settings, producer=producer)
    sink.write([reply("a", 0), reply("b", 1)], 0)
    assert sink.commit_transaction({TP: 2}, group=None) is False
    assert sink.pending() == 2  # same assignment: back in the buffer for the next try
    # revoked (and maybe assigned back) while the transaction ran: not put back, the
    # records come again from the last commit
    producer.on_send = lambda: sink.drop({TP}, {TP: 1})
    assert sink.commit_transaction({TP: 2}, group=None) is False
    assert sink.pending() == 0


def test_an_answered_request_whose_result_expired_is_logged() -> None:
    """Answered before, its result gone (result_ttl_s) by the redelivery: the topic gets
    nothing to republish, and the operator gets a line saying which."""
    from structlog.testing import capture_logs

    store, topic = Store(), Topic()
    writer, done, _ = make(store, topic)
    with capture_logs() as logs:
        writer.write([Reply(TP, 7, "record-7", None, answered="expired")])
    assert topic.got == [("expired", None, None)]
    assert done == [[(TP, 7, 0)]]
    [line] = [e for e in logs if e["event"] == "stored_result_missing"]
    assert line["count"] == 1 and line["request_ids"] == ["expired"]


def test_a_tool_loop_turn_that_cannot_be_built_costs_only_its_request(
    monkeypatch: Any,
) -> None:
    """A defect on the way to the next tool-loop turn (here: routing raises) answers that
    request with an internal_error result; the writer thread lives on, writes the next
    request and hands both offsets back (before, the exception ended the writer before the
    chunk was set, so nothing was blamed and every restart met the record again)."""
    from schemas import decode_request
    from worker.engines.echo import echo_output
    from worker.records import Finished, Inbound, Running
    from worker.rendering import PromptRenderer
    from worker.tool_loop import routing

    def finished(rid: str, offset: int, *, loop: bool) -> Finished:
        env: dict[str, Any] = {
            "request_id": rid,
            "body": {"messages": [{"role": "user", "content": "hi"}]},
        }
        if loop:
            env["tool_loop"] = {"max_turns": 4}
            env["body"]["tools"] = [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
            ]
        envelope = decode_request(json.dumps(env).encode(), rid.encode())
        rendered = PromptRenderer(None, max_model_len=4096, served_names={"m"}).render(envelope)
        output = echo_output(rendered.engine_request(rid))
        return Finished(
            Running(Inbound(TP, offset, f"rec-{offset}", envelope, 0), rendered, 0), output, 1
        )

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed")

    monkeypatch.setattr(routing, "route", broken)
    store = Store()
    writer, done, _ = make(store)
    writer.inbox.put(finished("loop-1", 7, loop=True))
    writer.inbox.put(finished("plain-1", 8, loop=False))
    writer.inbox.put(None)
    writer.run()
    failed = store.written["loop-1"]
    assert failed.status is Status.failed and failed.error is not None
    assert failed.error.code is ErrorCode.internal_error
    assert "building the next tool-loop turn: UnicodeEncodeError" in failed.error.message
    assert store.written["plain-1"].status is Status.succeeded
    assert sorted(o for chunk in done for _, o, _ in chunk) == [7, 8]
