"""`qbatch serve`'s files in a local directory (`--storage PATH` or `file://`; a volume in
production): the `storage.FileStore` contract on the filesystem, no sockets. The layout
and why it is shaped so: `producer.serve.storage`."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from producer.serve.file_index import INDEX_DIR, REINDEXED, IndexEntry, tenant_dir
from producer.serve.storage import FileStore, StoredFile, stored_from_json


class LocalStorage(FileStore):
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

    def _place(self, src: Path, stored: StoredFile) -> None:
        os.replace(src, self._data(stored.id))
        self._write_json(self._meta(stored.id), asdict(stored))

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

    def _load(self, file_id: str, tenant: str) -> StoredFile | None:
        try:
            return stored_from_json(self._meta(file_id).read_text(encoding="utf-8"), tenant)
        except FileNotFoundError:
            return None

    def _unlink(self, file_id: str, kind: str) -> None:
        (self._meta if kind == "json" else self._data)(file_id).unlink(missing_ok=True)

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


__all__ = ["LocalStorage"]
