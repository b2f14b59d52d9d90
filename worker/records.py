"""What travels between the worker's threads: a record's journey, stage by stage.

intake (main thread) -> `Inbound` -> dispatcher -> `Running` (in the engine) ->
`Finished` -> writer -> `Reply` -> sinks; the writer hands the written offsets back
to intake, which commits them.
"""

from __future__ import annotations

import itertools
import math
import queue
from dataclasses import dataclass
from typing import Any

from kafka.structs import TopicPartition

from schemas import RequestEnvelope, ResultEnvelope, WorkerInfo
from schemas.tool_events import ToolTurnEvent
from worker.batching import Batch
from worker.engines.base import EngineOutput
from worker.rendering import RenderedPrompt


@dataclass(slots=True)
class Inbound:
    """A decoded record waiting for, or inside, a micro-batch."""

    tp: TopicPartition
    offset: int
    record: Any
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
    record: Any
    result: ResultEnvelope | None
    ttl_s: int = 86_400
    lane: str = "interactive"
    epoch: int = 0
    answered: str | None = None
    stored: bytes | None = None
    isolate: bool = False
    turn: ToolTurnEvent | None = None
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


__all__ = ["DispatchQueue", "Done", "Finished", "Inbound", "Reply", "Running"]
