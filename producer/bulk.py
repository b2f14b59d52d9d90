"""Bulk files, pure parts: formats, line validation, request ids, output lines, status maths.

Nothing here touches a socket or the clock (callers pass `now_ms`), so all of it is
unit-tested without Kafka or Redis. The I/O lives in `producer.jobs`.

Decisions (see `producer/README.md`):

* Input is OpenAI Batch JSONL (`custom_id`, `method`, `url`, `body`) or native request
  envelopes, one JSON object a line. The first non-blank line decides the format; a line
  of the other format is a "mixed formats" error naming that line. Blank lines are
  skipped and do not count as requests.
* Request ids are derived from the job id and the *physical* line number (1-based):
  `{job_id}.{line}`; a retry attempt k>=1 of that line is `{job_id}.{line}.r{k}`. So a
  re-run of `bulk submit` publishes the very same ids, and the worker's written-once rule
  makes a re-sent line harmless.
* Native envelopes keep their options, but `request_id` is replaced by the derived id
  (the original one becomes `custom_id` when the line has none) and `job_id` is set to
  the job (a line naming another job is an error).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

from pydantic import ValidationError

from schemas import (
    BatchInputLine,
    BatchOutputError,
    BatchOutputLine,
    BatchOutputResponse,
    ContractError,
    ErrorCode,
    ErrorInfo,
    JobField,
    JobStatus,
    RequestEnvelope,
    ResultEnvelope,
    Status,
    Timings,
    valid_id,
    validate_envelope,
)
from schemas.limits import MAX_ENVELOPE_BYTES, RESERVED_JOB_SUFFIXES
from schemas.ref import RequestRef

MAX_JOB_ID_CHARS = 96
"""Leaves room for `.{line}.r{attempt}` inside the 128-char request id limit."""

OUTPUT_ID_PREFIX = "batch_req_"

# ---------------------------------------------------------------- ids


def check_job_id(job_id: str) -> str:
    """`job_id` if usable for a bulk job, else ContractError naming `job_id`."""
    if valid_id(job_id) is None or len(job_id) > MAX_JOB_ID_CHARS:
        raise ContractError(
            f"must be 1-{MAX_JOB_ID_CHARS} characters of [A-Za-z0-9_.:-], got {job_id!r}",
            param="job_id",
        )
    if job_id.endswith(RESERVED_JOB_SUFFIXES):
        raise ContractError(
            f"may not end with {' or '.join(RESERVED_JOB_SUFFIXES)}, got {job_id!r}",
            param="job_id",
        )
    return job_id


def request_id_for(job_id: str, line: int, attempt: int = 0) -> str:
    """Deterministic request id of physical line `line` (1-based) of a job's input file."""
    if line < 1 or attempt < 0:
        raise ValueError("line is 1-based and attempt >= 0")
    rid = f"{job_id}.{line}" if attempt == 0 else f"{job_id}.{line}.r{attempt}"
    if valid_id(rid) is None:
        raise ContractError(f"derived request id {rid!r} is not a valid id", param="job_id")
    return rid


def parse_request_id(job_id: str, request_id: str) -> tuple[int, int] | None:
    """(line, attempt) of a request id made by `request_id_for`, or None if it is not one."""
    head = job_id + "."
    if not request_id.startswith(head):
        return None
    parts = request_id[len(head) :].split(".")
    try:
        if len(parts) == 1 and parts[0].isdigit():
            return int(parts[0]), 0
        if (
            len(parts) == 2
            and parts[0].isdigit()
            and parts[1][:1] == "r"
            and parts[1][1:].isdigit()
        ):
            return int(parts[0]), int(parts[1][1:])
    except ValueError:
        return None
    return None


# ---------------------------------------------------------------- formats


class InputFormat(StrEnum):
    openai = "openai"
    native = "native"


_OPENAI_ONLY = frozenset({"url", "method"})
_NATIVE_ONLY = frozenset({"request_id", "v", "endpoint", "job_id", "submitted_at"})


def line_kind(obj: Mapping[str, Any]) -> InputFormat | None:
    """Which format a JSON object looks like, or None when it has no telling key."""
    keys = set(obj)
    if keys & _OPENAI_ONLY:
        return InputFormat.openai
    if keys & _NATIVE_ONLY:
        return InputFormat.native
    return None


@dataclass(frozen=True, slots=True)
class Defaults:
    """Envelope options a bulk run applies to every line that does not set them."""

    priority: int | None = None
    deadline: datetime | None = None
    result_ttl_s: int | None = None
    metadata: dict[str, Any] | None = None

    def apply(self, data: dict[str, Any]) -> None:
        if self.priority is not None:
            data.setdefault("priority", self.priority)
        if self.deadline is not None:
            data.setdefault("deadline", self.deadline.isoformat())
        if self.result_ttl_s is not None:
            data.setdefault("result_ttl_s", self.result_ttl_s)
        if self.metadata is not None:
            data.setdefault("metadata", self.metadata)


NO_DEFAULTS = Defaults()


@dataclass(frozen=True, slots=True)
class Line:
    """One non-blank line of a bulk file, validated."""

    line: int
    """Physical line number, 1-based."""
    request_id: str
    custom_id: str | None
    envelope: RequestEnvelope | None = None
    error: ContractError | None = None
    mixed: bool = False
    """The line is of the other format than the file's (a mixed file)."""

    @property
    def ok(self) -> bool:
        return self.envelope is not None


@dataclass(slots=True)
class Scan:
    """A whole bulk file, validated line by line."""

    format: InputFormat | None
    lines: list[Line] = field(default_factory=list)

    @property
    def total(self) -> int:
        return len(self.lines)

    @property
    def bad(self) -> list[Line]:
        return [line for line in self.lines if not line.ok]

    @property
    def mixed(self) -> list[Line]:
        return [line for line in self.lines if line.mixed]


def _custom_id_of(obj: object) -> str | None:
    if isinstance(obj, dict):
        value = obj.get("custom_id")
        if isinstance(value, str) and value:
            return value
    return None


def parse_line(
    text: str,
    line: int,
    fmt: InputFormat | None,
    job_id: str,
    *,
    attempt: int = 0,
    defaults: Defaults | None = None,
) -> Line:
    """Validate one line of a bulk file into an envelope, or a Line carrying the error."""
    rid = request_id_for(job_id, line, attempt)
    if len(text.encode("utf-8")) > MAX_ENVELOPE_BYTES:
        return Line(
            line,
            rid,
            None,
            error=ContractError(f"line is over {MAX_ENVELOPE_BYTES} bytes", param="(line)"),
        )
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        return Line(line, rid, None, error=ContractError(f"not JSON: {exc}", param="(line)"))
    except (ValueError, RecursionError) as exc:  # a 5,000-digit integer, deep nesting
        why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        return Line(
            line, rid, None, error=ContractError(f"not JSON this tool reads: {why}", param="(line)")
        )
    if not isinstance(obj, dict):
        return Line(
            line,
            rid,
            None,
            error=ContractError(
                f"a line must be a JSON object, got {type(obj).__name__}", param="(line)"
            ),
        )
    custom_id = _custom_id_of(obj)
    kind = line_kind(obj) or fmt
    if fmt is not None and kind is not fmt:
        return Line(
            line,
            rid,
            custom_id,
            mixed=True,
            error=ContractError(
                f"mixed formats: this line is a {kind} line in a {fmt} file", param="(line)"
            ),
        )
    try:
        if kind is InputFormat.native:
            data = _native_data(obj, rid, job_id)
        else:
            data = _openai_data(obj, rid, job_id)
        (defaults or NO_DEFAULTS).apply(data)
        envelope = validate_envelope(data)
    except ContractError as exc:
        return Line(line, rid, custom_id, error=exc)
    return Line(line, rid, envelope.custom_id, envelope=envelope)


def _openai_data(obj: dict[str, Any], rid: str, job_id: str) -> dict[str, Any]:
    try:
        parsed = BatchInputLine.model_validate(obj)
    except ValidationError as exc:
        raise ContractError.from_validation(exc) from None
    return {
        "request_id": rid,
        "endpoint": parsed.url,
        "body": parsed.body,
        "job_id": job_id,
        "custom_id": parsed.custom_id,
    }


def _native_data(obj: dict[str, Any], rid: str, job_id: str) -> dict[str, Any]:
    data = dict(obj)
    own_job = data.get("job_id")
    if own_job is not None and own_job != job_id:
        raise ContractError(f"line belongs to job {own_job!r}, not {job_id!r}", param="job_id")
    original = data.get("request_id")
    if "custom_id" not in data and isinstance(original, str) and original:
        data["custom_id"] = original
    data["request_id"] = rid
    data["job_id"] = job_id
    data.pop("submitted_at", None)
    return data


def scan_lines(
    texts: Iterable[str],
    job_id: str,
    *,
    attempt: int = 0,
    defaults: Defaults | None = None,
) -> Scan:
    """Validate every line (texts are the file's lines, in order); report every bad one.

    A custom_id seen on an earlier line makes the later line an error (OpenAI requires
    them unique, and output lines are matched on them).
    """
    scan = Scan(format=None)
    seen: dict[str, int] = {}
    for number, raw in enumerate(texts, start=1):
        text = raw.strip()
        if not text:
            continue
        if scan.format is None:
            scan.format = _detect(text)
        parsed = parse_line(text, number, scan.format, job_id, attempt=attempt, defaults=defaults)
        cid = parsed.custom_id
        if cid is not None:
            if cid in seen:
                if parsed.ok:
                    parsed = Line(
                        number,
                        parsed.request_id,
                        cid,
                        error=ContractError(
                            f"duplicate custom_id {cid!r} (first on line {seen[cid]})",
                            param="custom_id",
                        ),
                    )
            else:
                seen[cid] = number
        scan.lines.append(parsed)
    return scan


def _detect(text: str) -> InputFormat:
    """The format a file's first non-blank line announces (OpenAI when it cannot tell)."""
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        return InputFormat.openai
    if isinstance(obj, dict):
        return line_kind(obj) or InputFormat.openai
    return InputFormat.openai


def detect_format(texts: Iterable[str]) -> InputFormat | None:
    """The format of a file: its first non-blank line decides; None for an empty file."""
    for raw in texts:
        text = raw.strip()
        if text:
            return _detect(text)
    return None


# ---------------------------------------------------------------- results and output lines

STATUS_CODES: dict[str, int] = {
    ErrorCode.invalid_request: 400,
    ErrorCode.unknown_model: 400,
    ErrorCode.context_length_exceeded: 400,
    ErrorCode.deadline_exceeded: 408,
    ErrorCode.cancelled: 499,
    ErrorCode.engine_error: 500,
    ErrorCode.internal_error: 500,
    ErrorCode.duplicate_request_id: 409,
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
        )
    err = _error_of(result)
    body = {
        "error": {
            "message": err.message,
            "type": str(err.code),
            "param": err.param,
            "code": str(err.code),
        }
    }
    return BatchOutputLine(
        id=OUTPUT_ID_PREFIX + rid,
        custom_id=result.custom_id,
        response=BatchOutputResponse(status_code=status_code(result), request_id=rid, body=body),
        error=BatchOutputError(code=str(err.code), message=err.message),
    )


def output_json(result: ResultEnvelope) -> str:
    """One output JSONL line (no newline)."""
    return output_line(result).model_dump_json()


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
    return local_result(
        line,
        job_id,
        Status.cancelled,
        ErrorInfo(code=ErrorCode.cancelled, message="job cancelled before this line was sent"),
        now_ms,
    )


# ---------------------------------------------------------------- status maths

TERMINAL = frozenset({JobStatus.completed, JobStatus.completed_with_errors, JobStatus.cancelled})


def _int(value: object) -> int:
    if value is None:
        return 0
    if isinstance(value, bytes):
        value = value.decode()
    try:
        return int(str(value))
    except ValueError:
        return 0


@dataclass(frozen=True, slots=True)
class JobView:
    """A job hash, read at `now_ms`, with the derived figures `bulk status` shows."""

    job_id: str
    status: str
    total: int
    submitted: int
    succeeded: int
    failed: int
    expired: int
    cancelled: int
    created_at: int
    updated_at: int
    now_ms: int

    @classmethod
    def from_hash(cls, job_id: str, h: Mapping[Any, Any], now_ms: int) -> JobView:
        def get(name: str) -> object:
            if name in h:
                return h[name]
            return h.get(name.encode())

        status = get(JobField.status)
        if isinstance(status, bytes):
            status = status.decode()
        return cls(
            job_id=job_id,
            status=str(status) if status is not None else "unknown",
            total=_int(get(JobField.total)),
            submitted=_int(get(JobField.submitted)),
            succeeded=_int(get(JobField.succeeded)),
            failed=_int(get(JobField.failed)),
            expired=_int(get(JobField.expired)),
            cancelled=_int(get(JobField.cancelled)),
            created_at=_int(get(JobField.created_at)),
            updated_at=_int(get(JobField.updated_at)),
            now_ms=now_ms,
        )

    @property
    def done(self) -> int:
        return self.succeeded + self.failed + self.expired + self.cancelled

    @property
    def unsuccessful(self) -> int:
        return self.failed + self.expired + self.cancelled

    @property
    def pending(self) -> int:
        return max(self.total - self.done, 0)

    @property
    def finished(self) -> bool:
        """Every line has a result."""
        return self.total > 0 and self.done >= self.total

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL

    @property
    def all_succeeded(self) -> bool:
        return self.finished and self.unsuccessful == 0

    @property
    def progress_pct(self) -> float:
        """Done / total in percent, floored to 0.1, and never 100 while a result is missing."""
        if self.total <= 0:
            return 0.0
        if self.done >= self.total:
            return 100.0
        return min(math.floor(self.done * 1000 / self.total) / 10, 99.9)

    @property
    def elapsed_s(self) -> float:
        """From creation to the last result (finished jobs) or to now."""
        if not self.created_at:
            return 0.0
        end = self.updated_at if self.finished and self.updated_at else self.now_ms
        return max(end - self.created_at, 0) / 1000

    @property
    def rate(self) -> float | None:
        """Results per second since the job was created."""
        if self.elapsed_s <= 0 or self.done == 0:
            return None
        return self.done / self.elapsed_s

    @property
    def eta_s(self) -> float | None:
        if self.finished:
            return 0.0
        rate = self.rate
        if rate is None or self.status == JobStatus.cancelled:
            return None
        return self.pending / rate

    @property
    def label(self) -> str:
        """The status, said honestly (a finished job with failures says how many)."""
        if self.status == JobStatus.completed_with_errors or (
            self.status == JobStatus.completed and self.unsuccessful
        ):
            return (
                f"completed_with_errors ({self.succeeded} succeeded, {self.failed} failed, "
                f"{self.expired} expired, {self.cancelled} cancelled)"
            )
        if self.status == JobStatus.submitting:
            return f"submitting ({self.submitted}/{self.total} sent)"
        return self.status

    def as_dict(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "status": self.status,
            "total": self.total,
            "submitted": self.submitted,
            "succeeded": self.succeeded,
            "failed": self.failed,
            "expired": self.expired,
            "cancelled": self.cancelled,
            "done": self.done,
            "pending": self.pending,
            "progress_pct": self.progress_pct,
            "created_at": self.created_at or None,
            "updated_at": self.updated_at or None,
            "elapsed_s": round(self.elapsed_s, 3),
            "rate_per_s": round(self.rate, 3) if self.rate is not None else None,
            "eta_s": round(self.eta_s, 1) if self.eta_s is not None else None,
            "all_succeeded": self.all_succeeded,
        }


@dataclass(slots=True)
class Collected:
    """Which result each line of a job has, newest attempt winning (pure bookkeeping)."""

    job_id: str
    attempts: dict[int, int] = field(default_factory=dict)
    """line -> attempt of the result kept for it."""
    statuses: dict[int, str] = field(default_factory=dict)

    def offer(self, request_id: str, status: str) -> tuple[int, int] | None:
        """Record a finished request; (line, attempt) if it is news for its line, else None."""
        parsed = parse_request_id(self.job_id, request_id)
        if parsed is None:
            return None
        line, attempt = parsed
        have = self.attempts.get(line)
        if have is not None and have >= attempt:
            return None
        self.attempts[line] = attempt
        self.statuses[line] = status
        return parsed

    def __len__(self) -> int:
        return len(self.attempts)

    def counts(self) -> dict[str, int]:
        out = {str(s): 0 for s in Status}
        for status in self.statuses.values():
            out[status] = out.get(status, 0) + 1
        return out
