"""`qbatch serve` file storage: one contract (streamed uploads with a limit, tenants, ids,
listing with OpenAI's cursor, rewrites, deletes, crashes, byte ranges) run against both
backends: a local directory with records in fakeredis, and S3 on a real S3-compatible
server (moto's server mode) with records in the real Redis (marked integration). Plus
the `--storage` URL parsing."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from producer.serve.file_records import TOMBSTONE_TTL_S, StorageFull
from producer.serve.lease import LeaseLost
from producer.serve.storage import LEFTOVER_AGE_S, UploadTooLarge
from producer.serve.storage_location import CloudLocation, StorageError, parse_storage_url
from producer.serve.storage_url import open_storage
from producer.serve.stored_file import clean_filename, new_file_id
from producer.serve.upload import check_jsonl
from tests.benchmarks.bench_serve_storage import CountedRedis
from tests.s3_fixtures import CREDENTIALS
from tests.storage_fixtures import (  # `backend`: tests/unit/conftest.py
    Backend,
    fake_redis,
    new_lease,
    put_bytes,
    read_all,
    upload_bytes,
)
from worker.failpoints import FailpointError, armed


def test_upload_round_trip_and_tenant_isolation(backend: Backend) -> None:
    storage = backend.storage
    data = b'{"a": 1}\n{"b": 2}\n'
    fid = upload_bytes(storage, data, tenant="a")
    stored = storage.get(fid, "a")
    assert stored is not None and stored.bytes == len(data) and stored.purpose == "batch"
    assert read_all(storage, stored) == data
    assert storage.get(fid, "b") is None and not storage.delete(fid, "b")
    assert storage.list("b") == ([], False)
    assert storage.usage("a") == len(data) and storage.usage("b") == 0
    assert backend.stored_names() == [stored.object] and backend.temp_names() == []
    assert storage.delete(fid, "a") and storage.get(fid, "a") is None
    assert backend.stored_names() == [] and storage.usage("a") == 0
    assert not storage.delete(fid, "a")


def test_oversize_upload_stops_at_the_limit_and_leaves_nothing(backend: Backend) -> None:
    up = backend.storage.begin(10)
    up.write(b"0123456789")
    with pytest.raises(UploadTooLarge):
        up.write(b"x")
    up.discard()
    assert backend.stored_names() == [] and backend.temp_names() == []


def uploads_a_second_apart(backend: Backend, n: int) -> list[str]:
    ids = []
    for _ in range(n):
        ids.append(upload_bytes(backend.storage, b"{}\n"))
        backend.clock.now += 1
    return ids


def test_listing_orders_pages_and_filters(backend: Backend) -> None:
    storage = backend.storage
    ids = uploads_a_second_apart(backend, 5)
    out = put_bytes(storage).id
    page, more = storage.list("a", limit=3)
    assert [f.id for f in page] == [out, *ids[::-1][:2]] and more
    page, more = storage.list("a", after=page[-1].id, limit=3)
    assert [f.id for f in page] == ids[::-1][2:5] and not more
    assert [f.id for f in storage.list("a", order="asc")[0]] == [*ids, out]
    assert [f.id for f in storage.list("a", purpose="batch_output")[0]] == [out]
    assert [f.id for f in storage.list("a", purpose="batch", after=ids[2])[0]] == ids[:2][::-1]
    assert storage.list("a", after="file-" + "0" * 32) == ([], False)  # not a file of the tenant
    assert storage.list("b", after=ids[0]) == ([], False)  # another tenant's id tells nothing


def test_files_of_one_second_page_by_id(backend: Backend) -> None:
    """An output file and an error file often share their second: the cursor is the
    (time, id) pair, so a page boundary between them loses and repeats nothing."""
    storage = backend.storage
    ids = sorted(upload_bytes(storage, b"{}\n") for _ in range(7))
    seen, after = [], None
    while True:
        page, more = storage.list("a", limit=2, after=after, order="asc")
        seen += [f.id for f in page]
        if not more:
            break
        after = page[-1].id
    assert seen == ids


def test_paging_goes_on_after_the_files_of_the_last_page_were_deleted(backend: Backend) -> None:
    """The SDK's clean-up loop deletes a page, then asks for the page after its last id."""
    storage = backend.storage
    ids = uploads_a_second_apart(backend, 5)
    page, _ = storage.list("a", limit=2)
    for f in page:
        assert storage.delete(f.id, "a")
    rest, more = storage.list("a", after=page[-1].id, limit=2)
    assert [f.id for f in rest] == ids[::-1][2:4] and more
    assert storage.list("b", after=page[-1].id) == ([], False)  # its tombstone is a's only
    backend.lease.redis.delete(backend.lease.keys.serve_file_gone(page[-1].id))  # a day later
    assert storage.list("a", after=page[-1].id) == ([], False)
    assert TOMBSTONE_TTL_S == 86_400


def test_expired_files_are_hidden_then_swept_and_only_they(backend: Backend) -> None:
    storage, clock = backend.storage, backend.clock
    brief = put_bytes(storage, expires_after_s=3600)
    kept = put_bytes(storage, expires_after_s=7200)
    forever = put_bytes(storage)
    assert storage.sweep_expired() == 0
    clock.now += 3600
    assert storage.get(brief.id, "a") is None  # hidden at once; reads never delete
    assert [f.id for f in storage.list("a")[0]] == sorted([kept.id, forever.id], reverse=True)
    assert brief.object in backend.stored_names()
    assert storage.usage("a") == 9  # counted until the sweep removes it
    assert storage.sweep_expired() == 1
    assert brief.object not in backend.stored_names() and storage.usage("a") == 6
    assert storage.get(kept.id, "a") is not None and storage.get(forever.id, "a") is not None


def test_the_sweep_spares_a_file_rewritten_under_the_same_id(backend: Backend) -> None:
    storage, clock = backend.storage, backend.clock
    first = put_bytes(storage, expires_after_s=3600)
    clock.now += 3000
    again = put_bytes(storage, b"{}\n{}\n", file_id=first.id, expires_after_s=3600)
    clock.now += 700  # the first write's time has come, the second's not
    assert storage.sweep_expired() == 0
    assert read_all(storage, again) == b"{}\n{}\n"
    assert backend.stored_names() == [again.object]
    clock.now += 3000
    assert storage.sweep_expired() == 1 and backend.stored_names() == []


def test_put_with_a_given_id_rewrites_the_same_file(backend: Backend) -> None:
    storage = backend.storage
    first = put_bytes(storage, b"{}\n")
    second = put_bytes(storage, b"{}\n{}\n{}\n", file_id=first.id)
    assert second.object != first.object
    assert [f.id for f in storage.list("a")[0]] == [first.id]
    assert storage.usage("a") == 9 and backend.stored_names() == [second.object]
    with pytest.raises(ValueError, match="another tenant"):
        put_bytes(storage, file_id=first.id, tenant="b")
    assert storage.usage("b") == 0 and backend.stored_names() == [second.object]


def test_a_delete_racing_a_rewrite_of_the_same_id_keeps_the_new_file(backend: Backend) -> None:
    """The delete read the first version; the rewrite landed before its record went: the
    delete removes the new version's record and bytes as one (never a record without
    bytes), and the rewrite's replaced bytes are gone too."""
    storage = backend.storage
    first = put_bytes(storage)
    second = put_bytes(storage, b"{}\n{}\n", file_id=first.id)
    from producer.serve.file_records import Removed

    assert storage.records.remove(first) is Removed.changed  # names bytes no longer its
    assert storage.get(first.id, "a") == second and read_all(storage, second) == b"{}\n{}\n"
    assert storage.delete(first.id, "a")
    assert backend.stored_names() == [] and storage.usage("a") == 0


def test_a_crash_between_bytes_and_record_leaves_an_orphan_the_sweep_removes(
    backend: Backend,
) -> None:
    storage, clock = backend.storage, backend.clock
    storage.records.mark_imported()
    with armed("serve_put_record"), pytest.raises(FailpointError):
        put_bytes(storage)
    assert storage.list("a") == ([], False) and storage.usage("a") == 0
    (orphan,) = backend.stored_names()
    kept = put_bytes(storage)
    assert storage.sweep_orphans() == 0  # not a day old: may be an upload under way
    clock.now += LEFTOVER_AGE_S + 60
    assert storage.sweep_orphans() == 1
    assert backend.stored_names() == [kept.object] and orphan != kept.object


def test_a_crash_mid_delete_leaves_only_bytes_which_the_sweep_removes(backend: Backend) -> None:
    storage, clock = backend.storage, backend.clock
    storage.records.mark_imported()
    stored = put_bytes(storage)
    with armed(f"serve_delete_bytes={stored.id}"), pytest.raises(FailpointError):
        storage.delete(stored.id, "a")
    assert storage.get(stored.id, "a") is None and storage.usage("a") == 0
    assert backend.stored_names() == [stored.object]
    clock.now += LEFTOVER_AGE_S + 60
    assert storage.sweep_orphans() == 1 and backend.stored_names() == []


def test_old_temp_files_are_swept_and_foreign_objects_left(backend: Backend) -> None:
    storage, clock = backend.storage, backend.clock
    storage.records.mark_imported()
    up = storage.begin(100)
    up.write(b"{}\n")
    up.close()  # an upload a killed server left in tmp
    backend.write_object("files/notes.txt", b"someone else's")
    backend.write_object("elsewhere/file-" + "a" * 32 + ".0123456789abcdef", b"x")
    clock.now += LEFTOVER_AGE_S + 60
    assert storage.sweep_orphans() == 1
    assert backend.temp_names() == [] and backend.stored_names() == ["files/notes.txt"]


def test_the_orphan_sweep_waits_for_the_import(backend: Backend) -> None:
    """Before an old store's metadata is imported its files have no records yet."""
    backend.write_object("files/file-" + "b" * 32 + ".data", b"{}\n")
    backend.clock.now += LEFTOVER_AGE_S + 60
    assert backend.storage.sweep_orphans() == 0 and len(backend.stored_names()) == 1


def test_quota_is_checked_with_the_record_and_nothing_refused_is_kept(backend: Backend) -> None:
    storage = backend.storage
    put_bytes(storage, b"{}\n" * 3, quota=10)
    with pytest.raises(StorageFull) as caught:
        put_bytes(storage, b"{}\n" * 2, quota=10)
    assert caught.value.used == 9 and storage.usage("a") == 9
    assert len(backend.stored_names()) == 1 and backend.temp_names() == []
    put_bytes(storage, b"{", quota=10)  # exactly full
    assert storage.usage("a") == 10


def test_byte_ranges_stream_only_their_bytes(backend: Backend) -> None:
    storage = backend.storage
    data = bytes(range(256)) * 1024
    src = storage.tmp / "big"
    src.write_bytes(data)
    stored = storage.put(src, tenant="a", filename="big", purpose="batch_output")
    assert not src.exists()
    assert read_all(storage, stored) == data
    assert b"".join(storage.iter_bytes(stored, 1000, 70_000)) == data[1000:70_000]
    assert b"".join(storage.iter_bytes(stored, 262_000)) == data[262_000:]


def test_ids_that_are_not_file_ids_are_never_keys(backend: Backend) -> None:
    storage = backend.storage
    upload_bytes(storage, b"{}\n")
    calls: Counter[str] = Counter()
    real = storage.records.redis
    storage.records.redis = CountedRedis(real, calls)
    for purpose in ("x" * 100_000, "Batch", "batch:a", "../x", ""):  # never a key name
        assert storage.list("a", purpose=purpose) == ([], False)
    assert calls["redis"] == 0  # refused before any round trip
    assert len(storage.list("a", purpose="batch")[0]) == 1
    for bad in ("../x", "file-../../x", "file-ZZ", "", "file-" + "a" * 65, "a\nb"):
        assert storage.get(bad, "a") is None and not storage.delete(bad, "a")
        assert storage.list("a", after=bad) == ([], False)


def test_a_damaged_record_is_no_file(backend: Backend) -> None:
    storage = backend.storage
    fid = new_file_id()
    backend.lease.redis.hset(
        backend.lease.keys.serve_file(fid), mapping={"id": fid, "bytes": "x", "tenant": "a"}
    )
    assert storage.get(fid, "a") is None and not storage.delete(fid, "a")


def test_a_server_that_lost_its_lease_changes_nothing(backend: Backend) -> None:
    storage = backend.storage
    stored = put_bytes(storage)
    redis, keys = backend.lease.redis, backend.lease.keys
    redis.set(keys.serve_lease(), "999:another-server")
    with pytest.raises(LeaseLost):
        put_bytes(storage)
    with pytest.raises(LeaseLost):
        storage.delete(stored.id, "a")
    assert storage.get(stored.id, "a") == stored and storage.usage("a") == 3


def test_tenant_names_never_meet_in_keys() -> None:
    lease = new_lease(fake_redis())
    keys = lease.keys
    assert keys.serve_tenant_files("a") != keys.serve_tenant_files("a", "batch")
    assert keys.serve_tenant_files("a") != keys.serve_tenant_batches("a")


@pytest.mark.integration
def test_cloud_storage_refuses_a_bucket_that_is_not_there(
    s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(StorageError, match="no-such-bucket"):
        open_storage("s3://no-such-bucket/x", new_lease(fake_redis()), s3_endpoint_url=s3_endpoint)


# ------------------------------------------------------------ --storage URLs


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("qbatch-files", Path("qbatch-files")),
        ("/data/qbatch", Path("/data/qbatch")),
        ("file:///data/qbatch", Path("/data/qbatch")),
        ("file://localhost/data/with%20space", Path("/data/with space")),
        ("s3://bucket", CloudLocation("s3", "bucket", "")),
        ("s3://my.bucket-1/", CloudLocation("s3", "my.bucket-1", "")),
        ("s3://bucket/a/b", CloudLocation("s3", "bucket", "a/b/")),
        ("S3://bucket/a/b/", CloudLocation("s3", "bucket", "a/b/")),
        ("gs://bucket/p", CloudLocation("gs", "bucket", "p/")),
        ("az://container/p/q", CloudLocation("az", "container", "p/q/")),
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
        ("s3://bucket/a//b", "empty"),
        ("s3://bucket/a/../b", "'..'"),
        ("http://minio:9000/bucket", "http://"),
        ("file://otherhost/x", "host"),
        ("file://", "no path"),
    ],
)
def test_bad_storage_urls(value: str, problem: str) -> None:
    with pytest.raises(StorageError, match=problem):
        parse_storage_url(value)


def test_a_path_opens_a_local_directory(tmp_path: Path) -> None:
    storage = open_storage(f"file://{tmp_path}/files", new_lease(fake_redis()))
    assert storage.objects.where == f"{tmp_path}/files"
    assert (tmp_path / "files" / "tmp").is_dir()
    stored = put_bytes(storage)
    assert (tmp_path / "files" / stored.object).read_bytes() == b"{}\n"


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
