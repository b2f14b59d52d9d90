"""`qbatch serve`'s files in a local directory (`--storage PATH` or `file://`; a volume in
production): the `storage.FileStore` contract on the filesystem, no sockets. The layout
and why it is shaped so: `producer.serve.storage`."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from producer.serve.storage import FileStore, StoredFile


class LocalStorage(FileStore):
    """Files in a local directory (default `./qbatch-files`; a volume in production)."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root
        self.files = root / "files"
        self.tmp = root / "tmp"
        for d in (self.files, self.tmp):
            d.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------ a file's two objects

    def _data(self, file_id: str) -> Path:
        return self.files / f"{file_id}.data"

    def _meta(self, file_id: str) -> Path:
        return self.files / f"{file_id}.json"

    def _place(self, src: Path, stored: StoredFile) -> None:
        os.replace(src, self._data(stored.id))
        fd, tmp = tempfile.mkstemp(prefix=".meta-", dir=self.tmp)
        with os.fdopen(fd, "wb") as fh:
            fh.write(stored.document().encode("utf-8"))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self._meta(stored.id))

    def _read_meta(self, file_id: str) -> bytes | None:
        """Bytes: a document that is not UTF-8 is then no file (`stored_any`), not a 500."""
        try:
            return self._meta(file_id).read_bytes()
        except FileNotFoundError:
            return None

    def _unlink(self, file_id: str, kind: str) -> None:
        (self._meta if kind == "json" else self._data)(file_id).unlink(missing_ok=True)

    def _metadata_docs(self) -> Iterator[tuple[str, bytes]]:
        for meta in self.files.glob("file-*.json"):
            with contextlib.suppress(FileNotFoundError):
                yield meta.stem, meta.read_bytes()

    def _file_objects(self) -> Iterator[tuple[str, float]]:
        for name in sorted(os.listdir(self.files)):
            if not name.endswith(".data"):
                yield name, 0.0
                continue
            with contextlib.suppress(FileNotFoundError):
                yield name, (self.files / name).stat().st_mtime

    def path(self, stored: StoredFile) -> Path:
        return self._data(stored.id)

    @contextlib.contextmanager
    def local_copy(self, stored: StoredFile) -> Iterator[Path]:
        """The file's bytes as a local path (here: the data file itself)."""
        yield self._data(stored.id)

    def iter_bytes(self, stored: StoredFile, block: int = 1 << 16) -> Iterator[bytes]:
        with self._data(stored.id).open("rb") as fh:
            yield from iter(lambda: fh.read(block), b"")

    # ------------------------------------------------------------ index entries (empty files)

    def _mark(self, key: str) -> None:
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()

    def _unmark(self, key: str) -> None:
        (self.root / key).unlink(missing_ok=True)

    def _marked(self, key: str) -> bool:
        return (self.root / key).exists()

    def _marks(self, folder: str) -> Iterator[str]:
        try:
            names = sorted(os.listdir(self.root / folder))
        except FileNotFoundError:
            return
        yield from names


__all__ = ["LocalStorage"]
