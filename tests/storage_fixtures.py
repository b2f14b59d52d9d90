"""The `qbatch serve` storage backends under test, each seen from outside it: the local
directory, and S3 on a real S3-compatible server (moto's server mode on a loopback
port; marked integration). Import `backend` (and `s3_endpoint`, which it uses) into a
test module to run its tests against both."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest

from producer.serve.file_index import EXPIRY_DIR, INDEX_DIR, SIZES_DIR, tenant_dir
from producer.serve.local_store import LocalStorage
from producer.serve.storage import FileStore, StoredFile
from producer.serve.storage_url import open_storage
from tests.s3_fixtures import BUCKET, CREDENTIALS, moto_s3, object_keys


@dataclass
class Backend:
    """A storage under test and what it holds, seen from outside it."""

    storage: FileStore
    endpoint: str | None = None
    prefix: str = ""

    def stored_names(self) -> list[str]:
        """The names in `files/` (local directory or objects under the prefix)."""
        if self.endpoint is None:
            assert isinstance(self.storage, LocalStorage)
            return sorted(p.name for p in self.storage.files.iterdir())
        files = f"{self.prefix}files/"
        keys = object_keys(self.endpoint, prefix=files)
        return [k.removeprefix(files) for k in keys]

    def temp_names(self) -> list[str]:
        return sorted(p.name for p in self.storage.tmp.iterdir())

    def folder_names(self, tenant: str, top: str = INDEX_DIR) -> list[str]:
        """Every name in the tenant's folder under `top` (its listing index, or sizes)."""
        where = f"{top}/{tenant_dir(tenant)}"
        if self.endpoint is None:
            assert isinstance(self.storage, LocalStorage)
            folder = self.storage.root / where
            return sorted(p.name for p in folder.iterdir()) if folder.exists() else []
        keys = object_keys(self.endpoint, prefix=f"{self.prefix}{where}/")
        return [k.rsplit("/", 1)[1] for k in keys]

    def set_entry(self, tenant: str, name: str, present: bool, top: str = INDEX_DIR) -> None:
        """Write or remove an entry of the tenant's folder under `top` behind the store's
        back (what a release without it, or a server killed half-way, leaves)."""
        where = f"{top}/{tenant_dir(tenant)}/{name}"
        if self.endpoint is None:
            assert isinstance(self.storage, LocalStorage)
            path = self.storage.root / where
            path.touch() if present else path.unlink()
            return
        s3, key = cast(Any, self.storage).client, f"{self.prefix}{where}"
        if present:
            s3.put_object(Bucket=BUCKET, Key=key, Body=b"")
        else:
            s3.delete_object(Bucket=BUCKET, Key=key)

    def write_document(self, file_id: str, doc: bytes) -> None:
        """A metadata document written behind the store's back (damaged, hand-made, or
        another release's)."""
        if self.endpoint is None:
            assert isinstance(self.storage, LocalStorage)
            self.storage.files.joinpath(f"{file_id}.json").write_bytes(doc)
        else:
            key = f"{self.prefix}files/{file_id}.json"
            cast(Any, self.storage).client.put_object(Bucket=BUCKET, Key=key, Body=doc)

    def index_names(self, tenant: str) -> list[str]:
        """The tenant's listing-index entries."""
        return self.folder_names(tenant)

    def size_names(self, tenant: str) -> list[str]:
        """The tenant's size entries."""
        return self.folder_names(tenant, SIZES_DIR)

    def drop_index(self) -> None:
        """Remove the indexes and the marker (a store written before they existed)."""
        if self.endpoint is None:
            assert isinstance(self.storage, LocalStorage)
            for folder in (INDEX_DIR, EXPIRY_DIR, SIZES_DIR):
                shutil.rmtree(self.storage.root / folder, ignore_errors=True)
            return
        s3 = cast(Any, self.storage).client
        for folder in (INDEX_DIR, EXPIRY_DIR, SIZES_DIR):
            for key in object_keys(self.endpoint, prefix=f"{self.prefix}{folder}/"):
                s3.delete_object(Bucket=BUCKET, Key=key)

    def reopen(self) -> FileStore:
        if self.endpoint is None:
            assert isinstance(self.storage, LocalStorage)
            return open_storage(str(self.storage.root))
        return open_storage(f"s3://{BUCKET}/{self.prefix}", s3_endpoint_url=self.endpoint)


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    with moto_s3() as endpoint:
        yield endpoint


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.integration)])
def backend(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Backend:
    if request.param == "local":
        return Backend(open_storage(str(tmp_path)))
    endpoint: str = request.getfixturevalue("s3_endpoint")
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    prefix = f"t-{uuid.uuid4().hex[:12]}/"  # each test its own prefix in the one bucket
    storage = open_storage(f"s3://{BUCKET}/{prefix}", s3_endpoint_url=endpoint)
    return Backend(storage, endpoint, prefix)


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


__all__ = ["Backend", "backend", "put_bytes", "s3_endpoint", "upload_bytes"]
