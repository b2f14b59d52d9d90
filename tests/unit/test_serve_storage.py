"""`qbatch serve` file storage: one contract (streamed uploads with a limit, tenants, ids,
layout) run against every backend: the local directory (pure filesystem) and S3 on a
real S3-compatible server (moto's server mode on a loopback port; marked integration).
Plus the `--storage` URL parsing."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, cast

import pytest

from producer.serve.local_store import LocalStorage
from producer.serve.storage import UploadTooLarge, clean_filename, new_file_id
from producer.serve.storage_url import S3Location, StorageError, open_storage, parse_storage_url
from producer.serve.upload import check_jsonl
from tests.s3_fixtures import BUCKET, CREDENTIALS
from tests.storage_fixtures import (  # `backend`: tests/unit/conftest.py
    Backend,
    put_bytes,
    upload_bytes,
)


def test_upload_round_trip_and_tenant_isolation(backend: Backend) -> None:
    storage = backend.storage
    fid = upload_bytes(storage, b'{"a": 1}\n')
    stored = storage.get(fid, "a")
    assert stored is not None and stored.bytes == 9 and stored.purpose == "batch"
    assert b"".join(storage.iter_bytes(stored)) == b'{"a": 1}\n'
    assert backend.stored_names() == [f"{fid}.data", f"{fid}.json"]  # metadata beside it
    assert backend.temp_names() == []  # the spooled upload is gone
    obj = stored.openai()
    assert obj["object"] == "file" and obj["id"] == fid and "tenant" not in obj
    assert storage.get(fid, "b") is None  # another tenant sees nothing
    assert storage.delete(fid, "b") is False and storage.get(fid, "a") is not None
    assert storage.delete(fid, "a") is True and storage.get(fid, "a") is None
    assert backend.stored_names() == []


def test_oversize_upload_stops_at_the_limit_and_leaves_nothing(backend: Backend) -> None:
    storage = backend.storage
    up = storage.begin(10)
    up.write(b"0123456789")
    with pytest.raises(UploadTooLarge):
        up.write(b"x")
    up.discard()
    assert backend.temp_names() == []
    assert storage.list("a") == ([], False)
    assert backend.stored_names() == []


def test_listing_orders_pages_and_filters(backend: Backend) -> None:
    storage = backend.storage
    ids = [upload_bytes(storage, b"{}\n") for _ in range(3)]
    upload_bytes(storage, b"{}\n", tenant="b")
    page, more = storage.list("a", order="asc", limit=2)
    assert len(page) == 2 and {f.id for f in page} <= set(ids)
    assert more is True
    rest, more = storage.list("a", order="asc", after=page[-1].id)
    assert len(rest) == 1 and more is False and rest[0].id not in {f.id for f in page}
    assert {f.id for f in storage.list("a")[0]} == set(ids)
    assert storage.list("a", purpose="batch_output") == ([], False)


def test_listing_reads_only_the_tenants_own_page(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A list call reads the tenant's index and the metadata of its page (plus one to
    tell `has_more`), never the other tenants' files."""
    storage = backend.storage
    for _ in range(12):
        upload_bytes(storage, b"{}\n", tenant="busy")
    mine = [upload_bytes(storage, b"{}\n", tenant="b") for _ in range(4)]
    reads: list[str] = []
    real_load = cast(Any, storage)._load

    def counted(file_id: str) -> Any:
        reads.append(file_id)
        return real_load(file_id)

    def no_scan() -> Any:
        raise AssertionError("a listing scanned every metadata document")

    monkeypatch.setattr(storage, "_load", counted)
    monkeypatch.setattr(storage, "_metadata_docs", no_scan)
    page, more = storage.list("b", limit=2)
    assert more is True and len(page) == 2 and set(reads) <= set(mine) and len(reads) == 3


def test_a_listing_heals_entries_of_files_gone_or_rewritten(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An entry whose metadata vanished (a server killed mid-delete) or whose file was
    rewritten with a new creation time is skipped, dropped, and not counted in has_more."""
    storage = backend.storage
    kept = upload_bytes(storage, b"{}\n")
    gone = upload_bytes(storage, b"{}\n")
    if isinstance(storage, LocalStorage):
        storage.files.joinpath(f"{gone}.json").unlink()
    else:
        key = f"{backend.prefix}files/{gone}.json"
        cast(Any, storage).client.delete_object(Bucket=BUCKET, Key=key)
    fid = "file-" + "ef" * 16
    real_time = time.time
    for offset in (0, 5):  # the second put lands 5 s later: a new entry, the old stale
        monkeypatch.setattr(time, "time", lambda offset=offset: real_time() + offset)
        src = storage.tmp / "o.jsonl"
        src.write_text("{}\n")
        storage.put(src, tenant="a", filename="o.jsonl", purpose="batch_output", file_id=fid)
    monkeypatch.setattr(time, "time", real_time)
    assert sorted(f.id for f in storage.list("a")[0]) == sorted([kept, fid])
    assert storage.list("a", limit=2)[1] is False
    assert len(backend.index_names("a")) == 2  # the two stale entries were dropped
    # the rewrite replaced its own entries; the size entry of the file gone mid-delete
    # is left to the next usage count, which drops it
    assert len(backend.size_names("a")) == 3
    assert storage.usage("a") == 6
    assert backend.size_names("a") == sorted(f"{f}.3" for f in (kept, fid))


def test_a_store_from_before_the_index_is_indexed_once_when_opened(
    backend: Backend, tmp_path: Path
) -> None:
    storage = backend.storage
    ids = [upload_bytes(storage, b"{}\n", tenant=t) for t in ("a", "a", "b")]
    backend.drop_index()
    again = backend.reopen()
    assert again.list("a") == ([], False)  # not indexed yet
    assert again.reindex() == 3
    assert sorted(f.id for f in again.list("a")[0]) == sorted(ids[:2])
    assert [f.id for f in again.list("b")[0]] == [ids[2]]
    assert again.reindex() == 0  # marked: not scanned again
    assert again.reindex(force=True) == 3  # unless forced


def test_tenant_names_never_become_index_paths(backend: Backend) -> None:
    storage = backend.storage
    odd = ["../x", "a/b", "..", "tenant\n2", "ü" * 300]
    ids = {t: upload_bytes(storage, b"{}\n", tenant=t) for t in odd}
    for t in odd:
        assert [f.id for f in storage.list(t)[0]] == [ids[t]]
    assert storage.list("x")[0] == [] and storage.list("a")[0] == []
    assert all(name.startswith("file-") for name in backend.stored_names())


def test_expired_files_are_hidden_then_swept_and_only_they(backend: Backend) -> None:
    storage = backend.storage
    brief = put_bytes(storage, expires_after_s=3600)
    later_file = put_bytes(storage, tenant="b", expires_after_s=7200)
    kept = put_bytes(storage)
    assert brief.expires_at == brief.created_at + 3600
    due = brief.created_at + 3600
    assert storage.sweep_expired(due - 1) == 0 and storage.get(brief.id, "a") is not None
    assert storage.sweep_expired(due) == 1
    assert storage.get(brief.id, "a") is None
    assert [f.id for f in storage.list("a")[0]] == [kept.id]
    assert [f.id for f in storage.list("b")[0]] == [later_file.id]
    assert sorted(backend.stored_names()) == sorted(
        f"{f.id}.{kind}" for f in (later_file, kept) for kind in ("data", "json")
    )


def test_the_sweep_spares_a_file_rewritten_under_the_same_id(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An output file written again (a batch finalized again, here 10 s later) has a new
    time: the old expiry entry is dropped and the new file stays until its own."""
    storage = backend.storage
    fid = "file-" + "ab" * 16
    old = put_bytes(storage, file_id=fid, expires_after_s=3600)
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 10)
    newer = put_bytes(storage, file_id=fid, expires_after_s=3600)
    monkeypatch.setattr(time, "time", real)
    assert newer.expires_at > old.expires_at
    assert storage.sweep_expired(old.expires_at) == 0  # the old entry only
    assert storage.get(fid, "a") == newer  # not due yet
    assert f"{fid}.data" in backend.stored_names()
    assert storage.sweep_expired(newer.expires_at) == 1
    assert backend.stored_names() == []


def test_expiry_is_hidden_from_reads_that_were_due_before_the_sweep(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reading never deletes: a read of an expired file is a 404 and leaves the bytes
    for the sweep (which checks the file again first)."""
    storage = backend.storage
    brief = put_bytes(storage, expires_after_s=3600)
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 3601)
    assert storage.get(brief.id, "a") is None and storage.list("a") == ([], False)
    assert storage.delete(brief.id, "a") is False
    monkeypatch.setattr(time, "time", real)
    assert f"{brief.id}.data" in backend.stored_names()


@pytest.mark.parametrize(
    "doc",
    [
        b'{"id": "FILE", "bytes": 3, "created_at": 1.7e9, "filename": "x", "purpose": "batch", "tenant": "a"}',
        b'{"id": "FILE", "bytes": 3, "created_at": "1700000000", "filename": "x", "purpose": "batch", "tenant": "a"}',
        b'{"id": "FILE", "bytes": 3, "created_at": -5, "filename": "x", "purpose": "batch", "tenant": "a"}',
        b'{"id": "FILE", "bytes": 3, "created_at": 1700000000, "filename": "x", "purpose": "batch", "tenant": "a", "expires_at": "1700003600"}',
        b'{"id": "FILE", "bytes": 3, "created_at": 1700000000, "filename": "x", "purpose": "fine-tune", "tenant": "a"}',
        b'{"id": "file-../../x", "bytes": 3, "created_at": 1700000000, "filename": "x", "purpose": "batch", "tenant": "a"}',
        b'{"id": "FILE", "bytes": true, "created_at": 1700000000, "filename": "x", "purpose": "batch", "tenant": "a"}',
        b'{"id": "FILE", "bytes": 3, "created_at": 1700000000, "filename": ["x"], "purpose": "batch", "tenant": "a"}',
    ],
)
def test_a_malformed_document_is_no_file_and_stops_nothing(backend: Backend, doc: bytes) -> None:
    """A damaged or hand-written metadata document is neither found, listed nor indexed,
    and the store opens, lists, indexes and sweeps around it."""
    storage = backend.storage
    good = put_bytes(storage, expires_after_s=3600)
    bad = "file-" + "cd" * 16
    backend.write_document(bad, doc.replace(b"FILE", bad.encode()))
    assert storage.get(bad, "a") is None
    backend.drop_index()
    again = backend.reopen()
    assert again.reindex() == 1
    assert [f.id for f in again.list("a")[0]] == [good.id]
    assert again.sweep_expired(good.created_at + 3600) == 1


def test_a_document_that_is_not_utf8_is_no_file(backend: Backend) -> None:
    storage = backend.storage
    good = put_bytes(storage)
    bad = put_bytes(storage)
    backend.write_document(bad.id, b'\xff{"id": 1}')
    assert storage.get(bad.id, "a") is None
    assert [f.id for f in storage.list("a")[0]] == [good.id]
    assert storage.reindex(force=True) == 1


def test_a_store_with_policies_but_no_expiry_entries_is_swept_after_reindex(
    backend: Backend,
) -> None:
    """Files written before the expiry index (or by a release without it) get their
    entries from the (re)index, so the sweep still comes to them."""
    storage = backend.storage
    brief = put_bytes(storage, expires_after_s=3600)
    backend.drop_index()
    again = backend.reopen()
    assert again.sweep_expired(brief.created_at + 3600) == 0  # no entry: not seen
    assert again.reindex() == 1
    assert again.sweep_expired(brief.created_at + 3600) == 1
    assert backend.stored_names() == []


def test_paging_goes_on_after_the_files_of_the_last_page_were_deleted(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The SDK's clean-up loop: list a page, delete its files, ask for the page after
    the last (deleted) id. A removed file's entry stays a day as a tombstone."""
    storage = backend.storage
    real = time.time
    ids = []
    for n in range(5):  # one a second, so the order is known
        monkeypatch.setattr(time, "time", lambda n=n: real() + n)
        ids.append(put_bytes(storage).id)
    seen: list[str] = []
    after = None
    while True:
        page, more = storage.list("a", limit=2, after=after, order="asc")
        seen += [f.id for f in page]
        for f in page:
            assert storage.delete(f.id, "a")
        if not more:
            break
        after = page[-1].id
    assert seen == ids and storage.list("a") == ([], False)
    names = backend.index_names("a")
    assert len(names) == 5 and all(".gone" in n for n in names)
    monkeypatch.setattr(time, "time", lambda: real() + 86_400 + 10)
    assert storage.list("a") == ([], False)
    assert backend.index_names("a") == []  # tombstones older than a day are dropped


def test_a_delete_racing_a_rewrite_of_the_same_id_keeps_the_new_file(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another replica's runner writes an output file again (same id) while this one
    deletes it: the new metadata, entry and bytes all stay. (Within one process the
    store's per-file lock keeps the two apart.)"""
    storage, replica = backend.storage, backend.reopen()
    fid = "file-" + "ef" * 16
    put_bytes(storage, file_id=fid)
    real_unlink = cast(Any, storage)._unlink
    rewritten: list[Any] = []

    def unlink(file_id: str, kind: str) -> None:
        real_unlink(file_id, kind)
        if kind == "json" and not rewritten:
            rewritten.append(put_bytes(replica, file_id=fid))  # lands between metadata and bytes

    monkeypatch.setattr(storage, "_unlink", unlink)
    assert storage.delete(fid, "a")
    new = storage.get(fid, "a")
    assert new is not None and new == rewritten[0]
    assert b"".join(storage.iter_bytes(new)) == b"{}\n"
    assert [f.id for f in storage.list("a")[0]] == [fid]


def test_documents_without_a_policy_read_as_a_release_before_expiry_wrote_them(
    backend: Backend,
) -> None:
    """No `expires_at` key without a policy (an older release, during a rolling update
    or after a rollback, builds its file object from exactly the keys it knows)."""
    storage = backend.storage
    plain = put_bytes(storage)
    if backend.endpoint is None:
        assert isinstance(storage, LocalStorage)
        doc = json.loads(storage.files.joinpath(f"{plain.id}.json").read_text())
    else:
        key = f"{backend.prefix}files/{plain.id}.json"
        body = cast(Any, storage).client.get_object(Bucket=BUCKET, Key=key)["Body"]
        doc = json.loads(body.read())
    assert set(doc) == {"id", "bytes", "created_at", "filename", "purpose", "tenant"}


def test_ids_that_are_not_file_ids_are_never_paths(backend: Backend) -> None:
    storage = backend.storage
    for bad in ("../etc/passwd", "file-../../x", "file-ABC", ""):
        assert storage.get(bad, "a") is None
    assert new_file_id().startswith("file-")
    put = storage.tmp / "out.jsonl"
    put.write_text("{}\n")
    with pytest.raises(ValueError):
        storage.put(put, tenant="a", filename="o", purpose="batch_output", file_id="../x")


def test_put_with_a_given_id_rewrites_the_same_file(backend: Backend) -> None:
    storage = backend.storage
    fid = "file-" + "ab" * 16
    for text in ("first\n", "second\n"):
        src = storage.tmp / "o.jsonl"
        src.write_text(text)
        storage.put(src, tenant="a", filename="o.jsonl", purpose="batch_output", file_id=fid)
        assert not src.exists()  # moved in
    stored = storage.get(fid, "a")
    assert stored is not None and b"".join(storage.iter_bytes(stored)) == b"second\n"
    assert len(storage.list("a")[0]) == 1


def test_large_file_streams_in_and_out_in_blocks(backend: Backend) -> None:
    """Past boto3's 8 MiB multipart threshold; read back in blocks and as a local copy."""
    storage = backend.storage
    data = bytes(range(256)) * (9 * 4096)  # 9 MiB
    up = storage.begin(10 * 1024 * 1024)
    for start in range(0, len(data), 1 << 20):
        up.write(data[start : start + (1 << 20)])
    stored = storage.commit(up, tenant="a", filename="big.jsonl", purpose="batch")
    assert stored.bytes == len(data)
    blocks = list(storage.iter_bytes(stored, block=1 << 20))
    assert len(blocks) >= 9 and b"".join(blocks) == data
    with storage.local_copy(stored) as path:
        assert path.read_bytes() == data
    assert path.exists() == isinstance(storage, LocalStorage)  # a download is removed
    assert backend.temp_names() == []


def test_metadata_that_is_not_a_file_reads_as_missing(backend: Backend) -> None:
    """A stray or damaged metadata document is neither listed nor found."""
    storage = backend.storage
    fid = upload_bytes(storage, b"{}\n")
    src = storage.tmp / "x.jsonl"
    src.write_text("{}\n")
    other = "file-" + "cd" * 16
    storage.put(src, tenant="a", filename="x", purpose="batch", file_id=other)
    if isinstance(storage, LocalStorage):
        storage.files.joinpath(f"{other}.json").write_text('{"id": 1}')
    else:
        key = f"{backend.prefix}files/{other}.json"
        cast(Any, storage).client.put_object(Bucket=BUCKET, Key=key, Body=b"[not json")
    assert storage.get(other, "a") is None
    assert [f.id for f in storage.list("a")[0]] == [fid]


@pytest.mark.integration
def test_s3_storage_refuses_a_bucket_that_is_not_there(
    s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(StorageError, match="no-such-bucket"):
        open_storage("s3://no-such-bucket/x", s3_endpoint_url=s3_endpoint)


# ------------------------------------------------------------ --storage URLs


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("qbatch-files", Path("qbatch-files")),
        ("/data/qbatch", Path("/data/qbatch")),
        ("file:///data/qbatch", Path("/data/qbatch")),
        ("file://localhost/data/with%20space", Path("/data/with space")),
        ("s3://bucket", S3Location("bucket", "")),
        ("s3://my.bucket-1/", S3Location("my.bucket-1", "")),
        ("s3://bucket/a/b", S3Location("bucket", "a/b/")),
        ("S3://bucket//a/b//", S3Location("bucket", "a/b/")),
    ],
)
def test_storage_urls(value: str, expected: Any) -> None:
    assert parse_storage_url(value) == expected


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("", "empty"),
        ("  ", "empty"),
        ("s3://", "bucket"),
        ("s3://Bad_Bucket/x", "bucket"),
        ("s3://ab/x", "bucket"),
        ("s3://a..b/x", "bucket"),
        ("s3://bucket/p?versionId=1", "query"),
        ("gs://bucket/p", "gs://"),
        ("http://minio:9000/bucket", "http://"),
        ("file://otherhost/x", "host"),
        ("file://", "no path"),
    ],
)
def test_bad_storage_urls(value: str, problem: str) -> None:
    with pytest.raises(StorageError, match=problem):
        parse_storage_url(value)


def test_a_path_opens_a_local_directory(tmp_path: Path) -> None:
    storage = open_storage(f"file://{tmp_path}/files")
    assert isinstance(storage, LocalStorage) and storage.root == tmp_path / "files"
    assert (tmp_path / "files" / "tmp").is_dir()


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (b'{"a": 1}\n\n{"b": 2}\n', None),
        (b"a,b\n1,2\n", "line 1 is not JSON"),
        (b'{"a": 1}\n[1]\n', "line 2 is not a JSON object"),
        (b'{"a": "\xff"}\n', "line 1 is not UTF-8"),
        (b"\n\n", "no lines"),
        (b'\xef\xbb\xbf{"a": 1}\n', None),  # a byte-order mark (Windows tools) is skipped
        (b'{"a": 1}\n\xef\xbb\xbf{"b": 2}\n', "line 2 is not JSON"),  # only at the start
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
