"""How done offsets reach Kafka: a plain consumer commit, or one Kafka transaction that
carries the results topic's records and the offsets together.

Neither waits for dead letters: intake never offers an offset past a record whose letter
is not sent yet (`worker.dead_letters`). The consumer commit runs on the main thread (the
consumer's owner). The transaction runs on a thread of its own, so publishing a commit's
results (tens of microseconds of kafka-python per record) overlaps the main loop's polling
and decoding instead of stalling it: `commit()` starts one and returns, `completed()` reports the
offsets of transactions that have committed since, and at most one is in flight.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Mapping
from typing import Any, Protocol

from kafka.errors import CommitFailedError, KafkaError
from kafka.structs import TopicPartition

from worker.kafka_io import RequestConsumer
from worker.logs import log
from worker.sinks.kafka_sink import KafkaResultsSink

Offsets = Mapping[TopicPartition, int]
Epochs = Mapping[TopicPartition, int]
"""Per partition, its assignment epoch (worker.intake.Intake.epochs)."""


class Committer(Protocol):
    rewinds_to_commit: bool
    """True when "done" is not yet durable everywhere until committed (transactional
    results): a partition that comes back is sought to its last commit, not its first
    unanswered record."""

    def commit(self, offsets: Offsets, *, blocking: bool = True) -> bool:
        """Commit `offsets`; True when they are committed on return. False: not (yet):
        retried at the next interval, or reported later by `completed()`."""

    def completed(self) -> list[Offsets]:
        """Offsets committed in the background since the last call (main thread)."""

    def settle(self, timeout_s: float) -> list[Offsets]:
        """Wait for a background commit in flight (draining); returns what `completed` would."""

    def revoked(self, partitions: set[TopicPartition], epochs: Epochs) -> None:
        """Forget what is held for partitions this worker no longer owns; `epochs`: their
        new assignment epochs (results of older ones are stale)."""

    def close(self) -> None:
        """Stop background work."""


class ConsumerCommitter:
    """At-least-once: every sink already holds the records below `offsets` (the writer
    marks offsets done only after every sink acknowledged them)."""

    rewinds_to_commit = False

    def __init__(self, consumer: RequestConsumer) -> None:
        self._consumer = consumer

    def commit(self, offsets: Offsets, *, blocking: bool = True) -> bool:
        try:
            if blocking:
                self._consumer.commit(offsets)
            else:  # inside a rebalance callback (kafka-python's IO thread)
                self._consumer.commit_nowait(offsets)
        except CommitFailedError as exc:
            log.warning("commit_failed_rebalance", error=str(exc))
            return False
        except KafkaError as exc:
            log.warning("commit_failed", error=str(exc))
            return False
        return True

    def completed(self) -> list[Offsets]:
        return []

    def settle(self, timeout_s: float) -> list[Offsets]:
        return []

    def revoked(self, partitions: set[TopicPartition], epochs: Epochs) -> None:
        return

    def close(self) -> None:
        return


class TransactionalCommitter:
    """Exactly once on the results topic: the results of exactly the records below
    `offsets` and the offsets themselves, in one transaction (see KafkaResultsSink)."""

    rewinds_to_commit = True

    def __init__(
        self,
        consumer: RequestConsumer,
        sink: KafkaResultsSink,
    ) -> None:
        self._consumer = consumer
        self._sink = sink
        self._requests: queue.SimpleQueue[tuple[dict[TopicPartition, int], Any] | None] = (
            queue.SimpleQueue()
        )
        self._done: queue.SimpleQueue[tuple[dict[TopicPartition, int], bool] | BaseException] = (
            queue.SimpleQueue()
        )
        self._busy = False
        self._fault: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="qbatch-txn", daemon=True)
        self._thread.start()

    def commit(self, offsets: Offsets, *, blocking: bool = True) -> bool:
        if not blocking:
            # A rebalance callback cannot wait for a transaction; the records stay
            # uncommitted and the new owner republishes their stored results.
            return False
        if self._busy:
            return False  # one transaction at a time; the next interval asks again
        self._busy = True
        self._requests.put((dict(offsets), self._consumer.group_metadata()))
        return False

    def _run(self) -> None:
        while True:
            request = self._requests.get()
            if request is None:
                return
            offsets, group = request
            try:
                ok = self._sink.commit_transaction(offsets, group)
            except KafkaError as exc:
                log.warning("commit_failed", error=str(exc))
                ok = False
            except BaseException as exc:  # TransactionFenced: the main thread stops
                self._done.put(exc)
                continue
            self._done.put((offsets, ok))

    def completed(self) -> list[Offsets]:
        if self._fault is not None:
            raise self._fault  # sticky: a rebalance callback that saw it may have swallowed it
        out: list[Offsets] = []
        while True:
            try:
                item = self._done.get_nowait()
            except queue.Empty:
                return out
            self._busy = False
            if isinstance(item, BaseException):
                self._fault = item
                raise item
            offsets, ok = item
            if ok:
                out.append(offsets)

    def settle(self, timeout_s: float) -> list[Offsets]:
        if not self._busy:
            return self.completed()
        try:
            item = self._done.get(timeout=timeout_s)
        except queue.Empty:
            log.warning("transaction_still_in_flight", timeout_s=timeout_s)
            return []
        self._done.put(item)
        return self.completed()

    def revoked(self, partitions: set[TopicPartition], epochs: Epochs) -> None:
        self._sink.drop(partitions, epochs)

    def close(self) -> None:
        self._requests.put(None)
        self._thread.join(timeout=30)


__all__ = ["Committer", "ConsumerCommitter", "Offsets", "TransactionalCommitter"]
