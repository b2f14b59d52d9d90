"""File storage of `qbatch serve`: a local directory (OpenAI's Files API objects). Pure
filesystem, no sockets.

Layout under the storage root::

    files/{file_id}.data   the bytes
    files/{file_id}.json   the metadata (OpenAI's file object + the owning tenant)
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
import json
import os
import re
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO

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


class Upload:
    """An upload being received: `write` chunks (UploadTooLarge past `limit`), then
    `LocalStorage.commit` it, or `discard` it."""

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


class LocalStorage:
    """Files in a local directory (default `./qbatch-files`; a volume in production)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.files = root / "files"
        self.tmp = root / "tmp"
        self.files.mkdir(parents=True, exist_ok=True)
        self.tmp.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------ writing

    def begin(self, limit: int) -> Upload:
        fd, name = tempfile.mkstemp(prefix="upload-", dir=self.tmp)
        return Upload(os.fdopen(fd, "wb"), Path(name), limit)

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
        return self._place(upload.path, upload.size, tenant, filename, purpose, file_id)

    def put(
        self, src: Path, *, tenant: str, filename: str, purpose: str, file_id: str | None = None
    ) -> StoredFile:
        """Move a finished local file (same filesystem) in as a stored file."""
        return self._place(src, src.stat().st_size, tenant, filename, purpose, file_id)

    def _place(
        self, src: Path, size: int, tenant: str, filename: str, purpose: str, file_id: str | None
    ) -> StoredFile:
        fid = file_id or new_file_id()
        if not FILE_ID.match(fid):
            raise ValueError(f"not a file id: {fid!r}")
        stored = StoredFile(fid, size, int(time.time()), clean_filename(filename), purpose, tenant)
        os.replace(src, self._data(fid))
        self._write_json(self._meta(fid), asdict(stored))
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
            data = json.loads(self._meta(file_id).read_text(encoding="utf-8"))
        except (FileNotFoundError, ValueError):
            return None
        stored = StoredFile(**data)
        return stored if stored.tenant == tenant else None

    def path(self, stored: StoredFile) -> Path:
        return self._data(stored.id)

    def iter_bytes(self, stored: StoredFile, block: int = 1 << 16) -> Iterator[bytes]:
        with self._data(stored.id).open("rb") as fh:
            yield from iter(lambda: fh.read(block), b"")

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
        returns (page, has_more). Scans the metadata files: fine for thousands of files."""
        mine: list[StoredFile] = []
        for meta in self.files.glob("file-*.json"):
            with contextlib.suppress(FileNotFoundError, ValueError, TypeError):
                stored = StoredFile(**json.loads(meta.read_text(encoding="utf-8")))
                if stored.tenant == tenant and (purpose is None or stored.purpose == purpose):
                    mine.append(stored)
        mine.sort(key=lambda f: (f.created_at, f.id), reverse=order != "asc")
        if after is not None:
            ids = [f.id for f in mine]
            mine = mine[ids.index(after) + 1 :] if after in ids else []
        return mine[:limit], len(mine) > limit

    def delete(self, file_id: str, tenant: str) -> bool:
        """Delete the tenant's file: metadata first (it vanishes), then the bytes."""
        if self.get(file_id, tenant) is None:
            return False
        with contextlib.suppress(FileNotFoundError):
            self._meta(file_id).unlink()
        with contextlib.suppress(FileNotFoundError):
            self._data(file_id).unlink()
        return True


def check_jsonl(path: Path) -> str | None:
    """Why the file is not JSONL (UTF-8, one JSON object a non-blank line), or None.
    Only the format: what each line asks for is checked when a batch validates it."""
    count = 0
    with path.open("rb") as fh:
        for number, raw in enumerate(fh, start=1):
            try:
                text = raw.decode("utf-8").strip()
            except UnicodeDecodeError as exc:
                return f"line {number} is not UTF-8 (byte {exc.start})"
            if not text:
                continue
            try:
                obj = json.loads(text)
            except (ValueError, RecursionError) as exc:
                return f"line {number} is not JSON: {exc}"
            if not isinstance(obj, dict):
                return f"line {number} is not a JSON object"
            count += 1
    return None if count else "the file holds no lines"


__all__ = [
    "FILE_ID",
    "PURPOSE_BATCH",
    "PURPOSE_OUTPUT",
    "LocalStorage",
    "StoredFile",
    "Upload",
    "UploadTooLarge",
    "check_jsonl",
    "clean_filename",
    "new_file_id",
]
