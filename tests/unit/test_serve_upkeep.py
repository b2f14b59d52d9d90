"""The storage upkeep of `qbatch serve` (`producer.serve.upkeep`): its schedule on an
injected clock, and what the leftover sweep removes (`file_index.orphan_ids`, pure;
`FileStore.sweep_leftovers` on both backends)."""

from __future__ import annotations

import errno
import os
import shutil
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, cast

import pytest

from producer.serve.file_index import orphan_ids
from producer.serve.keyed_locks import KeyedLocks
from producer.serve.local_store import LocalStorage
from producer.serve.storage import LEFTOVER_AGE_S, FileStore, StoredFile
from producer.serve.upkeep import Upkeep
from tests.s3_fixtures import BUCKET
from tests.storage_fixtures import Backend, put_bytes, upload_bytes


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
    assert list(orphan_ids(objects, before=100.0)) == [(fid(2), 10.0), (fid(5), 10.0)]
    assert list(orphan_ids([], before=100.0)) == []


def test_keyed_locks_exclude_one_key_only_and_forget_it() -> None:
    locks = KeyedLocks()
    inside: list[str] = []

    def enter(key: str) -> None:
        with locks.hold(key):
            inside.append(key)

    with locks.hold("a"):
        other = threading.Thread(target=enter, args=("b",))
        other.start()
        other.join(5)
        assert inside == ["b"]  # another key is free
        same = threading.Thread(target=enter, args=("a",))
        same.start()
        same.join(0.2)
        assert inside == ["b"] and same.is_alive()  # the same key waits
    same.join(5)
    assert inside == ["b", "a"] and len(locks) == 0  # nothing kept once released


# ---------------------------------------------------------------- the sweep, both backends


def drop_metadata(backend: Backend, file_id: str) -> None:
    """What a server killed between a file's two objects (or in a delete) leaves."""
    if backend.endpoint is None:
        assert isinstance(backend.storage, LocalStorage)
        backend.storage.files.joinpath(f"{file_id}.json").unlink()
    else:
        key = f"{backend.prefix}files/{file_id}.json"
        cast(Any, backend.storage).client.delete_object(Bucket=BUCKET, Key=key)


DAY_AGO = time.time() - LEFTOVER_AGE_S - 3_600


def aged(path: Path) -> Path:
    os.utime(path, (DAY_AGO, DAY_AGO))
    return path


def test_the_leftover_sweep_removes_old_orphans_and_temp_files_only(backend: Backend) -> None:
    storage = backend.storage
    kept = upload_bytes(storage, b"{}\n")
    orphan = upload_bytes(storage, b"{}\n")
    drop_metadata(backend, orphan)
    stale_tmp = storage.tmp / "upload-killed"
    fresh_tmp = storage.tmp / "upload-now"
    for path, text in ((stale_tmp, b"half an upload"), (fresh_tmp, b"an upload under way")):
        path.write_bytes(text)
    aged(stale_tmp)

    assert storage.sweep_leftovers() == 1  # the old temp file; the orphan is too recent
    assert not stale_tmp.exists() and fresh_tmp.exists()
    assert f"{orphan}.data" in backend.stored_names()

    later = time.time() + LEFTOVER_AGE_S + 60
    fresh_tmp.unlink()
    assert storage.sweep_leftovers(now=later) == 0  # seen once: a suspect
    assert f"{orphan}.data" in backend.stored_names()
    assert storage.sweep_leftovers(now=later + 3_600) == 1  # seen so twice: gone
    assert backend.stored_names() == [f"{kept}.data", f"{kept}.json"]
    assert storage.get(kept, "a") is not None


def test_a_file_restored_with_old_times_keeps_its_bytes(tmp_path: Path) -> None:
    """`cp -p`/`rsync -a` copies `.data` before `.json` (name order), with the backup's
    times; a sweep between the two sees a day-old orphan (helper review, session 18)."""
    backup = LocalStorage(tmp_path / "backup")
    f = put_bytes(backup, b"{}\n")
    for path in backup.files.iterdir():
        aged(path)
    live = LocalStorage(tmp_path / "live")
    shutil.copy2(backup.files / f"{f.id}.data", live.files)
    live.sweep_leftovers()
    shutil.copy2(backup.files / f"{f.id}.json", live.files)
    live.sweep_leftovers()
    assert live.get(f.id, "a") is not None and (live.files / f"{f.id}.data").exists()


def test_one_item_that_cannot_be_removed_stops_nothing_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An NFS silly-renamed temp file (unlink: EBUSY) and an orphan whose check fails (an
    S3 503) are logged and left; every other leftover goes (helper review, session 18)."""
    store = LocalStorage(tmp_path)
    busy = store.tmp / ".nfs0000000001"
    for path in [busy] + [store.tmp / f"upload-{i}" for i in range(5)]:
        path.write_bytes(b"x")
        aged(path)
    orphans = [put_bytes(store, b"{}\n").id for _ in range(2)]
    for orphan in orphans:
        store.files.joinpath(f"{orphan}.json").unlink()
        aged(store.files / f"{orphan}.data")
    real_unlink, real_read = Path.unlink, store._read_meta

    def unlink(self: Path, missing_ok: bool = False) -> None:
        if self.name.startswith(".nfs"):
            raise OSError(errno.EBUSY, "Device or resource busy", str(self))
        real_unlink(self, missing_ok=missing_ok)

    def read_meta(file_id: str) -> bytes | None:
        if file_id == orphans[0]:
            raise OSError(errno.EIO, "transient")
        return real_read(file_id)

    monkeypatch.setattr(Path, "unlink", unlink)
    monkeypatch.setattr(store, "_read_meta", read_meta)
    assert store.sweep_leftovers() == 5  # the temp files; the orphans are suspects
    assert sorted(p.name for p in store.tmp.iterdir()) == [busy.name]
    assert store.sweep_leftovers() == 1  # the orphan that could be checked
    assert sorted(p.name for p in store.files.iterdir()) == [f"{orphans[0]}.data"]
    monkeypatch.setattr(store, "_read_meta", real_read)
    assert store.sweep_leftovers() == 1  # still a suspect: removed once it can be checked


def test_the_expiry_sweep_racing_a_rewrite_keeps_the_new_bytes(tmp_path: Path) -> None:
    """The runner rewrites an expired output under its id while the upkeep thread sweeps
    it: the sweep waits for the rewrite and then leaves the new file (helper review,
    session 18: it deleted the new bytes of a listed file)."""
    store = LocalStorage(tmp_path)
    file_id = fid(7)
    first = put_bytes(store, b"old\n", file_id=file_id, expires_after_s=3_600)
    placed, swept = threading.Event(), []

    def place(src: Path, stored: StoredFile) -> None:
        os.replace(src, store._data(stored.id))  # the data in place ...
        placed.set()
        time.sleep(0.3)  # ... the sweep runs now, on its thread ...
        meta = store.tmp / ".meta-test"  # ... then the metadata, as _place writes it
        meta.write_text(stored.document())
        os.replace(meta, store._meta(stored.id))

    store._place = place  # type: ignore[method-assign]
    sweeper = threading.Thread(
        target=lambda: placed.wait(5) and swept.append(store.sweep_expired(first.expires_at))
    )
    sweeper.start()
    again = put_bytes(store, b"new output\n", file_id=file_id)
    sweeper.join(5)
    assert swept == [0] and store.get(file_id, "a") == again
    assert store._data(file_id).read_bytes() == b"new output\n"


# ---------------------------------------------------------------- the threads


class FakeStorage:
    """Counts the upkeep's calls; `fail` names calls that raise once; the index waits
    for `release`."""

    def __init__(self, fail: set[str] | None = None) -> None:
        self.calls: Counter[str] = Counter()
        self.fail = fail or set()
        self.release = threading.Event()

    def _call(self, name: str) -> int:
        self.calls[name] += 1
        if name in self.fail:
            self.fail.discard(name)
            raise OSError(f"{name} failed")
        return 1

    def reindex(self, *, force: bool = False) -> int:
        self.release.wait(30)
        return self._call("reindex")

    def sweep_expired(self) -> int:
        return self._call("expired")

    def sweep_leftovers(self) -> int:
        return self._call("leftovers")


def test_a_long_index_holds_no_sweep_and_a_failure_waits_for_the_next_time(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake = FakeStorage(fail={"expired"})
    upkeep = Upkeep(cast(FileStore, fake), expiry_interval_s=0.05, leftover_interval_s=60)
    upkeep.start()
    deadline = time.monotonic() + 10
    while fake.calls["expired"] < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fake.calls["expired"] >= 3 and fake.calls["leftovers"] == 1
    assert fake.calls["reindex"] == 0  # still indexing: the sweeps went on beside it
    assert "expiry sweep failed" in caplog.text  # the first; the next ones ran
    fake.release.set()
    t = time.monotonic()
    upkeep.stop(timeout=5)
    assert time.monotonic() - t < 5 and upkeep.alive == []
    assert fake.calls["reindex"] == 1


def test_stop_returns_by_its_timeout_with_a_pass_under_way() -> None:
    fake = FakeStorage()
    upkeep = Upkeep(cast(FileStore, fake))
    upkeep.start()
    t = time.monotonic()
    upkeep.stop(timeout=0.5)
    assert time.monotonic() - t < 2
    assert upkeep.alive == ["qbatch-serve-upkeep-index"]  # a daemon: dies with the process
    fake.release.set()
