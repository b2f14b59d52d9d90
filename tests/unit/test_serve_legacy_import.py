"""A store written by a release before 2026-12-07 (metadata documents beside the bytes,
empty index entries under `tenants/`, `sizes/`, `expiring/`), imported once into Redis
(`producer.serve.legacy_import`), on both backends. The old layout is written here by
hand, as that release wrote it."""

from __future__ import annotations

import json

from producer.serve.legacy_import import import_legacy
from producer.serve.storage import LEFTOVER_AGE_S
from producer.serve.stored_file import new_file_id
from tests.storage_fixtures import Backend, put_bytes, read_all


def old_file(
    backend: Backend,
    tenant: str,
    data: bytes,
    created_at: int,
    *,
    expires_at: int | None = None,
    with_bytes: bool = True,
) -> str:
    fid = new_file_id()
    doc = {
        "id": fid,
        "bytes": len(data),
        "created_at": created_at,
        "filename": "in.jsonl",
        "purpose": "batch",
        "tenant": tenant,
    }
    if expires_at is not None:
        doc["expires_at"] = expires_at
    if with_bytes:
        backend.write_object(f"files/{fid}.data", data)
    backend.write_object(f"files/{fid}.json", json.dumps(doc).encode())
    backend.write_object(f"tenants/0123abcd/{created_at:012d}.{fid}.batch", b"")
    backend.write_object(f"sizes/0123abcd/{fid}.{len(data)}", b"")
    return fid


def test_an_old_store_is_imported_once_and_its_leftovers_swept(backend: Backend) -> None:
    storage, clock = backend.storage, backend.clock
    now = int(clock.now)
    a1 = old_file(backend, "a", b"{}\n", now - 100)
    a2 = old_file(backend, "a", b"{}\n{}\n", now - 50)
    b1 = old_file(backend, "b", b"{}\n", now - 10)
    brief = old_file(backend, "a", b"{}\n", now - 10, expires_at=now + 60)
    no_bytes = old_file(backend, "a", b"{}\n", now - 5, with_bytes=False)  # deleted half-way
    backend.write_object(f"files/{new_file_id()}.json", b"{damaged")
    backend.write_object("expiring/000000000001.x", b"")
    assert storage.get(a1, "a") is None  # before the import: no record yet

    assert import_legacy(storage) == 4
    assert [f.id for f in storage.list("a")[0]] == [brief, a2, a1]
    assert [f.id for f in storage.list("b")[0]] == [b1]
    stored = storage.get(a2, "a")
    assert stored is not None and read_all(storage, stored) == b"{}\n{}\n"
    assert stored.object == f"files/{a2}.data"  # the bytes stay where they are
    assert storage.usage("a") == 12 and storage.usage("b") == 3
    assert storage.get(no_bytes, "a") is None
    assert not [
        n for n in backend.all_names() if n.split("/")[0] in ("tenants", "sizes", "expiring")
    ]
    assert import_legacy(storage) == 0  # once per prefix

    clock.now += 60
    assert storage.sweep_expired() == 1  # its policy came along
    assert storage.delete(a1, "a") and storage.get(a1, "a") is None

    clock.now += LEFTOVER_AGE_S + 60  # the old documents are nobody's now
    storage.sweep_orphans()
    assert backend.stored_names() == sorted([f"files/{a2}.data", f"files/{b1}.data"])
    assert read_all(storage, stored) == b"{}\n{}\n"


def test_a_forced_import_adds_only_what_is_missing(backend: Backend) -> None:
    storage, clock = backend.storage, backend.clock
    first = old_file(backend, "a", b"{}\n", int(clock.now))
    assert import_legacy(storage) == 1
    kept = storage.get(first, "a")
    rewritten = put_bytes(storage, b"{}\n{}\n", file_id=None)
    assert storage.delete(first, "a")  # deleted since: its document is still there
    late = old_file(backend, "a", b"{}\n", int(clock.now))  # an older replica wrote it since
    assert import_legacy(storage) == 0  # marked: not again unless forced
    assert import_legacy(storage, force=True) == 1
    assert storage.get(late, "a") is not None
    assert storage.get(first, "a") is None and kept is not None  # its bytes went: not revived
    assert storage.get(rewritten.id, "a") == rewritten
