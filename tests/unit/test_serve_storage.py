"""`qbatch serve` local file storage: streamed uploads with a limit, tenants, ids. Pure
filesystem."""

from __future__ import annotations

from pathlib import Path

import pytest

from producer.serve.storage import (
    LocalStorage,
    UploadTooLarge,
    check_jsonl,
    clean_filename,
    new_file_id,
)


def _upload(storage: LocalStorage, data: bytes, tenant: str = "a", limit: int = 1_000) -> str:
    up = storage.begin(limit)
    for start in range(0, len(data), 7):
        up.write(data[start : start + 7])
    return storage.commit(up, tenant=tenant, filename="in.jsonl", purpose="batch").id


def test_upload_round_trip_and_tenant_isolation(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    fid = _upload(storage, b'{"a": 1}\n')
    stored = storage.get(fid, "a")
    assert stored is not None and stored.bytes == 9 and stored.purpose == "batch"
    assert b"".join(storage.iter_bytes(stored)) == b'{"a": 1}\n'
    obj = stored.openai()
    assert obj["object"] == "file" and obj["id"] == fid and "tenant" not in obj
    assert storage.get(fid, "b") is None  # another tenant sees nothing
    assert storage.delete(fid, "b") is False and storage.get(fid, "a") is not None
    assert storage.delete(fid, "a") is True and storage.get(fid, "a") is None
    assert list(tmp_path.joinpath("files").iterdir()) == []


def test_oversize_upload_stops_at_the_limit_and_leaves_nothing(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    up = storage.begin(10)
    up.write(b"0123456789")
    with pytest.raises(UploadTooLarge):
        up.write(b"x")
    up.discard()
    assert list(tmp_path.joinpath("tmp").iterdir()) == []
    assert storage.list("a") == ([], False)


def test_listing_orders_pages_and_filters(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    ids = [_upload(storage, b"{}\n") for _ in range(3)]
    _upload(storage, b"{}\n", tenant="b")
    page, more = storage.list("a", order="asc", limit=2)
    assert len(page) == 2 and {f.id for f in page} <= set(ids)
    assert more is True
    rest, more = storage.list("a", order="asc", after=page[-1].id)
    assert len(rest) == 1 and more is False and rest[0].id not in {f.id for f in page}
    assert {f.id for f in storage.list("a")[0]} == set(ids)
    assert storage.list("a", purpose="batch_output") == ([], False)


def test_ids_that_are_not_file_ids_are_never_paths(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    for bad in ("../etc/passwd", "file-../../x", "file-ABC", ""):
        assert storage.get(bad, "a") is None
    assert new_file_id().startswith("file-")
    put = tmp_path / "out.jsonl"
    put.write_text("{}\n")
    with pytest.raises(ValueError):
        storage.put(put, tenant="a", filename="o", purpose="batch_output", file_id="../x")


def test_put_with_a_given_id_rewrites_the_same_file(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    fid = "file-" + "ab" * 16
    for text in ("first\n", "second\n"):
        src = tmp_path / "tmp" / "o.jsonl"
        src.write_text(text)
        storage.put(src, tenant="a", filename="o.jsonl", purpose="batch_output", file_id=fid)
    stored = storage.get(fid, "a")
    assert stored is not None and b"".join(storage.iter_bytes(stored)) == b"second\n"
    assert len(storage.list("a")[0]) == 1


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (b'{"a": 1}\n\n{"b": 2}\n', None),
        (b"a,b\n1,2\n", "line 1 is not JSON"),
        (b'{"a": 1}\n[1]\n', "line 2 is not a JSON object"),
        (b'{"a": "\xff"}\n', "line 1 is not UTF-8"),
        (b"\n\n", "no lines"),
    ],
)
def test_jsonl_check(tmp_path: Path, data: bytes, problem: str | None) -> None:
    path = tmp_path / "f"
    path.write_bytes(data)
    found = check_jsonl(path)
    assert found is None if problem is None else (found is not None and problem in found)


def test_filenames_lose_their_directories() -> None:
    assert clean_filename("../../etc/passwd") == "passwd"
    assert clean_filename("C:\\x\\in.jsonl") == "in.jsonl"
    assert clean_filename(None) == "upload.jsonl"
