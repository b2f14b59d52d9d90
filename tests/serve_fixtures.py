"""`qbatch serve` as a subprocess on a loopback port, and OpenAI Batch file helpers.

Shared by `tests/integration/test_serve*.py` and `tests/benchmarks/bench_serve.py`; no
pytest here, so a benchmark script can import it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai

from tests.integration.workers import REPO, Lane, echo_worker

KEY_A, KEY_B = "sk-test-team-a-0123456789", "sk-test-team-b-9876543210"
UPLOAD_LIMIT_B = 8_192


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Server:
    lane: Lane
    storage: Path | str
    """--storage: a directory or a storage URL (s3://...)."""
    keys_file: Path
    log: Path
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> Server:
        self.port = free_port()
        env = self.lane.env()
        env["QBATCH_API_KEYS"] = f"{KEY_A}:team-a"
        # a server killed outright blocks its successor on the prefix this long (its lease)
        env["QBATCH_SERVE_LEASE_TTL"] = "5"
        env.update(self.extra_env)
        cmd = [
            sys.executable,
            "-m",
            "producer.cli",
            *self.lane.cli_args(),
            "serve",
            "--port",
            str(self.port),
            "--storage-dir",
            str(self.storage),
            "--keys-file",
            str(self.keys_file),
            "--models",
            "echo",
        ]
        sink = self.log.open("ab")
        self.proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=sink, stderr=sink)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{self.port}/healthz", timeout=1).is_success:
                    return self
            time.sleep(0.2)
        raise AssertionError(f"server did not start:\n{self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def client(self, key: str = KEY_A, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=key, **kwargs)


def keys_file(path: Path) -> Path:
    """team-b's key, stored hashed, with small per-tenant limits."""
    doc = {
        "keys": [{"sha256": hashlib.sha256(KEY_B.encode()).hexdigest(), "tenant": "team-b"}],
        "tenants": {"team-b": {"max_upload_bytes": UPLOAD_LIMIT_B, "max_concurrent_batches": 1}},
    }
    path.write_text(json.dumps(doc))
    return path


def batch_lines(n: int, url: str = "/v1/chat/completions") -> list[dict[str, Any]]:
    return [
        {
            "custom_id": f"c{i}",
            "method": "POST",
            "url": url,
            "body": {"model": "echo", "messages": [{"role": "user", "content": f"m{i}"}]},
        }
        for i in range(n)
    ]


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def read_file(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    text = client.files.content(file_id).text
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def wait_batch(
    client: openai.OpenAI,
    batch_id: str,
    until: set[str],
    timeout: float = 120,
    poll_s: float = 0.2,
) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in until:
            return batch
        assert time.monotonic() < deadline, f"batch stuck in {batch.status}: {batch}"
        time.sleep(poll_s)


def offline_app(
    files: Path,
    config: Any = None,
    limits: dict[str, Any] | None = None,
    redis_client: Any = None,
    clock: Any = None,
) -> Any:
    """The real `qbatch serve` app, in process, for tests that drive it as ASGI without
    Kafka: its client's Kafka is a closed port (connected only on first use), its Redis
    fakeredis (or `redis_client`), its files' bytes under `files`, and the batch runner
    is not started. Keys: KEY_A (team-a), KEY_B (team-b); `limits`: tenant ->
    `TenantLimits`, as a keys file gives them; `clock`: the file store's time
    (`tests.storage_fixtures.Clock`)."""
    from producer.client import QBatchClient
    from producer.serve.app import ServeConfig, build_state, create_app
    from producer.serve.auth import KeyRing, load_keyring
    from producer.serve.storage_url import open_storage
    from tests.storage_fixtures import fake_redis, new_lease

    client = QBatchClient(bootstrap="127.0.0.1:9", redis_client=redis_client or fake_redis())
    lease = new_lease(client.redis, client.keys.prefix)
    keyring = load_keyring(f"{KEY_A}:team-a,{KEY_B}:team-b", None)
    keyring = KeyRing(keyring.digests, limits or {})
    state = build_state(
        config or ServeConfig(),
        keyring,
        open_storage(str(files), lease, clock=clock or time.time),
        client,
        lease,
    )
    return create_app(state, run_batches=False)


@contextlib.contextmanager
def serving(
    tmp: Path, *worker_args: str, name: str = "qbs", server_cls: type[Server] = Server
) -> Iterator[Any]:
    """A private lane, an echo worker on it (with `worker_args`) and a server in front."""
    lane = Lane.new(name)
    lane.create_topics()
    server = server_cls(lane, tmp / "files", keys_file(tmp / "keys.json"), tmp / "serve.log")
    try:
        with echo_worker(lane, *worker_args, log=tmp / "worker.log"):
            server.start()
            yield server
    finally:
        server.stop()
        lane.delete_topics()
        lane.clean_redis()
