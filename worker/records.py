"""What travels between the worker's threads: a record's journey, stage by stage.

intake (main thread) -> `Inbound` -> dispatcher -> `Running` (in the engine) ->
`Finished` -> writer -> `Reply` -> sinks; the writer hands the written offsets back
to intake, which commits them.
"""

from __future__ import annotations

import itertools
import math
import queue
import zlib
from dataclasses import dataclass
from typing import Any

from kafka.structs import TopicPartition

from schemas import RequestEnvelope, ResultEnvelope, WorkerInfo
from schemas.tool_events import ToolTurnEvent
from worker.batching import Batch
from worker.endpoints.base import RenderedPrompt
from worker.engines.base import EngineOutput


@dataclass(slots=True)
class SourceRecord:
    """What the worker keeps of a Kafka record while its request is in flight: where it
    came from and its bytes, for a dead letter and for the strike rule.

    Not kafka-python's record object: that one holds every header the producer sent
    (500,000 empty headers in a 1 MB record cost 35 MB of Python objects each), and a
    decompressed value of any size (a 100 KB gzip record can hold 100 MB). The value is
    kept whole up to `keep` bytes (requests are under 1 MB, so every record that runs
    keeps its bytes), else only its first `keep` bytes, with its size and checksum.
    """

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    size: int
    """The value's length as received (`len(value)` unless it was cut)."""
    timestamp: int | None = None
    _crc: int | None = None

    @classmethod
    def of(cls, record: Any, keep: int) -> SourceRecord:
        value = record.value if record.value is not None else b""
        source = cls(
            record.topic,
            record.partition,
            record.offset,
            record.key,
            value[:keep] if len(value) > keep else value,
            len(value),
            record.timestamp,
        )
        if source.cut:
            source._crc = _checksum(record.key, value)
        return source

    @property
    def cut(self) -> bool:
        return len(self.value) < self.size

    def suspect(self) -> tuple[str, int, int, int]:
        """Its name for the strike rule (`worker.supervision.Suspect`)."""
        return (self.topic, self.partition, self.offset, self.checksum())

    def checksum(self) -> int:
        """CRC-32 of key and value as received (computed when first asked: only the strike
        rule asks, for records with strikes)."""
        if self._crc is None:
            self._crc = _checksum(self.key, self.value)
        return self._crc


def _checksum(key: bytes | None, value: bytes) -> int:
    return zlib.crc32(value, zlib.crc32(key or b""))


@dataclass(slots=True)
class Inbound:
    """A decoded record waiting for, or inside, a micro-batch."""

    tp: TopicPartition
    offset: int
    record: SourceRecord
    envelope: RequestEnvelope
    dequeued_ms: int
    lane: str = "interactive"
    epoch: int = 0
    """The partition's assignment epoch when the record was taken (see Intake.epochs)."""
    isolate: bool = False
    """On probation: this record was being handled when a worker stopped on a fault, so it
    runs and is written alone (a second fault then blames it, and only it)."""


@dataclass(slots=True)
class Running:
    inbound: Inbound
    rendered: RenderedPrompt
    dispatched_ms: int
    worker: WorkerInfo | None = None
    admitted_ms: int | None = None
    """When its batch's admission look-up answered."""
    engine_submitted_ms: int | None = None
    """When its batch went to the engine (after every request of it was rendered)."""
    """Shared by the whole micro-batch; set once its size is known."""


@dataclass(slots=True)
class Finished:
    running: Running
    output: EngineOutput
    finished_ms: int


@dataclass(slots=True)
class Reply:
    """One record's final state for the sinks.

    `result` None means nothing new to write: either the request was answered before (a
    redelivery: `answered` names it, and the writer fills `stored` with that earlier
    result's JSON when a sink other than the dedupe store needs it again), or the record
    had no request_id at all (it was only dead-lettered), or it is a tool loop's turn that
    ended in calls (`turn`: only the tool-calls sink takes it).
    """

    tp: TopicPartition
    offset: int
    record: SourceRecord | None
    result: ResultEnvelope | None
    ttl_s: int = 86_400
    lane: str = "interactive"
    epoch: int = 0
    answered: str | None = None
    stored: bytes | None = None
    isolate: bool = False
    turn: ToolTurnEvent | None = None
    reserved: int = 0
    """The result bytes its request reserved (`worker.result_budget`), freed once written."""
    _encoded: tuple[int, bytes] | None = None
    _turn_bytes: bytes | None = None

    def encoded(self) -> bytes:
        """The result's JSON, made once for every sink (and again only if the result is
        replaced, e.g. by a duplicate-id answer)."""
        assert self.result is not None
        cached = self._encoded
        if cached is None or cached[0] != id(self.result):
            cached = (id(self.result), self.result.model_dump_json(exclude_none=True).encode())
            self._encoded = cached
        return cached[1]

    def size(self) -> int:
        """Bytes this reply sends: its result's JSON (made now, once) or its turn's."""
        if self.result is not None:
            return len(self.encoded())
        if self.turn is not None:
            return len(self.encoded_turn())
        return 0

    def encoded_turn(self) -> bytes:
        """The turn event's JSON, made once (the writer checks its size first)."""
        assert self.turn is not None
        if self._turn_bytes is None:
            self._turn_bytes = self.turn.model_dump_json().encode()
        return self._turn_bytes


Done = list[tuple[TopicPartition, int, int]]
"""(partition, offset, the partition's assignment epoch when the record was taken) of
records every sink now holds: what the writer hands back to intake."""


class DispatchQueue:
    """Micro-batches waiting for the dispatcher, best lane first, then in arrival order:
    an interactive batch never waits behind bulk batches already queued (a poll can
    bring dozens at once). Thread-safe; `close()` queues the end after everything."""

    def __init__(self) -> None:
        self._q: queue.PriorityQueue[tuple[float, int, Batch[Inbound] | None]] = (
            queue.PriorityQueue()
        )
        self._seq = itertools.count()

    def put(self, batch: Batch[Inbound], rank: int = 0) -> None:
        self._q.put((rank, next(self._seq), batch))

    def close(self) -> None:
        self._q.put((math.inf, next(self._seq), None))

    def get(self) -> Batch[Inbound] | None:
        return self._q.get()[2]

    def qsize(self) -> int:
        return self._q.qsize()


__all__ = ["DispatchQueue", "Done", "Finished", "Inbound", "Reply", "Running", "SourceRecord"]
