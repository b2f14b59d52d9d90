"""Where `qbatch serve --storage` points, parsed: a local directory (a path or
`file:///path`) or an S3 location. Apart from `storage_url.open_storage`, so the S3
backend can name its location type without importing the module that imports it."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


class StorageError(ValueError):
    """The storage setting is unusable (bad URL, unreachable bucket, no credentials)."""


@dataclass(frozen=True, slots=True)
class S3Location:
    """`s3://bucket/prefix`: objects under `prefix` ("" or ending in "/")."""

    bucket: str
    prefix: str = ""


def parse_storage_url(value: str) -> Path | S3Location:
    """`--storage`: a plain path or `file:///path` (a local directory), or
    `s3://bucket[/prefix]`. Anything else is a StorageError."""
    text = value.strip()
    if not text:
        raise StorageError("the storage setting is empty")
    if not _URL.match(text) and not text.startswith("file:"):
        return Path(text)
    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    if parts.query or parts.fragment:
        raise StorageError(f"a storage URL takes no query or fragment: {value!r}")
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise StorageError(f"file:// URLs name no other host: {value!r}")
        if not parts.path:
            raise StorageError(f"the file:// URL has no path: {value!r}")
        return Path(unquote(parts.path))
    if scheme == "s3":
        if not _BUCKET.match(parts.netloc) or ".." in parts.netloc:
            raise StorageError(f"not an S3 bucket name: {parts.netloc!r}")
        prefix = unquote(parts.path).strip("/")
        return S3Location(parts.netloc, f"{prefix}/" if prefix else "")
    raise StorageError(f"storage must be a path, file:// or s3:// URL, not {scheme}://")


__all__ = ["S3Location", "StorageError", "parse_storage_url"]
