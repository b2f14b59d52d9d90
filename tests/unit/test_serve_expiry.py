"""Expiration policies in `qbatch serve`: `expires_after` on an upload and
`output_expires_after` on a batch (`producer.serve.expiry`), driven through the real
`openai` SDK against the app in process (its Redis fakeredis, no Kafka: every request
here is answered before Kafka would be reached). The store's time is a `Clock` the test
moves. An expired file is a 404, is not listed, and its bytes are removed by the sweep
(reads never delete).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from producer.serve.errors import ApiError
from producer.serve.expiry import MAX_SECONDS, MIN_SECONDS, form_policy, policy_seconds
from producer.serve.storage import FileStore
from tests.serve_fixtures import KEY_A, offline_app
from tests.storage_fixtures import Backend, Clock, put_bytes

LINE = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'


# ---------------------------------------------------------------- the policy, pure


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (None, None),
        ({"anchor": "created_at", "seconds": MIN_SECONDS}, MIN_SECONDS),
        ({"anchor": "created_at", "seconds": MAX_SECONDS}, MAX_SECONDS),
        ({"anchor": "created_at", "seconds": "7200"}, 7200),  # a form's text
    ],
)
def test_policies_taken(value: Any, seconds: int | None) -> None:
    assert policy_seconds(value, "expires_after") == seconds


@pytest.mark.parametrize(
    ("value", "param"),
    [
        ("3600", "expires_after"),
        ([3600], "expires_after"),
        ({"seconds": 3600}, "expires_after.anchor"),
        ({"anchor": "last_active_at", "seconds": 3600}, "expires_after.anchor"),
        ({"anchor": "created_at"}, "expires_after.seconds"),
        ({"anchor": "created_at", "seconds": MIN_SECONDS - 1}, "expires_after.seconds"),
        ({"anchor": "created_at", "seconds": MAX_SECONDS + 1}, "expires_after.seconds"),
        ({"anchor": "created_at", "seconds": 3600.5}, "expires_after.seconds"),
        ({"anchor": "created_at", "seconds": True}, "expires_after.seconds"),
        ({"anchor": "created_at", "seconds": "-3600"}, "expires_after.seconds"),
        ({"anchor": "created_at", "seconds": "9" * 400}, "expires_after.seconds"),
        ({"anchor": "created_at", "seconds": "\u00b2"}, "expires_after.seconds"),  # isdigit()
        ({"anchor": "created_at", "seconds": "\u0663\u0666\u0660\u0660"}, "expires_after.seconds"),
        ({"anchor": "created_at", "seconds": 3600, "x": 1}, "expires_after.x"),
    ],
)
def test_policies_refused_name_their_part(value: Any, param: str) -> None:
    with pytest.raises(ApiError) as caught:
        policy_seconds(value, "expires_after")
    assert caught.value.status == 400 and caught.value.param == param


def test_a_form_policy_is_read_from_its_flattened_fields() -> None:
    fields = {
        "purpose": "batch",
        "expires_after[anchor]": "created_at",
        "expires_after[seconds]": "3600",
    }
    assert form_policy(fields, "expires_after") == {"anchor": "created_at", "seconds": "3600"}
    assert form_policy({"purpose": "batch"}, "expires_after") is None
    with pytest.raises(ApiError):
        form_policy({"expires_after": "3600"}, "expires_after")


# ---------------------------------------------------------------- through the SDK


def sdk_run(app: Any, scenario: Callable[[openai.AsyncOpenAI], Coroutine[Any, Any, Any]]) -> Any:
    async def go() -> Any:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t/v1") as http:
            client = openai.AsyncOpenAI(
                api_key=KEY_A, base_url="http://t/v1", http_client=http, max_retries=0
            )
            return await scenario(client)

    return asyncio.run(go())


def object_names(storage: FileStore) -> list[str]:
    """The object keys under `files/`, seen from outside the store."""
    return sorted(key for key, _ in storage.objects.listing("files/"))


def test_an_upload_expires_after_its_policy(tmp_path: Path) -> None:
    clock = Clock()
    app = offline_app(tmp_path / "files", clock=clock)
    storage: FileStore = app.state.serve.storage

    async def upload(client: openai.AsyncOpenAI) -> Any:
        kept = await client.files.create(file=("keep.jsonl", LINE), purpose="batch")
        brief = await client.files.create(
            file=("brief.jsonl", LINE),
            purpose="batch",
            expires_after={"anchor": "created_at", "seconds": 3600},
        )
        return kept, brief, await client.files.retrieve(brief.id)

    kept, brief, seen = sdk_run(app, upload)
    assert kept.expires_at is None
    assert brief.expires_at == brief.created_at + 3600 and seen.expires_at == brief.expires_at
    record = storage.records.get(brief.id)
    assert record is not None and record.object in object_names(storage)

    clock.now = brief.expires_at  # due from its expires_at on

    async def after(client: openai.AsyncOpenAI) -> Any:
        listed = [f.id async for f in client.files.list()]
        with pytest.raises(openai.NotFoundError):
            await client.files.retrieve(brief.id)
        with pytest.raises(openai.NotFoundError):
            await client.files.content(brief.id)
        with pytest.raises(openai.NotFoundError):
            await client.files.delete(brief.id)
        return listed

    assert sdk_run(app, after) == [kept.id]
    assert storage.records.get(brief.id) == record  # hidden; reads never delete
    assert record.object in object_names(storage)
    assert storage.sweep_expired() == 1
    assert storage.records.get(brief.id) is None
    assert record.object not in object_names(storage)
    assert storage.records.get(kept.id) is not None and len(object_names(storage)) == 1


def test_a_bad_upload_policy_is_a_400_and_nothing_is_kept(tmp_path: Path) -> None:
    app = offline_app(tmp_path / "files")

    async def upload(client: openai.AsyncOpenAI) -> Any:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.files.create(
                file=("x.jsonl", LINE),
                purpose="batch",
                expires_after={"anchor": "created_at", "seconds": 60},
            )
        return caught.value, [f async for f in client.files.list()]

    error, listed = sdk_run(app, upload)
    assert error.body["param"] == "expires_after.seconds" and listed == []
    storage: FileStore = app.state.serve.storage
    assert object_names(storage) == [] and storage.usage("team-a") == 0
    assert list((tmp_path / "files" / "tmp").iterdir()) == []


def test_a_bad_output_policy_refuses_the_batch(tmp_path: Path) -> None:
    app = offline_app(tmp_path / "files")

    async def create(client: openai.AsyncOpenAI) -> Any:
        up = await client.files.create(file=("in.jsonl", LINE), purpose="batch")
        with pytest.raises(openai.BadRequestError) as caught:
            await client.batches.create(
                input_file_id=up.id,
                endpoint="/v1/chat/completions",
                completion_window="24h",
                output_expires_after={"anchor": "created_at", "seconds": MAX_SECONDS + 1},
            )
        return caught.value

    assert sdk_run(app, create).body["param"] == "output_expires_after.seconds"


def test_a_batch_whose_input_expires_within_its_window_is_refused(tmp_path: Path) -> None:
    """Its input would vanish while it runs (a restarted runner reads it again)."""
    app = offline_app(tmp_path / "files")

    async def create(client: openai.AsyncOpenAI) -> Any:
        up = await client.files.create(
            file=("in.jsonl", LINE),
            purpose="batch",
            expires_after={"anchor": "created_at", "seconds": 3600},
        )
        with pytest.raises(openai.BadRequestError) as caught:
            await client.batches.create(
                input_file_id=up.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
        return caught.value

    error = sdk_run(app, create)
    assert error.body["code"] == "invalid_input_file" and "expires" in error.body["message"]


# ---------------------------------------------------------------- the sweep


def test_the_sweep_removes_every_tenants_expired_files_and_only_those(backend: Backend) -> None:
    store, clock = backend.storage, backend.clock
    start = clock.now
    gone = [put_bytes(store, LINE, tenant=t, expires_after_s=3600) for t in ("a", "b")]
    kept = [
        put_bytes(store, LINE, tenant="a"),
        put_bytes(store, LINE, tenant="b", expires_after_s=7200),
    ]
    clock.now = start + 10
    assert store.sweep_expired() == 0
    clock.now = start + 3700
    assert store.sweep_expired() == 2
    assert backend.stored_names() == sorted(f.object for f in kept)
    assert all(store.records.get(f.id) is None for f in gone)
    assert [f.id for f in store.list("a")[0]] == [kept[0].id]
    assert [f.id for f in store.list("b")[0]] == [kept[1].id]
