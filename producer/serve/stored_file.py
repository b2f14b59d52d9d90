"""What `qbatch serve` knows of one stored file (OpenAI's file object plus its owner and
expiry): `StoredFile`, its metadata document, and how a new one is made. Pure: the
stores (`producer.serve.storage`) read and write these documents."""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import asdict, dataclass, fields
from typing import Any

from producer.serve.file_index import FILE_ID, PURPOSE, ExpiryEntry, IndexEntry, SizeEntry

PURPOSE_BATCH = "batch"
PURPOSE_OUTPUT = "batch_output"
MAX_FILENAME_CHARS = 255
MAX_TIME = 10**12
"""Times past this (the year 33658) are not a stored file's: index names hold 12 digits."""


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

    @property
    def listing_entry(self) -> IndexEntry:
        return IndexEntry(self.created_at, self.id, self.purpose)

    @property
    def size_entry(self) -> SizeEntry:
        return SizeEntry(self.id, self.bytes)

    @property
    def expiry_entry(self) -> ExpiryEntry | None:
        return None if self.expires_at is None else ExpiryEntry(self.expires_at, self.id)

    def document(self) -> str:
        """The metadata document (no `expires_at` key without a policy, so a release
        from before expiry still reads it)."""
        doc = {k: v for k, v in asdict(self).items() if v is not None}
        return json.dumps(doc)

    def well_formed(self) -> bool:
        """Every field of the type and shape a stored file's has (a document read back
        may be damaged or written by hand; it is then no file at all)."""
        times = [self.bytes, self.created_at]
        if self.expires_at is not None:
            times.append(self.expires_at)
        return (
            all(type(v) is int and 0 <= v < MAX_TIME for v in times)
            and all(type(v) is str for v in (self.id, self.filename, self.purpose, self.tenant))
            and FILE_ID.match(self.id) is not None
            and PURPOSE.match(self.purpose) is not None
        )

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
    if not PURPOSE.match(purpose):
        raise ValueError(f"not a purpose a stored file can have: {purpose!r}")
    now = int(time.time())
    expires_at = None if expires_after_s is None else now + expires_after_s
    return StoredFile(fid, size, now, clean_filename(filename), purpose, tenant, expires_at)


_FIELDS = tuple(f.name for f in fields(StoredFile) if f.name != "expires_at")


def stored_any(raw: str | bytes) -> StoredFile | None:
    """A metadata document's file, whoever owns it (None for a document that is not a
    well-formed one: damaged, hand-written or of another kind)."""
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict) or not all(k in doc for k in _FIELDS):
        return None
    stored = StoredFile(**{k: doc[k] for k in _FIELDS}, expires_at=doc.get("expires_at"))
    return stored if stored.well_formed() else None


__all__ = [
    "MAX_FILENAME_CHARS",
    "MAX_TIME",
    "PURPOSE_BATCH",
    "PURPOSE_OUTPUT",
    "StoredFile",
    "clean_filename",
    "new_file_id",
    "new_stored",
    "stored_any",
]
