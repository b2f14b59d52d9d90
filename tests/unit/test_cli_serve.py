"""`qbatch serve`'s flags reach what they configure (uvicorn, the app and its lease on
the Redis prefix), without starting a server: uvicorn.run is replaced by a recorder and
the client's Redis by fakeredis (one per test). And a start that cannot take the lease,
or reach Redis at all, exits 4 with a message."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import uvicorn
from typer.testing import CliRunner

import producer.cli_serve
from producer.cli import app
from producer.cli_common import EXIT_UNAVAILABLE, Options
from producer.client import QBatchClient
from tests.storage_fixtures import fake_redis, new_lease


@pytest.fixture
def redis_client(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The Redis `qbatch serve` connects to: fakeredis (Kafka: a closed port, never
    reached)."""
    client = fake_redis()
    real = producer.cli_serve.client_for

    def client_for(o: Options) -> QBatchClient:
        settings = real(o).settings  # the flags and environment, as the command reads them
        return QBatchClient(settings, bootstrap="127.0.0.1:9", redis_client=client)

    monkeypatch.setattr(producer.cli_serve, "client_for", client_for)
    monkeypatch.setenv("QBATCH_API_KEYS", "sk-cli-serve-test-0123456789:team-a")
    return client


def test_proxy_and_sync_flags_reach_uvicorn_and_the_app(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, redis_client: Any
) -> None:
    seen: dict[str, Any] = {}

    def record(asgi: Any, **kwargs: Any) -> None:
        seen["app"], seen["kwargs"] = asgi, kwargs

    monkeypatch.setattr(uvicorn, "run", record)
    result = CliRunner().invoke(
        app,
        [
            "serve",
            "--storage",
            str(tmp_path / "files"),
            "--forwarded-allow-ips",
            "10.0.0.0/8",
            "--max-sync-inflight",
            "7",
            "--max-sync-inflight-per-tenant",
            "3",
            "--reindex",
            "--max-storage-bytes",
            "5000",
            "--lease-ttl",
            "12",
        ],
    )
    assert result.exit_code == 0, result.output
    assert seen["kwargs"]["forwarded_allow_ips"] == "10.0.0.0/8"
    assert seen["kwargs"]["proxy_headers"] is True
    state = seen["app"].state.serve
    assert state.config.max_sync_inflight == 7
    assert state.config.max_sync_inflight_per_tenant == 3
    assert state.config.reindex is True
    assert state.config.max_storage_bytes == 5000
    assert state.lease.ttl_s == 12 and state.lease.held()
    assert redis_client.pttl(state.lease.key) > 0  # the lease expires unless renewed
    assert state.storage.records.lease is state.lease  # the store writes under it


def test_the_default_trusts_only_a_local_proxy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, redis_client: Any
) -> None:
    seen: dict[str, Any] = {}
    monkeypatch.setattr(uvicorn, "run", lambda _app, **kw: seen.update(kw))
    monkeypatch.delenv("QBATCH_SERVE_FORWARDED_ALLOW_IPS", raising=False)
    result = CliRunner().invoke(app, ["serve", "--storage", str(tmp_path / "files")])
    assert result.exit_code == 0, result.output
    assert seen["forwarded_allow_ips"] == "127.0.0.1"


def test_a_second_server_on_a_held_prefix_refuses_to_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, redis_client: Any
) -> None:
    """One server per Redis prefix: with the lease another server's and no wait, the
    command exits 4 naming the holder, and never serves."""
    served: list[Any] = []
    monkeypatch.setattr(uvicorn, "run", lambda asgi, **_kw: served.append(asgi))
    prefix = "qb-held"
    holder = new_lease(redis_client, prefix)
    result = CliRunner().invoke(
        app,
        [
            "--prefix",
            prefix,
            "serve",
            "--storage",
            str(tmp_path / "files"),
            "--lease-wait",
            "0",
        ],
    )
    assert result.exit_code == EXIT_UNAVAILABLE, result.output
    said = " ".join(result.output.split())  # as one line, however the console wrapped it
    assert "another qbatch serve holds this Redis prefix" in said and holder.token in said
    assert served == [] and holder.held()
    # another prefix is free
    result = CliRunner().invoke(
        app,
        ["--prefix", "qb-free", "serve", "--storage", str(tmp_path / "other"), "--lease-wait", "0"],
    )
    assert result.exit_code == 0, result.output
    assert len(served) == 1 and served[0].state.serve.lease.keys.prefix == "qb-free"


def test_a_start_without_redis_exits_4_with_a_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    served: list[Any] = []
    monkeypatch.setattr(uvicorn, "run", lambda asgi, **_kw: served.append(asgi))
    monkeypatch.setenv("QBATCH_API_KEYS", "sk-cli-serve-test-0123456789:team-a")
    result = CliRunner().invoke(
        app,
        [
            "--redis-url",
            "redis://127.0.0.1:9/0",  # a closed port
            "serve",
            "--storage",
            str(tmp_path / "files"),
        ],
    )
    assert result.exit_code == EXIT_UNAVAILABLE, result.output
    said = " ".join(result.output.split())  # as one line, however the console wrapped it
    assert "error: Redis:" in said and "127.0.0.1:9" in said
    assert served == []
