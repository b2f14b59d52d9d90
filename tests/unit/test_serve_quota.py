"""A tenant's storage quota in `qbatch serve` (`--max-storage-bytes`, or a tenant's
`max_storage_bytes` in the keys file): the storage's count of a tenant's bytes on both
backends (`FileStore.usage`, kept in Redis beside the records), its check at commit,
atomic with the record (`FileStore.commit(..., quota=)`), and the refusals through the
real `openai` SDK against the app in process.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import openai
import pytest

from producer.serve.app import ServeConfig
from producer.serve.auth import KeysError, TenantLimits, parse_keys_document
from producer.serve.storage import FileStore, StorageFull
from tests.serve_fixtures import KEY_B, offline_app
from tests.storage_fixtures import Backend, put_bytes, upload_bytes
from tests.unit.test_serve_expiry import sdk_run
from worker.failpoints import FailpointError, armed

LINE = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'


def fid(n: int) -> str:
    return f"file-{n:032x}"


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
    assert storage.usage("a") == sum(f.bytes for f in storage.list("a")[0])


def test_a_server_killed_mid_delete_leaves_nothing_counted(backend: Backend) -> None:
    """Killed after the record went, before its bytes did (the `serve_delete_bytes`
    failpoint): the file is gone (a retried DELETE is a 404) and its bytes no longer
    count; what is left is an object no record names (the orphan sweep's)."""
    storage = backend.storage
    gone = upload_bytes(storage, b"{}\n" * 10)  # 30 bytes
    upload_bytes(storage, b"{}\n" * 2)  # 6
    stored = storage.get(gone, "a")
    assert stored is not None
    with armed(f"serve_delete_bytes={gone}"), pytest.raises(FailpointError):
        storage.delete(gone, "a")
    assert storage.get(gone, "a") is None and storage.delete(gone, "a") is False
    assert storage.usage("a") == 6
    assert stored.object in backend.stored_names()  # left for the orphan sweep


def test_expired_files_count_until_the_sweep_removes_them(backend: Backend) -> None:
    storage = backend.storage
    brief = put_bytes(storage, b"{}\n" * 5, expires_after_s=3_600)
    backend.clock.now = brief.created_at + 3_600
    assert storage.get(brief.id, "a") is None  # expired: gone to its tenant ...
    assert storage.usage("a") == 15  # ... but counted until swept
    assert storage.sweep_expired() == 1 and storage.usage("a") == 0


def test_the_quota_is_checked_at_commit_atomically_with_the_record(backend: Backend) -> None:
    """Two uploads received side by side, each fitting alone: the one committed second
    is refused (StorageFull) and nothing of it is kept (no object, no record, no temp
    file, the count unchanged)."""
    storage = backend.storage
    quota = 50
    first, second = storage.begin(1_000), storage.begin(1_000)
    first.write(b"{}\n" * 10)  # 30 bytes
    second.write(b"{}\n" * 8)  # 24: fits alone, not beside the first
    kept = storage.commit(first, tenant="a", filename="1.jsonl", purpose="batch", quota=quota)
    with pytest.raises(StorageFull) as full:
        storage.commit(second, tenant="a", filename="2.jsonl", purpose="batch", quota=quota)
    assert full.value.used == 30
    assert storage.usage("a") == 30
    assert [f.id for f in storage.list("a")[0]] == [kept.id]
    assert backend.stored_names() == [kept.object]
    assert len(backend.records("a")) == 1
    assert backend.temp_names() == []
    # without a quota (a batch's output is always stored) it fits
    third = storage.begin(1_000)
    third.write(b"{}\n" * 8)
    storage.commit(third, tenant="a", filename="3.jsonl", purpose="batch")
    assert storage.usage("a") == 54


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
    storage: FileStore = app.state.serve.storage
    assert storage.usage("team-a") == quota
    # the refused uploads left nothing: no object, no record, no temp file
    files = storage.list("team-a")[0]
    assert sorted(f.object for f in files) == sorted(k for k, _ in storage.objects.listing(""))
    assert len(files) == 3
    assert list(storage.tmp.iterdir()) == []


def test_two_uploads_that_fit_alone_but_not_together_the_second_committed_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both pass the check before their bodies (nothing stored yet); the first's bytes
    are held on their way to the store while the second lands, so the first's record is
    the one that would take the tenant past its quota: a 413 storage_limit_reached, and
    its bytes are not kept."""
    quota = 3 * len(LINE)
    app = offline_app(tmp_path / "files", ServeConfig(max_storage_bytes=quota))
    storage: FileStore = app.state.serve.storage
    real_put = storage.objects.put
    entered, release = threading.Event(), threading.Event()
    calls: list[str] = []

    def held_put(key: str, src: Path) -> None:
        calls.append(key)
        if len(calls) == 1:  # the first upload's bytes wait until the test lets them
            entered.set()
            release.wait(10)
        real_put(key, src)

    monkeypatch.setattr(storage.objects, "put", held_put)

    async def scenario(client: openai.AsyncOpenAI) -> Any:
        first = asyncio.create_task(upload(client, LINE * 2))
        assert await asyncio.to_thread(entered.wait, 10)
        try:
            second = await asyncio.wait_for(upload(client, LINE * 2), 10)
        finally:
            release.set()
        with pytest.raises(openai.APIStatusError) as refused:
            await asyncio.wait_for(first, 10)
        return second, refused.value

    second, refused = sdk_run(app, scenario)
    assert refused.status_code == 413 and refused.body["code"] == "storage_limit_reached"
    assert f"hold {2 * len(LINE)} of its {quota} bytes" in refused.body["message"]
    assert second.bytes == 2 * len(LINE)
    assert storage.usage("team-a") == 2 * len(LINE)
    kept = storage.list("team-a")[0]
    assert [f.id for f in kept] == [second.id]
    assert [k for k, _ in storage.objects.listing("files/")] == [kept[0].object]
    assert calls[1] == kept[0].object  # the refused one's bytes, at calls[0]: removed
    assert list(storage.tmp.iterdir()) == []


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
    storage = app.state.serve.storage
    assert storage.usage("team-a") == 3 * len(LINE) and storage.usage("team-b") == len(LINE)


def test_a_full_tenant_starts_no_batch(tmp_path: Path) -> None:
    """A batch's outputs are always stored, so a tenant at its quota may not start one
    (helper review, session 18: batches were taken at 13x the quota). 403, before the
    batch is recorded. (Batches started under the quota may together take it past: the
    check is at creation, their outputs land at the end.)"""
    app = offline_app(tmp_path / "files", ServeConfig(max_storage_bytes=3 * len(LINE)))
    state = app.state.serve

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
        return refused.value, [b.id async for b in client.batches.list()]

    refused, batches = sdk_run(app, scenario)
    assert refused.body["code"] == "storage_limit_reached"
    assert "a batch's output has no room" in refused.body["message"]
    assert len(batches) == 1


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
    assert app.state.serve.storage.usage("team-a") == len(LINE)
