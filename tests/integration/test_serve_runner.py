"""`qbatch serve`'s batch runner, in process on real Kafka and Redis (the API only offers
windows of an hour or more, and ticks are driven here one by one).

Expiry: a batch past its completion window ends `expired`, every line answered, even
where nothing could be published. The expiry tests' lane topics are never created and the
broker does not create topics on demand, so every publish fails after `max_block_ms`:
the state of a cluster whose bulk topic is gone or unreachable. Before the expiry check
came ahead of submitting, such a batch retried its publish on every tick and never
expired.

Turns: a huge batch publishes a slice per pass, so other batches do not wait for it.

Lost results: a line whose result expired from Redis before the finalize is in the error
file as a failed line, not missing from both files of a `completed` batch; and results
now live for the window plus a day (the default day was shorter than a 72-h window).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from producer.bulk import request_id_for
from producer.collect import collect_job
from producer.jobs import JobStore
from producer.serve.batches import BatchRecord, BatchStatus, BatchStore, new_batch_id
from producer.serve.lease import Lease
from producer.serve.runner import BatchRunner
from producer.serve.storage import PURPOSE_BATCH
from producer.serve.storage_url import open_storage
from schemas import JobStatus
from tests.serve_fixtures import batch_lines, jsonl

try:
    from tests.integration.workers import Lane, echo_worker
except ModuleNotFoundError:
    from workers import Lane, echo_worker  # type: ignore[no-redef]

pytestmark = pytest.mark.integration

TENANT = "tenant-expiry"
LINES = 7


@pytest.fixture(scope="module", autouse=True)
def _stack(stack: Any) -> None:
    """The local Kafka + Redis (conftest's `stack` starts it or fails loudly)."""


@contextlib.contextmanager
def lane_runner(
    tmp: Path, name: str, *, topics: bool = True, **options: Any
) -> Iterator[tuple[Lane, BatchRunner]]:
    """A runner on a private lane (its topics created unless `topics=False`), cleaned up."""
    lane = Lane.new(name)
    if topics:
        lane.create_topics()
    client = lane.client(producer_config={"max_block_ms": 1_500})
    lease = Lease.acquire(client.redis, client.keys, wait_s=0)
    runner = BatchRunner(
        client,
        BatchStore(client.redis, client.keys, lease),
        JobStore.of(client),
        open_storage(str(tmp / "files"), lease),
        **options,
    )
    try:
        yield lane, runner
    finally:
        lease.release()
        client.close()
        if topics:
            lane.delete_topics()
        lane.clean_redis()


@pytest.fixture
def runner(tmp_path: Path) -> Iterator[BatchRunner]:
    with lane_runner(tmp_path, "qbx", topics=False) as (_lane, runner):  # publishes fail
        yield runner


def _create(
    runner: BatchRunner,
    tmp: Path,
    expires_in_s: float,
    lines: int = LINES,
    output_expires_after_s: int | None = None,
    tenant: str = TENANT,
) -> str:
    src = tmp / "input.jsonl"
    src.write_bytes(jsonl(batch_lines(lines)))
    stored = runner.storage.put(src, tenant=tenant, filename="input.jsonl", purpose=PURPOSE_BATCH)
    now = int(time.time())
    record = BatchRecord(
        id=new_batch_id(),
        tenant=tenant,
        endpoint="/v1/chat/completions",
        input_file_id=stored.id,
        completion_window="24h",
        status=BatchStatus.validating,
        created_at=now,
        expires_at=int(now + expires_in_s),
        output_expires_after_s=output_expires_after_s,
    )
    assert runner.batches.create(record, max_active=10) is None
    return record.id


def _error_lines(runner: BatchRunner, record: BatchRecord) -> list[dict[str, Any]]:
    assert record.error_file_id is not None
    stored = runner.storage.get(record.error_file_id, TENANT)
    assert stored is not None
    text = b"".join(runner.storage.iter_bytes(stored)).decode()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _assert_expired_with_every_line(runner: BatchRunner, batch_id: str) -> None:
    record = runner.batches.load(batch_id)
    assert record is not None
    assert record.status == BatchStatus.expired, record
    assert record.expired_at is not None
    assert record.final_counts == {"total": LINES, "completed": 0, "failed": LINES}
    assert record.output_file_id is None  # no line succeeded
    lines = _error_lines(runner, record)
    assert sorted(line["custom_id"] for line in lines) == sorted(f"c{i}" for i in range(LINES))
    for line in lines:
        assert line["response"]["status_code"] == 408, line
        assert line["error"]["code"] == "deadline_exceeded", line
    assert batch_id not in runner.batches.active_ids()


def test_a_batch_whose_publish_fails_on_every_tick_still_expires(
    runner: BatchRunner, tmp_path: Path
) -> None:
    batch_id = _create(runner, tmp_path, expires_in_s=4)
    runner.tick()  # validates, then the first publish fails (logged; retried next tick)
    record = runner.batches.load(batch_id)
    assert record is not None and record.status == BatchStatus.in_progress
    view = runner.jobs.view(batch_id)
    assert view is not None and view.submitted == 0  # nothing went out
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        runner.tick()
        record = runner.batches.load(batch_id)
        assert record is not None
        if record.status == BatchStatus.expired:
            break
    _assert_expired_with_every_line(runner, batch_id)


def test_a_batch_past_its_window_before_its_job_began_expires_without_publishing(
    runner: BatchRunner, tmp_path: Path
) -> None:
    batch_id = _create(runner, tmp_path, expires_in_s=-1)
    started = time.monotonic()
    runner.tick()
    # One tick, and no publish attempt: one would have blocked for max_block_ms.
    assert time.monotonic() - started < 1.5
    _assert_expired_with_every_line(runner, batch_id)
    view = runner.jobs.view(batch_id)
    assert view is not None and view.submitted == LINES


def test_output_files_carry_the_batchs_output_expires_after(
    runner: BatchRunner, tmp_path: Path
) -> None:
    """`output_expires_after` is kept in the batch hash and given to the files it writes."""
    batch_id = _create(runner, tmp_path, expires_in_s=-1, output_expires_after_s=7_200)
    runner.tick()
    _assert_expired_with_every_line(runner, batch_id)
    record = runner.batches.load(batch_id)
    assert record is not None and record.output_expires_after_s == 7_200
    assert record.error_file_id is not None
    stored = runner.storage.get(record.error_file_id, TENANT)
    assert stored is not None and stored.expires_at == stored.created_at + 7_200
    assert runner.storage.sweep_expired(stored.created_at + 7_200) == 1
    assert runner.storage.get(record.error_file_id, TENANT) is None


def test_a_huge_batch_publishes_in_turns_with_the_others(tmp_path: Path) -> None:
    """With a slice of 0 s a batch publishes one chunk a pass: the small batch beside
    it is fully sent in the first pass instead of after the whole big one."""
    with lane_runner(tmp_path, "qbr", chunk=50, submit_slice_s=0.0) as (_lane, runner):
        # two tenants: one tenant's second batch would wait a pass to be validated
        big = _create(runner, tmp_path, expires_in_s=3_600, lines=500, tenant="tenant-big")
        small = _create(runner, tmp_path, expires_in_s=3_600, lines=3)
        runner.tick()
        small_view, big_view = runner.jobs.view(small), runner.jobs.view(big)
        assert small_view is not None and small_view.submitted == 3
        assert small_view.status == JobStatus.running
        assert big_view is not None and big_view.status == JobStatus.submitting
        assert big_view.submitted == 50  # one chunk, then the others' turn
        passes = 1
        while big_view.status == JobStatus.submitting and passes < 50:
            runner.tick()
            passes += 1
            big_view = runner.jobs.view(big)
            assert big_view is not None
        assert big_view.submitted == 500 and big_view.status == JobStatus.running
        assert passes == 10  # 500 lines in chunks of 50, one chunk a pass


def test_one_tenants_batches_are_validated_in_turns_with_the_others(tmp_path: Path) -> None:
    """A pass validates one batch a tenant: three of one tenant's and one of another's,
    and the other's is under way after the first pass, not after all three."""
    with lane_runner(tmp_path, "qbf") as (_lane, runner):
        many = [_create(runner, tmp_path, 3_600, tenant="tenant-many") for _ in range(3)]
        other = _create(runner, tmp_path, 3_600, tenant="tenant-other")
        runner.tick()

        def status(batch_id: str) -> BatchStatus:
            record = runner.batches.load(batch_id)
            assert record is not None
            return record.status

        assert status(other) == BatchStatus.in_progress
        assert sorted(status(b) == BatchStatus.validating for b in many) == [False, True, True]
        runner.tick()
        runner.tick()
        assert all(status(b) == BatchStatus.in_progress for b in many)


def _answered(lane: Lane, runner: BatchRunner, tmp: Path, expires_in_s: float, lines: int) -> str:
    """A batch run by an echo worker until its job is finished (not yet finalized)."""
    batch_id = _create(runner, tmp, expires_in_s=expires_in_s, lines=lines)
    with echo_worker(lane, log=tmp / "worker.log"):
        runner.tick()  # validates and publishes; the worker answers
        deadline = time.monotonic() + 60
        view = runner.jobs.view(batch_id)
        while not (view is not None and view.finished) and time.monotonic() < deadline:
            time.sleep(0.2)
            view = runner.jobs.view(batch_id)
        assert view is not None and view.finished, view
    return batch_id


def test_a_cancel_landing_during_a_pass_ends_the_batch_cancelled(tmp_path: Path) -> None:
    """The runner read the batch `in_progress`; the API's cancel came before the pass
    switched it to finalizing. The ending follows the status at the switch."""
    with lane_runner(tmp_path, "qbc") as (lane, runner):
        batch_id = _answered(lane, runner, tmp_path, expires_in_s=3_600, lines=2)
        stale = runner.batches.load(batch_id)
        assert stale is not None and stale.status == BatchStatus.in_progress
        assert runner.batches.transition(  # what POST /v1/batches/{id}/cancel writes
            batch_id,
            (BatchStatus.in_progress,),
            status=BatchStatus.cancelling,
            cancelling_at=int(time.time()),
        )
        runner._drive(stale)  # the pass that read the record before the cancel
        record = runner.batches.load(batch_id)
        assert record is not None and record.status == BatchStatus.cancelled, record


def test_a_result_lost_before_the_finalize_is_a_failed_line_not_a_gap(tmp_path: Path) -> None:
    with lane_runner(tmp_path, "qbl") as (lane, runner):
        client = runner.client
        batch_id = _answered(lane, runner, tmp_path, expires_in_s=72 * 3_600, lines=3)
        first = request_id_for(batch_id, 1)
        ttl = client.redis.ttl(client.keys.result(first))
        assert ttl > 72 * 3_600  # the window and a day, not the default day
        client.redis.delete(client.keys.result(first))  # as if it had expired
        runner.tick()  # finalizes
        record = runner.batches.load(batch_id)
        assert record is not None and record.status == BatchStatus.completed, record
        assert record.final_counts == {"total": 3, "completed": 2, "failed": 1}
        (lost,) = _error_lines(runner, record)
        assert lost["custom_id"] == "c0" and lost["error"]["code"] == "internal_error"
        assert "expired from Redis" in lost["error"]["message"]


def test_input_deleted_mid_submission_fails_the_batch_and_cancels_its_job(
    tmp_path: Path,
) -> None:
    """OpenAI users delete input files after creating batches. After a restart (the
    parsed file is gone with the old process) the file cannot be read again: the batch
    ends `failed`, its half-published job is cancelled (the workers answer the unstarted
    lines; nothing is collected) and its counts stay as they were."""
    with lane_runner(tmp_path, "qbd", chunk=5, submit_slice_s=0.0) as (_lane, runner):
        batch_id = _create(runner, tmp_path, expires_in_s=3_600, lines=10)
        runner.tick()  # validates, publishes the first chunk, pauses
        view = runner.jobs.view(batch_id)
        assert view is not None and view.submitted == 5
        record = runner.batches.load(batch_id)
        assert record is not None
        assert runner.storage.delete(record.input_file_id, TENANT)
        restarted = BatchRunner(runner.client, runner.batches, runner.jobs, runner.storage)
        restarted.tick()
        record = restarted.batches.load(batch_id)
        assert record is not None and record.status == BatchStatus.failed, record
        assert record.errors is not None and "changed or gone" in record.errors[0]["message"]
        assert record.final_counts == {"total": 10, "completed": 0, "failed": 0}
        assert restarted.jobs.cancel_requested(batch_id)
        assert batch_id not in restarted.batches.active_ids()


def test_an_expired_batch_nobody_consumes_still_ends(tmp_path: Path) -> None:
    """Its lines went out, but no worker reads the topic: once the window and the grace
    after it have passed, the runner answers every unanswered line `expired` itself
    (before, the batch stayed `in_progress` past its window for ever)."""
    with lane_runner(tmp_path, "qbn", expiry_grace_s=0.0) as (_lane, runner):
        batch_id = _create(runner, tmp_path, expires_in_s=2)
        runner.tick()  # validates and publishes; nobody consumes
        view = runner.jobs.view(batch_id)
        assert view is not None and view.submitted == LINES and not view.finished
        record = runner.batches.load(batch_id)
        assert record is not None
        time.sleep(max(0.0, record.expires_at - time.time()) + 0.1)
        runner.tick()
        _assert_expired_with_every_line(runner, batch_id)
        record = runner.batches.load(batch_id)
        assert record is not None
        for line in _error_lines(runner, record):
            assert "completion window ended" in line["error"]["message"]


def test_a_cancel_before_the_job_began_stops_publishing_at_the_next_pass(
    tmp_path: Path,
) -> None:
    """The runner read the batch `in_progress`; the API's cancel found no job (so it set
    no cancel flag); that pass began the job and published one slice. The next pass
    cancels the job, and the lines not yet published are answered `cancelled` here
    instead of being published slice after slice."""
    with lane_runner(tmp_path, "qbk", chunk=5, submit_slice_s=0.0) as (_lane, runner):
        batch_id = _create(runner, tmp_path, expires_in_s=3_600, lines=40)
        assert runner.batches.transition(
            batch_id, (BatchStatus.validating,), status=BatchStatus.in_progress
        )
        stale = runner.batches.load(batch_id)
        assert stale is not None
        assert runner.batches.transition(  # the API's cancel
            batch_id, (BatchStatus.in_progress,), status=BatchStatus.cancelling
        )
        assert runner.jobs.cancel(batch_id) == ""  # no job yet: no flag
        runner._drive(stale)  # begins the job, publishes one slice
        view = runner.jobs.view(batch_id)
        assert view is not None and view.submitted == 5
        runner.tick()
        view = runner.jobs.view(batch_id)
        assert view is not None and view.cancelled == 35, view  # answered, never published


def test_an_expired_batch_whose_input_was_deleted_still_ends(tmp_path: Path) -> None:
    """The sweep reads the line numbers stored before publishing when the input file is
    gone: every line answered `expired` (custom_id then unknown), the batch ends."""
    with lane_runner(tmp_path, "qbg", expiry_grace_s=0.0) as (_lane, runner):
        batch_id = _create(runner, tmp_path, expires_in_s=2)
        runner.tick()  # validates and publishes; nobody consumes
        record = runner.batches.load(batch_id)
        assert record is not None
        assert runner.jobs.remembered_lines(batch_id) == list(range(1, LINES + 1))
        assert runner.storage.delete(record.input_file_id, TENANT)
        restarted = BatchRunner(  # a restart: nothing of the file in memory either
            runner.client, runner.batches, runner.jobs, runner.storage, expiry_grace_s=0.0
        )
        time.sleep(max(0.0, record.expires_at - time.time()) + 0.1)
        restarted.tick()
        record = restarted.batches.load(batch_id)
        assert record is not None and record.status == BatchStatus.expired, record
        assert record.final_counts == {"total": LINES, "completed": 0, "failed": LINES}
        lines = _error_lines(restarted, record)
        assert len(lines) == LINES
        assert {line["error"]["code"] for line in lines} == {"deadline_exceeded"}
        assert {line["custom_id"] for line in lines} == {None}


def test_collect_counts_a_lost_result_but_is_complete_and_recounts_it(tmp_path: Path) -> None:
    """`collect_job` (what `qbatch bulk collect` and the finalize run): a lost result is
    a failed line, the collect is complete (every line has an outcome), the loss is
    counted, and a re-collect that reuses the earlier output counts it again."""
    with lane_runner(tmp_path, "qbm") as (lane, runner):
        batch_id = _answered(lane, runner, tmp_path, expires_in_s=3_600, lines=3)
        runner.client.redis.delete(runner.client.keys.result(request_id_for(batch_id, 2)))
        out, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
        for _ in range(2):
            report = collect_job(runner.jobs, batch_id, out, errors=errors, timeout=30)
            assert report.complete and report.written == 3 and report.missing_results == 1
            assert report.counts["failed"] == 1 and report.counts["succeeded"] == 2
        (lost,) = [json.loads(text) for text in errors.read_text().splitlines()]
        assert lost["custom_id"] == "c1" and lost["error"]["code"] == "internal_error"
