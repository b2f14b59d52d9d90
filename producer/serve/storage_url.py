"""`--storage` of `qbatch serve`: a local directory (a path or `file:///path`) or
`s3://bucket/prefix`, parsed (`parse_storage_url`) and opened (`open_storage`; each
backend imported only when named, so boto3 is needed only for S3)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from producer.serve.storage_location import S3Location, StorageError, parse_storage_url

if TYPE_CHECKING:
    from producer.serve.storage import FileStore


def open_storage(value: str, *, s3_endpoint_url: str | None = None) -> FileStore:
    """The storage `value` names (`parse_storage_url`); an S3 bucket is checked to be
    reachable now, so a wrong setting stops the server at start."""
    where = parse_storage_url(value)
    if isinstance(where, Path):
        from producer.serve.local_store import LocalStorage

        return LocalStorage(where)
    from producer.serve.s3 import S3Storage

    return S3Storage.connect(where, endpoint_url=s3_endpoint_url)


__all__ = ["S3Location", "StorageError", "open_storage", "parse_storage_url"]
