"""The one-off import of a store written by a release before 2026-12-07.

Those releases kept each file's metadata in the store itself (`files/{id}.json` beside
`files/{id}.data`) and three indexes of empty entries (`tenants/`, `sizes/`,
`expiring/`). This release keeps records in Redis (`producer.serve.file_records`), so a
server that finds the store not yet imported (no `serve_files_imported` marker under
its Redis prefix) reads every old metadata document once, writes a record naming the
old bytes where they are (no byte is copied or moved), removes the old index entries,
and sets the marker. It runs in the background at start (`producer.serve.upkeep`);
until it is done, old files answer 404 and the orphan sweep waits. The old `.json`
documents are left to the orphan sweep (a day later), so a failed import can be run
again (`qbatch serve --reindex` forces one, for files an older replica wrote since).
Rolling back to an older release after the import is not supported: it would not see
the files stored since.
"""

from __future__ import annotations

import logging
import re

from producer.serve.storage import FileStore
from producer.serve.stored_file import StoredFile, legacy_file

log = logging.getLogger("qbatch.serve")

LEGACY_DOCUMENT = re.compile(r"^files/(file-[0-9a-f]{24,64})\.json$")
LEGACY_INDEXES = ("tenants/", "sizes/", "expiring/")
MAX_DOCUMENT_BYTES = 64 * 1024
"""An old metadata document is a few hundred bytes; a larger object there is not one."""


def import_legacy(store: FileStore, *, force: bool = False) -> int:
    """Import the old metadata documents (once per prefix, or again when `force`d);
    returns how many files got a record."""
    if store.records.imported() and not force:
        return 0
    count = 0
    for key, _modified in list(store.objects.listing("files/")):
        m = LEGACY_DOCUMENT.match(key)
        if m is None or store.records.get(m[1]) is not None:
            continue
        stored = _read_document(store, key)
        if stored is None or stored.id != m[1] or not store.objects.exists(stored.object):
            continue  # damaged, another kind, or its bytes already deleted
        store.records.add(stored)
        count += 1
    for folder in LEGACY_INDEXES:
        for key, _modified in list(store.objects.listing(folder)):
            store.objects.delete(key)
    store.records.mark_imported()
    return count


def _read_document(store: FileStore, key: str) -> StoredFile | None:
    data = bytearray()
    for chunk in store.objects.get(key):
        data += chunk
        if len(data) > MAX_DOCUMENT_BYTES:
            log.warning("serve storage: %s is not a metadata document (too large)", key)
            return None
    return legacy_file(bytes(data))


__all__ = ["LEGACY_DOCUMENT", "LEGACY_INDEXES", "import_legacy"]
