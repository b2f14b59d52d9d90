"""The storage upkeep of `qbatch serve` (`producer.serve.upkeep`): its schedule on an
injected clock, and what the leftover sweep removes (`file_index.orphan_ids`, pure;
`FileStore.sweep_leftovers` on both backends)."""

from __future__ import annotations

import os
import time
from collections import Counter
from typing import Any, cast

import pytest

from producer.serve.file_index import orphan_ids
from producer.serve.local_store import LocalStorage
from producer.serve.storage import LEFTOVER_AGE_S, FileStore
from producer.serve.upkeep import Upkeep
from tests.s3_fixtures import BUCKET
from tests.storage_fixtures import Backend, upload_bytes


def fid(n: int) -> str:
    return f"file-{n:032x}"


# ---------------------------------------------------------------- orphans, pure


def test_orphans_are_old_data_objects_without_metadata() -> None:
    objects = [
        (f"{fid(1)}.data", 10.0),
        (f"{fid(1)}.json", 0.0),  # a whole file
        (f"{fid(2)}.data", 10.0),  # metadata gone: an orphan
        (f"{fid(3)}.data", 500.0),  # too recent (its metadata may be coming)
        (f"{fid(4)}.json", 0.0),  # metadata without data: not this sweep's
        ("notes.data", 1.0),  # not a file id: never touched
        (f"{fid(5)}.data", 10.0),  # the last one, an orphan
    ]
    assert list(orphan_ids(objects, before=100.0)) == [fid(2), fid(5)]
    assert list(orphan_ids([], before=100.0)) == []


# ---------------------------------------------------------------- the sweep, both backends


def drop_metadata(backend: Backend, file_id: str) -> None:
    """What a server killed between a file's two objects (or in a delete) leaves."""
    if backend.endpoint is None:
        assert isinstance(backend.storage, LocalStorage)
        backend.storage.files.joinpath(f"{file_id}.json").unlink()
    else:
        key = f"{backend.prefix}files/{file_id}.json"
        cast(Any, backend.storage).client.delete_object(Bucket=BUCKET, Key=key)


def test_the_leftover_sweep_removes_old_orphans_and_temp_files_only(backend: Backend) -> None:
    storage = backend.storage
    kept = upload_bytes(storage, b"{}\n")
    orphan = upload_bytes(storage, b"{}\n")
    drop_metadata(backend, orphan)
    stale_tmp = storage.tmp / "upload-killed"
    stale_tmp.write_bytes(b"half an upload")
    day_ago = time.time() - LEFTOVER_AGE_S - 60
    os.utime(stale_tmp, (day_ago, day_ago))
    fresh_tmp = storage.tmp / "upload-now"
    fresh_tmp.write_bytes(b"an upload under way")

    assert storage.sweep_leftovers() == 1  # the old temp file; the orphan is too recent
    assert not stale_tmp.exists() and fresh_tmp.exists()
    assert f"{orphan}.data" in backend.stored_names()

    later = time.time() + LEFTOVER_AGE_S + 60
    fresh_tmp.unlink()
    assert storage.sweep_leftovers(now=later) == 1
    assert backend.stored_names() == [f"{kept}.data", f"{kept}.json"]
    assert storage.get(kept, "a") is not None


# ---------------------------------------------------------------- the schedule


class FakeStorage:
    """Counts the upkeep's calls; `fail` names calls that raise once."""

    def __init__(self, fail: set[str] | None = None) -> None:
        self.calls: Counter[str] = Counter()
        self.fail = fail or set()

    def _call(self, name: str) -> int:
        self.calls[name] += 1
        if name in self.fail:
            self.fail.discard(name)
            raise OSError(f"{name} failed")
        return 1

    def reindex(self, *, force: bool = False) -> int:
        return self._call("reindex")

    def sweep_expired(self) -> int:
        return self._call("expired")

    def sweep_leftovers(self) -> int:
        return self._call("leftovers")


def test_each_job_runs_when_due_and_a_failure_waits_for_its_next_time(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [1_000.0]
    fake = FakeStorage(fail={"expired"})
    upkeep = Upkeep(
        cast(FileStore, fake),
        expiry_interval_s=300,
        leftover_interval_s=3_600,
        clock=lambda: now[0],
    )
    assert upkeep.run_due() == 300  # all three ran; the expiry sweep failed
    assert fake.calls == Counter(reindex=1, expired=1, leftovers=1)
    assert "expiry sweep failed" in caplog.text
    now[0] += 299
    assert upkeep.run_due() == pytest.approx(1)
    assert fake.calls == Counter(reindex=1, expired=1, leftovers=1)
    now[0] += 1
    upkeep.run_due()
    assert fake.calls == Counter(reindex=1, expired=2, leftovers=1)  # the index: once
    now[0] += 3_600
    upkeep.run_due()
    assert fake.calls == Counter(reindex=1, expired=3, leftovers=2)


def test_the_thread_runs_the_jobs_and_stops() -> None:
    fake = FakeStorage()
    upkeep = Upkeep(cast(FileStore, fake))
    upkeep.start()
    deadline = time.monotonic() + 10
    while fake.calls["leftovers"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    upkeep.stop()
    assert fake.calls == Counter(reindex=1, expired=1, leftovers=1)
    assert upkeep._thread is not None and not upkeep._thread.is_alive()
