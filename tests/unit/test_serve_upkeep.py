"""The storage upkeep of `qbatch serve` (`producer.serve.upkeep`): its threads (jobs with
fake actions, synchronised by events, never by sleeps), and the sweeps beside requests
(both backends: one item that cannot be removed stops nothing else; a sweep racing a
rewrite keeps the new bytes)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

import pytest

from producer.serve.file_records import Removed
from producer.serve.storage import LEFTOVER_AGE_S
from producer.serve.upkeep import Job, Upkeep, storage_jobs
from tests.storage_fixtures import Backend, put_bytes, read_all


def test_one_file_that_cannot_be_removed_stops_nothing_else(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    storage, clock = backend.storage, backend.clock
    stuck, *rest = [put_bytes(storage, expires_after_s=3600) for _ in range(3)]
    real_delete = storage.objects.delete

    def delete(key: str) -> None:
        if key == stuck.object:
            raise OSError("permission denied")
        real_delete(key)

    monkeypatch.setattr(storage.objects, "delete", delete)  # the adapter: an I/O edge
    clock.now += 3600
    assert storage.sweep_expired() == 2  # the records all went; one object stayed
    assert "cannot remove expired" in caplog.text
    assert backend.stored_names() == [stuck.object] and storage.usage("a") == 0
    assert all(storage.get(f.id, "a") is None for f in rest)
    monkeypatch.undo()
    storage.records.mark_imported()
    clock.now += LEFTOVER_AGE_S + 60
    assert storage.sweep_orphans() == 1 and backend.stored_names() == []


def test_a_record_that_cannot_be_read_is_logged_and_the_rest_swept(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    storage, clock = backend.storage, backend.clock
    files = [put_bytes(storage, expires_after_s=3600) for _ in range(3)]
    real_get = storage.records.get

    def get(file_id: str) -> Any:
        if file_id == files[1].id:
            raise ConnectionError("redis went away")
        return real_get(file_id)

    monkeypatch.setattr(storage.records, "get", get)
    clock.now += 3600
    assert storage.sweep_expired() == 2
    assert "cannot remove expired" in caplog.text
    monkeypatch.undo()
    assert storage.sweep_expired() == 1 and backend.stored_names() == []


def test_the_expiry_sweep_racing_a_rewrite_keeps_the_new_bytes(backend: Backend) -> None:
    """The sweep read the old record; the runner rewrote the id (a batch finalized again)
    before the sweep's remove: the remove finds other bytes named and leaves them."""
    storage, clock = backend.storage, backend.clock
    old = put_bytes(storage, expires_after_s=3600)
    clock.now += 3600
    new = put_bytes(storage, b"new output\n", file_id=old.id, expires_after_s=3600)
    assert storage.records.remove(old) is Removed.changed
    assert storage.sweep_expired() == 0  # the new one's time has not come
    assert storage.get(old.id, "a") == new and read_all(storage, new) == b"new output\n"
    assert backend.stored_names() == [new.object]


def test_a_sweep_of_thousands_goes_round_by_round(backend: Backend) -> None:
    storage, clock = backend.storage, backend.clock
    if backend.endpoint is not None:
        pytest.skip("the local backend shows it; on moto 1,200 puts take a minute")
    for _ in range(1_200):
        put_bytes(storage, expires_after_s=3600)
    clock.now += 3600
    assert storage.sweep_expired() == 1_200 and storage.usage("a") == 0
    assert backend.stored_names() == []


# ---------------------------------------------------------------- the threads


class Actions:
    """Fake job actions: counted; `fail` names actions that raise once; `import` waits
    for `release`."""

    def __init__(self, fail: set[str] | None = None) -> None:
        self.calls: Counter[str] = Counter()
        self.fail = fail or set()
        self.release = threading.Event()
        self.seen = {name: threading.Event() for name in ("import", "expired", "orphans")}
        self.expired_thrice = threading.Event()
        self.imported = threading.Event()

    def call(self, name: str) -> int:
        self.calls[name] += 1
        self.seen[name].set()
        if name == "expired" and self.calls[name] >= 3:
            self.expired_thrice.set()
        if name in self.fail:
            self.fail.discard(name)
            raise OSError(f"{name} failed")
        return 1

    def do_import(self) -> int:
        self.release.wait(30)
        if self.calls["import"] == 1:  # this call, the second, succeeds
            self.imported.set()
        return self.call("import")

    def jobs(self, expiry_s: float = 0.01) -> list[Job]:
        return [
            Job("import", self.do_import, None, "imported", retry_s=0.01),
            Job("expiry sweep", lambda: self.call("expired"), expiry_s, "expired"),
            Job("leftover sweep", lambda: self.call("orphans"), 60, "orphans"),
        ]


def test_a_long_import_holds_no_sweep_and_a_failure_waits_for_the_next_time(
    caplog: pytest.LogCaptureFixture,
) -> None:
    actions = Actions(fail={"expired", "import"})
    upkeep = Upkeep(actions.jobs())
    upkeep.start()
    assert actions.expired_thrice.wait(10) and actions.seen["orphans"].wait(10)
    assert actions.calls["import"] == 0  # still importing: the sweeps went on beside it
    assert "expiry sweep failed" in caplog.text  # the first; the next ones ran
    actions.release.set()
    assert actions.imported.wait(10)  # failed once, retried after retry_s
    assert "import failed" in caplog.text
    upkeep.stop(timeout=5)
    assert upkeep.alive == [] and actions.calls["import"] == 2  # done: never run again


def test_stop_returns_by_its_timeout_with_a_pass_under_way() -> None:
    actions = Actions()
    upkeep = Upkeep(actions.jobs(expiry_s=60))
    upkeep.start()
    t = time.monotonic()
    upkeep.stop(timeout=0.5)
    assert time.monotonic() - t < 2
    assert upkeep.alive == ["qbatch-serve-upkeep-import"]  # a daemon: dies with the process
    actions.release.set()


def test_the_storage_jobs_run_the_import_and_both_sweeps(backend: Backend) -> None:
    names = [job.name for job in storage_jobs(backend.storage)]
    assert names == ["import", "expiry sweep", "leftover sweep"]
    job = storage_jobs(backend.storage)[0]
    assert not backend.storage.records.imported()
    assert job.run() and backend.storage.records.imported()
