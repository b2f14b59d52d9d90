"""A tenant's storage quota in `qbatch serve` (`--max-storage-bytes`, or a tenant's
`max_storage_bytes` in the keys file): the size entries beside the listing index
(`file_index.tally`, pure), the storage's count of them on both backends
(`FileStore.usage`, which mends what an older release or a crash left), and the
upload refusals through the real `openai` SDK against the app in process.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import openai
import pytest

from producer.serve.app import ServeConfig
from producer.serve.auth import KeysError, TenantLimits, parse_keys_document
from producer.serve.file_index import (
    MARKER_KEYS,
    SIZES_DIR,
    IndexEntry,
    SizeEntry,
    Unsure,
    size_key,
    tally,
    tenant_dir,
)
from producer.serve.storage import MEND_PER_COUNT, FileStore
from tests.serve_fixtures import KEY_B, offline_app
from tests.storage_fixtures import Backend, put_bytes, upload_bytes
from tests.unit.test_serve_expiry import sdk_run

LINE = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'


def fid(n: int) -> str:
    return f"file-{n:032x}"


# ---------------------------------------------------------------- the tally, pure


def test_sizes_count_only_beside_a_live_listing_entry() -> None:
    listing = [
        IndexEntry(1, fid(1), "batch").name,  # size 10: counted
        IndexEntry(2, fid(2), "batch").name,  # no size entry: unsure
        IndexEntry(3, fid(3), "batch_output").name,  # two sizes: unsure
        IndexEntry(4, fid(4), "batch").tombstone(100).name,  # removed: its size stale
        ".indexed-v3",
    ]
    sizes = [
        SizeEntry(fid(1), 10).name,
        SizeEntry(fid(3), 5).name,
        SizeEntry(fid(3), 7).name,
        SizeEntry(fid(4), 99).name,
        SizeEntry(fid(5), 3).name,  # no listing entry at all: stale
        "not-a-file.1",
    ]
    found = tally(listing, sizes)
    assert found.bytes == 10
    assert sorted(found.stale) == [SizeEntry(fid(4), 99), SizeEntry(fid(5), 3)]
    assert found.unsure == {
        fid(2): Unsure([IndexEntry(2, fid(2), "batch")], []),
        fid(3): Unsure(
            [IndexEntry(3, fid(3), "batch_output")], [SizeEntry(fid(3), 5), SizeEntry(fid(3), 7)]
        ),
    }
    # two live listing entries (an older release rewrote the file): unsure as well
    doubled = tally([IndexEntry(1, fid(1), "b").name, IndexEntry(9, fid(1), "b").name], sizes)
    assert doubled.bytes == 0 and list(doubled.unsure) == [fid(1)]


def test_size_entry_names() -> None:
    entry = SizeEntry(fid(1), 123_456)
    assert entry.name == f"{fid(1)}.123456" and SizeEntry.parse(entry.name) == entry
    assert size_key("t", entry) == f"{SIZES_DIR}/{tenant_dir('t')}/{entry.name}"
    for bad in (f"{fid(1)}.-1", f"{fid(1)}.1e3", f"{fid(1)}." + "9" * 16, f"{fid(1)}.", "x.1"):
        assert SizeEntry.parse(bad) is None


# ---------------------------------------------------------------- the storage's count


def test_usage_counts_a_tenants_uploads_and_outputs(backend: Backend) -> None:
    storage = backend.storage
    first = upload_bytes(storage, b"{}\n" * 10)  # 30 bytes
    upload_bytes(storage, b"{}\n" * 2)  # 6
    upload_bytes(storage, b"{}\n" * 100, tenant="b")  # another tenant's
    put_bytes(storage, b"{}\n" * 4, file_id=fid(7))  # 12
    assert storage.usage("a") == 48 and storage.usage("b") == 300
    assert storage.usage("nobody") == 0
    assert storage.delete(first, "a")
    assert storage.usage("a") == 18
    put_bytes(storage, b"{}\n" * 9, file_id=fid(7))  # rewritten under its id: 27
    assert storage.usage("a") == 33
    assert backend.size_names("a") == sorted(
        SizeEntry(f.id, f.bytes).name for f in storage.list("a")[0]
    )


def test_usage_mends_what_an_older_release_or_a_crash_left(backend: Backend) -> None:
    storage = backend.storage
    old = upload_bytes(storage, b"{}\n" * 5)  # 15
    doubled = upload_bytes(storage, b"{}\n" * 3)  # 9
    removed = upload_bytes(storage, b"{}\n")  # 3
    # a release before sizes stored `old` (no size entry); a server killed mid-rewrite
    # left `doubled` two; one killed mid-delete left `removed`'s size and nothing else
    backend.set_entry("a", SizeEntry(old, 15).name, present=False, top=SIZES_DIR)
    backend.set_entry("a", SizeEntry(doubled, 4).name, present=True, top=SIZES_DIR)
    stored = storage.get(removed, "a")
    assert stored is not None
    backend.set_entry("a", stored.listing_entry.name, present=False)
    assert storage.usage("a") == 24
    assert backend.size_names("a") == sorted([SizeEntry(old, 15).name, SizeEntry(doubled, 9).name])
    assert storage.usage("a") == 24  # now from the names alone


class Killed(Exception):
    """The server dies here."""


def test_a_server_killed_mid_delete_leaves_nothing_counted(backend: Backend) -> None:
    """Killed after the metadata went, before the listing entry did: the file is gone
    (a retried DELETE is a 404) and its bytes no longer count (helper review, session 18:
    the size entry outlived the metadata and counted until a listing walked past)."""
    storage = backend.storage
    gone = upload_bytes(storage, b"{}\n" * 10)  # 30 bytes
    upload_bytes(storage, b"{}\n" * 2)  # 6
    real_mark = storage._mark

    def mark(key: str) -> None:
        if ".gone" in key:  # the tombstone: the first write after the metadata went
            raise Killed
        real_mark(key)

    storage._mark = mark  # type: ignore[method-assign]
    with pytest.raises(Killed):
        storage.delete(gone, "a")
    del storage._mark  # a restarted server
    assert storage.get(gone, "a") is None and storage.delete(gone, "a") is False
    assert storage.usage("a") == 6


def test_a_reindex_racing_a_delete_does_not_count_the_deleted_file(backend: Backend) -> None:
    """The index reads a document, the tenant deletes that file, then the index writes
    its entries: they are taken back (helper review, session 18)."""
    storage = backend.storage
    victim = upload_bytes(storage, b"{}\n" * 10)  # 30
    upload_bytes(storage, b"{}\n" * 2)  # 6
    real_docs = storage._metadata_docs

    def docs() -> Iterator[tuple[str, str | bytes]]:
        for file_id, raw in real_docs():
            if file_id == victim:
                assert storage.delete(victim, "a")
            yield file_id, raw

    storage._metadata_docs = docs  # type: ignore[method-assign]
    assert storage.reindex(force=True) == 2
    assert storage.get(victim, "a") is None
    assert storage.usage("a") == 6
    assert not any(victim in name for name in backend.size_names("a"))


def test_reindex_writes_the_size_entries(backend: Backend) -> None:
    storage = backend.storage
    ids = [upload_bytes(storage, b"{}\n" * n) for n in (1, 2)]
    backend.drop_index()
    assert backend.size_names("a") == []
    assert backend.reopen().reindex() == 2
    assert backend.size_names("a") == sorted(
        SizeEntry(i, 3 * n).name for i, n in zip(ids, (1, 2), strict=True)
    )


# ---------------------------------------------------------------- through the SDK


def upload(client: openai.AsyncOpenAI, data: bytes) -> Any:
    return client.files.create(file=("in.jsonl", data), purpose="batch")


def test_an_upload_past_the_quota_is_refused_and_nothing_kept(tmp_path: Path) -> None:
    quota = 3 * len(LINE)
    app = offline_app(tmp_path / "files", ServeConfig(max_storage_bytes=quota))

    async def scenario(client: openai.AsyncOpenAI) -> Any:
        one = await upload(client, LINE)
        await upload(client, LINE)
        with pytest.raises(openai.APIStatusError) as late:  # room for one line, not two
            await upload(client, LINE * 2)
        three = await upload(client, LINE)  # exactly full
        with pytest.raises(openai.APIStatusError) as early:  # refused before its body
            await upload(client, LINE)
        listed = [f.id async for f in client.files.list()]
        await client.files.delete(one.id)
        again = await upload(client, LINE)  # deleting made room
        return late.value, early.value, listed, three, again

    late, early, listed, three, again = sdk_run(app, scenario)
    for refused in (late, early):
        assert refused.status_code == 413
        assert refused.body["code"] == "storage_limit_reached"
    assert f"of its {quota} bytes" in early.body["message"]
    # cut where the room ended, as it arrived (a chunked upload was not stopped at all)
    assert f"larger than the {len(LINE)} bytes" in late.body["message"]
    assert len(listed) == 3 and three.id in listed and again.bytes == len(LINE)
    storage = app.state.serve.storage
    assert storage.usage("team-a") == quota
    assert list(storage.tmp.iterdir()) == []  # the refused uploads left nothing


def test_a_tenants_own_quota_overrides_the_servers(tmp_path: Path) -> None:
    limits = {
        "team-a": TenantLimits(max_storage_bytes=0),  # exempt
        "team-b": TenantLimits(max_storage_bytes=len(LINE)),
    }
    app = offline_app(tmp_path / "files", ServeConfig(max_storage_bytes=2 * len(LINE)), limits)

    async def scenario(client: openai.AsyncOpenAI) -> Any:
        for _ in range(3):  # team-a: past the server's quota, its own is none
            await upload(client, LINE)
        b = client.with_options(api_key=KEY_B)
        await upload(b, LINE)
        with pytest.raises(openai.APIStatusError) as refused:
            await upload(b, LINE)
        return refused.value

    assert sdk_run(app, scenario).status_code == 413


def test_a_full_tenant_starts_no_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch's outputs are always stored, so a tenant at its quota may not start one
    (helper review, session 18: batches were taken at 13x the quota). 403, before the
    batch is recorded. (Batches started under the quota may together take it past: the
    check is at creation, their outputs land at the end.)"""
    app = offline_app(tmp_path / "files", ServeConfig(max_storage_bytes=3 * len(LINE)))
    state = app.state.serve
    created: list[str] = []
    # no Redis here: the batch store's create is the one part replaced
    monkeypatch.setattr(state.batches, "create", lambda record, _max: created.append(record.id))

    async def scenario(client: openai.AsyncOpenAI) -> Any:
        f = await upload(client, LINE)
        await client.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        put_bytes(state.storage, LINE * 4, file_id=fid(9), tenant="team-a")  # its output: 5x
        with pytest.raises(openai.PermissionDeniedError) as refused:
            await client.batches.create(
                input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
        return refused.value

    refused = sdk_run(app, scenario)
    assert refused.body["code"] == "storage_limit_reached"
    assert "a batch's output has no room" in refused.body["message"]
    assert len(created) == 1


def test_a_keys_file_may_exempt_a_tenant_from_the_storage_quota() -> None:
    doc = {
        "keys": [{"sha256": "a" * 64, "tenant": "t"}],
        "tenants": {"t": {"max_storage_bytes": 0}, "u": {"max_storage_bytes": 10}},
    }
    ring = parse_keys_document(doc, "keys.yaml")
    assert ring.storage_quota("t", 100) is None
    assert ring.storage_quota("u", 100) == 10
    assert ring.storage_quota("v", 100) == 100 and ring.storage_quota("v", None) is None
    for bad in (-1, 1.5, True, "10"):
        doc["tenants"] = {"t": {"max_storage_bytes": bad}}
        with pytest.raises(KeysError, match="max_storage_bytes"):
            parse_keys_document(doc, "keys.yaml")
    doc["tenants"] = {"t": {"max_upload_bytes": 0}}  # only the quota takes 0
    with pytest.raises(KeysError, match="positive"):
        parse_keys_document(doc, "keys.yaml")


def test_one_count_mends_a_bounded_number_of_files(backend: Backend) -> None:
    """A store just upgraded has no size entries: a count inside an upload request reads
    at most MEND_PER_COUNT files' metadata; the rest count from a later call on (the
    background index writes them meanwhile)."""
    storage = backend.storage
    ids = [upload_bytes(storage, b"{}\n") for _ in range(MEND_PER_COUNT + 8)]
    for file_id in ids:
        backend.set_entry("a", SizeEntry(file_id, 3).name, present=False, top=SIZES_DIR)
    assert storage.usage("a") == 3 * MEND_PER_COUNT
    assert storage.usage("a") == 3 * len(ids)
    assert len(backend.size_names("a")) == len(ids)


def kill_deletes_after_the_metadata(storage: FileStore, ids: list[str]) -> None:
    """Deletes of `ids`, each killed after the metadata went (the tombstone's write)."""
    real_mark = storage._mark

    def mark(key: str) -> None:
        if ".gone" in key:
            raise Killed
        real_mark(key)

    storage._mark = mark  # type: ignore[method-assign]
    for file_id in ids:
        with pytest.raises(Killed):
            storage.delete(file_id, "a")
    del storage._mark


def test_listing_entries_of_gone_files_are_dropped_and_do_not_starve_the_count(
    backend: Backend,
) -> None:
    """Listing entries left by deletes killed half-way are dropped by the count that
    meets them, so files that need mending are reached by the next one (helper review,
    session 18: 32 of them took every count's mending, and files stored by the release
    before size entries counted 0 for ever)."""
    storage = backend.storage
    gone = [upload_bytes(storage, b"{}\n") for _ in range(MEND_PER_COUNT)]
    kill_deletes_after_the_metadata(storage, gone)
    big = [upload_bytes(storage, b"{}\n" * 100) for _ in range(3)]
    for file_id in big:  # stored by a release before size entries
        backend.set_entry("a", SizeEntry(file_id, 300).name, present=False, top=SIZES_DIR)
    storage.usage("a")
    assert storage.usage("a") == 900
    assert sorted(backend.index_names("a")) == sorted(
        f.listing_entry.name for f in storage.list("a")[0]
    )


def test_a_file_rewritten_by_an_older_release_counts_its_new_size(backend: Backend) -> None:
    """An older release rewrites an output under its id and leaves the old listing and
    size entries: two live listing entries make the file unsure, so its metadata says
    (helper review, session 18: it counted the old size, and still after a delete)."""
    storage = backend.storage
    stored = storage.get(upload_bytes(storage, b"{}\n" * 10), "a")
    assert stored is not None
    newer = IndexEntry(stored.created_at + 5, stored.id, stored.purpose)
    backend.set_entry("a", newer.name, present=True)  # what the older release wrote ...
    document = replace(stored, created_at=newer.created_at, bytes=3000).document()
    backend.write_document(stored.id, document.encode())  # ... and its metadata
    assert storage.usage("a") == 3000
    assert backend.index_names("a") == [newer.name]
    assert backend.size_names("a") == [SizeEntry(stored.id, 3000).name]
    assert storage.delete(stored.id, "a") and storage.usage("a") == 0


def test_a_file_stored_between_the_counts_two_walks_is_counted(backend: Backend) -> None:
    """The count reads the sizes, then the listing: a file stored in between has a
    listing entry and no size entry yet, so it is read, not taken for a removed file
    (helper review, session 18: in the other order its size entry was dropped)."""
    storage = backend.storage
    upload_bytes(storage, b"{}\n")
    real_marks = storage._marks
    landed: list[str] = []

    walks: list[str] = []

    def marks(folder: str) -> Iterator[str]:
        walks.append(folder)
        if len(walks) == 2:  # the file lands as the second walk begins
            landed.append(upload_bytes(storage, b"{}\n" * 2))
        yield from real_marks(folder)

    storage._marks = marks  # type: ignore[method-assign]
    assert storage.usage("a") == 9 and len(landed) == 1
    del storage._marks
    assert storage.usage("a") == 9 and len(backend.size_names("a")) == 2


def test_a_reindex_keeps_the_entries_of_a_file_rewritten_meanwhile(backend: Backend) -> None:
    """The index reads a document, the runner rewrites the file with another size: the
    entries of the old one are taken back, the new one's stay; and both index markers
    are written (a rollback to the release before does not index the store again)."""
    storage = backend.storage
    file_id = fid(3)
    put_bytes(storage, b"{}\n", file_id=file_id)
    real_docs = storage._metadata_docs

    def docs() -> Iterator[tuple[str, str | bytes]]:
        for doc_id, raw in real_docs():
            if doc_id == file_id:
                put_bytes(storage, b"{}\n" * 7, file_id=file_id)
            yield doc_id, raw

    storage._metadata_docs = docs  # type: ignore[method-assign]
    storage.reindex(force=True)
    del storage._metadata_docs
    assert backend.size_names("a") == [SizeEntry(file_id, 21).name]
    assert storage.usage("a") == 21
    assert all(storage._marked(key) for key in MARKER_KEYS)


def test_expired_files_count_until_the_sweep_removes_them(backend: Backend) -> None:
    storage = backend.storage
    src = storage.tmp / "brief.jsonl"
    src.write_bytes(b"{}\n" * 5)
    brief = storage.put(src, tenant="a", filename="b", purpose="batch", expires_after_s=3_600)
    later = brief.created_at + 3_600
    assert storage.usage("a") == 15  # due, not swept yet
    assert storage.sweep_expired(later) == 1 and storage.usage("a") == 0


def test_an_upload_that_cannot_fit_is_refused_before_its_body(tmp_path: Path) -> None:
    """With room left, a Content-Length that says the file cannot fit is refused at
    once; the message counts the least the body can hold (its length less the room a
    multipart form takes)."""
    quota = 100_000
    app = offline_app(tmp_path / "files", ServeConfig(max_storage_bytes=quota))

    async def scenario(client: openai.AsyncOpenAI) -> Any:
        await upload(client, LINE)
        with pytest.raises(openai.APIStatusError) as refused:
            await upload(client, LINE * 3_000)  # 240,000 bytes
        return refused.value

    refused = sdk_run(app, scenario)
    assert refused.status_code == 413 and refused.body["code"] == "storage_limit_reached"
    assert f"hold {len(LINE)} of its {quota} bytes" in refused.body["message"]
    assert list((tmp_path / "files" / "tmp").iterdir()) == []
