"""Bulk jobs, I/O parts: job bookkeeping in Redis, and submission (collect and retry are in
`producer.collect`).

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

import hashlib
import itertools
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from producer.batch_output import cancelled_result, invalid_result
from producer.bulk import Line
from producer.client import QBatchClient, now_utc
from producer.job_view import JobView
from producer.line_sources import LineSource, bitmap_lines, line_bitmap
from producer.placement import PlacementMode, PrefixPlanner, placement_mode
from schemas import JobField, JobStatus, RedisKeys, ResultEnvelope
from schemas.limits import DEFAULT_RESULT_TTL_S
from schemas.redis_conn import mget, reply_text
from schemas.replica_ack import ReplicaAck
from schemas.replies import ResultWriter
from schemas.scripts import lua
from schemas.settings import BULK

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


class JobError(RuntimeError):
    """A job-level problem: unknown job, conflicting re-run, wrong state."""


class JobStore:
    """Job bookkeeping against one Redis and prefix."""

    def __init__(
        self,
        redis_client: Any,
        keys: RedisKeys,
        job_ttl_s: int = DEFAULT_JOB_TTL_S,
        ack: ReplicaAck | None = None,
    ):
        self.redis = redis_client
        self.keys = keys
        self.job_ttl_s = job_ttl_s
        self._replies = ResultWriter(redis_client, keys, ack)
        self._begin = redis_client.register_script(lua("job_begin"))
        self._mark = redis_client.register_script(lua("job_mark_submitted"))
        self._cancel = redis_client.register_script(lua("job_cancel"))
        self._begin_retry = redis_client.register_script(lua("job_begin_retry"))

    @classmethod
    def of(cls, client: QBatchClient, job_ttl_s: int = DEFAULT_JOB_TTL_S) -> JobStore:
        """The store of `client`'s Redis, key layout and replica acknowledgement
        (`QBATCH_REDIS_WAIT_REPLICAS`)."""
        return cls(client.redis, client.keys, job_ttl_s, client.settings.replica_ack)

    def view(self, job_id: str) -> JobView | None:
        h = self.redis.hgetall(self.keys.job(job_id))
        if not h:
            return None
        return JobView.from_hash(job_id, h, now_ms())

    def field(self, job_id: str, name: str) -> str | None:
        value = self.redis.hget(self.keys.job(job_id), name)
        return None if value is None else reply_text(value)

    def begin(self, job_id: str, total: int, input_path: str, sha: str) -> tuple[str, str, int]:
        """('new'|'exists', status, submitted); JobError on a conflicting re-run."""
        reply = [
            reply_text(x)
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
        return reply_text(
            self._mark(
                keys=[
                    self.keys.job(job_id),
                    self.keys.job_stream(job_id),
                    self.keys.job_counted(job_id),
                ],
                args=[total, self.job_ttl_s],
            )
        )

    def remember_lines(self, job_id: str, numbers: Iterable[int]) -> None:
        """Store the job's request line numbers (`RedisKeys.job_lines`) unless stored."""
        self.redis.set(
            self.keys.job_lines(job_id), line_bitmap(numbers), ex=self.job_ttl_s, nx=True
        )

    def remembered_lines(self, job_id: str) -> list[int] | None:
        """The line numbers `remember_lines` stored, None when there are none."""
        raw = self.redis.get(self.keys.job_lines(job_id))
        return None if raw is None else bitmap_lines(raw)

    def cancel_requested(self, job_id: str) -> bool:
        return bool(self.redis.exists(self.keys.job_cancel(job_id)))

    def cancel(self, job_id: str) -> str:
        """Set the cancel flag; returns the job's status after it ('' if no such job)."""
        return reply_text(
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
        return reply_text(reply[0]), reply_text(reply[1])

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
        return [
            (reply_text(eid), {reply_text(k): reply_text(v) for k, v in fields.items()})
            for eid, fields in entries
        ]

    def wait_stream(self, job_id: str, after: str, block_ms: int) -> None:
        """Block until the stream has an entry after `after` (or `block_ms` passes)."""
        last = "0-0" if after == "-" else after
        self.redis.xread({self.keys.job_stream(job_id): last}, count=1, block=max(block_ms, 1))

    def results(self, request_ids: Sequence[str]) -> list[bytes | None]:
        if not request_ids:
            return []
        return mget(self.redis, [self.keys.result(rid) for rid in request_ids])

    def iter_results(
        self, request_ids: Sequence[str], max_bytes: int = 32 * 1024 * 1024
    ) -> Iterator[bytes | None]:
        """The results of `request_ids`, in order, fetched a part of at most `max_bytes`
        at a time (their sizes asked first, one STRLEN each in a pipeline): 5,000 stream
        entries of megabyte results in one MGET would be gigabytes at once."""
        if not request_ids:
            return
        keys = [self.keys.result(rid) for rid in request_ids]
        pipe = self.redis.pipeline(transaction=False)
        for key in keys:
            pipe.strlen(key)
        sizes = [n if isinstance(n, int) else 0 for n in pipe.execute(raise_on_error=False)]
        start = 0
        while start < len(keys):
            end, total = start + 1, sizes[start]
            while end < len(keys) and total + sizes[end] <= max_bytes:
                total += sizes[end]
                end += 1
            yield from mget(self.redis, keys[start:end])
            start = end


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
    placement: str = PlacementMode.none.value
    families: int = 0
    """Prompt-prefix families seen (placement prefix)."""
    placed: int = 0
    """Lines published to their family's partition (the others: Kafka's key partitioner)."""
    paused: bool = False
    """Stopped at the end of its time slice with lines left (`slice_s`): call again."""

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
            "placement": self.placement,
            "families": self.families,
            "placed": self.placed,
            "paused": self.paused,
            "lines_per_s": round(self.published / self.seconds, 1) if self.seconds else None,
        }


def publish_chunk(
    client: QBatchClient,
    store: JobStore,
    job_id: str,
    lines: Sequence[Line],
    lane: str | None = BULK,
    planner: PrefixPlanner | None = None,
) -> int:
    """Publish the chunk's valid lines, wait for every ack, write its invalid lines' results.

    With a `planner` (prefix-aware placement, `producer.placement`) the chunk is the
    placement window: its lines are published grouped by family, a family to one
    partition; without one, in file order to Kafka's key partitioner. Either way `submitted`
    only moves once the whole chunk is acknowledged, so the order inside it is free.
    """
    stamp = now_utc()
    envelopes = [
        line.envelope.model_copy(update={"submitted_at": stamp})
        for line in lines
        if line.envelope is not None
    ]
    placed = (
        client.place(envelopes, lane, planner)
        if planner is not None
        else [(env, None) for env in envelopes]
    )
    futures = [(env.request_id, client.send(env, lane, part)) for env, part in placed]
    client.flush(futures)
    ms = now_ms()
    store.write_results(
        [(invalid_result(line, job_id, ms), _ttl(line)) for line in lines if not line.ok]
    )
    return len(futures)


def planner_for(placement: str | PlacementMode) -> PrefixPlanner | None:
    """A fresh planner for one job's run under `placement` (None for `none`)."""
    return PrefixPlanner() if placement_mode(placement) is PlacementMode.prefix else None


def _ttl(line: Line) -> int:
    return line.envelope.result_ttl_s if line.envelope is not None else DEFAULT_RESULT_TTL_S


def submit_job(
    client: QBatchClient,
    store: JobStore,
    job_id: str,
    scan: LineSource,
    *,
    input_path: str,
    sha: str,
    chunk: int = DEFAULT_CHUNK,
    on_progress: Progress | None = None,
    lane: str | None = BULK,
    placement: str | PlacementMode = PlacementMode.prefix,
    slice_s: float | None = None,
    planner: PrefixPlanner | None = None,
) -> SubmitReport:
    """Publish a scanned file (or any `LineSource`) as job `job_id`, resuming where an
    earlier run stopped.

    Lines are published `chunk` at a time, to priority lane `lane` (bulk by default, so a
    nightly job never queues ahead of interactive requests); after each chunk is fully
    acknowledged (acks=all) `submitted` is advanced. A run killed mid-chunk re-sends at
    most that chunk; the worker's written-once rule makes the re-sent lines harmless.
    `placement`: `prefix` (default) groups each chunk's lines by prompt-prefix family, a
    family to one partition (`producer.placement`); `none` publishes in file order.
    `slice_s`: return after the first chunk that ends past this many seconds, with the
    job still `submitting` and `paused` set, so a caller driving several jobs on one
    thread (`qbatch serve`'s runner) can take turns; the next call resumes. Such a caller
    passes the job's own `planner` to every call, so a family's runs go on rotating over
    partitions across slices instead of starting again at its home partition.
    """
    if planner is None or placement_mode(placement) is not PlacementMode.prefix:
        planner = planner_for(placement)
    started = time.monotonic()
    total = scan.total
    report = SubmitReport(job_id, total, invalid=scan.invalid, placement=placement_mode(placement))
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
    source = scan.lines_from(position)
    first = position
    slice_end = None if slice_s is None else started + slice_s
    while position < total:
        if store.cancel_requested(job_id):
            break
        # at least one chunk a call, then stop once the slice is spent
        if slice_end is not None and position > first and time.monotonic() >= slice_end:
            report.paused = True
            report.status = JobStatus.submitting
            report.seconds = time.monotonic() - started
            return report
        end = min(position + chunk, total)
        part = list(itertools.islice(source, end - position))
        report.published += publish_chunk(client, store, job_id, part, lane, planner)
        store.set_submitted(job_id, end)
        position = end
        if on_progress:
            on_progress(position, total)
    if position < total:  # cancelled during submission: answer the unsent lines ourselves
        ms = now_ms()
        while rest := list(itertools.islice(source, chunk)):  # a chunk at a time in memory
            store.write_results(
                [
                    (
                        invalid_result(line, job_id, ms)
                        if not line.ok
                        else cancelled_result(line, job_id, ms),
                        _ttl(line),
                    )
                    for line in rest
                ]
            )
            report.cancelled_unsent += sum(1 for line in rest if line.ok)
        if on_progress:
            on_progress(total, total)
    report.status = store.mark_submitted(job_id, total)
    report.seconds = time.monotonic() - started
    if planner is not None:
        report.families, report.placed = planner.families, planner.placed
    return report


__all__ = [
    "DEFAULT_CHUNK",
    "DEFAULT_JOB_TTL_S",
    "JobError",
    "JobStore",
    "SubmitReport",
    "file_sha256",
    "planner_for",
    "publish_chunk",
    "submit_job",
]
