"""`qbatch serve`'s batch runner, in process on real Kafka and Redis (the API only offers
windows of an hour or more, and ticks are driven here one by one).

Expiry: a batch past its completion window ends `expired`, every line answered, even
where nothing could be published. The expiry tests' lane topics are never created and the
broker does not create topics on demand, so every publish fails after `max_block_ms`:
the state of a cluster whose bulk topic is gone or unreachable. Before the expiry check
came ahead of submitting, such a batch retried its publish on every tick and never
expired.

Turns: a huge batch publishes a slice per pass, so other batches do not wait for it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from producer.jobs import JobStore
from producer.serve.batches import BatchRecord, BatchStatus, BatchStore, new_batch_id
from producer.serve.runner import BatchRunner
from producer.serve.storage import PURPOSE_BATCH, LocalStorage
from schemas import JobStatus
from tests.serve_fixtures import batch_lines, jsonl

try:
    from tests.integration.workers import Lane
except ModuleNotFoundError:
    from workers import Lane  # type: ignore[no-redef]

pytestmark = pytest.mark.integration

TENANT = "tenant-expiry"
LINES = 7


@pytest.fixture(scope="module", autouse=True)
def _stack(stack: Any) -> None:
    """The local Kafka + Redis (conftest's `stack` starts it or fails loudly)."""


@pytest.fixture
def runner(tmp_path: Path) -> Iterator[BatchRunner]:
    lane = Lane.new("qbx")  # topics deliberately not created
    client = lane.client(producer_config={"max_block_ms": 1_500})
    storage = LocalStorage(tmp_path / "files")
    batches = BatchStore(client.redis, client.keys)
    runner = BatchRunner(client, batches, JobStore.of(client), storage)
    try:
        yield runner
    finally:
        client.close()
        lane.clean_redis()


def _create(runner: BatchRunner, tmp: Path, expires_in_s: float, lines: int = LINES) -> str:
    src = tmp / "input.jsonl"
    src.write_bytes(jsonl(batch_lines(lines)))
    stored = runner.storage.put(src, tenant=TENANT, filename="input.jsonl", purpose=PURPOSE_BATCH)
    now = int(time.time())
    record = BatchRecord(
        id=new_batch_id(),
        tenant=TENANT,
        endpoint="/v1/chat/completions",
        input_file_id=stored.id,
        completion_window="24h",
        status=BatchStatus.validating,
        created_at=now,
        expires_at=int(now + expires_in_s),
    )
    assert runner.batches.create(record, max_active=10)
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


def test_a_huge_batch_publishes_in_turns_with_the_others(tmp_path: Path) -> None:
    """With a slice of 0 s a batch publishes one chunk a pass: the small batch beside
    it is fully sent in the first pass instead of after the whole big one."""
    lane = Lane.new("qbr")
    lane.create_topics()
    client = lane.client()
    runner = BatchRunner(
        client,
        BatchStore(client.redis, client.keys),
        JobStore.of(client),
        LocalStorage(tmp_path / "files"),
        chunk=50,
        submit_slice_s=0.0,
    )
    try:
        big = _create(runner, tmp_path, expires_in_s=3_600, lines=500)
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
    finally:
        client.close()
        lane.delete_topics()
        lane.clean_redis()
