"""`qbatch serve`'s flags reach what they configure (uvicorn and the app), without
starting a server: uvicorn.run is replaced by a recorder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import uvicorn
from typer.testing import CliRunner

from producer.cli import app


def test_proxy_and_sync_flags_reach_uvicorn_and_the_app(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, Any] = {}

    def record(asgi: Any, **kwargs: Any) -> None:
        seen["app"], seen["kwargs"] = asgi, kwargs

    monkeypatch.setattr(uvicorn, "run", record)
    monkeypatch.setenv("QBATCH_API_KEYS", "sk-cli-serve-test-0123456789:team-a")
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
        ],
    )
    assert result.exit_code == 0, result.output
    assert seen["kwargs"]["forwarded_allow_ips"] == "10.0.0.0/8"
    assert seen["kwargs"]["proxy_headers"] is True
    assert seen["app"].state.serve.config.max_sync_inflight == 7
    assert seen["app"].state.serve.config.max_sync_inflight_per_tenant == 3
    assert seen["app"].state.serve.config.reindex is True
    assert seen["app"].state.serve.config.max_storage_bytes == 5000


def test_the_default_trusts_only_a_local_proxy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, Any] = {}
    monkeypatch.setattr(uvicorn, "run", lambda _app, **kw: seen.update(kw))
    monkeypatch.setenv("QBATCH_API_KEYS", "sk-cli-serve-test-0123456789:team-a")
    monkeypatch.delenv("QBATCH_SERVE_FORWARDED_ALLOW_IPS", raising=False)
    result = CliRunner().invoke(app, ["serve", "--storage", str(tmp_path / "files")])
    assert result.exit_code == 0, result.output
    assert seen["forwarded_allow_ips"] == "127.0.0.1"
