"""An upload of `qbatch serve` being received: spooled to a local temp file and counted
as it comes, so an oversize upload stops at its limit without ever being held in memory
or reaching the storage (`FileStore.begin` / `FileStore.commit`)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import BinaryIO


class UploadTooLarge(Exception):
    """The upload went past its byte limit (nothing was kept)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"file is larger than the limit of {limit} bytes")
        self.limit = limit


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


__all__ = ["Upload", "UploadTooLarge", "begin_upload"]
