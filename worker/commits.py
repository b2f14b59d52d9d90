"""How done offsets reach Kafka: a plain consumer commit, or one Kafka transaction that
carries the results topic's records and the offsets together.

Both run on the main thread (the consumer's owner). Dead letters are flushed first
either way: a record's offset never moves before its dead letter is durable.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from kafka.errors import CommitFailedError, KafkaError
from kafka.structs import TopicPartition

from worker.kafka_io import DeadLetters, RequestConsumer
from worker.logs import log
from worker.sinks.kafka_sink import KafkaResultsSink

Offsets = Mapping[TopicPartition, int]


class Committer(Protocol):
    def commit(self, offsets: Offsets, *, blocking: bool = True) -> bool:
        """Make `offsets` the group's committed offsets; False when it did not happen."""

    def revoked(self, partitions: set[TopicPartition]) -> None:
        """Forget what is held for partitions this worker no longer owns."""


class ConsumerCommitter:
    """At-least-once: every sink already holds the records below `offsets` (the writer
    marks offsets done only after every sink acknowledged them)."""

    def __init__(self, consumer: RequestConsumer, dead_letters: DeadLetters | None) -> None:
        self._consumer = consumer
        self._dead_letters = dead_letters

    def commit(self, offsets: Offsets, *, blocking: bool = True) -> bool:
        try:
            if self._dead_letters is not None:
                self._dead_letters.flush()
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

    def revoked(self, partitions: set[TopicPartition]) -> None:
        return


class TransactionalCommitter:
    """Exactly once on the results topic: the results of exactly the records below
    `offsets` and the offsets themselves, in one transaction (see KafkaResultsSink)."""

    def __init__(
        self,
        consumer: RequestConsumer,
        sink: KafkaResultsSink,
        dead_letters: DeadLetters | None,
    ) -> None:
        self._consumer = consumer
        self._sink = sink
        self._dead_letters = dead_letters

    def commit(self, offsets: Offsets, *, blocking: bool = True) -> bool:
        if not blocking:
            # A rebalance callback cannot block on a transaction; the records stay
            # uncommitted and the new owner republishes their stored results.
            return False
        try:
            if self._dead_letters is not None:
                self._dead_letters.flush()
        except KafkaError as exc:
            log.warning("commit_failed", error=str(exc))
            return False
        return self._sink.commit_transaction(offsets, self._consumer.group_metadata())

    def revoked(self, partitions: set[TopicPartition]) -> None:
        self._sink.drop(partitions)


__all__ = ["Committer", "ConsumerCommitter", "Offsets", "TransactionalCommitter"]
