"""Reading results from the Kafka results topic (workers run with `--results-topic`).

For code that consumes the topic as a stream, any Kafka consumer will do (key =
request_id, value = the result envelope JSON; `isolation_level="read_committed"` when
the workers publish transactionally). This module is for *waiting* on given requests
without Redis: it reads only the partitions the ids hash to (the producer's default
partitioner: murmur2 of the key, as Java's), from a start time on, and returns the
first result seen for each id.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

from kafka import KafkaConsumer
from kafka.partitioner.default import murmur2
from kafka.structs import TopicPartition

from schemas import ResultEnvelope
from schemas.settings import ConnectionSettings

DEFAULT_LOOKBACK_S = 3_600.0
"""How far back `wait` reads when no start time is given."""


def partition_for(request_id: str, partitions: int) -> int:
    """The partition a result keyed by `request_id` lands in (Kafka's default partitioner)."""
    return (murmur2(request_id.encode("utf-8")) & 0x7FFFFFFF) % partitions


class TopicResults:
    """Waits for results on the results topic (settings.results_topic, or `topic`)."""

    def __init__(
        self,
        settings: ConnectionSettings | None = None,
        *,
        topic: str | None = None,
        consumer: Any | None = None,
    ) -> None:
        self.settings = settings or ConnectionSettings()
        name = topic or self.settings.results_topic
        if not name:
            raise ValueError("no results topic: give --from-topic NAME or QBATCH_RESULTS_TOPIC")
        self.topic = name
        self._consumer = consumer

    @property
    def consumer(self) -> Any:
        if self._consumer is None:
            self._consumer = KafkaConsumer(
                group_id=None,
                enable_auto_commit=False,
                isolation_level="read_committed",
                client_id="qbatch-wait",
                **self.settings.kafka_kwargs(),
            )
        return self._consumer

    def wait(
        self,
        request_ids: Sequence[str],
        timeout: float | None = 60.0,
        *,
        since_ms: int | None = None,
    ) -> dict[str, ResultEnvelope | None]:
        """The first result on the topic for each id (None where none came in time).

        Reads from `since_ms` (epoch ms; default: an hour ago) in the partitions the ids
        hash to.
        """
        found: dict[str, ResultEnvelope | None] = dict.fromkeys(request_ids)
        wanted = {rid.encode("utf-8"): rid for rid in request_ids}
        if not wanted:
            return found
        consumer = self.consumer
        parts = consumer.partitions_for_topic(self.topic)
        if not parts:
            raise ValueError(f"results topic {self.topic!r} does not exist")
        mine = sorted({partition_for(rid, len(parts)) for rid in request_ids})
        tps = [TopicPartition(self.topic, p) for p in mine]
        consumer.assign(tps)
        self._seek(tps, since_ms or int((time.time() - DEFAULT_LOOKBACK_S) * 1000))
        deadline = None if timeout is None else time.monotonic() + timeout
        missing = set(wanted)
        while missing:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            batches = consumer.poll(timeout_ms=int(min(left or 1.0, 1.0) * 1000))
            for record in _records(batches.values()):
                if record.key in missing:
                    missing.discard(record.key)
                    found[wanted[record.key]] = ResultEnvelope.model_validate_json(record.value)
        return found

    def _seek(self, tps: list[TopicPartition], since_ms: int) -> None:
        consumer = self.consumer
        offsets = consumer.offsets_for_times(dict.fromkeys(tps, since_ms))
        ends = consumer.end_offsets(tps)
        for tp in tps:
            at = offsets.get(tp)
            consumer.seek(tp, at.offset if at is not None else ends[tp])

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()


def _records(batches: Iterable[list[Any]]) -> Iterable[Any]:
    for batch in batches:
        yield from batch


__all__ = ["DEFAULT_LOOKBACK_S", "TopicResults", "partition_for"]
