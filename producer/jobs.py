"""Bulk jobs, I/O parts: job bookkeeping in Redis, submit / collect / cancel / retry.

Job hash `{prefix}:job:{job}` fields written here (the worker owns the counters):

* `total` (non-blank input lines), `created_at` (HSETNX: a re-run keeps it), `status`
  (`submitting` -> `running`; `cancelling` on cancel), `submitted` (lines durably
  published, in file order, updated after each acknowledged chunk).
* Producer-only extras (not read by the worker): `input_path`, `input_sha256` (a
  re-run with another file under the same job id is refused), `attempt` and
  `retry_line` (progress of `bulk retry`).

Lines the producer never publishes get their result written by the producer itself,
through the worker's own once-only writer (`schemas.replies.ResultWriter`), so the
counters, the job stream and the final status move exactly as if a worker had
answered: invalid lines (`failed`, `invalid_request`) and, after a cancel during
submission, the unsent lines (`cancelled`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from producer.bulk import (
    Defaults,
    JobView,
    Line,
    Scan,
    cancelled_result,
    invalid_result,
    output_json,
    parse_request_id,
    scan_lines,
)
from producer.client import QBatchClient, now_utc
from schemas import JobField, JobStatus, RedisKeys, ResultEnvelope, Status
from schemas.keys import StreamField
from schemas.limits import DEFAULT_RESULT_TTL_S
from schemas.replies import ResultWriter
from schemas.scripts import lua

DEFAULT_JOB_TTL_S = 7 * 86_400
DEFAULT_CHUNK = 5_000

INPUT_PATH_FIELD = JobField.input_path
INPUT_SHA_FIELD = JobField.input_sha256
ATTEMPT_FIELD = JobField.attempt
RETRY_LINE_FIELD = JobField.retry_line

Progress = Callable[[int, int], None]
"""on_progress(done, total)."""


def now_ms() -> int:
    return int(time.time() * 1000)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_lines(path: Path) -> list[str]:
    """A bulk file's lines (UTF-8; `-` is stdin is not supported: a file is needed to resume)."""
    with path.open("r", encoding="utf-8", newline="") as fh:
        return fh.read().splitlines()


def scan_file(
    path: Path, job_id: str, *, attempt: int = 0, defaults: Defaults | None = None
) -> Scan:
    return scan_lines(read_lines(path), job_id, attempt=attempt, defaults=defaults)


class JobError(RuntimeError):
    """A job-level problem: unknown job, conflicting re-run, wrong state."""


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class JobStore:
    """Job bookkeeping against one Redis and prefix."""

    def __init__(self, redis_client: Any, keys: RedisKeys, job_ttl_s: int = DEFAULT_JOB_TTL_S):
        self.redis = redis_client
        self.keys = keys
        self.job_ttl_s = job_ttl_s
        self._replies = ResultWriter(redis_client, keys)
        self._begin = redis_client.register_script(lua("job_begin"))
        self._mark = redis_client.register_script(lua("job_mark_submitted"))
        self._cancel = redis_client.register_script(lua("job_cancel"))
        self._begin_retry = redis_client.register_script(lua("job_begin_retry"))

    def view(self, job_id: str) -> JobView | None:
        h = self.redis.hgetall(self.keys.job(job_id))
        if not h:
            return None
        return JobView.from_hash(job_id, h, now_ms())

    def field(self, job_id: str, name: str) -> str | None:
        value = self.redis.hget(self.keys.job(job_id), name)
        return None if value is None else _s(value)

    def begin(self, job_id: str, total: int, input_path: str, sha: str) -> tuple[str, str, int]:
        """('new'|'exists', status, submitted); JobError on a conflicting re-run."""
        reply = [
            _s(x)
            for x in self._begin(
                keys=[self.keys.job(job_id)],
                args=[total, now_ms(), input_path, sha, self.job_ttl_s],
            )
        ]
        if reply[0] == "conflict" and reply[1] == "wrongtype":
            raise JobError(f"job {job_id!r}: its Redis key holds a {reply[2]}, not a job hash")
        if reply[0] == "conflict":
            raise JobError(
                f"job {job_id!r} already exists with another input ({reply[2]} lines, "
                f"sha256 {reply[3][:12]}...); use another --job id"
            )
        return reply[0], reply[1], int(reply[2])

    def set_submitted(self, job_id: str, count: int) -> None:
        self.redis.hset(self.keys.job(job_id), JobField.submitted, count)

    def set_retry_line(self, job_id: str, line: int) -> None:
        self.redis.hset(self.keys.job(job_id), RETRY_LINE_FIELD, line)

    def mark_submitted(self, job_id: str, total: int) -> str:
        return _s(
            self._mark(
                keys=[self.keys.job(job_id), self.keys.job_stream(job_id)],
                args=[total, self.job_ttl_s],
            )
        )

    def cancel_requested(self, job_id: str) -> bool:
        return bool(self.redis.exists(self.keys.job_cancel(job_id)))

    def cancel(self, job_id: str) -> str:
        """Set the cancel flag; returns the job's status after it ('' if no such job)."""
        return _s(
            self._cancel(
                keys=[self.keys.job(job_id), self.keys.job_cancel(job_id)], args=[self.job_ttl_s]
            )
        )

    def begin_retry(
        self, job_id: str, attempt: int, n_failed: int, n_expired: int
    ) -> tuple[str, str]:
        reply = self._begin_retry(
            keys=[self.keys.job(job_id)], args=[attempt, str(-n_failed), str(-n_expired)]
        )
        return _s(reply[0]), _s(reply[1])

    def write_results(self, results: Sequence[tuple[ResultEnvelope, int]]) -> int:
        """Write producer-made results once each (worker's writer); returns how many are new."""
        written = 0
        for start in range(0, len(results), 1_000):
            replies = self._replies.write(list(results[start : start + 1_000]), now_ms())
            written += sum(1 for reply in replies if reply.fresh)
        return written

    def stream(
        self, job_id: str, after: str = "-", count: int = 5_000
    ) -> list[tuple[str, dict[str, str]]]:
        """Stream entries strictly after id `after` ('-': from the start)."""
        start = "-" if after == "-" else f"({after}"
        entries = self.redis.xrange(self.keys.job_stream(job_id), min=start, max="+", count=count)
        return [(_s(eid), {_s(k): _s(v) for k, v in fields.items()}) for eid, fields in entries]

    def wait_stream(self, job_id: str, after: str, block_ms: int) -> None:
        """Block until the stream has an entry after `after` (or `block_ms` passes)."""
        last = "0-0" if after == "-" else after
        self.redis.xread({self.keys.job_stream(job_id): last}, count=1, block=max(block_ms, 1))

    def results(self, request_ids: Sequence[str]) -> list[bytes | None]:
        if not request_ids:
            return []
        return list(self.redis.mget([self.keys.result(rid) for rid in request_ids]))


# ---------------------------------------------------------------- submit


@dataclass(slots=True)
class SubmitReport:
    job_id: str
    total: int
    invalid: int
    published: int = 0
    cancelled_unsent: int = 0
    resumed_from: int = 0
    already_submitted: bool = False
    status: str = ""
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "total": self.total,
            "invalid": self.invalid,
            "published": self.published,
            "cancelled_unsent": self.cancelled_unsent,
            "resumed_from": self.resumed_from,
            "already_submitted": self.already_submitted,
            "status": self.status,
            "seconds": round(self.seconds, 3),
            "lines_per_s": round(self.published / self.seconds, 1) if self.seconds else None,
        }


def _publish_chunk(
    client: QBatchClient, store: JobStore, job_id: str, lines: Sequence[Line]
) -> int:
    """Publish the chunk's valid lines, wait for every ack, write its invalid lines' results."""
    stamp = now_utc()
    futures = []
    for line in lines:
        if line.envelope is not None:
            env = line.envelope.model_copy(update={"submitted_at": stamp})
            futures.append((line.request_id, client.send(env)))
    client.flush(futures)
    ms = now_ms()
    store.write_results(
        [(invalid_result(line, job_id, ms), _ttl(line)) for line in lines if not line.ok]
    )
    return len(futures)


def _ttl(line: Line) -> int:
    return line.envelope.result_ttl_s if line.envelope is not None else DEFAULT_RESULT_TTL_S


def submit_job(
    client: QBatchClient,
    store: JobStore,
    job_id: str,
    scan: Scan,
    *,
    input_path: str,
    sha: str,
    chunk: int = DEFAULT_CHUNK,
    on_progress: Progress | None = None,
    default_ttl_s: int | None = None,
) -> SubmitReport:
    """Publish a scanned file as job `job_id`, resuming where an earlier run stopped.

    Lines are published in file order, `chunk` at a time; after each chunk is fully
    acknowledged (acks=all) `submitted` is advanced. A run killed mid-chunk re-sends at
    most that chunk; the worker's written-once rule makes the re-sent lines harmless.
    """
    started = time.monotonic()
    total = scan.total
    report = SubmitReport(job_id, total, invalid=len(scan.bad))
    kind, status, submitted = store.begin(job_id, total, input_path, sha)
    report.resumed_from = submitted if kind == "exists" else 0
    if kind == "exists" and status not in (JobStatus.submitting, JobStatus.cancelling):
        report.already_submitted = True
        report.status = status
        if on_progress:
            on_progress(total, total)
        return report
    if kind == "exists" and status == JobStatus.cancelling and submitted >= total:
        report.already_submitted = True
    position = min(submitted, total)
    if on_progress:
        on_progress(position, total)
    while position < total:
        if store.cancel_requested(job_id):
            break
        end = min(position + chunk, total)
        report.published += _publish_chunk(client, store, job_id, scan.lines[position:end])
        store.set_submitted(job_id, end)
        position = end
        if on_progress:
            on_progress(position, total)
    if position < total:  # cancelled during submission: answer the unsent lines ourselves
        ms = now_ms()
        rest = scan.lines[position:]
        results = [
            (
                invalid_result(line, job_id, ms)
                if not line.ok
                else cancelled_result(line, job_id, ms),
                _ttl(line),
            )
            for line in rest
        ]
        for start in range(0, len(results), chunk):
            store.write_results(results[start : start + chunk])
        report.cancelled_unsent = sum(1 for line in rest if line.ok)
        if on_progress:
            on_progress(total, total)
    report.status = store.mark_submitted(job_id, total)
    report.seconds = time.monotonic() - started
    return report


# ---------------------------------------------------------------- collect


@dataclass(slots=True)
class CollectReport:
    job_id: str
    total: int
    written: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    complete: bool = False
    interrupted: bool = False
    missing_results: int = 0
    """Stream entries whose result key had expired and were not in an earlier output."""
    status: str = ""
    seconds: float = 0.0
    out: str = ""
    errors: str | None = None

    @property
    def all_succeeded(self) -> bool:
        return self.complete and self.counts.get(Status.succeeded, 0) == self.total

    def as_dict(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "total": self.total,
            "written": self.written,
            "counts": self.counts,
            "complete": self.complete,
            "interrupted": self.interrupted,
            "missing_results": self.missing_results,
            "all_succeeded": self.all_succeeded,
            "status": self.status,
            "seconds": round(self.seconds, 3),
            "results_per_s": round(self.written / self.seconds, 1) if self.seconds else None,
            "out": self.out,
            "errors": self.errors,
        }


@dataclass(slots=True)
class _Kept:
    attempt: int
    status: str
    offset: int
    length: int


def _existing_lines(job_id: str, paths: Iterable[Path]) -> dict[int, tuple[int, str, str]]:
    """line -> (attempt, status, json) from earlier output files of this job."""
    found: dict[int, tuple[int, str, str]] = {}
    for path in paths:
        if not path.exists():
            continue
        with path.open("r", encoding="utf-8") as fh:
            for text in fh:
                text = text.strip()
                try:
                    obj = json.loads(text)
                    rid = obj["response"]["request_id"]
                except (ValueError, KeyError, TypeError):
                    continue
                parsed = parse_request_id(job_id, rid) if isinstance(rid, str) else None
                if parsed is None:
                    continue
                code = obj["response"].get("status_code")
                status = "succeeded" if code == 200 else _status_of_code(obj)
                have = found.get(parsed[0])
                if have is None or have[0] < parsed[1]:
                    found[parsed[0]] = (parsed[1], status, text)
    return found


def _status_of_code(obj: dict[str, Any]) -> str:
    code = (obj.get("error") or {}).get("code")
    return {"deadline_exceeded": "expired", "cancelled": "cancelled"}.get(str(code), "failed")


def collect_job(
    store: JobStore,
    job_id: str,
    out: Path,
    *,
    errors: Path | None = None,
    timeout: float | None = None,
    on_progress: Progress | None = None,
    block_ms: int = 1_000,
) -> CollectReport:
    """Read the job's stream from the start and write one output line per finished line.

    The output is written at the end (also on timeout or Ctrl-C: every finished line),
    in input-line order, atomically (temp file + rename). Results are spooled to a temp
    file as they arrive so memory stays bounded by the number of lines, not their size.
    A re-run reads the stream again from the start; results whose Redis key has expired
    are taken from the earlier output files when they have them.
    """
    started = time.monotonic()
    view = store.view(job_id)
    if view is None:
        raise JobError(f"no job {job_id!r} (wrong --prefix, or expired)")
    total = view.total
    report = CollectReport(job_id, total, out=str(out), errors=str(errors) if errors else None)
    deadline = None if timeout is None else time.monotonic() + timeout
    kept: dict[int, _Kept] = {}
    earlier: dict[int, tuple[int, str, str]] | None = None
    last = "-"
    out.parent.mkdir(parents=True, exist_ok=True)
    spool = tempfile.TemporaryFile(mode="w+b", dir=out.parent)  # noqa: SIM115
    try:
        if on_progress:
            on_progress(0, total)
        while True:
            try:
                view = store.view(job_id) or view
                while True:
                    entries = store.stream(job_id, last)
                    if not entries:
                        break
                    last = entries[-1][0]
                    fresh: dict[int, tuple[int, str, str | None]] = {}
                    for _eid, fields in entries:
                        rid = fields.get(StreamField.request_id, "")
                        parsed = parse_request_id(job_id, rid)
                        if parsed is None:
                            continue
                        line, attempt = parsed
                        have = kept.get(line)
                        prev = fresh.get(line)
                        if (have is None or have.attempt < attempt) and (
                            prev is None or prev[0] < attempt
                        ):
                            # An inline result: the request_id held another job's result.
                            fresh[line] = (attempt, rid, fields.get(StreamField.result))
                    items = sorted(fresh.items())
                    raws = store.results([rid for _line, (_a, rid, inline) in items if not inline])
                    found = iter(raws)
                    for line, (attempt, _rid, inline) in items:
                        raw = inline.encode() if inline else next(found)
                        if raw is not None:
                            result = ResultEnvelope.model_validate_json(raw)
                            text, status = output_json(result), result.status.value
                        else:
                            if earlier is None:
                                earlier = _existing_lines(
                                    job_id, [p for p in (out, errors) if p is not None]
                                )
                            old = earlier.get(line)
                            if old is None or old[0] != attempt:
                                report.missing_results += 1
                                continue
                            text, status = old[2], old[1]
                        data = (text + "\n").encode("utf-8")
                        spool.seek(0, os.SEEK_END)
                        offset = spool.tell()
                        spool.write(data)
                        kept[line] = _Kept(attempt, status, offset, len(data))
                    if on_progress:
                        on_progress(min(len(kept), total), total)
                if view.finished and len(kept) + report.missing_results >= total:
                    report.complete = report.missing_results == 0
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    break
                wait = block_ms
                if deadline is not None:
                    wait = min(wait, int((deadline - time.monotonic()) * 1000))
                if wait > 0:
                    store.wait_stream(job_id, last, wait)
            except KeyboardInterrupt:
                report.interrupted = True
                break
        report.status = view.status
        report.written = _write_outputs(spool, kept, out, errors)
        counts = {str(s): 0 for s in Status}
        for item in kept.values():
            counts[item.status] = counts.get(item.status, 0) + 1
        report.counts = counts
    finally:
        spool.close()
    report.seconds = time.monotonic() - started
    return report


def _write_outputs(spool: Any, kept: dict[int, _Kept], out: Path, errors: Path | None) -> int:
    """Write kept lines in line order to out (and errors), each atomically."""
    targets = [out] if errors is None else [out, errors]
    tmps = {}
    try:
        for path in targets:
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
            tmps[path] = (os.fdopen(fd, "wb"), tmp)
        for line in sorted(kept):
            item = kept[line]
            spool.seek(item.offset)
            data = spool.read(item.length)
            target = out if errors is None or item.status == Status.succeeded else errors
            tmps[target][0].write(data)
        for path, (fh, tmp) in tmps.items():
            fh.flush()
            os.fsync(fh.fileno())
            fh.close()
            os.replace(tmp, path)
    except BaseException:
        for fh, tmp in tmps.values():
            fh.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        raise
    return len(kept)


# ---------------------------------------------------------------- retry


@dataclass(slots=True)
class RetryReport:
    job_id: str
    attempt: int
    retried: int = 0
    skipped_invalid: int = 0
    resumed: bool = False
    status: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "attempt": self.attempt,
            "retried": self.retried,
            "skipped_invalid": self.skipped_invalid,
            "resumed": self.resumed,
            "status": self.status,
        }


def latest_statuses(store: JobStore, job_id: str) -> dict[int, tuple[int, str]]:
    """line -> (attempt, status) of the newest finished attempt, from the job stream."""
    latest: dict[int, tuple[int, str]] = {}
    last = "-"
    while True:
        entries = store.stream(job_id, last, count=10_000)
        if not entries:
            return latest
        last = entries[-1][0]
        for _eid, fields in entries:
            parsed = parse_request_id(job_id, fields.get("request_id", ""))
            if parsed is None:
                continue
            line, attempt = parsed
            have = latest.get(line)
            if have is None or have[0] < attempt:
                latest[line] = (attempt, fields.get("status", ""))


def retry_job(
    client: QBatchClient,
    store: JobStore,
    job_id: str,
    path: Path,
    *,
    defaults: Defaults | None = None,
    chunk: int = DEFAULT_CHUNK,
    on_progress: Progress | None = None,
) -> RetryReport:
    """Resubmit the lines whose newest attempt failed or expired, as attempt k+1.

    The job must be `completed_with_errors` (or be resuming this very retry). Lines
    that are invalid in the input file are not retried (they would fail the same way).
    Counters: the retried lines' failed/expired counts are taken back when the retry
    starts, so the job completes again when every retried line has its new result.
    """
    view = store.view(job_id)
    if view is None:
        raise JobError(f"no job {job_id!r}")
    sha = store.field(job_id, INPUT_SHA_FIELD)
    if sha and sha != file_sha256(path):
        raise JobError(f"{path} is not the file job {job_id!r} was submitted from (sha256 differs)")
    current = int(store.field(job_id, ATTEMPT_FIELD) or 0)
    resuming = view.status == JobStatus.submitting and current > 0
    attempt = current if resuming else current + 1
    scan = scan_file(path, job_id, attempt=attempt, defaults=defaults)
    by_line = {line.line: line for line in scan.lines}
    latest = latest_statuses(store, job_id)
    retry: list[Line] = []
    skipped = 0
    n_failed = n_expired = 0
    for number, (got, status) in sorted(latest.items()):
        if got >= attempt or status not in (Status.failed, Status.expired):
            continue
        line = by_line.get(number)
        if line is None or not line.ok:
            skipped += 1
            continue
        retry.append(line)
        n_failed += status == Status.failed
        n_expired += status == Status.expired
    report = RetryReport(job_id, attempt, skipped_invalid=skipped)
    if not retry and not resuming:
        report.status = view.status
        return report
    kind, retry_line = store.begin_retry(job_id, attempt, n_failed, n_expired)
    if kind == "busy":
        raise JobError(f"job {job_id!r} is {retry_line!r}; retry needs a finished job with errors")
    report.resumed = kind == "resume"
    done_line = int(retry_line or 0)
    todo = [line for line in retry if line.line > done_line]
    if on_progress:
        on_progress(0, len(todo))
    for start in range(0, len(todo), chunk):
        part = todo[start : start + chunk]
        report.retried += _publish_chunk(client, store, job_id, part)
        store.set_retry_line(job_id, part[-1].line)
        if on_progress:
            on_progress(start + len(part), len(todo))
    report.status = store.mark_submitted(job_id, view.total)
    return report


__all__ = [
    "DEFAULT_CHUNK",
    "DEFAULT_JOB_TTL_S",
    "CollectReport",
    "JobError",
    "JobStore",
    "RetryReport",
    "SubmitReport",
    "collect_job",
    "file_sha256",
    "retry_job",
    "scan_file",
    "submit_job",
]
