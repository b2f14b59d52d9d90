"""`--storage` of `qbatch serve` opened: the bytes where the URL says
(`producer.serve.objects`), the records in the server's Redis under its lease
(`producer.serve.file_records`), uploads spooled in a local temp directory (inside a
local store's directory, so it shares its volume; a private one for a cloud store)."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from producer.serve.file_records import FileRecords
from producer.serve.lease import Lease
from producer.serve.objects import open_objects
from producer.serve.storage import FileStore
from producer.serve.storage_location import StorageError, parse_storage_url


def open_storage(
    value: str,
    lease: Lease,
    *,
    s3_endpoint_url: str | None = None,
    clock: Callable[[], float] = time.time,
) -> FileStore:
    """The storage `value` names; a cloud store is checked to answer now, so a wrong
    setting stops the server at start."""
    where = parse_storage_url(value)
    objects = open_objects(value, s3_endpoint_url=s3_endpoint_url)
    tmp = where / "tmp" if isinstance(where, Path) else Path(tempfile.mkdtemp(prefix="qbatch-"))
    records = FileRecords(lease.redis, lease.keys, lease)
    return FileStore(objects, records, tmp, clock)


__all__ = ["StorageError", "open_storage", "parse_storage_url"]
