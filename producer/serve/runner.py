"""The thread inside `qbatch serve` that drives batches through OpenAI's lifecycle.

Every `interval_s` (and at once when the API creates or cancels a batch) it takes each
batch of `{prefix}:serve:active` one step further:

* `validating`: read the input file from storage and validate every line with the bulk
  jobs' own validator. Any bad line fails the whole batch with `errors.data[{code, line,
  message, param}]` and nothing is sent: that is what OpenAI does (its validation step
  rejects a file before any request runs), so a script written for OpenAI sees the same.
  Good: `in_progress`.
* `in_progress` / `cancelling`: submit the file as bulk job `batch_id` on the bulk lane
  (`producer.jobs.submit_job`; every line gets `deadline` = the batch's `expires_at`, so
  a line still queued when the window closes is `expired` without running), in slices
  of `submit_slice_s` so that one huge batch does not hold every other batch up. When the
  window closes first the job is cancelled (checked before each slice, so a batch whose
  publish keeps failing still expires). When the job is final: `finalizing`.
* `finalizing`: collect the job (`producer.collect.collect_job`) into an output file
  (successes) and an error file (the rest) in OpenAI's Batch output format, store both,
  and end `completed`, `cancelled` or `expired`.

Why this survives a kill -9 of the server at any point: state is in Redis (the batch
hash, the job hash) and files are in storage; each step is safe to redo. A submission
resumes from the job's `submitted` count (at most one chunk is published again, and the
worker writes each request's result once); collecting re-reads the job stream from the
start; output files get ids derived from the batch id, so a redone finalize rewrites the
same files. One server (runner) per Redis prefix.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from producer.bulk import Defaults
from producer.client import QBatchClient
from producer.collect import collect_job
from producer.job_view import TERMINAL, JobView
from producer.jobs import (
    DEFAULT_CHUNK,
    JobStore,
    submit_job,
)
from producer.line_sources import LineSource
from producer.placement import PrefixPlanner
from producer.serve.batch_strikes import QUARANTINED, BatchStrikes
from producer.serve.batches import (
    FINAL,
    MAX_BATCH_LINES,
    BatchRecord,
    BatchStatus,
    BatchStore,
    InputCheck,
    request_counts,
)
from producer.serve.late_lines import late_from_lines, late_from_numbers
from producer.serve.storage import PURPOSE_OUTPUT, FileStore
from producer.stream_scan import StreamScan, scan_stream
from schemas import JobStatus, ResultEnvelope, Status, limits
from schemas.result_size import DEFAULT_MAX_RESULT_BYTES
from schemas.settings import BULK

log = logging.getLogger("qbatch.serve")

DRIVEN = (BatchStatus.in_progress, BatchStatus.cancelling)


def output_file_id(batch_id: str, kind: str) -> str:
    """The id of a batch's output (`kind` output) or error file: derived, so a finalize
    redone after a restart rewrites the same file."""
    return "file-" + hashlib.sha256(f"{batch_id}:{kind}".encode()).hexdigest()[:32]


COLLECT_MARGIN_S = 86_400
"""How long a line's result outlives the batch's window, for the finalize to read it."""


def result_ttl_for(expires_at: float, now: float) -> int:
    """A line's `result_ttl_s`: the rest of the window plus a day. The default (one day)
    is shorter than the windows a batch may have (up to 168 h), and a result that expires
    before the job ends is gone from both output files."""
    ttl = int(expires_at - now) + COLLECT_MARGIN_S
    return max(limits.DEFAULT_RESULT_TTL_S, min(ttl, limits.MAX_RESULT_TTL_S))


class BatchRunner:
    """Background driver of every active batch (see the module docstring)."""

    def __init__(
        self,
        client: QBatchClient,
        batches: BatchStore,
        jobs: JobStore,
        storage: FileStore,
        *,
        interval_s: float = 0.5,
        chunk: int = DEFAULT_CHUNK,
        submit_slice_s: float = 2.0,
        expiry_grace_s: float = 300.0,
        max_batch_lines: int = MAX_BATCH_LINES,
        max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES,
        priority_range: Callable[[str], tuple[int, int]] = lambda tenant: (0, 0),
    ) -> None:
        self.max_batch_lines = max_batch_lines
        self.max_result_bytes = max_result_bytes
        self.priority_range = priority_range
        """A tenant's batch lines' priority range (`TenantLimits.priority_range`)."""
        self.strikes = BatchStrikes(batches.redis, batches.keys)
        self.client = client
        self.batches = batches
        self.jobs = jobs
        self.storage = storage
        self.interval_s = interval_s
        self.chunk = chunk
        self.submit_slice_s = submit_slice_s
        """Publishing time one batch gets per pass before the others have their turn: a
        million-line batch takes minutes to publish, and on one thread every other
        tenant's batch (validation, finalizing) would wait behind it."""
        self.expiry_grace_s = expiry_grace_s
        """How long after an expired batch's window the workers have to answer its queued
        lines before the runner answers the rest itself (`_answer_unanswered`)."""
        self._scans: dict[str, tuple[LineSource, str]] = {}
        self._planners: dict[str, PrefixPlanner] = {}
        """Each submitting batch's placement planner, kept across its slices."""
        self._stuck: set[str] = set()
        """Expired batches whose lines cannot be known (warned about once)."""
        self.on_result: Callable[[str, ResultEnvelope], None] | None = None
        """(tenant, result) of every result a finalize reads (usage; counted once)."""
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------ thread

    def start(self) -> None:
        crashed = self.strikes.recover()
        if crashed is not None:
            log.error("serve runner: the last server died stepping batch %s (a strike)", crashed)
        self._thread = threading.Thread(target=self._run, name="qbatch-serve-runner", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def wake(self) -> None:
        """Look at the active batches now (after a create or a cancel)."""
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.tick()
            self._wake.wait(self.interval_s)
            self._wake.clear()

    def tick(self) -> None:
        """One pass over the active batches; a failing batch is logged, others go on."""
        try:
            ids = self.batches.active_ids()
        except Exception:
            log.exception("serve runner: cannot list active batches")
            return
        validated: set[str] = set()  # tenants whose batch was validated in this pass
        for batch_id in ids:
            if self._stop.is_set():
                return
            try:
                self.strikes.mark(batch_id)
                self.advance(batch_id, validated)
                self.strikes.clear()
            except Exception:
                log.exception("serve runner: batch %s: step failed; retrying next tick", batch_id)

    # ------------------------------------------------------------ steps

    def advance(self, batch_id: str, validated: set[str] | None = None) -> None:
        """One step of the batch. `validated`: the tenants that had a batch validated in
        this pass; another of theirs waits for the next pass (which comes at once), so one
        tenant's many large files (~2 s a 50,000-line file) do not hold the others'."""
        record = self.batches.load(batch_id)
        if record is None:
            self.batches.redis.srem(self.batches.keys.serve_active(), batch_id)
            return
        if record.status not in FINAL and self.strikes.quarantined(batch_id):
            self._fail(record, "internal_error", QUARANTINED)
        elif record.status in FINAL:
            self.batches.finish(record)
        elif record.status == BatchStatus.validating:
            if validated is not None and record.tenant in validated:
                self.wake()
                return
            if validated is not None:
                validated.add(record.tenant)
            self._validate(record)
        elif record.status in DRIVEN:
            self._drive(record)
        elif record.status == BatchStatus.finalizing:
            self._finalize(record)

    def _fail(self, record: BatchRecord, code: str, message: str) -> None:
        """End the batch `failed`. A job it had begun is cancelled (the workers answer its
        unstarted lines, nobody collects them) and its counts are frozen as they stand."""
        error = {"code": code, "line": None, "message": message, "param": None}
        view = self.jobs.view(record.id)
        if view is not None:
            self.jobs.cancel(record.id)
        if self.batches.transition(
            record.id,
            (BatchStatus.validating, *DRIVEN),
            status=BatchStatus.failed,
            failed_at=int(time.time()),
            errors=[error],
            final_counts=request_counts(record, view),
        ):
            self._forget(record.id)
            self.batches.finish(record)

    def _scan(self, record: BatchRecord) -> tuple[LineSource, str, list[dict[str, Any]]] | None:
        """The validated input (its lines, sha256, errors), or None when the file is gone.
        Streamed from the store twice (`producer.stream_scan`: validated, then published),
        so memory does not follow the file's size (a 70 MB upload held ~35x itself and
        killed the server at every restart); at most `max_batch_lines` request lines."""
        cached = self._scans.get(record.id)
        if cached is not None:
            return cached[0], cached[1], []
        stored = self.storage.get(record.input_file_id, record.tenant)
        if stored is None:
            return None
        defaults = Defaults(
            routes=self.client.routes,
            max_result_bytes=self.max_result_bytes,
            priority_range=self.priority_range(record.tenant),
            deadline=datetime.fromtimestamp(record.expires_at, UTC),
            result_ttl_s=result_ttl_for(record.expires_at, time.time()),
        )
        check = InputCheck(record.endpoint, self.max_batch_lines)
        scan = scan_stream(
            lambda: self.storage.iter_bytes(stored),
            record.id,
            defaults=defaults,
            visit=check.visit,
            max_lines=self.max_batch_lines,
            errors="replace",
        )
        first = scan.numbers[0] if scan.numbers else None
        errors = check.result(scan.format, scan.total, first, scan.over_limit)
        if not errors:
            self._scans[record.id] = (scan, scan.sha256)
        return scan, scan.sha256, errors

    def _validate(self, record: BatchRecord) -> None:
        found = self._scan(record)
        if found is None:
            self._fail(record, "invalid_file", f"input file {record.input_file_id} not found")
            return
        _scan, _sha, errors = found
        if errors:
            if self.batches.transition(
                record.id,
                (BatchStatus.validating,),
                status=BatchStatus.failed,
                failed_at=int(time.time()),
                errors=errors,
            ):
                self.batches.finish(record)
            return
        if self.batches.transition(
            record.id,
            (BatchStatus.validating,),
            status=BatchStatus.in_progress,
            in_progress_at=int(time.time()),
        ):
            record.status = BatchStatus.in_progress
            self._drive(record)
        else:  # cancelled while validating: the next tick sees `cancelling`
            self.wake()

    def _drive(self, record: BatchRecord) -> None:
        view = self.jobs.view(record.id)
        if view is None and record.status == BatchStatus.cancelling:
            self._end_unsubmitted(record)
            return
        if self._expire_if_due(record, view):
            view = self.jobs.view(record.id)
        if (
            record.status == BatchStatus.cancelling
            and view is not None
            and view.status not in TERMINAL
            and not self.jobs.cancel_requested(record.id)
        ):
            # The API's cancel found no job yet (this pass began it): cancel it now, so
            # the lines not yet published are answered here, not sent slice by slice.
            self.jobs.cancel(record.id)
            view = self.jobs.view(record.id)
        unsent = (
            view is None
            or view.status == JobStatus.submitting
            or (view.status == JobStatus.cancelling and view.submitted < view.total)
        )
        if unsent:
            found = self._scan(record)
            if found is None or found[2]:
                self._fail(
                    record, "invalid_file", f"input file {record.input_file_id} changed or gone"
                )
                return
            scan, sha, _errors = found
            if isinstance(scan, StreamScan) and (view is None or view.submitted == 0):
                self.jobs.remember_lines(record.id, scan.numbers)
            report = submit_job(
                self.client,
                self.jobs,
                record.id,
                scan,
                input_path=f"serve:{record.input_file_id}",
                sha=sha,
                chunk=self.chunk,
                lane=BULK,
                slice_s=self.submit_slice_s,
                planner=self._planners.setdefault(record.id, PrefixPlanner()),
            )
            if report.paused:  # other batches take their turn; come back at once
                self.wake()
                return
            self._forget(record.id)  # all sent: the file's text is not needed now
            view = self.jobs.view(record.id)
        if view is None:
            return
        if (
            record.ending == BatchStatus.expired
            and view.status not in TERMINAL
            and time.time() >= record.expires_at + self.expiry_grace_s
        ):
            self._answer_unanswered(record)
            view = self.jobs.view(record.id) or view
        if view.status in TERMINAL:
            # The ending follows the status at the moment of the switch, not the one read
            # at the start of the pass: a cancel landing in between ends `cancelled`.
            endings = (
                [(DRIVEN, record.ending)]
                if record.ending
                else [
                    ((BatchStatus.in_progress,), BatchStatus.completed),
                    ((BatchStatus.cancelling,), BatchStatus.cancelled),
                ]
            )
            if any(
                self.batches.transition(
                    record.id,
                    allowed,
                    status=BatchStatus.finalizing,
                    finalizing_at=int(time.time()),
                    ending=ending,
                )
                for allowed, ending in endings
            ):
                self._forget(record.id)
                fresh = self.batches.load(record.id)
                if fresh is not None:
                    self._finalize(fresh)

    def _answer_unanswered(self, record: BatchRecord) -> None:
        """`expiry_grace_s` after the window: every line still without a result is
        answered `expired` here. The workers answer queued lines of an expired batch
        themselves, but only if some are running; without this a batch nobody consumes
        would stay `in_progress` past its window for ever. Written once each: a line a
        worker answered keeps that answer, and a worker's answer arriving later is
        dropped. The lines come from the input file (with their custom_ids) or, when it
        was deleted or no longer validates, from the line numbers stored before
        publishing (`JobStore.remember_lines`; custom_id then null)."""
        ms = int(time.time() * 1000)
        found = self._scan(record)
        items: Iterator[tuple[ResultEnvelope, int]]
        if found is not None and not found[2]:
            items = late_from_lines(record.id, found[0].lines_from(0), ms)
        else:
            numbers = self.jobs.remembered_lines(record.id)
            if numbers is None:
                if record.id not in self._stuck:
                    self._stuck.add(record.id)
                    log.warning(
                        "serve: batch %s expired, its lines unknown: left to workers", record.id
                    )
                return
            ttl = result_ttl_for(record.expires_at, time.time())
            items = late_from_numbers(record.id, numbers, ttl, ms)
        written = 0
        while part := list(itertools.islice(items, self.chunk)):  # a chunk at a time in memory
            written += self.jobs.write_results(part)
        self._forget(record.id)
        log.info("serve: batch %s expired: %d unanswered lines answered", record.id, written)

    def _forget(self, batch_id: str) -> None:
        """Drop what this process holds for a batch once it no longer needs it."""
        self._scans.pop(batch_id, None)
        self._planners.pop(batch_id, None)
        self._stuck.discard(batch_id)

    def _expire_if_due(self, record: BatchRecord, view: JobView | None) -> bool:
        """Past its window: mark the batch to end `expired` and cancel its job.

        Checked before any publishing, so a batch whose publish fails on every tick
        still expires. The cancel makes `submit_job` answer the lines it never sent
        itself (`expired`: each line's deadline is the window's end) without Kafka;
        lines already published expire in the worker. A batch whose job never began
        gets one first, so every line still has its outcome in the error file.
        """
        if record.ending or time.time() < record.expires_at:
            return False
        if view is not None and view.status in TERMINAL:
            return False
        self.batches.update(record.id, ending=BatchStatus.expired)
        record.ending = BatchStatus.expired
        if view is None:
            found = self._scan(record)
            if found is None or found[2]:
                return False  # the unsent branch fails the batch `invalid_file`
            scan, sha, _errors = found
            self.jobs.begin(record.id, scan.total, f"serve:{record.input_file_id}", sha)
        self.jobs.cancel(record.id)
        return True

    def _end_unsubmitted(self, record: BatchRecord) -> None:
        """Cancelled before its job began: nothing ran, nothing to collect."""
        if self.batches.transition(
            record.id,
            (BatchStatus.cancelling,),
            status=BatchStatus.cancelled,
            cancelled_at=int(time.time()),
            final_counts={"total": 0, "completed": 0, "failed": 0},
        ):
            self._forget(record.id)
            self.batches.finish(record)

    def _finalize(self, record: BatchRecord) -> None:
        out = self.storage.tmp / f"{record.id}.output.jsonl"
        errors = self.storage.tmp / f"{record.id}.errors.jsonl"
        try:
            hook = self.on_result
            report = collect_job(
                self.jobs,
                record.id,
                out,
                errors=errors,
                timeout=60,
                on_result=(lambda r: hook(record.tenant, r)) if hook else None,
            )
            if not report.complete and report.status not in TERMINAL:
                return  # not everything is in yet: the next tick collects again
            succeeded = report.counts.get(Status.succeeded, 0)
            unsuccessful = report.written - succeeded
            out_id = self._store(record, out, "output", succeeded)
            err_id = self._store(record, errors, "error", unsuccessful)
        finally:
            for path in (out, errors):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
        ending = record.ending or BatchStatus.completed
        counts = {"total": report.total, "completed": succeeded, "failed": report.total - succeeded}
        if self.batches.transition(
            record.id,
            (BatchStatus.finalizing,),
            status=ending,
            output_file_id=out_id,
            error_file_id=err_id,
            final_counts=counts,
            **{f"{ending}_at": int(time.time())},
        ):
            self.batches.finish(record)
            log.info("serve: batch %s %s (%s)", record.id, ending, counts)

    def _store(self, record: BatchRecord, path: Path, kind: str, lines: int) -> str | None:
        """Put one collected file in storage (None when it would hold no line, as
        OpenAI leaves `output_file_id` / `error_file_id` null then)."""
        if lines <= 0:
            return None
        stored = self.storage.put(
            path,
            tenant=record.tenant,
            filename=f"{record.id}_{kind}.jsonl",
            purpose=PURPOSE_OUTPUT,
            file_id=output_file_id(record.id, kind),
            expires_after_s=record.output_expires_after_s,
        )
        return stored.id


__all__ = ["BatchRunner", "output_file_id", "result_ttl_for"]
