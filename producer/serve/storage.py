"""File storage of `qbatch serve` (OpenAI's Files API objects): `FileStore`, the interface
the app and the runner use; `LocalStorage`, a local directory (pure filesystem, no
sockets); `open_storage`, which picks the backend from a `--storage` URL (`s3://` is
`producer.serve.s3`, imported only then).

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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol
from urllib.parse import unquote, urlsplit

from producer.serve.file_index import (
    INDEX_DIR,
    REINDEXED,
    IndexEntry,
    entry_for,
    listing_order,
    tenant_dir,
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
            "expires_at": None,
        }


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"


def clean_filename(name: str | None) -> str:
    """The base name only (no directories), printable, bounded."""
    base = os.path.basename((name or "").replace("\\", "/")) or "upload.jsonl"
    base = "".join(ch for ch in base if ch.isprintable())
    return base[:MAX_FILENAME_CHARS] or "upload.jsonl"


def new_stored(
    size: int, tenant: str, filename: str, purpose: str, file_id: str | None
) -> StoredFile:
    """The metadata of a file being placed (a new id unless `file_id`, which must be one)."""
    fid = file_id or new_file_id()
    if not FILE_ID.match(fid):
        raise ValueError(f"not a file id: {fid!r}")
    return StoredFile(fid, size, int(time.time()), clean_filename(filename), purpose, tenant)


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


class FileStore(Protocol):
    """What `qbatch serve` needs of a file storage (`LocalStorage`, `s3.S3Storage`)."""

    tmp: Path
    """A local directory for uploads being received and output files being collected."""

    def begin(self, limit: int) -> Upload: ...

    def commit(
        self,
        upload: Upload,
        *,
        tenant: str,
        filename: str,
        purpose: str,
        file_id: str | None = None,
    ) -> StoredFile: ...

    def put(
        self, src: Path, *, tenant: str, filename: str, purpose: str, file_id: str | None = None
    ) -> StoredFile: ...

    def get(self, file_id: str, tenant: str) -> StoredFile | None: ...

    def local_copy(self, stored: StoredFile) -> AbstractContextManager[Path]: ...

    def iter_bytes(self, stored: StoredFile, block: int = 1 << 16) -> Iterator[bytes]: ...

    def list(
        self,
        tenant: str,
        *,
        purpose: str | None = None,
        after: str | None = None,
        limit: int = 10_000,
        order: str = "desc",
    ) -> tuple[list[StoredFile], bool]: ...

    def delete(self, file_id: str, tenant: str) -> bool: ...


class StorageBase:
    """What every backend shares: uploads spooled in `tmp`, placing, listing. A backend
    gives `_place` (store a finished local file and its metadata) and `_metadata_docs`
    (every metadata document it holds)."""

    tmp: Path

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
    ) -> StoredFile:
        """Move a received upload into place and publish its metadata."""
        upload.close()
        stored = self._place(upload.path, upload.size, tenant, filename, purpose, file_id)
        self._index(stored)
        return stored

    def put(
        self, src: Path, *, tenant: str, filename: str, purpose: str, file_id: str | None = None
    ) -> StoredFile:
        """Move a finished local file (same filesystem) in as a stored file."""
        stored = self._place(src, src.stat().st_size, tenant, filename, purpose, file_id)
        self._index(stored)
        return stored

    def _place(
        self, src: Path, size: int, tenant: str, filename: str, purpose: str, file_id: str | None
    ) -> StoredFile:
        raise NotImplementedError

    def _metadata_docs(self) -> Iterator[str | bytes]:
        raise NotImplementedError

    def get(self, file_id: str, tenant: str) -> StoredFile | None:
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


class LocalStorage(StorageBase):
    """Files in a local directory (default `./qbatch-files`; a volume in production)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.files = root / "files"
        self.tmp = root / "tmp"
        self.tenants = root / INDEX_DIR
        for d in (self.files, self.tmp, self.tenants):
            d.mkdir(parents=True, exist_ok=True)
        self.reindex()

    # ------------------------------------------------------------ writing

    def _place(
        self, src: Path, size: int, tenant: str, filename: str, purpose: str, file_id: str | None
    ) -> StoredFile:
        stored = new_stored(size, tenant, filename, purpose, file_id)
        os.replace(src, self._data(stored.id))
        self._write_json(self._meta(stored.id), asdict(stored))
        return stored

    def _write_json(self, path: Path, data: dict[str, Any]) -> None:
        fd, tmp = tempfile.mkstemp(prefix=".meta-", dir=self.tmp)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(data, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)

    # ------------------------------------------------------------ reading

    def _data(self, file_id: str) -> Path:
        return self.files / f"{file_id}.data"

    def _meta(self, file_id: str) -> Path:
        return self.files / f"{file_id}.json"

    def get(self, file_id: str, tenant: str) -> StoredFile | None:
        """The file if it exists **and belongs to `tenant`** (else None: a 404 either way,
        so another tenant's id tells nothing)."""
        if not FILE_ID.match(file_id):
            return None
        try:
            return stored_from_json(self._meta(file_id).read_text(encoding="utf-8"), tenant)
        except FileNotFoundError:
            return None

    def path(self, stored: StoredFile) -> Path:
        return self._data(stored.id)

    @contextlib.contextmanager
    def local_copy(self, stored: StoredFile) -> Iterator[Path]:
        """The file's bytes as a local path (here: the data file itself)."""
        yield self._data(stored.id)

    def iter_bytes(self, stored: StoredFile, block: int = 1 << 16) -> Iterator[bytes]:
        with self._data(stored.id).open("rb") as fh:
            yield from iter(lambda: fh.read(block), b"")

    def _metadata_docs(self) -> Iterator[str]:
        for meta in self.files.glob("file-*.json"):
            with contextlib.suppress(FileNotFoundError):
                yield meta.read_text(encoding="utf-8")

    def delete(self, file_id: str, tenant: str) -> bool:
        """Delete the tenant's file: metadata first (it vanishes), its index entry, then
        the bytes."""
        stored = self.get(file_id, tenant)
        if stored is None:
            return False
        with contextlib.suppress(FileNotFoundError):
            self._meta(file_id).unlink()
        self._index_drop(tenant, entry_for(stored.created_at, stored.id, stored.purpose))
        with contextlib.suppress(FileNotFoundError):
            self._data(file_id).unlink()
        return True

    # ------------------------------------------------------------ the listing index

    def _index_add(self, tenant: str, entry: IndexEntry) -> None:
        where = self.tenants / tenant_dir(tenant)
        where.mkdir(exist_ok=True)
        (where / entry.name).touch()

    def _index_drop(self, tenant: str, entry: IndexEntry) -> None:
        (self.tenants / tenant_dir(tenant) / entry.name).unlink(missing_ok=True)

    def _index_entries(self, tenant: str) -> Iterator[IndexEntry]:
        with contextlib.suppress(FileNotFoundError):
            for item in os.scandir(self.tenants / tenant_dir(tenant)):
                entry = IndexEntry.parse(item.name)
                if entry is not None:
                    yield entry

    def _index_marked(self) -> bool:
        return (self.tenants / REINDEXED).exists()

    def _index_mark(self) -> None:
        (self.tenants / REINDEXED).touch()


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
        return LocalStorage(where)
    from producer.serve.s3 import S3Storage

    return S3Storage.connect(where, endpoint_url=s3_endpoint_url)


__all__ = [
    "FILE_ID",
    "PURPOSE_BATCH",
    "PURPOSE_OUTPUT",
    "FileStore",
    "LocalStorage",
    "S3Location",
    "StorageBase",
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
