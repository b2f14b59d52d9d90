"""The tool-calls sink: a tool loop's turn that ended in calls goes to the tool-calls topic.

Such a turn has no result (`Reply.result` is None), only `Reply.turn`; every other sink
skips it. Record: key = request_id (one loop's turns stay in one partition's order), value
= the `schemas.tool_events.ToolTurnEvent` JSON, header `qbatch.turn`. Produced with
acks=all and idempotence, and flushed before the writer marks the record done, so a
committed request offset never passes a turn the executor has not got (at-least-once: a
worker that dies after the send and before its commit runs the turn again and publishes it
again; the executor's call records keep the tools from running twice for the same calls).
The writer checks each event's size against `tool_calls_max_record_bytes` first, so the
topic refusing one is a configuration error (a topic limit below the setting) and is
dead-lettered like any refused reply.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kafka import KafkaProducer
from kafka.errors import KafkaError, MessageSizeTooLargeError, RecordListTooLargeError

from schemas.kafka_compat import repair_idempotent_reset
from schemas.replies import WriteReply, WriteStatus
from worker.config import WorkerSettings
from worker.records import Reply
from worker.sinks.base import ReplySink, SinkRefused, SinkUnavailable
from worker.sinks.kafka_sink import flush_sends

TURN_HEADER = "qbatch.turn"
_REFUSED = (MessageSizeTooLargeError, RecordListTooLargeError)


class ToolCallsSink(ReplySink):
    name = "tool_calls"

    def __init__(self, settings: WorkerSettings, producer: Any | None = None) -> None:
        self.topic = settings.tool_calls_topic
        self.where = f"{self.topic} on {settings.kafka_bootstrap}"
        self._producer: Any = producer or repair_idempotent_reset(
            KafkaProducer(
                acks="all",
                enable_idempotence=True,
                linger_ms=2,
                max_block_ms=10_000,
                request_timeout_ms=10_000,
                delivery_timeout_ms=30_000,
                max_request_size=settings.tool_calls_max_record_bytes + 4096,
                reconnect_backoff_max_ms=2_000,
                client_id=f"qbatch-tool-calls-{settings.worker_id}",
                **settings.kafka_kwargs(),
            )
        )
        self._futures: list[Any] = []

    def write(
        self, replies: Sequence[Reply], now_ms: int, *, job_bookkeeping: bool = True
    ) -> list[WriteReply]:
        for reply in replies:
            if reply.turn is None:
                continue
            event = reply.turn
            try:
                self._futures.append(
                    self._producer.send(
                        self.topic,
                        key=event.request_id.encode("utf-8"),
                        value=reply.encoded_turn(),
                        headers=[(TURN_HEADER, str(event.turn).encode())],
                    )
                )
            except _REFUSED as exc:
                raise SinkRefused(f"tool-calls topic: {exc}") from exc
            except KafkaError as exc:
                raise SinkUnavailable(f"tool-calls topic: {type(exc).__name__}: {exc}") from exc
        return [WriteReply(WriteStatus.written)] * len(replies)

    def flush(self) -> None:
        futures, self._futures = self._futures, []
        if futures:
            flush_sends(self._producer, futures, "tool-calls topic")

    def close(self) -> None:
        self._producer.close(timeout=5)


__all__ = ["TURN_HEADER", "ToolCallsSink"]
