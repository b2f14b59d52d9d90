"""The dead-letter producer: a bad record's original bytes, unchanged, on the DLQ topic,
with headers naming the fault and its source (schemas.dlq).

A dead letter must be durable before its record's offset is committed, or the bad record
is gone without a trace. `flush()` (called before every commit) therefore waits for the
sends AND checks them: a send the broker refused (the chaos soak saw
`OutOfOrderSequenceNumberError` from the idempotent producer after a broker was killed,
and 25 dead letters of 3,515 were lost: the errback logged them, the commit went on) is
sent again, on a new producer when the old one is in a fatal state, and until every
letter is delivered `flush()` raises, so the commit waits and the offsets stay where
they are. A repeat is harmless: consumers dedupe dead letters by their source topic,
partition and offset headers.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

from kafka import KafkaProducer
from kafka.errors import KafkaError
from tenacity import retry, retry_if_exception_type, stop_after_attempt, wait_exponential

from schemas import ContractError, dlq
from schemas.kafka_compat import producer_in_fatal_state, repair_idempotent_reset
from worker.config import WorkerSettings
from worker.kafka_io import RECONNECT_BACKOFF_MAX_MS
from worker.logs import log


class DeadLetters:
    """Sends the original bytes, unchanged, with headers naming the fault and its source."""

    def __init__(self, settings: WorkerSettings, producer: Any = None) -> None:
        self._topic = settings.dlq_topic
        self._config: dict[str, Any] = {
            "acks": "all",
            "retries": 10,
            "linger_ms": 5,
            "max_block_ms": 5_000,
            "reconnect_backoff_max_ms": RECONNECT_BACKOFF_MAX_MS,
            "client_id": f"qbatch-dlq-{settings.worker_id}",
            **settings.kafka_kwargs(),
        }
        self._producer = producer or self._new_producer()
        self._lock = threading.Lock()
        self._unflushed = 0
        self._failed: list[tuple[Any, ContractError]] = []
        """Letters the broker refused: sent again by the next flush."""

    def _new_producer(self) -> Any:
        return repair_idempotent_reset(KafkaProducer(**self._config))

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
                future = self._producer.send(
                    self._topic, key=record.key, value=value, headers=headers
                )
                self._unflushed += 1
            future.add_errback(lambda exc: self._refused(record, error, exc))
        except KafkaError as exc:
            # The caller still answers the request in Redis; a missing DLQ topic or a
            # broker hiccup must not stop the worker or block its partition here: the
            # letter waits in `_failed`, and the next commit waits for it.
            self._refused(record, error, exc)

    def _refused(self, record: Any, error: ContractError, exc: BaseException) -> None:
        log.error(
            "dead_letter_failed",
            topic=self._topic,
            error=str(exc),
            partition=record.partition,
            offset=record.offset,
            message="sent again before the next commit",
        )
        with self._lock:
            self._failed.append((record, error))

    @retry(
        retry=retry_if_exception_type(KafkaError),
        wait=wait_exponential(multiplier=0.2, max=5),
        stop=stop_after_attempt(8),
        reraise=True,
    )
    def flush(self) -> None:
        """Called before a commit: every dead letter sent so far is durable when this
        returns; raises KafkaError (the commit waits) while one is still refused."""
        with self._lock:
            pending = self._unflushed
        if pending:
            self._producer.flush(timeout=30)
            with self._lock:
                self._unflushed -= pending
        with self._lock:
            failed, self._failed = self._failed, []
        if not failed:
            return
        if producer_in_fatal_state(self._producer):
            log.warning("dead_letter_producer_replaced", refused=len(failed))
            old, self._producer = self._producer, self._new_producer()
            with contextlib.suppress(KafkaError):
                old.close(timeout=1)
        for record, error in failed:
            self.send(record, error)
        with self._lock:
            pending = self._unflushed
        self._producer.flush(timeout=30)
        with self._lock:
            self._unflushed -= pending
            still = len(self._failed)
        if still:
            raise KafkaError(f"{still} dead letters not delivered yet")

    def close(self) -> None:
        try:
            self._producer.flush(timeout=10)
        except KafkaError as exc:
            log.warning("dlq_flush_failed", error=str(exc))
        self._producer.close(timeout=10)


__all__ = ["DeadLetters"]
