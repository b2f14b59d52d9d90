"""OpenAI Batch objects <-> qbatch bulk jobs: the record kept in Redis, the object the API
answers, and the validation of a batch's input file.

A batch **is** a bulk job: its job id is the batch id, so `qbatch bulk status batch_...`
shows it, and the job's counters are the batch's live `request_counts`. What the job does
not know (tenant, input file, endpoint, window, metadata, lifecycle timestamps, output
files) lives in the hash `{prefix}:serve:batch:{id}`; a tenant's batches are listed from
the sorted set `{prefix}:serve:tenant:{tenant}:batches`; batches not in a final state are
in `{prefix}:serve:active` (the runner resumes them after a restart) and in the tenant's
active set (its concurrent-batch limit). Every key comes from `schemas.keys.RedisKeys`.

Status lifecycle (OpenAI's): validating -> failed (a bad file) | in_progress ->
finalizing -> completed | expired; cancel: (validating | in_progress) -> cancelling ->
cancelled. The pure parts (record <-> hash, the object, file validation) are unit-tested
without Redis.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any

import redis

from producer.bulk import Defaults, InputFormat, Line, Scan, scan_lines
from producer.job_view import JobView
from producer.serve.errors import openai_code
from producer.serve.lease import Lease
from schemas import RedisKeys
from schemas.endpoints import PATHS

ENDPOINTS = PATHS
"""A batch's `endpoint` (and its lines' `url`): the endpoint table's paths."""
MAX_ERRORS = 1_000
MAX_ERRORS_BYTES = 64 * 1024
MAX_MESSAGE_CHARS = 500
MAX_PARAM_CHARS = 200
"""At most this many per-line errors are kept on a failed batch (the rest are counted)."""
MAX_WINDOW_HOURS = 168
RECORD_TTL_S = 30 * 86_400
"""A finished batch's record lives this long, or as long as its output files when they
are given a longer `output_expires_after`."""
MAX_KEPT_BATCHES = 10_000
"""Batch records one tenant may hold (finished ones expire after RECORD_TTL_S)."""
MAX_BATCH_LINES = 50_000
"""Request lines one batch may hold (OpenAI's limit; `--max-batch-lines`)."""
BATCH_ID = re.compile(r"^batch_[0-9a-f]{32}$")


class BatchStatus(StrEnum):
    validating = "validating"
    failed = "failed"
    in_progress = "in_progress"
    finalizing = "finalizing"
    completed = "completed"
    expired = "expired"
    cancelling = "cancelling"
    cancelled = "cancelled"


FINAL = frozenset(
    {BatchStatus.failed, BatchStatus.completed, BatchStatus.expired, BatchStatus.cancelled}
)


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex}"


def window_seconds(window: str) -> int:
    """`completion_window` in seconds: `{N}h`, 1 <= N <= 168 (OpenAI accepts only `24h`;
    qbatch also takes other hour counts). ValueError otherwise."""
    match = re.fullmatch(r"([0-9]{1,3})h", window)
    if match is None or not 1 <= int(match.group(1)) <= MAX_WINDOW_HOURS:
        raise ValueError(f"completion_window must be '24h' (or 1h-{MAX_WINDOW_HOURS}h)")
    return int(match.group(1)) * 3600


_JSON_FIELDS = ("metadata", "errors", "final_counts")


@dataclass(slots=True)
class BatchRecord:
    """What `{prefix}:serve:batch:{id}` holds. Times are epoch seconds, as OpenAI's."""

    id: str
    tenant: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    created_at: int
    expires_at: int
    metadata: dict[str, str] | None = None
    errors: list[dict[str, Any]] | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    final_counts: dict[str, int] | None = None
    """request_counts frozen when the batch ends (the job hash expires after a week)."""
    ending: str | None = None
    """The final status finalizing leads to (`completed`, `cancelled` or `expired`)."""
    output_expires_after_s: int | None = None
    """The output and error files' `expires_after` (the create's `output_expires_after`)."""
    extra: dict[str, str] = field(default_factory=dict)

    def to_hash(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "extra" and value is not None:
                out[f.name] = _encode(f.name, value)
        return out

    @classmethod
    def from_hash(cls, h: Mapping[Any, Any]) -> BatchRecord:
        data = {_s(k): _s(v) for k, v in h.items()}
        kwargs: dict[str, Any] = {}
        for f in fields(cls):
            if f.name == "extra" or f.name not in data:
                continue
            raw = data.pop(f.name)
            if f.name in _JSON_FIELDS:
                kwargs[f.name] = json.loads(raw)
            elif f.name.endswith(("_at", "_s")):
                kwargs[f.name] = int(raw)
            else:
                kwargs[f.name] = raw
        return cls(**kwargs, extra=data)


def _encode(name: str, value: Any) -> str:
    return json.dumps(value) if name in _JSON_FIELDS else str(value)


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def request_counts(record: BatchRecord, view: JobView | None) -> dict[str, int]:
    """OpenAI's `{total, completed, failed}`: live from the job's counters; `failed`
    counts every line that did not succeed (failed, expired, cancelled)."""
    if record.final_counts is not None:
        return dict(record.final_counts)
    if view is None:
        return {"total": 0, "completed": 0, "failed": 0}
    return {"total": view.total, "completed": view.succeeded, "failed": view.unsuccessful}


def batch_object(record: BatchRecord, view: JobView | None) -> dict[str, Any]:
    """The OpenAI Batch object of a record (and its job's counters, when it has a job)."""
    errors = None
    if record.errors:
        errors = {"object": "list", "data": record.errors}
    return {
        "id": record.id,
        "object": "batch",
        "endpoint": record.endpoint,
        "errors": errors,
        "input_file_id": record.input_file_id,
        "completion_window": record.completion_window,
        "status": record.status,
        "output_file_id": record.output_file_id,
        "error_file_id": record.error_file_id,
        "created_at": record.created_at,
        "in_progress_at": record.in_progress_at,
        "expires_at": record.expires_at,
        "finalizing_at": record.finalizing_at,
        "completed_at": record.completed_at,
        "failed_at": record.failed_at,
        "expired_at": record.expired_at,
        "cancelling_at": record.cancelling_at,
        "cancelled_at": record.cancelled_at,
        "request_counts": request_counts(record, view),
        "metadata": record.metadata,
    }


# ---------------------------------------------------------------- input validation


def _error(code: str, line: int | None, message: str, param: str | None) -> dict[str, Any]:
    """One entry of `errors.data`; message and param cut short (they may echo a line's
    keys and values, which are the uploader's, of any length)."""
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[:MAX_MESSAGE_CHARS] + "..."
    if param is not None and len(param) > MAX_PARAM_CHARS:
        param = param[:MAX_PARAM_CHARS] + "..."
    return {"code": code, "line": line, "message": message, "param": param}


def _capped(errors: list[dict[str, Any]], dropped: int = 0) -> list[dict[str, Any]]:
    """At most MAX_ERRORS entries and MAX_ERRORS_BYTES of JSON, then one entry saying how
    many more there were (`dropped`: errors not even kept): the list is stored in the
    batch hash and sent with every read of the batch, and a failed batch does not count
    towards the active-batch limit, so its size must not follow the size of the file."""
    kept: list[dict[str, Any]] = []
    size = 0
    for entry in errors[:MAX_ERRORS]:
        size += len(json.dumps(entry)) + 2  # and the ", " between entries
        if size > MAX_ERRORS_BYTES:
            break
        kept.append(entry)
    if len(kept) < len(errors) or dropped:
        more = len(errors) - len(kept) + dropped
        kept.append(_error("too_many_errors", None, f"{more} more bad lines not listed", None))
    return kept


class InputCheck:
    """OpenAI's per-line errors of a batch input (`{code, line, message, param}`), gathered
    as the lines go by (`visit`, e.g. from `producer.stream_scan.scan_stream`), at most
    MAX_ERRORS of them kept. As OpenAI does, one bad line fails the whole batch (nothing
    is run): bad JSON, an unknown `url` (endpoint), a `url` other than the batch's
    endpoint, a body the contract refuses (naming the field), a repeated `custom_id`, a
    line whose result could pass the server's `max_result_bytes`; and a native envelope
    file, an empty file, or one of more than `max_lines` request lines."""

    def __init__(self, endpoint: str, max_lines: int | None = None) -> None:
        self.endpoint = endpoint
        self.max_lines = max_lines
        self.errors: list[dict[str, Any]] = []
        self.more = 0

    def _add(self, entry: dict[str, Any]) -> None:
        if len(self.errors) < MAX_ERRORS:
            self.errors.append(entry)
        else:
            self.more += 1

    def visit(self, line: Line) -> None:
        if line.error is not None:
            message = line.error.message
            param = None if line.error.param == "(line)" else line.error.param
            duplicate = line.error.param == "custom_id" and "duplicate custom_id" in message
            code = "duplicate_custom_id" if duplicate else openai_code(line.error.code)
            self._add(_error(code, line.line, message, param))
        elif line.envelope is not None and line.envelope.endpoint != self.endpoint:
            self._add(
                _error(
                    "mismatched_endpoint",
                    line.line,
                    f"url {line.envelope.endpoint!r} is not the batch's endpoint {self.endpoint!r}",
                    "url",
                )
            )

    def result(
        self, fmt: InputFormat | None, total: int, first: int | None, over_limit: bool = False
    ) -> list[dict[str, Any]]:
        """The errors, capped (`first`: the first request line's number)."""
        head: list[dict[str, Any]] = []
        if fmt is InputFormat.native:
            head.append(
                _error(
                    "invalid_request",
                    first,
                    "not an OpenAI Batch input line (expected custom_id, method, url, body)",
                    None,
                )
            )
        if over_limit:
            head.append(
                _error(
                    "too_many_lines",
                    None,
                    f"a batch holds at most {self.max_lines:,} request lines "
                    "(--max-batch-lines; OpenAI's is 50,000): split the file",
                    None,
                )
            )
        if not total:
            head.append(_error("empty_file", None, "the input file holds no requests", None))
        return _capped(head + self.errors, self.more)


def validate_input(
    texts: Iterable[str], batch_id: str, endpoint: str, defaults: Defaults | None = None
) -> tuple[Scan, list[dict[str, Any]]]:
    """A batch input held as text, checked whole (`InputCheck`; `qbatch serve` streams
    its inputs through `producer.stream_scan` instead)."""
    scan = scan_lines(texts, batch_id, defaults=defaults)
    check = InputCheck(endpoint)
    for line in scan.lines:
        check.visit(line)
    first = scan.lines[0].line if scan.lines else None
    return scan, check.result(scan.format, scan.total, first)


# ---------------------------------------------------------------- Redis


def record_ttl(record: BatchRecord) -> int:
    """How long a finished batch's record is kept (see `BatchStore.finish`)."""
    return max(RECORD_TTL_S, record.output_expires_after_s or 0)


class BatchStore:
    """Batch records in Redis, under the connection's prefix. With a `lease` (the server
    always has one: `producer.serve.lease`), every write is a transaction watching it
    and checking it is this server's, so a server that lost its prefix to another
    changes nothing (LeaseLost)."""

    def __init__(self, redis_client: Any, keys: RedisKeys, lease: Lease | None = None) -> None:
        self.redis = redis_client
        self.keys = keys
        self.lease = lease

    def _watch(self, pipe: Any, *keys: str) -> None:
        """WATCH `keys` (and the lease), then check the lease."""
        watched = [*keys, *([self.lease.key] if self.lease else [])]
        if watched:
            pipe.watch(*watched)
        if self.lease is not None:
            self.lease.check_watched(pipe)

    def _write(
        self, *keys: str, check: Callable[[Any], bool] | None = None, build: Callable[[Any], None]
    ) -> bool:
        """One fenced transaction: watch `keys`, `check(pipe)` (False: write nothing),
        then `build(pipe)`'s writes; retried when a watched key changes meanwhile."""
        with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    self._watch(pipe, *keys)
                    if check is not None and not check(pipe):
                        pipe.reset()
                        return False
                    pipe.multi()
                    build(pipe)
                    pipe.execute()
                    return True
                except redis.WatchError:
                    continue

    def create(
        self, record: BatchRecord, max_active: int, max_kept: int = MAX_KEPT_BATCHES
    ) -> str | None:
        """Store a new batch unless its tenant already has `max_active` batches running
        ("active") or `max_kept` batch records (finished ones expire after
        `RECORD_TTL_S`: "kept"); None when stored. Check and insert are one transaction
        (WATCH), so concurrent creates cannot overshoot the limits."""
        active = self.keys.serve_tenant_active(record.tenant)
        index = self.keys.serve_tenant_batches(record.tenant)
        now_ms = int(time.time() * 1000)
        refused: list[str] = []

        def check(pipe: Any) -> bool:
            if pipe.scard(active) >= max_active:
                refused.append("active")
                return False
            stale = pipe.zcount(index, "-inf", now_ms - RECORD_TTL_S * 1000)
            if pipe.zcard(index) - stale >= max_kept:
                refused.append("kept")
                return False
            return True

        def build(pipe: Any) -> None:
            pipe.zremrangebyscore(index, "-inf", now_ms - RECORD_TTL_S * 1000)
            pipe.hset(self.keys.serve_batch(record.id), mapping=record.to_hash())
            pipe.zadd(index, {record.id: now_ms})
            pipe.sadd(active, record.id)
            pipe.sadd(self.keys.serve_active(), record.id)

        self._write(active, index, check=check, build=build)
        return refused[0] if refused else None

    def load(self, batch_id: str) -> BatchRecord | None:
        if not BATCH_ID.match(batch_id):
            return None
        h = self.redis.hgetall(self.keys.serve_batch(batch_id))
        return BatchRecord.from_hash(h) if h else None

    def get(self, batch_id: str, tenant: str) -> BatchRecord | None:
        """The batch if it exists and is `tenant`'s (else None: 404 either way)."""
        record = self.load(batch_id)
        return record if record is not None and record.tenant == tenant else None

    def update(self, batch_id: str, **values: Any) -> None:
        mapping = {k: _encode(k, v) for k, v in values.items() if v is not None}
        if mapping:
            key = self.keys.serve_batch(batch_id)
            self._write(build=lambda pipe: pipe.hset(key, mapping=mapping))

    def transition(self, batch_id: str, allowed: Iterable[str], **values: Any) -> bool:
        """Write `values` only if the batch's status is one of `allowed` (compare-and-set,
        WATCH): the API's cancel and the runner's steps never overwrite each other."""
        key = self.keys.serve_batch(batch_id)
        mapping = {k: _encode(k, v) for k, v in values.items() if v is not None}
        allowed = set(allowed)

        def check(pipe: Any) -> bool:
            status = pipe.hget(key, "status")
            return status is not None and _s(status) in allowed

        return self._write(key, check=check, build=lambda pipe: pipe.hset(key, mapping=mapping))

    def finish(self, record: BatchRecord, **values: Any) -> None:
        """Write the final fields, take the batch off the active sets, and let its record
        expire (`record_ttl`: with its output files, or after RECORD_TTL_S): records
        once lived for ever, and creating batches was unlimited (40 creates of 16 KiB
        metadata: 4 MB in Redis, no TTL)."""
        mapping = {k: _encode(k, v) for k, v in values.items() if v is not None}
        key = self.keys.serve_batch(record.id)

        def build(pipe: Any) -> None:
            if mapping:
                pipe.hset(key, mapping=mapping)
            pipe.expire(key, record_ttl(record))
            pipe.srem(self.keys.serve_tenant_active(record.tenant), record.id)
            pipe.srem(self.keys.serve_active(), record.id)

        self._write(build=build)

    def active_ids(self) -> list[str]:
        return sorted(_s(x) for x in self.redis.smembers(self.keys.serve_active()))

    def list(
        self, tenant: str, *, after: str | None = None, limit: int = 20
    ) -> tuple[list[BatchRecord], bool]:
        """Newest first, after the batch id `after` (OpenAI's cursor); (page, has_more)."""
        index = self.keys.serve_tenant_batches(tenant)
        start = 0
        if after is not None:
            rank = self.redis.zrevrank(index, after)
            if rank is None:
                return [], False
            start = rank + 1
        ids = [_s(x) for x in self.redis.zrevrange(index, start, start + limit)]
        records = []
        for batch_id in ids[:limit]:
            record = self.load(batch_id)
            if record is None:  # expired: out of the index too
                self.redis.zrem(index, batch_id)
            else:
                records.append(record)
        return records, len(ids) > limit


__all__ = [
    "BATCH_ID",
    "ENDPOINTS",
    "FINAL",
    "MAX_BATCH_LINES",
    "BatchRecord",
    "BatchStatus",
    "BatchStore",
    "InputCheck",
    "batch_object",
    "new_batch_id",
    "request_counts",
    "validate_input",
    "window_seconds",
]
