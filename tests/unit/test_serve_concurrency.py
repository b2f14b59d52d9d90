"""What one slow request must not hold up in `qbatch serve`.

Sync chat/completions requests wait on the event loop, holding no thread
(`producer.serve.result_wait`), admitted by `producer.serve.sync.SyncSlots`: past
`max_sync_inflight` a request is a 429 at once, and files, batches and `/healthz` are
served while every sync slot is taken. With a share per tenant
(`max_sync_inflight_per_tenant`), one key's burst leaves slots to the others.

Before, a sync request held a thread of the one shared pool while it waited (up to an
hour): as many slow requests as the pool had threads stopped every route, `/healthz`
included. Here the queue's answer is replaced by a wait on an event (no Kafka or Redis),
and the shared pool is cut to 2 threads, fewer than the 3 sync requests held.

An upload's commit to storage (an S3 upload of up to 200 MiB) runs off the event loop.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import anyio.to_thread
import httpx
import pytest

import producer.serve.app
from producer.serve.app import ServeConfig
from producer.serve.storage import FileStore
from producer.serve.sync import SyncSlots
from tests.serve_fixtures import KEY_A, KEY_B, offline_app

A = {"authorization": f"Bearer {KEY_A}"}
B = {"authorization": f"Bearer {KEY_B}"}
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


class Held:
    """Sync answers that wait until the test releases them (`entered` counts arrivals)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Semaphore(0)

    async def __call__(self, *_args: Any) -> tuple[int, bytes]:
        """Waits on the event loop, as the real wait does (the fake polls its event)."""
        self.entered.release()
        for _ in range(3000):
            if self.release.is_set():
                break
            await asyncio.sleep(0.01)
        return 200, b'{"object": "chat.completion"}'


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> Held:
    """`run_sync` replaced by a `Held` (no Kafka or Redis)."""
    answers = Held()
    monkeypatch.setattr(producer.serve.app, "run_sync", answers)
    return answers


def test_sync_requests_have_their_own_slots_and_a_429_past_them(tmp_path: Path, held: Held) -> None:
    release, entered = held.release, held.entered
    app = offline_app(tmp_path / "files", ServeConfig(max_sync_inflight=3))

    async def scenario() -> dict[str, Any]:
        anyio.to_thread.current_default_thread_limiter().total_tokens = 2
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            held = [
                asyncio.create_task(client.post("/v1/chat/completions", json=BODY, headers=A))
                for _ in range(3)
            ]
            for _ in range(3):  # all three are waiting on their threads
                assert await asyncio.to_thread(entered.acquire, True, 10)
            out: dict[str, Any] = {}
            try:
                out["fourth"] = await asyncio.wait_for(
                    client.post("/v1/completions", json={"model": "m", "prompt": "x"}, headers=B),
                    10,
                )
                out["healthz"] = await asyncio.wait_for(client.get("/healthz"), 10)
                out["files"] = await asyncio.wait_for(client.get("/v1/files", headers=B), 10)
                out["batch"] = await asyncio.wait_for(
                    client.get("/v1/batches/batch_nope", headers=B), 10
                )
            finally:
                release.set()
            out["held"] = await asyncio.wait_for(asyncio.gather(*held), 10)
            out["after"] = await asyncio.wait_for(client.get("/healthz"), 10)
            return out

    out = asyncio.run(scenario())
    fourth = out["fourth"]
    assert fourth.status_code == 429, fourth.text
    assert fourth.json()["error"]["code"] == "rate_limit_exceeded"
    assert "--max-sync-inflight" in fourth.json()["error"]["message"]
    assert out["healthz"].status_code == 200
    assert out["files"].status_code == 200 and out["files"].json()["data"] == []
    assert out["batch"].status_code == 404
    assert [r.status_code for r in out["held"]] == [200, 200, 200]
    assert out["after"].status_code == 200


def test_one_tenant_cannot_take_every_sync_slot(tmp_path: Path, held: Held) -> None:
    release, entered = held.release, held.entered
    config = ServeConfig(max_sync_inflight=4, max_sync_inflight_per_tenant=2)
    app = offline_app(tmp_path / "files", config)

    async def scenario() -> dict[str, Any]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            post = client.post
            held = [asyncio.create_task(post("/v1/chat/completions", json=BODY, headers=A))]
            held.append(asyncio.create_task(post("/v1/chat/completions", json=BODY, headers=A)))
            for _ in range(2):
                assert await asyncio.to_thread(entered.acquire, True, 10)
            out: dict[str, Any] = {}
            try:
                out["third_a"] = await asyncio.wait_for(
                    post("/v1/chat/completions", json=BODY, headers=A), 10
                )
                held.append(asyncio.create_task(post("/v1/chat/completions", json=BODY, headers=B)))
                assert await asyncio.to_thread(entered.acquire, True, 10)
            finally:
                release.set()
            out["held"] = await asyncio.wait_for(asyncio.gather(*held), 10)
            out["after_a"] = await asyncio.wait_for(
                post("/v1/chat/completions", json=BODY, headers=A), 10
            )
            return out

    out = asyncio.run(scenario())
    third = out["third_a"]
    assert third.status_code == 429, third.text
    assert third.json()["error"]["code"] == "rate_limit_exceeded"
    assert "--max-sync-inflight-per-tenant" in third.json()["error"]["message"]
    assert [r.status_code for r in out["held"]] == [200, 200, 200]  # B got a slot
    assert out["after_a"].status_code == 200  # A's slots came back


def test_a_share_that_is_not_positive_is_the_whole_limit() -> None:
    assert [SyncSlots(4, share).per_tenant for share in (None, 0, -1, 2, 9)] == [4, 4, 4, 2, 4]


class SlowPut:
    """The store's object writes wait until the test lets them (an S3 upload in
    progress)."""

    def __init__(self, storage: FileStore) -> None:
        self.real = storage.objects.put
        self.placing = threading.Event()
        self.release = threading.Event()
        self.placed = False

    def __call__(self, key: str, src: Path) -> None:
        self.placing.set()
        self.release.wait(5)  # on the event loop (the old way) this froze every request
        self.placed = True
        self.real(key, src)


def test_an_upload_commit_does_not_stop_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = offline_app(tmp_path / "files")
    storage: FileStore = app.state.serve.storage
    store = SlowPut(storage)
    monkeypatch.setattr(storage.objects, "put", store)

    async def scenario() -> tuple[httpx.Response, bool, httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            upload = asyncio.create_task(
                http.post(
                    "/v1/files",
                    headers=A,
                    files={"file": ("a.jsonl", b'{"x": 1}\n')},
                    data={"purpose": "batch"},
                )
            )
            try:
                assert await asyncio.to_thread(store.placing.wait, 10)
                healthz = await asyncio.wait_for(http.get("/healthz"), 10)
                answered_during_commit = not store.placed
            finally:
                store.release.set()
            return healthz, answered_during_commit, await asyncio.wait_for(upload, 10)

    healthz, during, uploaded = asyncio.run(scenario())
    assert healthz.status_code == 200 and during  # answered while the commit still ran
    assert uploaded.status_code == 200 and uploaded.json()["purpose"] == "batch"
    assert storage.get(uploaded.json()["id"], "team-a") is not None
