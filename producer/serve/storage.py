"""File storage of `qbatch serve` (OpenAI's Files API objects): `FileStore`, the interface
the app and the runner use and what its backends share; `open_storage`,
which picks the backend from a `--storage` URL (a directory is
`producer.serve.local_store`, `s3://` is `producer.serve.s3`, imported only then).

Layout under the storage root::

    files/{file_id}.data   the bytes
    files/{file_id}.json   the metadata (OpenAI's file object + the owning tenant)
    tenants/{hash}/...     each tenant's listing index (empty entries; `file_index`)
    tmp/                   uploads being received

Why this shape: an upload streams into `tmp/` and is counted as it comes, so an
oversize upload stops at the limit without ever being held in memory or landing in
`files/`; the data file is renamed into place first and the metadata last (each
atomically), so a file is visible exactly when it is complete, and a server killed at
any point leaves at worst an orphan `.data` or temp file, never a listed file without
bytes. Output files get ids derived from their batch, so finalising a batch again after
a restart rewrites the same files instead of leaving orphans.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import unquote, urlsplit

from producer.serve.file_index import (
    IndexEntry,
    entry_for,
    listing_order,
)

FILE_ID = re.compile(r"^file-[0-9a-f]{24,64}$")
"""What a file id looks like; anything else is never turned into a path."""
PURPOSE_BATCH = "batch"
PURPOSE_OUTPUT = "batch_output"
MAX_FILENAME_CHARS = 255


class UploadTooLarge(Exception):
    """The upload went past its byte limit (nothing was kept)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"file is larger than the limit of {limit} bytes")
        self.limit = limit


@dataclass(frozen=True, slots=True)
class StoredFile:
    """A file's metadata; `openai()` is the OpenAI file object (the tenant stays inside)."""

    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    tenant: str
    expires_at: int | None = None
    """When the file stops existing (its `expires_after` policy; `producer.serve.expiry`)."""

    def expired(self, now: float | None = None) -> bool:
        return (
            self.expires_at is not None and (time.time() if now is None else now) >= self.expires_at
        )

    def openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "status_details": None,
            "expires_at": self.expires_at,
        }


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"


def clean_filename(name: str | None) -> str:
    """The base name only (no directories), printable, bounded."""
    base = os.path.basename((name or "").replace("\\", "/")) or "upload.jsonl"
    base = "".join(ch for ch in base if ch.isprintable())
    return base[:MAX_FILENAME_CHARS] or "upload.jsonl"


def new_stored(
    size: int,
    tenant: str,
    filename: str,
    purpose: str,
    file_id: str | None,
    expires_after_s: int | None = None,
) -> StoredFile:
    """The metadata of a file being placed (a new id unless `file_id`, which must be one;
    `expires_at` `expires_after_s` after its creation when given)."""
    fid = file_id or new_file_id()
    if not FILE_ID.match(fid):
        raise ValueError(f"not a file id: {fid!r}")
    now = int(time.time())
    expires_at = None if expires_after_s is None else now + expires_after_s
    return StoredFile(fid, size, now, clean_filename(filename), purpose, tenant, expires_at)


def stored_any(raw: str | bytes) -> StoredFile | None:
    """A metadata document's file, whoever owns it (None for a document that is not one)."""
    try:
        return StoredFile(**json.loads(raw))
    except (ValueError, TypeError):
        return None


def stored_from_json(
    raw: str | bytes, tenant: str, purpose: str | None = None
) -> StoredFile | None:
    """A metadata document's file if it belongs to `tenant` (and has `purpose`), else None
    (also for a document that is not one)."""
    stored = stored_any(raw)
    if stored is None or stored.tenant != tenant:
        return None
    return None if purpose is not None and stored.purpose != purpose else stored


class Upload:
    """An upload being received: `write` chunks (UploadTooLarge past `limit`), then
    `FileStore.commit` it, or `discard` it. Always a local file (a storage's `tmp/`), so
    the JSONL check reads it before anything is stored."""

    def __init__(self, fh: BinaryIO, path: Path, limit: int) -> None:
        self._fh = fh
        self.path = path
        self.limit = limit
        self.size = 0

    def write(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self.limit:
            raise UploadTooLarge(self.limit)
        self._fh.write(chunk)

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._fh.close()

    def discard(self) -> None:
        with contextlib.suppress(OSError):
            self._fh.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def begin_upload(tmp: Path, limit: int) -> Upload:
    """A new upload spooled to a temp file in `tmp`."""
    fd, name = tempfile.mkstemp(prefix="upload-", dir=tmp)
    return Upload(os.fdopen(fd, "wb"), Path(name), limit)


class FileStore:
    """What `qbatch serve` needs of a file storage, and what every backend
    (`local_store.LocalStorage`, `s3.S3Storage`) shares: uploads spooled in `tmp`,
    placing, expiry, deleting, listing. A backend gives `local_copy`, `iter_bytes`,
    `_place` (store a finished local file and its metadata), `_load` (a metadata
    document), `_unlink` (one object), `_metadata_docs` (every metadata document it
    holds) and the index's `_index_*`."""

    tmp: Path
    """A local directory for uploads being received and output files being collected."""

    # ------------------------------------------------------------ writing

    def begin(self, limit: int) -> Upload:
        return begin_upload(self.tmp, limit)

    def commit(
        self,
        upload: Upload,
        *,
        tenant: str,
        filename: str,
        purpose: str,
        file_id: str | None = None,
        expires_after_s: int | None = None,
    ) -> StoredFile:
        """Move a received upload into place and publish its metadata."""
        upload.close()
        meta = new_stored(upload.size, tenant, filename, purpose, file_id, expires_after_s)
        return self._store(upload.path, meta)

    def put(
        self,
        src: Path,
        *,
        tenant: str,
        filename: str,
        purpose: str,
        file_id: str | None = None,
        expires_after_s: int | None = None,
    ) -> StoredFile:
        """Move a finished local file (same filesystem) in as a stored file."""
        meta = new_stored(src.stat().st_size, tenant, filename, purpose, file_id, expires_after_s)
        return self._store(src, meta)

    def _store(self, src: Path, stored: StoredFile) -> StoredFile:
        """Data, then metadata (`_place`), then the index entry."""
        self._place(src, stored)
        self._index(stored)
        return stored

    # ------------------------------------------------------------ reading, deleting

    def get(self, file_id: str, tenant: str) -> StoredFile | None:
        """The file if it exists, **belongs to `tenant`** and has not expired (else None:
        a 404 either way, so another tenant's id tells nothing). An expired file met
        here is removed."""
        if not FILE_ID.match(file_id):
            return None
        stored = self._load(file_id, tenant)
        if stored is not None and stored.expired():
            self._remove(stored)
            return None
        return stored

    def delete(self, file_id: str, tenant: str) -> bool:
        stored = self.get(file_id, tenant)
        if stored is None:
            return False
        self._remove(stored)
        return True

    def _remove(self, stored: StoredFile) -> None:
        """Metadata first (the file vanishes), its index entry, then the bytes."""
        self._unlink(stored.id, "json")
        self._index_drop(stored.tenant, entry_for(stored.created_at, stored.id, stored.purpose))
        self._unlink(stored.id, "data")

    def sweep_expired(self, now: float | None = None) -> int:
        """Remove every expired file, whoever owns it (reads every metadata document:
        the runner calls it now and then, not per request); returns how many."""
        gone = 0
        for raw in self._metadata_docs():
            stored = stored_any(raw)
            if stored is not None and stored.expired(now):
                self._remove(stored)
                gone += 1
        return gone

    def _place(self, src: Path, stored: StoredFile) -> None:
        raise NotImplementedError

    def _load(self, file_id: str, tenant: str) -> StoredFile | None:
        raise NotImplementedError

    def _unlink(self, file_id: str, kind: str) -> None:
        raise NotImplementedError

    def _metadata_docs(self) -> Iterator[str | bytes]:
        raise NotImplementedError

    def local_copy(self, stored: StoredFile) -> AbstractContextManager[Path]:
        raise NotImplementedError

    def iter_bytes(self, stored: StoredFile, block: int = 1 << 16) -> Iterator[bytes]:
        raise NotImplementedError

    def list(
        self,
        tenant: str,
        *,
        purpose: str | None = None,
        after: str | None = None,
        limit: int = 10_000,
        order: str = "desc",
    ) -> tuple[list[StoredFile], bool]:
        """A tenant's files by creation time (`order`), after the file id `after`;
        returns (page, has_more). Walks the tenant's index entries (`file_index`) and
        reads the metadata of the page's files only; an entry whose metadata is gone
        (a file deleted meanwhile) is skipped and dropped."""
        walk = listing_order(self._index_entries(tenant), purpose=purpose, after=after, order=order)
        live = (f for e in walk if (f := self._listed(tenant, e)) is not None)
        page = list(itertools.islice(live, limit))
        return page, next(live, None) is not None

    def _listed(self, tenant: str, entry: IndexEntry) -> StoredFile | None:
        """The entry's file, or None (and the entry dropped) when it is gone or was
        rewritten since (`put` with the same id gives it a new entry)."""
        stored = self.get(entry.file_id, tenant)
        if stored is None or (stored.created_at, stored.purpose) != (
            entry.created_at,
            entry.purpose,
        ):
            self._index_drop(tenant, entry)
            return None
        return stored

    # ------------------------------------------------------------ the listing index

    def _index(self, stored: StoredFile) -> None:
        self._index_add(stored.tenant, entry_for(stored.created_at, stored.id, stored.purpose))

    def reindex(self) -> int:
        """Give every stored file its index entry, once per store (stores written before
        the index existed); returns how many files were indexed (0 once marked)."""
        if self._index_marked():
            return 0
        count = 0
        for raw in self._metadata_docs():
            stored = stored_any(raw)
            if stored is not None:
                self._index(stored)
                count += 1
        self._index_mark()
        return count

    def _index_add(self, tenant: str, entry: IndexEntry) -> None:
        raise NotImplementedError

    def _index_drop(self, tenant: str, entry: IndexEntry) -> None:
        raise NotImplementedError

    def _index_entries(self, tenant: str) -> Iterator[IndexEntry]:
        raise NotImplementedError

    def _index_marked(self) -> bool:
        raise NotImplementedError

    def _index_mark(self) -> None:
        raise NotImplementedError


# ------------------------------------------------------------ choosing a backend

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


def open_storage(value: str, *, s3_endpoint_url: str | None = None) -> FileStore:
    """The storage `value` names (`parse_storage_url`); an S3 bucket is checked to be
    reachable now, so a wrong setting stops the server at start."""
    where = parse_storage_url(value)
    if isinstance(where, Path):
        from producer.serve.local_store import LocalStorage

        return LocalStorage(where)
    from producer.serve.s3 import S3Storage

    return S3Storage.connect(where, endpoint_url=s3_endpoint_url)


__all__ = [
    "FILE_ID",
    "PURPOSE_BATCH",
    "PURPOSE_OUTPUT",
    "FileStore",
    "S3Location",
    "StorageError",
    "StoredFile",
    "Upload",
    "UploadTooLarge",
    "begin_upload",
    "clean_filename",
    "new_file_id",
    "new_stored",
    "open_storage",
    "parse_storage_url",
    "stored_from_json",
]
