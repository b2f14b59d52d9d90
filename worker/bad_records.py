"""What intake does with a record it will not run: a record that does not decode or
validate, and one workers stopped on twice (quarantined, worker.supervision).

Each gets its one visible outcome: a `failed` result where a request id can be recovered
(with its job, custom_id and TTL, so its job still finishes), and the record's bytes to
the dead-letter topic either way (worker.dead_letters; the letter never holds up more
than its own partition's commits, and only for a while).
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from typing import Any

from kafka.structs import TopicPartition

from schemas import ContractError, ErrorCode, decode_request
from schemas.ref import RequestRef
from worker import metrics
from worker.dead_letters import DeadLetters
from worker.logs import log
from worker.records import Finished, Reply, SourceRecord
from worker.results import refused_result

QUARANTINED = (
    "a worker stopped on an internal fault twice while handling this record; it is not run "
    "again (see the dead-letter topic and the worker logs)"
)


class BadRecords:
    def __init__(
        self,
        dead_letters: DeadLetters | None,
        results_q: queue.SimpleQueue[Reply | Finished | None],
        worker_info: Callable[..., Any],
    ) -> None:
        self.dead_letters = dead_letters
        self.results_q = results_q
        self._worker_info = worker_info

    def reject(
        self, record: SourceRecord, error: ContractError, wall_ms: int, *, lane: str, epoch: int
    ) -> None:
        """Bad input: a failed result where a request is known, and the record to the DLQ."""
        log.info(
            "request_rejected",
            request_id=error.request_id,
            partition=record.partition,
            offset=record.offset,
            code=error.code.value,
            error=error.message[:500],
        )
        self.dead_letter(record, error)
        tp = TopicPartition(record.topic, record.partition)
        ref = error.ref
        if ref is None:
            self.results_q.put(Reply(tp, record.offset, record, None, lane=lane, epoch=epoch))
            metrics.REQUESTS.labels("failed", error.code.value).inc()
            return
        result = refused_result(
            ref,
            error.info(),
            dequeued_ms=wall_ms,
            finished_ms=time.time_ns() // 1_000_000,
            worker=self._worker_info(),
        )
        reply = Reply(tp, record.offset, record, result, ref.result_ttl_s, lane=lane, epoch=epoch)
        self.results_q.put(reply)

    def quarantine(self, record: SourceRecord, wall_ms: int, *, lane: str, epoch: int) -> None:
        """A record workers stopped on twice: not run again."""
        metrics.QUARANTINED.inc()
        ref: RequestRef | None = None
        try:
            ref = RequestRef.of(decode_request(record.value, record.key))
        except ContractError as bad:
            ref = bad.ref
        except Exception:
            ref = None
        error = ContractError(QUARANTINED, code=ErrorCode.internal_error, ref=ref)
        log.error(
            "record_quarantined",
            request_id=error.request_id,
            partition=record.partition,
            offset=record.offset,
        )
        self.reject(record, error, wall_ms, lane=lane, epoch=epoch)

    def dead_letter(self, record: SourceRecord, error: ContractError) -> None:
        if self.dead_letters is not None:
            self.dead_letters.send(record, error)
            metrics.DEAD_LETTERED.labels(error.code.value).inc()


__all__ = ["BadRecords"]
