"""Results as OpenAI Batch output lines, and the results the producer writes itself. Pure.

Success: `response{status_code: 200, request_id, body: the ChatCompletion/Completion}`,
`error: null`; otherwise `response{status_code, request_id, body: {"error": ...}}` (the
shape the OpenAI API answers errors with) and `error{code, message}`.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from producer.bulk import OUTPUT_ID_PREFIX, Line
from schemas import (
    BatchOutputError,
    BatchOutputLine,
    BatchOutputResponse,
    ErrorCode,
    ErrorInfo,
    ResultEnvelope,
    Status,
    Timings,
)
from schemas.ref import RequestRef

STATUS_CODES: dict[str, int] = {
    ErrorCode.invalid_request: 400,
    ErrorCode.unknown_model: 400,
    ErrorCode.context_length_exceeded: 400,
    ErrorCode.deadline_exceeded: 408,
    ErrorCode.cancelled: 499,
    ErrorCode.engine_error: 500,
    ErrorCode.internal_error: 500,
    ErrorCode.duplicate_request_id: 409,
    # the request was fine and ran; the loop did not reach an answer (transcript kept)
    ErrorCode.tool_loop_max_turns: 422,
    ErrorCode.tool_loop_aborted: 422,
    ErrorCode.result_too_large: 400,
}
"""HTTP-like status of an output line by error code; 200 when the request succeeded."""


def status_code(result: ResultEnvelope) -> int:
    if result.status is Status.succeeded:
        return 200
    if result.error is not None:
        return STATUS_CODES.get(result.error.code, 500)
    return {Status.expired: 408, Status.cancelled: 499}.get(result.status, 500)


def _error_of(result: ResultEnvelope) -> ErrorInfo:
    if result.error is not None:
        return result.error
    code = {
        Status.expired: ErrorCode.deadline_exceeded,
        Status.cancelled: ErrorCode.cancelled,
    }.get(result.status, ErrorCode.internal_error)
    return ErrorInfo(code=code, message=f"request {result.status}")


def error_body(result: ResultEnvelope) -> dict[str, Any]:
    """`{"error": {message, type, param, code}}`, the shape the OpenAI API answers errors
    with, for a result that did not succeed (also `qbatch serve`'s sync answers)."""
    err = _error_of(result)
    return {
        "error": {
            "message": err.message,
            "type": str(err.code),
            "param": err.param,
            "code": str(err.code),
        }
    }


def output_line(result: ResultEnvelope) -> BatchOutputLine:
    """The OpenAI Batch output line for one result.

    Success: `response{200, request_id, body: the ChatCompletion/Completion}`, `error: null`.
    Otherwise: `response{status_code, request_id, body: {"error": {...}}}` (the shape the
    OpenAI API answers errors with) and `error{code, message}`.
    """
    rid = result.request_id
    if result.status is Status.succeeded:
        body = result.response.model_dump(mode="json") if result.response is not None else None
        return BatchOutputLine(
            id=OUTPUT_ID_PREFIX + rid,
            custom_id=result.custom_id,
            response=BatchOutputResponse(status_code=200, request_id=rid, body=body),
            error=None,
            tool_loop=result.tool_loop,
            context=result.context,
        )
    err = _error_of(result)
    body = error_body(result)
    return BatchOutputLine(
        id=OUTPUT_ID_PREFIX + rid,
        custom_id=result.custom_id,
        response=BatchOutputResponse(status_code=status_code(result), request_id=rid, body=body),
        error=BatchOutputError(code=str(err.code), message=err.message),
        tool_loop=result.tool_loop,
    )


def output_json(result: ResultEnvelope) -> str:
    """One output JSONL line (no newline)."""
    absent = {name for name in ("tool_loop", "context") if getattr(result, name) is None}
    return output_line(result).model_dump_json(exclude=absent or None)


def local_result(
    line: Line, job_id: str, status: Status, error: ErrorInfo, now_ms: int
) -> ResultEnvelope:
    """A result the producer writes itself, for a line never published.

    Used for lines that fail validation (`failed`, `invalid_request`) and for lines left
    unpublished when the job is cancelled during submission (`cancelled`).
    """
    return ResultEnvelope.for_request(
        RequestRef(
            request_id=line.request_id,
            job_id=job_id,
            custom_id=line.custom_id,
            metadata=line.envelope.metadata if line.envelope is not None else None,
        ),
        status,
        error=error,
        timings=Timings(submitted=now_ms, finished=now_ms),
    )


def invalid_result(line: Line, job_id: str, now_ms: int) -> ResultEnvelope:
    assert line.error is not None
    message = f"line {line.line}: {line.error.message}"
    return local_result(
        line,
        job_id,
        Status.failed,
        ErrorInfo(code=line.error.code, message=message, param=line.error.param),
        now_ms,
    )


def cancelled_result(line: Line, job_id: str, now_ms: int) -> ResultEnvelope:
    """The answer to a line left unsent by a cancel: `expired` where the line's own
    deadline had passed by then (an expiring serve batch cancels its job so the lines it
    never published are answered the way the worker answers queued ones), else
    `cancelled`."""
    now = datetime.fromtimestamp(now_ms / 1000, UTC)
    if line.envelope is not None and line.envelope.deadline_passed(now):
        return local_result(
            line,
            job_id,
            Status.expired,
            ErrorInfo(
                code=ErrorCode.deadline_exceeded,
                message="deadline passed before this line was sent",
            ),
            now_ms,
        )
    return local_result(
        line,
        job_id,
        Status.cancelled,
        ErrorInfo(code=ErrorCode.cancelled, message="job cancelled before this line was sent"),
        now_ms,
    )
