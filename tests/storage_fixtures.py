"""The `qbatch serve` storage under test, each seen from outside it: bytes in a local
directory with records in fakeredis (a unit test), and bytes in S3 on a real
S3-compatible server (moto's server mode on a loopback port) with records in the real
Redis (marked integration). Import `backend` (and `s3_endpoint`, which it uses) into a
test module to run its tests against both. Time is a `Clock` the test moves."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import obstore
import pytest

from producer.serve.lease import Lease
from producer.serve.storage import FileStore, StoredFile
from producer.serve.storage_url import open_storage
from schemas.keys import RedisKeys
from tests.s3_fixtures import BUCKET, CREDENTIALS, moto_s3


@dataclass
class Clock:
    """The store's time: starts at the real time, moves only when a test moves it."""

    now: float = field(default_factory=time.time)

    def __call__(self) -> float:
        return self.now


def fake_redis() -> Any:
    import fakeredis

    return fakeredis.FakeRedis()


def real_redis() -> Any:
    import redis

    return redis.Redis.from_url(os.environ.get("QBATCH_REDIS_URL", "redis://127.0.0.1:6379/0"))


def new_lease(redis_client: Any, prefix: str | None = None) -> Lease:
    """A lease on a fresh prefix (each test its own keys)."""
    keys = RedisKeys(prefix or f"t{uuid.uuid4().hex[:12]}")
    return Lease.acquire(redis_client, keys, wait_s=0)


@dataclass
class Backend:
    """A storage under test and what it holds, seen from outside it."""

    storage: FileStore
    url: str
    lease: Lease
    clock: Clock
    endpoint: str | None = None

    def stored_names(self) -> list[str]:
        """The object keys under `files/`."""
        return sorted(key for key, _ in self.storage.objects.listing("files/"))

    def all_names(self) -> list[str]:
        return sorted(key for key, _ in self.storage.objects.listing(""))

    def temp_names(self) -> list[str]:
        return sorted(p.name for p in self.storage.tmp.iterdir())

    def write_object(self, key: str, data: bytes) -> None:
        """An object written behind the store's back (another release's, or a crash's)."""
        obstore.put(self.storage.objects.store, key, data)

    def reopen(self) -> FileStore:
        """The same store opened again (a restart: the same prefix and lease)."""
        return open_storage(self.url, self.lease, s3_endpoint_url=self.endpoint, clock=self.clock)

    def records(self, tenant: str) -> list[str]:
        """The members of the tenant's listing set (what Redis says it has)."""
        key = self.lease.keys.serve_tenant_files(tenant)
        return [m.decode() for m in self.lease.redis.zrange(key, 0, -1)]


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    with moto_s3() as endpoint:
        yield endpoint


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.integration)])
def backend(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Backend]:
    clock = Clock()
    if request.param == "local":
        lease = new_lease(fake_redis())
        url = str(tmp_path / "store")
        yield Backend(open_storage(url, lease, clock=clock), url, lease, clock)
        return
    endpoint: str = request.getfixturevalue("s3_endpoint")
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    lease = new_lease(real_redis())
    url = f"s3://{BUCKET}/t-{uuid.uuid4().hex[:12]}/"  # each test its own prefix in the one bucket
    storage = open_storage(url, lease, s3_endpoint_url=endpoint, clock=clock)
    try:
        yield Backend(storage, url, lease, clock, endpoint)
    finally:
        for key in lease.redis.scan_iter(f"{lease.keys.prefix}:*"):
            lease.redis.delete(key)


def put_bytes(
    storage: FileStore,
    data: bytes = b"{}\n",
    *,
    file_id: str | None = None,
    tenant: str = "a",
    **kw: Any,
) -> StoredFile:
    """A finished local file put in as an output file (`FileStore.put`, as the runner
    stores them; `file_id` rewrites that file)."""
    src = storage.tmp / f"put-{uuid.uuid4().hex}.jsonl"
    src.write_bytes(data)
    return storage.put(
        src, tenant=tenant, filename="o.jsonl", purpose="batch_output", file_id=file_id, **kw
    )


def upload_bytes(storage: FileStore, data: bytes, tenant: str = "a", limit: int = 1_000) -> str:
    up = storage.begin(limit)
    for start in range(0, len(data), 7):
        up.write(data[start : start + 7])
    return storage.commit(up, tenant=tenant, filename="in.jsonl", purpose="batch").id


def read_all(storage: FileStore, stored: StoredFile) -> bytes:
    return b"".join(storage.iter_bytes(stored))


__all__ = [
    "Backend",
    "Clock",
    "backend",
    "fake_redis",
    "new_lease",
    "put_bytes",
    "read_all",
    "real_redis",
    "s3_endpoint",
    "upload_bytes",
]
