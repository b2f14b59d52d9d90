"""The `expired` answers `qbatch serve` writes itself for an expired batch's lines that no
worker answered (`BatchRunner._answer_unanswered`). Pure: results, no I/O.

Each line is answered from the input file (with its custom_id) when the file still
validates, else from the line numbers stored before publishing (`JobStore.
remember_lines`; custom_id then null). Generated lazily, so the runner writes them a chunk
at a time whatever the batch's size."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from producer.batch_output import local_result
from producer.bulk import Line, request_id_for
from schemas import ErrorCode, ErrorInfo, ResultEnvelope, Status
from schemas.ref import RequestRef
from schemas.result import Timings

LATE = ErrorInfo(
    code=ErrorCode.deadline_exceeded,
    message="the batch's completion window ended before this line was answered",
)


def late_from_lines(
    batch_id: str, lines: Iterable[Line], now_ms: int
) -> Iterator[tuple[ResultEnvelope, int]]:
    """(result, ttl) for each request line of a batch's input."""
    for line in lines:
        if line.envelope is not None:
            result = local_result(line, batch_id, Status.expired, LATE, now_ms)
            yield result, line.envelope.result_ttl_s


def late_from_numbers(
    batch_id: str, numbers: Iterable[int], ttl: int, now_ms: int
) -> Iterator[tuple[ResultEnvelope, int]]:
    """(result, ttl) for each line number, when the input is gone."""
    for n in numbers:
        ref = RequestRef(request_id=request_id_for(batch_id, n), job_id=batch_id)
        timings = Timings(submitted=now_ms, finished=now_ms)
        yield ResultEnvelope.for_request(ref, Status.expired, error=LATE, timings=timings), ttl


__all__ = ["LATE", "late_from_lines", "late_from_numbers"]
