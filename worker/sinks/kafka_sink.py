"""The Kafka results sink: every result also goes to a topic (`--results-topic`), for
stream consumers (Flink, Kafka Connect sinks to object stores, other services).

Record: key = request_id (UTF-8), value = the result envelope JSON (exactly what Redis
holds), headers `qbatch.status` and `qbatch.job_id` (when the request has a job).

Two modes:

* **at-least-once** (default): results are produced (acks=all, idempotent) and flushed
  before the writer marks their offsets done. After a crash or a rebalance a result may
  appear twice on the topic; dedupe by request_id.
* **transactional** (`--results-transactional`): results are buffered per partition and
  offset, and each commit publishes the results of exactly the records it commits, in
  one Kafka transaction with the consumer offsets (KIP-447, the consumer's group
  metadata). A `read_committed` consumer then sees one result per request record across
  kill -9, rebalances and broker restarts: a record is either committed with its result
  or redelivered, and a redelivered record that Redis already answered has its stored
  result republished. (A request_id published twice as two records yields two, identical,
  result records.)

Without Redis (`--no-redis-sink`) the topic is the only sink: nothing is deduplicated,
so a redelivered record runs again (and, with transactions, still appears once).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kafka import KafkaProducer
from kafka.errors import (
    InvalidProducerEpochError,
    KafkaError,
    MessageSizeTooLargeError,
    ProducerFencedError,
    RecordListTooLargeError,
)
from kafka.structs import OffsetAndMetadata, TopicPartition

from schemas.kafka_compat import (
    forget_stale_txn_offsets,
    producer_in_fatal_state,
    repair_idempotent_reset,
)
from schemas.replies import WriteReply, WriteStatus
from worker.config import WorkerSettings
from worker.logs import log
from worker.records import Reply
from worker.sinks.base import ReplySink, SinkRefused, SinkUnavailable

STATUS_HEADER = "qbatch.status"
JOB_HEADER = "qbatch.job_id"
_REFUSED = (MessageSizeTooLargeError, RecordListTooLargeError)
_FENCED = (ProducerFencedError, InvalidProducerEpochError)
FENCES_BEFORE_STOP = 3
FENCE_WINDOW_S = 300.0
"""A producer fenced this often within the window means another live producer has this
transactional.id (two workers configured alike): stop instead of fencing each other."""

Record = tuple[bytes, bytes, list[tuple[str, bytes]]]
Held = dict[TopicPartition, dict[int, Record]]


@dataclass(frozen=True, slots=True)
class Taken:
    """What one transaction took from the buffer, and the partitions' epochs then: a
    failed transaction puts back only what is still of the current assignment."""

    held: Held
    epochs: dict[TopicPartition, int]


class TransactionFenced(RuntimeError):
    """Another producer took this transactional.id: this worker must stop."""


def _record(reply: Reply) -> Record | None:
    result = reply.result
    if result is not None:
        headers = [(STATUS_HEADER, result.status.value.encode())]
        if result.job_id:
            headers.append((JOB_HEADER, result.job_id.encode()))
        return result.request_id.encode("utf-8"), reply.encoded(), headers
    if reply.stored is not None and reply.answered is not None:
        return reply.answered.encode("utf-8"), reply.stored, _stored_headers(reply.stored)
    return None


_RECORD_FRAMING = 512
"""Bytes beyond key, value and headers that kafka-python counts against max_request_size
(record batch header, record varints, attribute bytes), rounded up: a result that fits
the check must never fail `send` inside every transaction after it."""


def _record_size(rec: Record) -> int:
    key, value, headers = rec
    return (
        len(key) + len(value) + sum(len(k.encode()) + len(v) for k, v in headers) + _RECORD_FRAMING
    )


def _stored_headers(value: bytes) -> list[tuple[str, bytes]]:
    from schemas import ResultEnvelope

    try:
        result = ResultEnvelope.model_validate_json(value)
    except ValueError:
        return []
    headers = [(STATUS_HEADER, result.status.value.encode())]
    if result.job_id:
        headers.append((JOB_HEADER, result.job_id.encode()))
    return headers


def flush_sends(producer: Any, futures: Sequence[Any], what: str) -> None:
    """Flush `producer` and check every send: SinkRefused for a record the broker will
    never take (too large), SinkUnavailable for anything waiting may cure."""
    try:
        producer.flush(timeout=30)
    except KafkaError as exc:
        raise SinkUnavailable(f"{what} flush: {exc}") from exc
    for future in futures:
        if not future.is_done:
            raise SinkUnavailable(f"{what}: a send did not complete in 30 s")
        failure = future.exception
        if failure is not None:
            if isinstance(failure, _REFUSED):
                raise SinkRefused(f"{what}: {failure}")
            raise SinkUnavailable(f"{what}: {type(failure).__name__}: {failure}")


def producer_config(settings: WorkerSettings) -> dict[str, Any]:
    config: dict[str, Any] = {
        "acks": "all",
        "enable_idempotence": True,
        "linger_ms": 5,
        "batch_size": 512 * 1024,
        "max_block_ms": 10_000,
        # bounded, so a transaction stuck behind a broker outage fails (and is retried)
        # within ~30 s instead of blocking the worker's loop for the 120 s default
        "request_timeout_ms": 10_000,
        "delivery_timeout_ms": 30_000,
        "max_request_size": settings.results_max_record_bytes,
        "reconnect_backoff_max_ms": 2_000,
        "client_id": f"qbatch-results-{settings.worker_id}",
        **settings.kafka_kwargs(),
    }
    if settings.results_transactional:
        config["transactional_id"] = settings.transactional_id_or_default()
        config["transaction_timeout_ms"] = settings.transaction_timeout_ms
    return config


class KafkaResultsSink(ReplySink):
    name = "kafka"

    def __init__(self, settings: WorkerSettings, producer: Any | None = None) -> None:
        assert settings.results_topic, "KafkaResultsSink needs results_topic"
        self.topic = settings.results_topic
        self.where = f"{self.topic} on {settings.kafka_bootstrap}"
        self.transactional = settings.results_transactional
        self._config = producer_config(settings)
        self._fences: list[float] = []
        self._producer: Any = producer or KafkaProducer(**self._config)
        if not self.transactional:
            repair_idempotent_reset(self._producer)
        else:
            self._producer.init_transactions()
        self._futures: list[Any] = []
        self._lock = threading.Lock()
        self._buffer: dict[TopicPartition, dict[int, Record]] = {}
        self._buffered = 0
        self._epochs: dict[TopicPartition, int] = {}
        """Current assignment epoch per partition: results of an older one are stale."""
        self._max_bytes = settings.results_max_record_bytes
        self._fenced_for_good = False

    # ------------------------------------------------------------------ writer thread

    def write(
        self, replies: Sequence[Reply], now_ms: int, *, job_bookkeeping: bool = True
    ) -> list[WriteReply]:
        written = WriteReply(WriteStatus.written)
        records = [(reply, _record(reply)) for reply in replies]
        for _reply, rec in records:  # before anything is sent or held: refuse the chunk whole
            if rec is not None and (size := _record_size(rec)) > self._max_bytes:
                raise SinkRefused(
                    f"result record of {size} bytes (key, value, headers and "
                    f"framing), over results_max_record_bytes {self._max_bytes}"
                )
        if self.transactional:
            with self._lock:
                for reply, rec in records:
                    if rec is None or reply.epoch != self._epochs.get(reply.tp, 0):
                        continue  # stale: its partition was revoked since it was taken
                    part = self._buffer.setdefault(reply.tp, {})
                    if reply.offset not in part:
                        self._buffered += 1
                    part[reply.offset] = rec
            return [written] * len(replies)
        for _reply, rec in records:
            if rec is None:
                continue
            key, value, headers = rec
            try:
                self._futures.append(
                    self._producer.send(self.topic, key=key, value=value, headers=headers)
                )
            except _REFUSED as exc:
                raise SinkRefused(f"results topic: {exc}") from exc
            except KafkaError as exc:
                raise SinkUnavailable(f"results topic: {type(exc).__name__}: {exc}") from exc
        return [written] * len(replies)

    def flush(self) -> None:
        if self.transactional:
            return
        futures, self._futures = self._futures, []
        flush_sends(self._producer, futures, "results topic")

    def pending(self) -> int:
        return self._buffered

    # ------------------------------------------------------------------ main thread (txn)

    def drop(
        self, partitions: Iterable[TopicPartition], epochs: Mapping[TopicPartition, int]
    ) -> None:
        """Revoked partitions: their buffered results go with them (the new owner
        republishes them from Redis, or runs them again without it), and results of the
        old assignment still on their way are ignored from now on (`epochs`)."""
        with self._lock:
            for tp in partitions:
                self._buffered -= len(self._buffer.pop(tp, {}))
                self._epochs[tp] = epochs.get(tp, self._epochs.get(tp, 0) + 1)

    def commit_transaction(self, offsets: Mapping[TopicPartition, int], group: Any) -> bool:
        """Publish the buffered results below `offsets` and commit the offsets, atomically.

        On failure the transaction is aborted and the results go back into the buffer for
        the next attempt. A producer fenced by the coordinator (its transaction outlived
        the transaction timeout, e.g. across a broker restart) is replaced by a new one
        with the same transactional.id; fenced again and again, another producer has that
        id, and `TransactionFenced` stops the worker.
        """
        if self._fenced_for_good:
            raise TransactionFenced("this worker's transactional producer was fenced")
        taken = self._take(offsets)
        try:
            producer = self._ready_producer()
            forget_stale_txn_offsets(producer)  # else an aborted one's offsets come along
            producer.begin_transaction()
            sends = [
                producer.send(self.topic, key=key, value=value, headers=headers)
                for tp in sorted(taken.held, key=lambda t: (t.topic, t.partition))
                for key, value, headers in (taken.held[tp][off] for off in sorted(taken.held[tp]))
            ]
            producer.send_offsets_to_transaction(
                {tp: OffsetAndMetadata(off, "", -1) for tp, off in offsets.items()}, group
            )
            # kafka-python 3.0.12 can commit a transaction whose batches failed (seen after
            # its own producer-epoch bump on InvalidProducerEpoch, another producer having
            # taken the transactional.id): the offsets commit, the results are gone. So
            # every send must have succeeded before the commit is asked for.
            producer.flush()
            failed = next((f.exception for f in sends if f.exception is not None), None)
            if failed is not None:
                raise KafkaError(f"a result send failed in the transaction: {failed!r}")
            producer.commit_transaction()
        except KafkaError as exc:
            log.warning("transaction_failed", error=f"{type(exc).__name__}: {exc}")
            self._put_back(taken)
            if isinstance(exc, _FENCED) or self._broken():
                self._fenced(exc)
            else:
                self._abort()
            return False
        return True

    def _take(self, offsets: Mapping[TopicPartition, int]) -> Taken:
        """The buffered results below `offsets`, with each partition's epoch at the take."""
        taken: Held = {}
        with self._lock:
            epochs = {tp: self._epochs.get(tp, 0) for tp in offsets}
            for tp, upto in offsets.items():
                part = self._buffer.get(tp)
                if not part:
                    continue
                mine = {off: rec for off, rec in part.items() if off < upto}
                for off in mine:
                    del part[off]
                self._buffered -= len(mine)
                taken[tp] = mine
        return Taken(taken, epochs)

    def _put_back(self, taken: Taken) -> None:
        with self._lock:
            for tp, mine in taken.held.items():
                if self._epochs.get(tp, 0) != taken.epochs.get(tp, 0):
                    continue  # revoked while the transaction ran (maybe back): stale now
                part = self._buffer.setdefault(tp, {})
                for off, rec in mine.items():
                    if off not in part:
                        self._buffered += 1
                    part.setdefault(off, rec)

    def _ready_producer(self) -> Any:
        """The transactional producer, made anew (init_transactions) after a fence."""
        if self._producer is None:
            producer = KafkaProducer(**self._config)
            producer.init_transactions()  # KafkaTimeoutError while the broker is away
            self._producer = producer
            log.info(
                "transactional_producer_replaced", transactional_id=self._config["transactional_id"]
            )
        return self._producer

    def _broken(self) -> bool:
        return self._producer is not None and producer_in_fatal_state(self._producer)

    def _fenced(self, exc: KafkaError) -> None:
        now = time.monotonic()
        self._fences = [t for t in self._fences if now - t < FENCE_WINDOW_S] + [now]
        old, self._producer = self._producer, None
        if old is not None:
            try:
                old.close(timeout=5)
            except Exception as close_exc:
                log.warning("fenced_producer_close_failed", error=str(close_exc))
        if len(self._fences) >= FENCES_BEFORE_STOP:
            self._fenced_for_good = True  # no new producer to fence the other one again
            raise TransactionFenced(
                f"fenced {len(self._fences)} times in {FENCE_WINDOW_S:.0f} s: another "
                f"producer uses transactional.id {self._config['transactional_id']!r}"
            ) from exc

    def _abort(self) -> None:
        if self._producer is None:  # not made yet (the broker was away): nothing open
            return
        try:
            self._producer.abort_transaction()
        except KafkaError as exc:
            log.warning("transaction_abort_failed", error=f"{type(exc).__name__}: {exc}")
            if isinstance(exc, _FENCED) or self._broken():
                self._fenced(exc)

    def close(self) -> None:
        if self._producer is None:
            return
        try:
            if not self.transactional:
                self._producer.flush(timeout=10)
        except KafkaError as exc:
            log.warning("results_flush_failed", error=str(exc))
        self._producer.close(timeout=10)


__all__ = ["JOB_HEADER", "STATUS_HEADER", "KafkaResultsSink", "TransactionFenced"]
