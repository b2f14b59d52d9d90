"""The Kafka side of the worker: a consumer owned by one thread, and the DLQ producer.

kafka-python's consumer is not thread-safe, so this adapter is used only from
the service's main loop: poll, commit, pause and resume all happen there. The
rebalance callbacks are the exception: kafka-python 3 runs them on its own IO
thread, but only while the main thread is blocked inside `poll()` or `close()`,
so they never run beside the loop; they must not block (see `commit_nowait`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from kafka import ConsumerRebalanceListener, KafkaConsumer, KafkaProducer
from kafka.errors import CommitFailedError, KafkaError, RebalanceInProgressError
from kafka.structs import OffsetAndMetadata, TopicPartition
from tenacity import (
    retry,
    retry_if_exception_type,
    retry_if_not_exception_type,
    stop_after_attempt,
    wait_exponential,
)

from schemas import ContractError, dlq
from worker.config import WorkerSettings
from worker.logs import log

Partitions = Callable[[set[TopicPartition]], None]
RECONNECT_BACKOFF_MAX_MS = 2_000


def resume_partitions(consumer: KafkaConsumer, *partitions: TopicPartition) -> None:
    """`consumer.resume()` plus a fix for a kafka-python 3.0.12 fetcher bug.

    Records already fetched for a partition when it is paused are parked in
    `Fetcher._paused_partition_records`; `fetch_records()` restores them only when
    `Fetcher._next_partition_records` is None, but a drained PartitionRecords is left
    there (falsy, not None). The resumed partition is then never returned nor fetched
    again: a stalled partition after every backpressure pause, in about half the runs
    (tests/integration/test_stack.py reproduces it). Resetting the drained slot lets
    the next poll restore the parked records.
    """
    consumer.resume(*partitions)
    fetcher = getattr(consumer, "_fetcher", None)
    current = getattr(fetcher, "_next_partition_records", None)
    if fetcher is not None and current is not None and not current:
        fetcher._next_partition_records = None


class _Listener(ConsumerRebalanceListener):
    def __init__(self, on_revoked: Partitions, on_assigned: Partitions) -> None:
        self._on_revoked = on_revoked
        self._on_assigned = on_assigned

    def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        self._on_revoked(set(revoked))

    def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        self._on_assigned(set(assigned))


class RequestConsumer:
    def __init__(self, settings: WorkerSettings) -> None:
        self._settings = settings
        self._consumer = KafkaConsumer(
            group_id=settings.group,
            enable_auto_commit=False,
            auto_offset_reset=settings.auto_offset_reset,
            session_timeout_ms=settings.session_timeout_ms,
            max_poll_interval_ms=settings.max_poll_interval_ms,
            max_poll_records=settings.poll_max_records,
            fetch_max_bytes=64 * 1024 * 1024,
            max_partition_fetch_bytes=4 * 1024 * 1024,
            # kafka-python's default grows the reconnect backoff to 30 s while a broker is
            # down, so after a 15 s outage the worker sat idle ~35 s more before it looked
            # again (tests/reliability, kafka outage). 2 s caps that wait.
            reconnect_backoff_max_ms=RECONNECT_BACKOFF_MAX_MS,
            client_id=f"qbatch-{settings.worker_id}",
            **settings.kafka_kwargs(),
        )
        self._paused = False

    def subscribe(self, on_revoked: Partitions, on_assigned: Partitions) -> None:
        # Subscribe, THEN load the topic's metadata, before the first JoinGroup (first
        # poll). kafka-python 3.0.12 rebuilds the coordinator's metadata snapshot only on
        # a metadata update that happens after subscribe(); without one, the first
        # generation is joined with an empty snapshot (or an empty assignment: "No
        # partition metadata for topic") and the next periodic metadata refresh forces a
        # second rebalance ~0.5 s after start. That rebalance is what dropped records
        # (see Worker._on_assigned) and, under load, never finished: the member expired,
        # the group went Empty and poll() spun at ~90% CPU without consuming.
        topic = self._settings.topic
        self._consumer.subscribe([topic], listener=_Listener(on_revoked, on_assigned))
        deadline = time.monotonic() + 30
        while not self._consumer.partitions_for_topic(topic) and time.monotonic() < deadline:
            time.sleep(0.2)  # topic not created yet: go on after 30 s (rebalance later)

    def poll(self, timeout_s: float, max_records: int) -> list[Any]:
        batches = self._consumer.poll(
            timeout_ms=max(0, int(timeout_s * 1000)), max_records=max(1, max_records)
        )
        records: list[Any] = []
        for chunk in batches.values():
            records.extend(chunk)
        return records

    def assignment(self) -> set[TopicPartition]:
        return set(self._consumer.assignment())

    @property
    def paused(self) -> bool:
        return self._paused

    def pause(self) -> None:
        assigned = self.assignment()
        if assigned:
            self._consumer.pause(*assigned)
        self._paused = True

    def resume(self) -> None:
        resume_partitions(self._consumer, *self._consumer.paused())
        self._paused = False

    def reapply_pause(self, assigned: set[TopicPartition]) -> None:
        """A rebalance hands out partitions unpaused; keep them paused while we are."""
        if self._paused and assigned:
            self._consumer.pause(*assigned)

    @retry(
        retry=retry_if_exception_type(KafkaError)
        & retry_if_not_exception_type((CommitFailedError, RebalanceInProgressError)),
        wait=wait_exponential(multiplier=0.1, max=2),
        stop=stop_after_attempt(5),
        reraise=True,
    )
    def commit(self, offsets: Mapping[TopicPartition, int]) -> None:
        """Commit `offsets` (next offset to read, per partition). Retries transient errors."""
        if offsets:
            self._consumer.commit(
                offsets={tp: OffsetAndMetadata(off, "", -1) for tp, off in offsets.items()}
            )

    def commit_nowait(self, offsets: Mapping[TopicPartition, int]) -> None:
        """Commit `offsets` without blocking; for the partitions-revoked callback.

        kafka-python 3.0.12 runs rebalance listeners on its IO thread, where the blocking
        `commit()` raises RuntimeError ("Cannot block on net.run() from the IO thread
        itself"): the rebalance failed and the exception escaped `poll()`, killing the
        worker whenever another worker joined or left the group. The async commit is
        queued on that IO loop ahead of the JoinGroup request; if it does not land, the
        new owner only gets those records redelivered, finds their results in Redis and
        skips them.
        """
        if not offsets:
            return

        def _done(_offsets: Any, response: Any) -> None:
            if isinstance(response, Exception):
                log.warning("revoke_commit_failed", error=str(response))

        self._consumer.commit_async(
            offsets={tp: OffsetAndMetadata(off, "", -1) for tp, off in offsets.items()},
            callback=_done,
        )

    def seek(self, tp: TopicPartition, offset: int) -> None:
        """Non-blocking: the next fetch of `tp` starts at `offset`."""
        self._consumer.seek(tp, offset)

    def lag(self, positions: Mapping[TopicPartition, int]) -> dict[TopicPartition, int]:
        """Records behind the high-water mark, from fetch metadata (no extra request)."""
        lags = {}
        for tp in self.assignment():
            high = self._consumer.highwater(tp)
            pos = positions.get(tp)
            if high is not None and pos is not None:
                lags[tp] = max(0, high - pos)
        return lags

    def position(self, tp: TopicPartition) -> int | None:
        try:
            return int(self._consumer.position(tp, timeout_ms=100))
        except Exception:
            return None

    def close(self) -> None:
        self._consumer.close(autocommit=False)


class DeadLetters:
    """Sends the original bytes, unchanged, with headers naming the fault and its source."""

    def __init__(self, settings: WorkerSettings) -> None:
        self._topic = settings.dlq_topic
        self._producer = KafkaProducer(
            acks="all",
            retries=10,
            linger_ms=5,
            max_block_ms=5_000,
            reconnect_backoff_max_ms=RECONNECT_BACKOFF_MAX_MS,
            client_id=f"qbatch-dlq-{settings.worker_id}",
            **settings.kafka_kwargs(),
        )
        self._lock = threading.Lock()
        self._unflushed = 0

    def send(self, record: Any, error: ContractError) -> None:
        headers = [
            (dlq.ERROR_CODE, error.code.value.encode()),
            (dlq.ERROR_MESSAGE, error.message[:4000].encode("utf-8", "replace")),
            (dlq.ERROR_PARAM, (error.param or "").encode("utf-8", "replace")),
            (dlq.SOURCE_TOPIC, str(record.topic).encode()),
            (dlq.SOURCE_PARTITION, str(record.partition).encode()),
            (dlq.SOURCE_OFFSET, str(record.offset).encode()),
        ]
        if error.request_id:
            headers.append((dlq.REQUEST_ID, error.request_id.encode()))
        value = record.value if record.value is not None else b""
        try:
            with self._lock:
                self._producer.send(self._topic, key=record.key, value=value, headers=headers)
                self._unflushed += 1
        except KafkaError as exc:
            # The caller still answers the request in Redis; a missing DLQ topic or a
            # broker hiccup must not stop the worker or block its partition.
            log.error(
                "dead_letter_failed",
                topic=self._topic,
                error=str(exc),
                partition=record.partition,
                offset=record.offset,
            )

    @retry(
        retry=retry_if_exception_type(KafkaError),
        wait=wait_exponential(multiplier=0.2, max=5),
        stop=stop_after_attempt(8),
        reraise=True,
    )
    def flush(self) -> None:
        """Called before a commit: a dead-lettered record is durable before its offset moves."""
        with self._lock:
            pending, self._unflushed = self._unflushed, 0
        if pending:
            self._producer.flush(timeout=30)

    def close(self) -> None:
        try:
            self._producer.flush(timeout=10)
        except KafkaError as exc:
            log.warning("dlq_flush_failed", error=str(exc))
        self._producer.close(timeout=10)
