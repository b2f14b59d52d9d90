"""A worker (re)started while a broker is down must not die at subscribe: its first
metadata request may fail (the chaos soak restarted a worker during a broker kill, and it
exited with KafkaConnectionError from `partitions_for_topic`)."""

from __future__ import annotations

from typing import Any

from kafka.errors import KafkaConnectionError

from worker.config import WorkerSettings
from worker.kafka_io import RequestConsumer


class Consumer:
    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.asked = 0

    def subscribe(self, topics: list[str], listener: Any) -> None:
        self.topics = topics

    def partitions_for_topic(self, topic: str) -> set[int] | None:
        self.asked += 1
        if self.failures > 0:
            self.failures -= 1
            raise KafkaConnectionError("111 ECONNREFUSED")
        return {0, 1}


def test_subscribe_rides_out_a_failing_metadata_request() -> None:
    rc = object.__new__(RequestConsumer)  # no broker: only the subscribe step is under test
    rc._settings = WorkerSettings(kafka_bootstrap="127.0.0.1:1")
    rc.topics = ["qbatch.requests"]
    rc._consumer = Consumer(failures=2)  # type: ignore[assignment]
    rc._listener = None
    rc.kafka_ok = True
    rc.on_reachability = lambda ok: None
    rc._stopping = lambda: False
    rc._subscribe()
    assert rc._consumer.asked >= 3  # type: ignore[attr-defined]
