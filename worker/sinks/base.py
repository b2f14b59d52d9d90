"""The reply-sink seam: what becomes of a finished request is a sink's business.

The worker owns threads, queues and offsets; a sink takes a chunk of `Reply`s and makes
them durable somewhere (Redis keys, a Kafka topic). The writer thread calls every
configured sink for each chunk, in order, and hands the chunk's offsets back for commit
only after every sink has acknowledged it (`write` returned and `flush` returned), so a
partition's committed offset never passes a record that some sink does not hold yet.

One sink may be the *dedupe store* (`dedupes = True`, Redis): it answers admission
look-ups before a batch runs (answered already? job cancelled?), and its verdict on each
write (new, existed, another job's) decides what the other sinks receive.

Errors: a sink raises `SinkUnavailable` for what waiting cures (connection lost, a
replica failing over, OOM while the server evicts); the writer retries the chunk with
backoff while intake pauses. It raises `SinkRefused` for what no retry cures (a key of
the wrong type, a script error); the writer then splits the chunk to find the
offending replies and answers those with a `failed` result and a dead letter.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from schemas import RequestEnvelope, ResultEnvelope
from schemas.replies import WriteReply, WriteStatus
from worker import metrics
from worker.logs import log
from worker.records import Reply


class SinkUnavailable(Exception):
    """Transient: retry the same chunk later."""

    def __init__(self, message: str, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out
        """The server took the request but did not answer in time (see `worker.sinks.
        retrying.Stalled`), rather than refusing the connection or saying "not now"."""


class SinkRefused(Exception):
    """Permanent for (some reply of) this chunk: retrying it as is cannot succeed."""


@dataclass(frozen=True, slots=True)
class Admission:
    """What the dedupe store says about a micro-batch before it runs."""

    answered: Mapping[str, str] = field(default_factory=dict)
    """request_id -> job_id of the result already written ('' when it has no job)."""
    cancelled_jobs: frozenset[str] = frozenset()

    def answered_in(self, request_id: str, job_id: str | None) -> bool | None:
        """None: no result yet; True: answered within this job (or outside any job);
        False: the request_id already holds another job's result."""
        if request_id not in self.answered:
            return None
        return self.answered[request_id] == (job_id or "")


NO_ADMISSION = Admission()


class ReplySink(abc.ABC):
    """One place results go. Called from the writer thread only (and `commit`-style
    hooks from the main thread where a sink says so)."""

    name: str = "sink"
    dedupes: bool = False
    where: str = ""
    """Where it writes, for operators' log lines (no credentials)."""

    def admission(self, envelopes: Sequence[RequestEnvelope]) -> Admission:
        """Only the dedupe store answers this."""
        return NO_ADMISSION

    def stored(self, request_ids: Sequence[str]) -> dict[str, bytes]:
        """Results already written, as JSON bytes (dedupe store only)."""
        return {}

    def cancelled_jobs(self, job_ids: Sequence[str]) -> frozenset[str]:
        """Which of these jobs are cancelled (dedupe store only)."""
        return frozenset()

    @abc.abstractmethod
    def write(
        self, replies: Sequence[Reply], now_ms: int, *, job_bookkeeping: bool = True
    ) -> list[WriteReply]:
        """Take a chunk; one reply per item. Raise SinkUnavailable / SinkRefused.

        `job_bookkeeping=False`: write the results without touching their jobs (a job
        whose own keys are broken); only the dedupe store has any.
        """

    def record_duplicate(self, result: ResultEnvelope, ttl_s: int, now_ms: int) -> WriteReply:
        """Count a `duplicate_request_id` result in its job (dedupe store only)."""
        return WriteReply(WriteStatus.existed)

    def flush(self) -> None:  # noqa: B027 - optional
        """Return once everything written so far is durable."""

    def pending(self) -> int:
        """Results held in memory, not yet durable (counted against max_inflight)."""
        return 0

    def healthy(self) -> bool:
        return True

    def close(self) -> None:  # noqa: B027 - optional
        """Release connections."""


class SinkHealth:
    """Which sinks are failing now, shared by the threads that call them.

    Logs each change once (`{sink}_unavailable` with the error, `{sink}_recovered`), keeps
    the `qbatch_sink_up` gauge, and tells the worker whether all sinks are up (intake
    pauses fetching while one is not; readiness turns false).
    """

    def __init__(self, on_change: Callable[[bool], None] = lambda ok: None) -> None:
        self._down: set[str] = set()
        self._lock = threading.Lock()
        self._on_change = on_change

    @property
    def ok(self) -> bool:
        return not self._down

    def failed(self, sink: ReplySink, error: BaseException) -> None:
        with self._lock:
            fresh = sink.name not in self._down
            self._down.add(sink.name)
        if fresh:
            log.warning(
                f"{sink.name}_unavailable",
                where=sink.where,
                # not always "unreachable": a reachable Redis whose replicas lag (ReplicasBehind)
                # refuses to acknowledge too, and the reason is the error's type and text
                message=(
                    f"{sink.name} at {sink.where} does not take results"
                    f" ({type(error).__name__}): results wait, intake pauses"
                ),
                error=str(error),
            )
            self._gauges(sink, 0)
            self._on_change(False)

    def recovered(self, sink: ReplySink) -> None:
        if sink.name not in self._down:
            return
        with self._lock:
            self._down.discard(sink.name)
            all_ok = not self._down
        log.info(f"{sink.name}_recovered")
        self._gauges(sink, 1)
        if all_ok:
            self._on_change(True)

    @staticmethod
    def _gauges(sink: ReplySink, value: int) -> None:
        metrics.SINK_UP.labels(sink.name).set(value)
        if sink.dedupes:
            metrics.REDIS_UP.set(value)
