"""File storage of `qbatch serve` (OpenAI's Files API objects): each file's record in Redis
(`producer.serve.file_records`), its bytes an object (`producer.serve.objects`: a local
directory, S3, GCS or Azure), uploads spooled in a local `tmp` directory first
(`producer.serve.spool`).

Why this order: an upload streams into `tmp` and is counted as it comes, so an
oversize upload stops at its limit without ever being held in memory or reaching the
store. Then the bytes are written at a **new** object key, and only then the record
naming that key (atomically, with the tenant's sets, bytes and quota check), so a file
is visible exactly when it is complete. Deleting removes the record first, then the
bytes. A server killed at any point leaves at worst an object no record names, which
the orphan sweep (`sweep_orphans`, a day later) removes, never a listed file without
bytes. A rewrite of the same id (an output file of a batch finalized again after a
restart) writes new bytes at a new key and removes the old key after the record moved,
so it never races a delete of the bytes it replaced; no lock is needed anywhere.
"""

from __future__ import annotations

import itertools
import logging
import re
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from producer.serve.file_records import FileRecords, Removed, StorageFull
from producer.serve.objects import Objects
from producer.serve.spool import Upload, UploadTooLarge, begin_upload
from producer.serve.stored_file import (
    FILE_ID,
    PURPOSE_BATCH,
    PURPOSE_OUTPUT,
    StoredFile,
    new_stored,
)
from worker import failpoints

log = logging.getLogger("qbatch.serve")

LEFTOVER_AGE_S = 86_400
"""How old an object no record names, or a temp file, must be to be a crash's leftover
(nothing being written is that old)."""
SWEEP_BATCH = 500
"""Objects (or due files) one round trip of a sweep reads the records of."""
_OWNER = re.compile(r"^files/(file-[0-9a-f]{24,64})\.")


class FileStore:
    """What `qbatch serve` needs of a file storage: uploads, placing, reading, deleting,
    listing, quota counts and the sweeps. `clock` gives the time (injected: tests
    move it instead of patching the process's clock)."""

    def __init__(
        self,
        objects: Objects,
        records: FileRecords,
        tmp: Path,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.objects = objects
        self.records = records
        self.tmp = tmp
        """A local directory for uploads being received and output files being collected."""
        self.clock = clock
        tmp.mkdir(parents=True, exist_ok=True)

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
        quota: int | None = None,
    ) -> StoredFile:
        """Store a received upload (StorageFull past `quota`: nothing kept)."""
        upload.close()
        return self.put(
            upload.path,
            tenant=tenant,
            filename=filename,
            purpose=purpose,
            file_id=file_id,
            expires_after_s=expires_after_s,
            quota=quota,
        )

    def put(
        self,
        src: Path,
        *,
        tenant: str,
        filename: str,
        purpose: str,
        file_id: str | None = None,
        expires_after_s: int | None = None,
        quota: int | None = None,
    ) -> StoredFile:
        """Store a finished local file (removed afterwards, stored or not); `file_id`
        rewrites that file. StorageFull when `quota` is given and it would not fit."""
        stored = new_stored(
            src.stat().st_size, tenant, filename, purpose, file_id, expires_after_s, self.clock()
        )
        try:
            self.objects.put(stored.object, src)
        finally:
            src.unlink(missing_ok=True)
        failpoints.hit("serve_put_record", [stored.id])  # a crash here leaves an orphan
        try:
            replaced = self.records.add(stored, quota)
        except (StorageFull, ValueError):
            self.objects.delete(stored.object)  # refused: no record names it
            raise
        # any other failure may have come after the record was written (a connection
        # lost mid-reply): the bytes stay, and the orphan sweep removes them if unnamed
        if replaced and replaced != stored.object:
            self.objects.delete(replaced)
        return stored

    # ------------------------------------------------------------ reading, deleting

    def get(self, file_id: str, tenant: str) -> StoredFile | None:
        """The file if it exists, **belongs to `tenant`** and has not expired (else None:
        a 404 either way, so another tenant's id tells nothing)."""
        stored = self.records.get(file_id)
        if stored is None or stored.tenant != tenant or stored.expired(self.clock()):
            return None
        return stored

    def iter_bytes(
        self, stored: StoredFile, start: int | None = None, end: int | None = None
    ) -> Iterator[bytes]:
        """The file's bytes (from `start`, to `end` exclusive), streamed; the request is
        sent now (FileNotFoundError here for bytes gone)."""
        return self.objects.get(stored.object, start, end)

    def delete(self, file_id: str, tenant: str) -> bool:
        stored = self.get(file_id, tenant)
        while stored is not None:
            outcome = self.records.remove(stored)
            if outcome is Removed.removed:
                failpoints.hit("serve_delete_bytes", [stored.id])
                self.objects.delete(stored.object)
                return True
            if outcome is Removed.gone:
                return False
            stored = self.get(file_id, tenant)  # written again meanwhile: that one goes
        return False

    def usage(self, tenant: str) -> int:
        """The bytes a tenant's files hold (`--max-storage-bytes` measures this). Expired
        files count until the sweep removes them."""
        return self.records.usage(tenant)

    def list(
        self,
        tenant: str,
        *,
        purpose: str | None = None,
        after: str | None = None,
        limit: int = 10_000,
        order: str = "desc",
    ) -> tuple[list[StoredFile], bool]:
        """A tenant's live files by creation time (`order`), after the file id `after`;
        returns (page, has_more)."""
        now = self.clock()
        walk = self.records.walk(tenant, purpose=purpose, after=after, order=order, first=limit + 1)
        live = (f for f in walk if not f.expired(now))
        page = list(itertools.islice(live, limit))
        return page, next(live, None) is not None

    # ------------------------------------------------------------ upkeep

    def sweep_expired(self, now: float | None = None) -> int:
        """Remove the files whose time has come, whoever owns them; returns how many. One
        file that cannot be removed is logged and left for the next sweep."""
        now = self.clock() if now is None else now
        gone = 0
        while True:
            due = self.records.due(now, SWEEP_BATCH)
            progress = False
            for file_id in due:
                try:
                    stored = self.records.get(file_id)
                    if stored is None:
                        self.records.remove(_missing(file_id))  # drops the entry
                        progress = True
                        continue
                    if not stored.expired(now):
                        continue  # rewritten with a later time between the two reads
                    if self.records.remove(stored) is Removed.removed:
                        self.objects.delete(stored.object)
                        gone += 1
                        progress = True
                except Exception:
                    log.warning("serve storage: cannot remove expired %s", file_id, exc_info=True)
            if not progress or len(due) < SWEEP_BATCH:
                return gone

    def sweep_orphans(self, now: float | None = None, min_age_s: float = LEFTOVER_AGE_S) -> int:
        """Remove what crashes leave once it is `min_age_s` old (a day: nothing being
        written is that old): objects under `files/` that no record names (a server
        killed between writing bytes and their record, or in a delete; a release
        before 2026-12-07's metadata documents, once imported) and temp files in
        `tmp`. Runs only once the store's old metadata is imported (before that, old
        files have no records yet). Returns how many went."""
        before = (self.clock() if now is None else now) - min_age_s
        gone = 0
        if self.records.imported():
            try:
                old = (key for key, modified in self.objects.listing("files/") if modified < before)
                while batch := list(itertools.islice(old, SWEEP_BATCH)):
                    gone += self._drop_unnamed(batch)
            except Exception:
                log.warning("serve storage: cannot list the stored objects", exc_info=True)
        for path in self.tmp.iterdir():
            try:
                if path.is_file() and path.stat().st_mtime < before:
                    path.unlink()
                    gone += 1
            except FileNotFoundError:
                pass
            except OSError:
                log.warning("serve storage: cannot remove temp file %s", path.name, exc_info=True)
        return gone

    def _drop_unnamed(self, keys: Sequence[str]) -> int:
        """Delete the keys no record names (object keys are never reused, so one that is
        not named now never will be)."""
        owners = [m[1] if (m := _OWNER.match(k)) else None for k in keys]
        named = self.records.objects_of([o for o in owners if o is not None])
        it = iter(named)
        gone = 0
        for key, owner in zip(keys, owners, strict=True):
            if owner is None or next(it) == key:
                continue  # named by its record, or not a name this store writes
            try:
                self.objects.delete(key)
                gone += 1
            except Exception:
                log.warning("serve storage: cannot remove orphan %s", key, exc_info=True)
        return gone


def _missing(file_id: str) -> StoredFile:
    """A stand-in for a file with no record (its `remove` only drops its expiry entry)."""
    return StoredFile(file_id, 0, 0, "", PURPOSE_BATCH, "", None, "")


__all__ = [
    "FILE_ID",
    "LEFTOVER_AGE_S",
    "PURPOSE_BATCH",
    "PURPOSE_OUTPUT",
    "FileStore",
    "StorageFull",
    "StoredFile",
    "Upload",
    "UploadTooLarge",
    "begin_upload",
]
