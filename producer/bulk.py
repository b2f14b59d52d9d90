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
* A `priority` inside a body (vLLM's batch files put it there) moves to the envelope,
  where qbatch reads it, unless the line sets the envelope's own (two different values
  are an error naming `body.priority`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from pydantic import ValidationError

from schemas import (
    BatchInputLine,
    ContractError,
    RequestEnvelope,
    valid_id,
    validate_envelope,
)
from schemas.endpoints import EMBEDDINGS
from schemas.limits import MAX_ENVELOPE_BYTES, RESERVED_JOB_SUFFIXES
from schemas.request import OPTION_NAMES, RequestOptions
from schemas.result_size import check_asked
from schemas.routes import RouteTable

MAX_JOB_ID_CHARS = 96
"""Leaves room for `.{line}.r{attempt}` inside the 128-char request id limit."""

OUTPUT_ID_PREFIX = "batch_req_"

# ---------------------------------------------------------------- ids


def jsonl_lines(text: str) -> list[str]:
    """A JSONL text's lines: split on `\n` only (a `\r` before it dropped).

    Not `str.splitlines()`, which also breaks at U+2028, U+2029, U+0085 and other
    characters JSON allows raw inside a string (`JSON.stringify` and Python's
    `ensure_ascii=False` write them so): one such line became two broken ones and
    every later line number moved.
    """
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


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


class Defaults:
    """Envelope options a bulk run applies to every line that does not set them: any of
    `schemas.RequestOptions` but `job_id` (the job's own) and `custom_id` (per line).
    Checked once, up front, by the envelope's own rules (a ContractError naming the
    option), so a bad default is one error, not one per line."""

    ALLOWED = tuple(n for n in OPTION_NAMES if n not in ("job_id", "custom_id"))

    def __init__(
        self,
        *,
        routes: RouteTable | None = None,
        max_result_bytes: int | None = None,
        priority_range: tuple[int, int] | None = None,
        embeddings_base64: bool = False,
        **options: Any,
    ) -> None:
        self.routes = routes
        self.embeddings_base64 = embeddings_base64
        """`/v1/embeddings` lines that leave `encoding_format` unset get base64 (`qbatch
        bulk`: a quarter of the floats' size in Redis and the output file)."""
        """With a route table, a line whose body.model nobody serves is a bad line."""
        self.max_result_bytes = max_result_bytes
        """With a bound, a line whose result could pass it is a bad line
        (`schemas.result_size.check_asked`; `qbatch serve` sets its own)."""
        self.priority_range = priority_range
        """With a range, a line's priority is clamped into it (`qbatch serve`: the
        tenant's, from the keys file)."""
        wrong = sorted(set(options) - set(self.ALLOWED))
        if wrong:
            raise ContractError(
                f"not a bulk default: {', '.join(wrong)} (defaults: {', '.join(self.ALLOWED)})",
                param=wrong[0],
            )
        given = {k: v for k, v in options.items() if v is not None}
        try:
            checked = RequestOptions.model_validate(given)
        except ValidationError as exc:
            raise ContractError.from_validation(exc) from None
        self._values = checked.model_dump(mode="json", include=set(given))

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Defaults)
            and other._values == self._values
            and other.routes == self.routes
            and other.max_result_bytes == self.max_result_bytes
            and other.priority_range == self.priority_range
            and other.embeddings_base64 == self.embeddings_base64
        )

    def routed(self, routes: RouteTable | None, max_result_bytes: int | None = None) -> Defaults:
        """These defaults, checking every line's model against `routes` (and its result
        size against `max_result_bytes`)."""
        copy = Defaults(
            routes=routes,
            max_result_bytes=max_result_bytes,
            embeddings_base64=self.embeddings_base64,
        )
        copy._values = dict(self._values)
        return copy

    def check(self, envelope: RequestEnvelope) -> None:
        """ContractError for a line no worker pool serves (naming body.model), or whose
        result could pass the bound (naming the field that makes it large)."""
        if self.routes is not None:
            self.routes.route(envelope.body.model)
        if self.max_result_bytes is not None:
            check_asked(envelope, self.max_result_bytes)

    def __repr__(self) -> str:
        return f"Defaults({self._values!r})"

    def apply(self, data: dict[str, Any]) -> None:
        for name, value in self._values.items():
            data.setdefault(name, value)
        body = data.get("body")
        if (
            self.embeddings_base64
            and data.get("endpoint") == EMBEDDINGS.path
            and isinstance(body, dict)
            and body.get("encoding_format") is None
        ):
            data["body"] = {**body, "encoding_format": "base64"}
        priority = data.get("priority")
        if self.priority_range is not None and isinstance(priority, int):
            low, high = self.priority_range
            data["priority"] = min(max(priority, low), high)


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

    @property
    def invalid(self) -> int:
        return sum(1 for line in self.lines if not line.ok)

    def lines_from(self, position: int) -> Iterator[Line]:
        """The lines after the first `position` (`producer.line_sources.LineSource`)."""
        return iter(self.lines[position:])


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
        _lift_priority(data)
        (defaults or NO_DEFAULTS).apply(data)
        envelope = validate_envelope(data)
        (defaults or NO_DEFAULTS).check(envelope)
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


def _lift_priority(data: dict[str, Any]) -> None:
    """Move a body's `priority` (vLLM's request field) to the envelope's."""
    body = data.get("body")
    if not isinstance(body, dict) or "priority" not in body:
        return
    body = dict(body)
    value = body.pop("priority")
    data["body"] = body
    if value is None:
        return
    own = data.get("priority")
    if own is not None and own != value:
        raise ContractError(
            f"the body's priority {value!r} contradicts the envelope's {own!r}",
            param="body.priority",
        )
    data["priority"] = value


def _native_data(obj: dict[str, Any], rid: str, job_id: str) -> dict[str, Any]:
    data = dict(obj)
    if "loop" in data:  # a continuation's state: the tool executor's, never a file's
        raise ContractError("loop is set by the tool executor, not by an input line", param="loop")
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


class CustomIds:
    """custom_id uniqueness (OpenAI requires it, and output lines are matched on it): the
    first line with an id keeps it, a later valid line repeating it is an error. Keyed by
    a 64-bit digest of the id, so a million ids cost tens of MB, not their text."""

    def __init__(self) -> None:
        self._first: dict[int, int] = {}

    def earlier(self, parsed: Line) -> int | None:
        """The earlier line `parsed` (a valid line) repeats the custom_id of, else None."""
        cid = parsed.custom_id
        if cid is None:
            return None
        digest = int.from_bytes(hashlib.blake2b(cid.encode(), digest_size=8).digest(), "big")
        first = self._first.setdefault(digest, parsed.line)
        return first if first != parsed.line and parsed.ok else None

    def check(self, parsed: Line) -> Line:
        """`parsed`, or an error line when its custom_id was seen on an earlier line."""
        first = self.earlier(parsed)
        return parsed if first is None else duplicate_line(parsed, first)


def duplicate_line(parsed: Line, first: int) -> Line:
    """`parsed` (a valid line) as the error of repeating line `first`'s custom_id."""
    return Line(
        parsed.line,
        parsed.request_id,
        parsed.custom_id,
        error=ContractError(
            f"duplicate custom_id {parsed.custom_id!r} (first on line {first})",
            param="custom_id",
        ),
    )


def scan_lines(
    texts: Iterable[str],
    job_id: str,
    *,
    attempt: int = 0,
    defaults: Defaults | None = None,
) -> Scan:
    """Validate every line (texts are the file's lines, in order); report every bad one.

    A custom_id seen on an earlier line makes the later line an error (`CustomIds`).
    Holds every line parsed: for a file of any size, `producer.line_sources.scan_stream`.
    """
    scan = Scan(format=None)
    ids = CustomIds()
    for number, raw in enumerate(texts, start=1):
        text = raw.strip()
        if not text:
            continue
        if scan.format is None:
            scan.format = detect_line(text)
        parsed = parse_line(text, number, scan.format, job_id, attempt=attempt, defaults=defaults)
        scan.lines.append(ids.check(parsed))
    return scan


def detect_line(text: str) -> InputFormat:
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
            return detect_line(text)
    return None
