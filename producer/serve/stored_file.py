"""What `qbatch serve` knows of one stored file (OpenAI's file object plus its owner,
expiry and the object holding its bytes): `StoredFile`, its Redis hash, and how a new
one is made. Pure: `producer.serve.file_records` keeps these in Redis."""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

PURPOSE_BATCH = "batch"
PURPOSE_OUTPUT = "batch_output"
MAX_FILENAME_CHARS = 255
MAX_TIME = 10**12
"""Times past this (the year 33658) are not a stored file's: listing members hold 12
digits."""
FILE_ID = re.compile(r"^file-[0-9a-f]{24,64}$")
"""What a file id looks like; anything else is never turned into a key."""
PURPOSE = re.compile(r"^[a-z_]{1,32}$")
"""What a stored file's purpose looks like (OpenAI's: `batch`, `batch_output`, ...)."""
OBJECT_KEY = re.compile(r"^files/(file-[0-9a-f]{24,64})\.[0-9a-z]{4,32}$")
"""The key of a file's bytes: `files/{file_id}.{version}` (`.data` for a store written
before 2026-12-07, imported by `producer.serve.legacy_import`)."""


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
    object: str = ""
    """The key of the object holding its bytes (a new one each time the id is written,
    so a rewrite never races a delete of the bytes it replaced)."""

    @property
    def member(self) -> str:
        """Its member in the tenant's listing sets: by creation time, then id."""
        return f"{self.created_at:012d}.{self.id}"

    def to_hash(self) -> dict[str, str]:
        return {k: str(v) for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_hash(cls, h: dict[Any, Any]) -> StoredFile | None:
        """The file a Redis hash holds (None for a damaged or foreign one)."""
        doc = {_s(k): _s(v) for k, v in h.items()}
        try:
            stored = cls(
                id=doc["id"],
                bytes=int(doc["bytes"]),
                created_at=int(doc["created_at"]),
                filename=doc["filename"],
                purpose=doc["purpose"],
                tenant=doc["tenant"],
                expires_at=int(doc["expires_at"]) if "expires_at" in doc else None,
                object=doc.get("object", ""),
            )
        except (KeyError, ValueError):
            return None
        return stored if stored.well_formed() else None

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

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and now >= self.expires_at

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


def _s(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"


def new_object_key(file_id: str) -> str:
    """A fresh key for a file's bytes (`OBJECT_KEY`)."""
    return f"files/{file_id}.{uuid.uuid4().hex[:16]}"


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
    now: float | None = None,
) -> StoredFile:
    """The metadata of a file being placed (a new id unless `file_id`, which must be one;
    `expires_at` `expires_after_s` after its creation when given; bytes at a new key)."""
    fid = file_id or new_file_id()
    if not FILE_ID.match(fid):
        raise ValueError(f"not a file id: {fid!r}")
    if not PURPOSE.match(purpose):
        raise ValueError(f"not a purpose a stored file can have: {purpose!r}")
    created = int(time.time() if now is None else now)
    expires_at = None if expires_after_s is None else created + expires_after_s
    return StoredFile(
        fid,
        size,
        created,
        clean_filename(filename),
        purpose,
        tenant,
        expires_at,
        new_object_key(fid),
    )


_LEGACY_FIELDS = tuple(f.name for f in fields(StoredFile) if f.name not in ("expires_at", "object"))


def legacy_file(raw: str | bytes) -> StoredFile | None:
    """The file a metadata document of a release before 2026-12-07 describes
    (`files/{id}.json`, its bytes at `files/{id}.data`); None for a document that is not
    a well-formed one (damaged, hand-written or of another kind)."""
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict) or not all(k in doc for k in _LEGACY_FIELDS):
        return None
    stored = StoredFile(**{k: doc[k] for k in _LEGACY_FIELDS}, expires_at=doc.get("expires_at"))
    if not stored.well_formed():
        return None
    return replace(stored, object=f"files/{stored.id}.data")


__all__ = [
    "FILE_ID",
    "MAX_FILENAME_CHARS",
    "MAX_TIME",
    "OBJECT_KEY",
    "PURPOSE",
    "PURPOSE_BATCH",
    "PURPOSE_OUTPUT",
    "StoredFile",
    "clean_filename",
    "legacy_file",
    "new_file_id",
    "new_object_key",
    "new_stored",
]
