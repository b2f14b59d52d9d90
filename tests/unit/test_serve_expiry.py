"""Expiration policies in `qbatch serve`: `expires_after` on an upload and
`output_expires_after` on a batch (`producer.serve.expiry`), driven through the real
`openai` SDK against the app in process (no Kafka or Redis: every request here is
answered before either would be reached). An expired file is a 404, is not listed, and
its bytes are removed by the sweep (reads never delete).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest

import producer.serve.storage
import producer.serve.stored_file
from producer.serve.errors import ApiError
from producer.serve.expiry import MAX_SECONDS, MIN_SECONDS, form_policy, policy_seconds
from producer.serve.local_store import LocalStorage
from tests.serve_fixtures import KEY_A, offline_app

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


def later(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """The storage's clock moved on by `seconds` (only its own modules' `time`)."""
    real = time.time
    moved = SimpleNamespace(time=lambda: real() + seconds)
    for module in (producer.serve.storage, producer.serve.stored_file):
        monkeypatch.setattr(module, "time", moved)


def test_an_upload_expires_after_its_policy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = offline_app(tmp_path / "files")

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
    data = tmp_path / "files" / "files" / f"{brief.id}.data"
    assert data.exists()

    later(monkeypatch, 3601)

    async def after(client: openai.AsyncOpenAI) -> Any:
        listed = [f.id async for f in client.files.list()]
        with pytest.raises(openai.NotFoundError):
            await client.files.retrieve(brief.id)
        with pytest.raises(openai.NotFoundError):
            await client.files.content(brief.id)
        return listed

    assert sdk_run(app, after) == [kept.id]
    assert data.exists()  # hidden; reads never delete
    monkeypatch.undo()
    assert app.state.serve.storage.sweep_expired(brief.expires_at) == 1
    assert not data.exists()


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
    assert list((tmp_path / "files" / "files").iterdir()) == []
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


def test_the_sweep_removes_every_tenants_expired_files_and_only_those(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path)

    def put(tenant: str, expires_after_s: int | None) -> str:
        src = store.tmp / "x.jsonl"
        src.write_bytes(LINE)
        return store.put(
            src, tenant=tenant, filename="x", purpose="batch", expires_after_s=expires_after_s
        ).id

    gone = [put("a", 3600), put("b", 3600)]
    kept = [put("a", None), put("b", 7200)]
    assert store.sweep_expired(time.time() + 10) == 0
    assert store.sweep_expired(time.time() + 3700) == 2
    names = {p.name for p in store.files.iterdir()}
    assert not any(fid in name for fid in gone for name in names)
    assert all(f"{fid}.data" in names for fid in kept)
    assert [f.id for f in store.list("a")[0]] == [kept[0]]
