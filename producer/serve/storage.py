"""File storage of `qbatch serve` (OpenAI's Files API objects): `FileStore`, the interface
the app and the runner use and what its backends share (`producer.serve.local_store`,
a directory; `producer.serve.s3`; `storage_url.open_storage` picks one).

Layout under the storage root::

    files/{file_id}.data   the bytes
    files/{file_id}.json   the metadata (OpenAI's file object + the owning tenant)
    tenants/{hash}/...     each tenant's listing index (empty entries; `file_index`)
    sizes/{hash}/...       each tenant's file sizes (empty entries; the storage quota)
    expiring/...           files with an `expires_after` policy, by time (`file_index`)
    tmp/                   uploads being received

Why this shape: an upload streams into `tmp/` and is counted as it comes, so an
oversize upload stops at the limit without ever being held in memory or landing in
`files/`; the data file is renamed into place first and the metadata last (each
atomically), so a file is visible exactly when it is complete, and a server killed at
any point leaves at worst an orphan `.data` or temp file (removed a day later by
`sweep_leftovers`, `producer.serve.upkeep`), never a listed file without bytes.
Output files get ids derived from their batch, so finalising a batch again after a
restart rewrites the same files instead of leaving orphans.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path

from producer.serve.file_index import (
    EXPIRY_DIR,
    FILE_ID,
    MARKER_KEY,
    MARKER_KEYS,
    TOMBSTONE_TTL_S,
    ExpiryEntry,
    IndexEntry,
    Unsure,
    expiry_key,
    listing_order,
    orphan_ids,
    size_folder,
    size_key,
    tally,
    tenant_folder,
    tenant_key,
)
from producer.serve.keyed_locks import KeyedLocks
from producer.serve.spool import Upload, UploadTooLarge, begin_upload
from producer.serve.stored_file import (
    PURPOSE_BATCH,
    PURPOSE_OUTPUT,
    StoredFile,
    clean_filename,
    new_file_id,
    new_stored,
    stored_any,
)

log = logging.getLogger("qbatch.serve")


MEND_PER_COUNT = 32
"""Files without a right size entry whose metadata one `usage` call reads (on S3 a GET
and a PUT each, inside an upload request): the rest wait for later calls."""
LEFTOVER_AGE_S = 86_400
"""How old a data object without metadata, or a temp file, must be to be a crash's
leftover (`FileStore.sweep_leftovers`)."""


def entry_keys(stored: StoredFile) -> tuple[str, str]:
    """The keys of a file's listing entry and size entry."""
    return (
        tenant_key(stored.tenant, stored.listing_entry),
        size_key(stored.tenant, stored.size_entry),
    )


class FileStore:
    """What `qbatch serve` needs of a file storage, and what every backend
    (`local_store.LocalStorage`, `s3.S3Storage`) shares: uploads spooled in `tmp`,
    placing, expiry, deleting, listing, the indexes. A backend gives `local_copy`,
    `iter_bytes`, `_place` (a finished local file and its metadata), `_read_meta`,
    `_unlink` (one of a file's two objects), `_metadata_docs` (every metadata document)
    and the indexes' empty entries: `_mark`, `_unmark`, `_marked`, `_marks` (a folder's
    names, in order)."""

    tmp: Path
    """A local directory for uploads being received and output files being collected."""

    def __init__(self) -> None:
        self._locks = KeyedLocks()
        """Placing, removing and the sweeps' check-then-remove of one file id never
        interleave on this store (the upkeep threads, the batch runner and requests reach
        the same ids); across replicas each step re-checks the file instead."""
        self._suspects: dict[str, float] = {}
        """Data objects without metadata seen by the last leftover sweep (id -> modified
        time): removed only if the next sweep finds them so, unchanged."""

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
        return self._store(upload.path, meta, may_exist=file_id is not None)

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
        return self._store(src, meta, may_exist=file_id is not None)

    def _store(self, src: Path, stored: StoredFile, *, may_exist: bool) -> StoredFile:
        """The expiry entry first (a file never outlives a crash unswept), then data and
        metadata (`_place`), then the listing entry, then the size entry (`tally` counts a
        size only beside its listing entry). A file it replaces (`may_exist`: the same id,
        an output file of a batch finalized again) loses its entries of other names."""
        with self._locks.hold(stored.id):
            before = self._load(stored.id) if may_exist else None
            if stored.expiry_entry is not None:
                self._mark(expiry_key(stored.expiry_entry))
            self._place(src, stored)
            for key in entry_keys(stored):  # the listing entry, then the size entry
                self._mark(key)
            if before is not None:
                self._drop_entries(before, stored)
        return stored

    def _drop_entries(self, gone: StoredFile, kept: StoredFile | None) -> None:
        """Unmark `gone`'s listing and size entries, but for names `kept` shares (the
        same id written again, in the same second or at the same size)."""
        keep = set() if kept is None else set(entry_keys(kept))
        for key in entry_keys(gone):
            if key not in keep:
                self._unmark(key)

    # ------------------------------------------------------------ reading, deleting

    def _load(self, file_id: str) -> StoredFile | None:
        """The file `file_id` names, whoever owns it, expired or not."""
        raw = self._read_meta(file_id)
        stored = None if raw is None else stored_any(raw)
        return stored if stored is not None and stored.id == file_id else None

    def get(self, file_id: str, tenant: str) -> StoredFile | None:
        """The file if it exists, **belongs to `tenant`** and has not expired (else None:
        a 404 either way, so another tenant's id tells nothing). Reading never deletes:
        an expired file goes on the sweep, which checks it again first."""
        if not FILE_ID.match(file_id):
            return None
        stored = self._load(file_id)
        if stored is None or stored.tenant != tenant or stored.expired():
            return None
        return stored

    def delete(self, file_id: str, tenant: str) -> bool:
        if not FILE_ID.match(file_id):
            return False
        with self._locks.hold(file_id):
            stored = self.get(file_id, tenant)
            if stored is None:
                return False
            self._remove(stored)
        return True

    def _remove(self, stored: StoredFile) -> None:
        """The size entry first (a server killed later leaves a listed file without one,
        which `usage` reads: counted while its metadata stays, not once it is gone), then
        the metadata (the file vanishes), its listing entry (a tombstone for a day:
        `IndexEntry`), then the bytes, unless the id was written again meanwhile (an
        output file of a batch finalized again: its new bytes stay; in this process the
        caller holds the id's lock, so that is another replica's)."""
        self._unmark(size_key(stored.tenant, stored.size_entry))
        self._unlink(stored.id, "json")
        entry = stored.listing_entry
        self._mark(tenant_key(stored.tenant, entry.tombstone(time.time())))
        self._unmark(tenant_key(stored.tenant, entry))
        again = self._load(stored.id)
        if again is None:
            self._unlink(stored.id, "data")
        else:  # its entries may share the names of those just dropped (the same second)
            for key in entry_keys(again):
                self._mark(key)
        if stored.expiry_entry is not None:
            self._unmark(expiry_key(stored.expiry_entry))

    def sweep_expired(self, now: float | None = None) -> int:
        """Remove the files whose time has come, whoever owns them; returns how many.
        Reads the expiry entries due (oldest first, stopping at the first not due) and
        each one's metadata again: a file rewritten since under the same id (an output
        file of a batch finalized again) has another time and stays. One file that
        cannot be removed is logged and left for the next sweep; the others go on."""
        now = time.time() if now is None else now
        gone = 0
        for name in self._marks(EXPIRY_DIR):
            entry = ExpiryEntry.parse(name)
            if entry is None:
                continue
            if entry.expires_at > now:
                break
            try:
                with self._locks.hold(entry.file_id):
                    stored = self._load(entry.file_id)
                    if stored is not None and stored.expiry_entry == entry:
                        self._remove(stored)
                        gone += 1
                    else:  # deleted or rewritten since: only the entry is left
                        self._unmark(expiry_key(entry))
            except Exception:
                log.warning("serve storage: cannot remove expired %s", entry.file_id, exc_info=True)
        return gone

    def sweep_leftovers(self, now: float | None = None, min_age_s: float = LEFTOVER_AGE_S) -> int:
        """Remove what crashes leave once it is `min_age_s` old (a day: nothing being
        written is that old): data objects without metadata (a server killed between a
        file's two objects, or in a delete), found so by two sweeps in a row with the
        same modified time (a restore copying `.data` before `.json` with old times is
        not one), and temp files in `tmp` (uploads and output files being collected
        when this process, or one before it on the same directory, died). One item
        that cannot be checked or removed is logged and the rest go on. Returns how
        many went."""
        before = (time.time() if now is None else now) - min_age_s
        gone, suspects = 0, {}
        try:
            for file_id, modified in orphan_ids(self._file_objects(), before):
                if self._suspects.get(file_id) != modified:
                    suspects[file_id] = modified  # removed if the next sweep sees it so
                    continue
                try:
                    with self._locks.hold(file_id):
                        if self._read_meta(file_id) is None:  # not placed meanwhile
                            self._unlink(file_id, "data")
                            gone += 1
                except Exception:
                    suspects[file_id] = modified
                    log.warning("serve storage: cannot remove orphan %s", file_id, exc_info=True)
        except Exception:
            log.warning("serve storage: cannot list the stored files", exc_info=True)
        self._suspects = suspects
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

    # ------------------------------------------------------------ listing

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
        reads the metadata of the page's files only."""
        entries = [e for n in self._marks(tenant_folder(tenant)) if (e := IndexEntry.parse(n))]
        old = time.time() - TOMBSTONE_TTL_S
        for e in entries:
            if e.gone_at is not None and e.gone_at < old:
                self._unmark(tenant_key(tenant, e))
        walk = listing_order(entries, purpose=purpose, after=after, order=order)
        live = (f for e in walk if (f := self._listed(tenant, e)) is not None)
        page = list(itertools.islice(live, limit))
        return page, next(live, None) is not None

    def _listed(self, tenant: str, entry: IndexEntry) -> StoredFile | None:
        """The entry's file, or None: expired (the sweep removes it), or gone or
        rewritten since (`put` with the same id gives it a new entry), when the stale
        entry is dropped here."""
        stored = self._load(entry.file_id)
        if stored is None or stored.tenant != tenant or stored.listing_entry != entry:
            self._unmark(tenant_key(tenant, entry))
            return None
        return None if stored.expired() else stored

    def usage(self, tenant: str) -> int:
        """The bytes a tenant's files hold (`--max-storage-bytes` measures this): a walk
        of its size and listing folders (`tally`), no metadata read. Size entries of
        removed files are dropped. A listed file whose names do not settle its size has
        its metadata read (under its lock: a file being stored is seen whole or not at
        all) and its entries put right: the right size entry written, others dropped,
        and listing entries of another file or none dropped too (a listing would drop
        them when met). At most `MEND_PER_COUNT` such files a call (after an upgrade
        the background index writes the rest; till then they count 0). Expired files
        count until the sweep removes them."""
        sizes = list(self._marks(size_folder(tenant)))  # first: see `tally`
        found = tally(self._marks(tenant_folder(tenant)), sizes)
        for size in found.stale:
            self._unmark(size_key(tenant, size))
        total = found.bytes
        for file_id, unsure in itertools.islice(found.unsure.items(), MEND_PER_COUNT):
            with self._locks.hold(file_id):
                total += self._mend(tenant, file_id, unsure)
        return total

    def _mend(self, tenant: str, file_id: str, unsure: Unsure) -> int:
        """Put one file's entries right from its metadata; returns its size (0: gone)."""
        stored = self._load(file_id)
        if stored is not None and stored.tenant != tenant:
            stored = None
        for entry in unsure.listed:
            if stored is None or entry != stored.listing_entry:
                self._unmark(tenant_key(tenant, entry))
        for size in unsure.sizes:
            if stored is None or size != stored.size_entry:
                self._unmark(size_key(tenant, size))
        if stored is None:
            return 0
        if stored.listing_entry not in unsure.listed:
            self._mark(tenant_key(tenant, stored.listing_entry))
        if stored.size_entry not in unsure.sizes:
            self._mark(size_key(tenant, stored.size_entry))
        return stored.bytes

    def reindex(self, *, force: bool = False) -> int:
        """Give every stored file its index entries: once per store (one written before
        the index existed), or again when `force`d (after replicas of an older release
        wrote files); returns how many files were indexed (0 when already marked)."""
        if not force and self._marked(MARKER_KEY):
            return 0
        count = 0
        for file_id, raw in self._metadata_docs():
            stored = stored_any(raw)
            if stored is None or stored.id != file_id:
                continue
            if stored.expiry_entry is not None:
                self._mark(expiry_key(stored.expiry_entry))
            with self._locks.hold(file_id):
                for key in entry_keys(stored):
                    self._mark(key)
                now = self._load(file_id)  # deleted or rewritten since its document was read?
                if now != stored:
                    self._drop_entries(stored, now)
            count += 1
        for marker in MARKER_KEYS:
            self._mark(marker)
        return count

    # ------------------------------------------------------------ what a backend gives

    def _place(self, src: Path, stored: StoredFile) -> None:
        raise NotImplementedError

    def _read_meta(self, file_id: str) -> str | bytes | None:
        raise NotImplementedError

    def _unlink(self, file_id: str, kind: str) -> None:
        raise NotImplementedError

    def _metadata_docs(self) -> Iterator[tuple[str, str | bytes]]:
        """(file id from the document's name, the document) for every one stored."""
        raise NotImplementedError

    def _file_objects(self) -> Iterator[tuple[str, float]]:
        """(name, modified time) of each object in `files/`, in ascending name order (a
        backend may give 0.0 for the times of metadata objects: only data's are read)."""
        raise NotImplementedError

    def local_copy(self, stored: StoredFile) -> AbstractContextManager[Path]:
        raise NotImplementedError

    def iter_bytes(self, stored: StoredFile, block: int = 1 << 16) -> Iterator[bytes]:
        raise NotImplementedError

    def _mark(self, key: str) -> None:
        raise NotImplementedError

    def _unmark(self, key: str) -> None:
        raise NotImplementedError

    def _marked(self, key: str) -> bool:
        raise NotImplementedError

    def _marks(self, folder: str) -> Iterator[str]:
        """The entry names directly in `folder`, in ascending order."""
        raise NotImplementedError


__all__ = [
    "FILE_ID",
    "PURPOSE_BATCH",
    "PURPOSE_OUTPUT",
    "FileStore",
    "StoredFile",
    "Upload",
    "UploadTooLarge",
    "begin_upload",
    "clean_filename",
    "new_file_id",
    "new_stored",
    "stored_any",
]
