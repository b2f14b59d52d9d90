"""The bytes of `qbatch serve`'s files: a small adapter on `obstore` (local directories,
S3, GCS and Azure alike, one Rust library with no Python dependencies to clash with
vLLM's image). What the store needs of it: put a finished local file, get (whole or a
byte range, streamed), delete, and list (the orphan sweep). Which objects exist and
what they mean is Redis's business (`producer.serve.file_records`); this module never
decides anything.

`--storage` (`open_objects`): a path or `file:///path` (a local directory), or
`s3://bucket/prefix`, `gs://bucket/prefix`, `az://container/prefix`. Credentials and
regions come from each cloud's own environment variables (`AWS_*`, `GOOGLE_*`,
`AZURE_*`), as obstore reads them; `--s3-endpoint-url` names an S3-compatible server.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import obstore
from obstore.exceptions import NotFoundError
from obstore.store import LocalStore, S3Store, from_url

from producer.serve.storage_location import CloudLocation, StorageError, parse_storage_url

BLOCK = 1 << 16


class Objects:
    """Objects under one store root (a directory or a bucket's prefix)."""

    def __init__(self, store: Any, where: str) -> None:
        self.store = store
        self.where = where
        """The root, for messages (`/data/files`, `s3://bucket/prefix/`)."""

    def put(self, key: str, src: Path) -> None:
        """Write `src`'s bytes at `key`, atomically (a reader sees all or nothing; on S3
        a multipart upload above 5 MiB)."""
        obstore.put(self.store, key, src)

    def get(
        self, key: str, start: int | None = None, end: int | None = None, block: int = BLOCK
    ) -> Iterator[bytes]:
        """The bytes at `key` (from `start`, up to `end` exclusive), streamed. The request
        is sent now: a missing object fails here (FileNotFoundError), before a response
        starts; the body is read as the iterator is."""
        options: Any = {}
        if start is not None or end is not None:
            options["range"] = {"offset": start or 0} if end is None else (start or 0, end)
        try:
            result = obstore.get(self.store, key, options=options or None)
        except NotFoundError:
            raise FileNotFoundError(key) from None
        return (bytes(chunk) for chunk in result.stream(min_chunk_size=block))

    def exists(self, key: str) -> bool:
        try:
            obstore.head(self.store, key)
        except (NotFoundError, FileNotFoundError):
            return False
        return True

    def delete(self, key: str) -> None:
        """Remove `key` (a missing one is no error: removing is idempotent)."""
        with contextlib.suppress(NotFoundError, FileNotFoundError):
            obstore.delete(self.store, key)

    def listing(self, prefix: str) -> Iterator[tuple[str, float]]:
        """(key, modified time) of every object under `prefix` (one request per 1,000 on
        a cloud store)."""
        for chunk in obstore.list(self.store, prefix=prefix):
            for meta in chunk:
                yield meta["path"], meta["last_modified"].timestamp()

    def check(self) -> None:
        """StorageError unless the store answers (a wrong bucket, credentials or
        endpoint stops the server at start, not at the first upload)."""
        try:
            next(iter(obstore.list(self.store, prefix="files/", chunk_size=1)), None)
        except Exception as exc:  # obstore's errors: credentials, DNS, HTTP, permissions
            raise StorageError(f"{self.where}: {exc}") from None


def open_objects(value: str, *, s3_endpoint_url: str | None = None) -> Objects:
    """The store `--storage` names (`parse_storage_url`), checked to answer."""
    where = parse_storage_url(value)
    if isinstance(where, Path):
        try:
            where.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"cannot create {where}: {exc}") from None
        return Objects(LocalStore(where.resolve(), mkdir=True), str(where))
    objects = Objects(_cloud_store(where, s3_endpoint_url), where.url)
    objects.check()
    return objects


def _cloud_store(where: CloudLocation, s3_endpoint_url: str | None) -> Any:
    prefix = where.prefix.rstrip("/") or None
    if where.scheme == "s3":
        options: dict[str, Any] = {}
        s3_endpoint_url = s3_endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3")
        if s3_endpoint_url:
            options["endpoint"] = s3_endpoint_url
        client: Any = (
            {"allow_http": True} if (s3_endpoint_url or "").startswith("http://") else None
        )
        return S3Store(where.bucket, prefix=prefix, client_options=client, **options)
    return from_url(where.url)


__all__ = ["BLOCK", "Objects", "open_objects"]
