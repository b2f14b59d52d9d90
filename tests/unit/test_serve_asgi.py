"""The real `qbatch serve` app driven as ASGI, in process: what it reads and who it lets in.

Body ceilings (`producer.serve.bodies`): no whole body past its route's ceiling is read.
The app's `receive` counts what the server pulled, so the test sees how much of an
oversized body was read, not just the status: before the ceiling, `/login` (no key
needed) buffered a body of any size and only then compared it to 4 KiB. And `/metrics`
behind its own token when one is set. The app's Kafka is never reached (the client
connects lazily and every request here is answered before it would); its Redis is
fakeredis.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest

from producer.serve.bodies import BATCH_BODY_BYTES, SYNC_BODY_BYTES
from producer.serve.page import MAX_FORM_BYTES
from tests.serve_fixtures import KEY_A, offline_app

KEY = KEY_A
CHUNK = 64 * 1024
FLOOD = 256 * 1024 * 1024  # what a client offers; far more than any route may read


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return offline_app(tmp_path_factory.mktemp("files"))


class Result:
    def __init__(self) -> None:
        self.status = 0
        self.body = b""
        self.read = 0
        """Request-body bytes the app pulled through `receive`."""

    def json(self) -> Any:
        return json.loads(self.body)


def call(
    app: Any,
    path: str,
    chunks: Iterator[bytes],
    headers: dict[str, str],
    method: str = "POST",
) -> Result:
    out = Result()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        "client": ("127.0.0.1", 5000),
        "server": ("testserver", 80),
    }

    async def receive() -> dict[str, Any]:
        chunk = next(chunks, None)
        if chunk is None:
            return {"type": "http.request", "body": b"", "more_body": False}
        out.read += len(chunk)
        return {"type": "http.request", "body": chunk, "more_body": True}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            out.status = message["status"]
        elif message["type"] == "http.response.body":
            out.body += message.get("body", b"")

    asyncio.run(app(scope, receive, send))
    return out


def flood(total: int = FLOOD) -> Iterator[bytes]:
    block = b"a" * CHUNK
    for _ in range(total // CHUNK):
        yield block


AUTH = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
ROUTES = [
    ("/login", {"content-type": "application/x-www-form-urlencoded"}, MAX_FORM_BYTES),
    ("/v1/batches", AUTH, BATCH_BODY_BYTES),
    ("/v1/chat/completions", AUTH, SYNC_BODY_BYTES),
    ("/v1/completions", AUTH, SYNC_BODY_BYTES),
]


@pytest.mark.parametrize(("path", "headers", "limit"), ROUTES)
def test_a_chunked_flood_is_refused_once_past_the_limit(
    app: Any, path: str, headers: dict[str, str], limit: int
) -> None:
    result = call(app, path, flood(), headers)
    assert result.status == 413, result.body
    error = result.json()["error"]
    assert error["code"] == "request_too_large" and str(limit) in error["message"]
    assert limit < result.read <= limit + CHUNK  # stopped at the limit, not at 256 MiB


@pytest.mark.parametrize(("path", "headers", "limit"), ROUTES)
def test_a_declared_length_over_the_limit_is_refused_unread(
    app: Any, path: str, headers: dict[str, str], limit: int
) -> None:
    declared = {**headers, "content-length": str(limit + 1)}
    result = call(app, path, flood(limit + CHUNK), declared)
    assert result.status == 413 and result.read == 0


def test_the_key_is_checked_before_any_body_is_read(app: Any) -> None:
    result = call(app, "/v1/batches", flood(), {"authorization": "Bearer wrong"})
    assert result.status == 401 and result.read == 0


def test_a_body_under_the_limit_is_still_read_and_judged(app: Any) -> None:
    not_json = call(app, "/v1/batches", iter([b"{nope"]), AUTH)
    assert not_json.status == 400 and not_json.json()["error"]["code"] == "invalid_json"
    bad_utf8 = call(app, "/v1/chat/completions", iter([b'{"a": "\xff"}']), AUTH)
    assert bad_utf8.status == 400 and bad_utf8.json()["error"]["code"] == "invalid_json"
    login = call(app, "/login", iter([b"key=wrong"]), ROUTES[0][1])
    assert login.status == 401
    missing = call(app, "/v1/batches", iter([b'{"endpoint": "/v1/chat/completions"}']), AUTH)
    assert missing.status == 400 and missing.json()["error"]["param"] == "input_file_id"


def test_a_batch_body_with_the_largest_metadata_fits_its_ceiling(app: Any) -> None:
    metadata = {f"k{i:02d}": "x" * 500 for i in range(16)}  # OpenAI's 16 pairs, at 512 chars
    body = json.dumps(
        {
            "input_file_id": "file-x",
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
            "metadata": metadata,
        }
    ).encode()
    result = call(app, "/v1/batches", iter([body]), AUTH)
    assert result.read == len(body) and result.status != 413, result.body


def test_metrics_needs_its_token_when_one_is_set(tmp_path: Any) -> None:
    from producer.serve.app import ServeConfig

    closed = offline_app(tmp_path / "files", ServeConfig(metrics_token="scrape-secret"))
    get = {"method": "GET"}
    for headers, status in (
        ({}, 401),
        ({"authorization": "Bearer wrong"}, 401),
        ({"authorization": f"Bearer {KEY}"}, 401),  # a tenant key is not the token
        ({"authorization": "Bearer scrape-secret"}, 200),
    ):
        assert call(closed, "/metrics", iter([]), headers, **get).status == status, headers
    open_app = offline_app(tmp_path / "files2")
    assert call(open_app, "/metrics", iter([]), {}, **get).status == 200


def test_redis_down_is_a_retryable_503_not_a_500(tmp_path: Any) -> None:
    """Files' records live in Redis: a listing while it is unreachable answers 503
    `queue_unavailable` (the SDK retries it), and the app serves again once it is back."""
    import fakeredis

    server = fakeredis.FakeServer()
    app = offline_app(tmp_path / "files", redis_client=fakeredis.FakeRedis(server=server))
    headers = {"authorization": f"Bearer {KEY}"}
    assert call(app, "/v1/files", iter(()), headers, method="GET").status == 200
    server.connected = False
    down = call(app, "/v1/files", iter(()), headers, method="GET")
    assert down.status == 503 and down.json()["error"]["code"] == "queue_unavailable"
    server.connected = True
    assert call(app, "/v1/files", iter(()), headers, method="GET").status == 200
