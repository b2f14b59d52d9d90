"""Where `qbatch serve --storage` points, parsed: a local directory (a path or
`file:///path`) or a cloud location (`s3://`, `gs://`, `az://`). Pure: no store is
opened here (`producer.serve.objects.open_objects` does that)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]$")
CLOUD_SCHEMES = ("s3", "gs", "az")


class StorageError(ValueError):
    """The storage setting is unusable (bad URL, unreachable bucket, no credentials)."""


@dataclass(frozen=True, slots=True)
class CloudLocation:
    """`s3://bucket/prefix` (or `gs://`, `az://` with a container): objects under
    `prefix` ("" or ending in "/")."""

    scheme: str
    bucket: str
    prefix: str = ""

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.prefix}"


def parse_storage_url(value: str) -> Path | CloudLocation:
    """`--storage`: a plain path or `file:///path` (a local directory), or
    `s3://bucket[/prefix]` (`gs://`, `az://` alike). Anything else is a StorageError."""
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
    if scheme in CLOUD_SCHEMES:
        if not _BUCKET.match(parts.netloc) or ".." in parts.netloc:
            raise StorageError(f"not a bucket name: {parts.netloc!r}")
        prefix = unquote(parts.path).strip("/")
        if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
            raise StorageError(f"the prefix has an empty, '.' or '..' part: {value!r}")
        return CloudLocation(scheme, parts.netloc, f"{prefix}/" if prefix else "")
    raise StorageError(
        f"storage must be a path or a file://, s3://, gs:// or az:// URL, not {scheme}://"
    )


__all__ = ["CLOUD_SCHEMES", "CloudLocation", "StorageError", "parse_storage_url"]
