"""Bulk jobs, collect and retry: the job stream -> an OpenAI Batch output file; failed lines
resubmitted as a new attempt. (Job bookkeeping and submission are in `producer.jobs`.)"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from producer.batch_output import output_json
from producer.bulk import Defaults, Line, parse_request_id
from producer.client import QBatchClient
from producer.jobs import (
    ATTEMPT_FIELD,
    DEFAULT_CHUNK,
    INPUT_SHA_FIELD,
    JobError,
    JobStore,
    Progress,
    file_sha256,
    planner_for,
    publish_chunk,
)
from producer.line_sources import scan_file
from producer.placement import PlacementMode
from schemas import ErrorCode, JobStatus, ResultEnvelope, Status
from schemas.keys import StreamField
from schemas.ref import RequestRef
from schemas.result import read_stored
from schemas.settings import BULK


@dataclass(slots=True)
class CollectReport:
    job_id: str
    total: int
    written: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    complete: bool = False
    interrupted: bool = False
    missing_results: int = 0
    """Lines whose result key had expired before any collect read it: each is written as
    a failed line (`lost_result`), so no line goes without an outcome and the collect is
    complete, and counted here (again by a re-collect) so the loss stays visible."""
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


def readable_result(raw: bytes, rid: str, job_id: str) -> ResultEnvelope:
    """The stored result, or, when it cannot be read (written by another version, or from
    figures no reader holds), a failed result for its line: one unreadable result must
    not stop the whole job's collect, on every re-run."""
    return readable(raw, rid, job_id)[0]


def readable(raw: bytes, rid: str, job_id: str) -> tuple[ResultEnvelope, tuple[int, int] | None]:
    """`readable_result`, the way `read_stored` reads it: a succeeded result without its
    response's choices, and where its response is in `raw` (`output_text` passes those
    bytes on as they are, instead of building them as objects at ~60x their size)."""
    try:
        return read_stored(raw)
    except ValidationError as exc:
        reason = (exc.errors()[0]["msg"] if exc.errors() else str(exc))[:200]
        failed = ResultEnvelope.failure(
            RequestRef(request_id=rid, job_id=job_id),
            ErrorCode.internal_error,
            f"the stored result could not be read: {reason}",
            timings=None,
        )
        return failed, None


def output_text(raw: bytes, result: ResultEnvelope, span: tuple[int, int] | None) -> bytes:
    """The output line of a stored result: `output_json`, with a succeeded result's
    response body spliced in as the bytes Redis holds."""
    if span is None:
        return output_json(result).encode("utf-8")
    placeholder = result.model_copy(update={"response": None})
    line = output_json(placeholder).encode("utf-8")
    empty = f'"request_id":"{result.request_id}","body":null}}'.encode()
    at = line.index(empty) + len(empty) - len(b"null}")
    return line[:at] + raw[span[0] : span[1]] + line[at + len(b"null") :]


LOST = "its result expired from Redis (result_ttl_s) before it was collected"


def lost_result(rid: str, job_id: str, fields: Mapping[str, str]) -> ResultEnvelope:
    """The outcome of a line whose result expired from Redis before it was collected
    (`result_ttl_s` shorter than the job took to collect): it ran, the answer is gone."""
    ran = fields.get(StreamField.status) or "finished"
    custom_id = fields.get(StreamField.custom_id) or None
    return ResultEnvelope.failure(
        RequestRef(request_id=rid, job_id=job_id, custom_id=custom_id),
        ErrorCode.internal_error,
        f"the line {ran}, but {LOST}",
        timings=None,
    )


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
    on_result: Callable[[ResultEnvelope], object] | None = None,
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
                    fresh: dict[int, tuple[int, str, str | None, Mapping[str, str]]] = {}
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
                            fresh[line] = (attempt, rid, fields.get(StreamField.result), fields)
                    items = sorted(fresh.items())
                    found = store.iter_results(
                        [rid for _line, (_a, rid, inline, _f) in items if not inline]
                    )
                    for line, (attempt, rid, inline, entry) in items:
                        raw = inline.encode() if inline else next(found)
                        if raw is not None:
                            result, span = readable(raw, rid, job_id)
                            if on_result is not None:
                                on_result(result)
                            data, status = output_text(raw, result, span), result.status.value
                        else:
                            if earlier is None:
                                earlier = _existing_lines(
                                    job_id, [p for p in (out, errors) if p is not None]
                                )
                            old = earlier.get(line)
                            if old is None or old[0] != attempt:
                                report.missing_results += 1
                                lost = lost_result(rid, job_id, entry)
                                data, status = output_json(lost).encode(), lost.status.value
                            else:
                                data, status = old[2].encode(), old[1]
                                if LOST in old[2]:  # an earlier collect found it lost
                                    report.missing_results += 1
                        data += b"\n"
                        spool.seek(0, os.SEEK_END)
                        offset = spool.tell()
                        spool.write(data)
                        kept[line] = _Kept(attempt, status, offset, len(data))
                    if on_progress:
                        on_progress(min(len(kept), total), total)
                if view.finished and len(kept) >= total:
                    report.complete = True  # every line has an outcome (lost ones: failed)
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
    lane: str | None = BULK,
    placement: str | PlacementMode = PlacementMode.prefix,
) -> RetryReport:
    """Resubmit the lines whose newest attempt failed or expired, as attempt k+1.

    The job must be `completed_with_errors` (or be resuming this very retry). Lines
    that are invalid in the input file are not retried (they would fail the same way).
    Counters: the retried lines' failed/expired counts are taken back when the retry
    starts, so the job completes again when every retried line has its new result.
    `placement` as for `submit_job` (each chunk a placement window).
    """
    planner = planner_for(placement)
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
        report.retried += publish_chunk(client, store, job_id, part, lane, planner)
        store.set_retry_line(job_id, part[-1].line)
        if on_progress:
            on_progress(start + len(part), len(todo))
    report.status = store.mark_submitted(job_id, view.total)
    return report


__all__ = ["CollectReport", "RetryReport", "collect_job", "latest_statuses", "retry_job"]
