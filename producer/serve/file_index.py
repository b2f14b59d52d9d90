"""The per-tenant listing index and the expiry index of `qbatch serve`'s file storage
(pure: names, keys and the listing's walk).

`GET /v1/files` used to read every metadata document in the store, every tenant's,
to answer one tenant: on S3 that is one GET per file in the bucket for each list call.
Each stored file now also has an empty **index entry** under its tenant's directory::

    tenants/{tenant_dir}/{created_at:012d}.{file_id}.{purpose}

The name carries everything a listing sorts and filters on, so a list call reads one
directory (one LIST per 1,000 entries on S3) and fetches the metadata of the page's
files only. `tenant_dir` is a hash of the tenant name: a name never becomes a path.

Written after the metadata and removed after it, so an entry whose metadata is gone is
a file being deleted (or one deleted by a server killed half-way): the listing skips
it and drops it. A server killed between the metadata and the entry leaves a file that
works by id but is not listed; its upload was never answered, so its client retries.
Stores written before the index existed are indexed once (`FileStore.reindex`, in the
background when the server starts; `MARKER_KEY` says it is done; `qbatch serve
--reindex` does it again, after replicas of an older release wrote files).

Each file also has a **size entry** in its tenant's folder of sizes::

    sizes/{tenant_dir}/{file_id}.{bytes}

so a tenant's storage use (its quota's measure, `tally`) is a walk of its two folders,
with no metadata read, and a listing walks no more names than before. A release from
before sizes never looks there, and a file it stored has no size entry:
`FileStore.usage` reads that file's metadata and writes the entry.

Files with an `expires_after` policy also have an entry in one store-wide folder::

    expiring/{expires_at:012d}.{file_id}

written before the file itself (so a file never outlives a crash unswept). Names sort
by time, so the sweep reads only the entries already due and stops at the first that is
not: files without a policy cost it nothing.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace

INDEX_DIR = "tenants"
SIZES_DIR = "sizes"
EXPIRY_DIR = "expiring"
REINDEXED = ".indexed-v3"
MARKER_KEY = f"{INDEX_DIR}/{REINDEXED}"
"""Every file stored before the index has its entries (v3: its size entry too)."""
MARKER_KEYS = (MARKER_KEY, f"{INDEX_DIR}/.indexed-v2")
"""What a reindex marks done: this release's marker and the one the release before it
reads (so a rollback to it does not index the whole store again)."""
_ID = r"file-[0-9a-f]{24,64}"
_PURPOSE = r"[a-z_]{1,32}"
FILE_ID = re.compile(rf"^{_ID}$")
"""What a file id looks like; anything else is never turned into a path or a key."""
PURPOSE = re.compile(rf"^{_PURPOSE}$")
"""What a purpose an entry can hold looks like (OpenAI's: `batch`, `batch_output`, ...)."""

_ENTRY = re.compile(rf"^(\d{{12}})\.({_ID})\.({_PURPOSE})(?:\.gone(\d{{12}}))?$")
TOMBSTONE_TTL_S = 86_400
"""How long a removed file's entry is kept as a tombstone (`IndexEntry.gone_at`)."""
_EXPIRY = re.compile(rf"^(\d{{12}})\.({_ID})$")
_SIZE = re.compile(rf"^({_ID})\.(\d{{1,15}})$")


def tenant_dir(tenant: str) -> str:
    """The directory name of a tenant's entries (a hash: any tenant name is safe)."""
    return hashlib.sha256(tenant.encode("utf-8")).hexdigest()[:32]


@dataclass(frozen=True, slots=True, order=True)
class IndexEntry:
    """One listed file as its entry name tells it (sorted by creation time, then id).

    A removed file leaves a **tombstone** for a day (`gone_at`, the removal time, in the
    name): never listed, but a cursor still finds its place. OpenAI's cursor is the
    last id of the previous page, and the SDK's usual clean-up loop (`for f in
    client.files.list(): client.files.delete(f.id)`) asks for the next page after a
    file it has just deleted; without the tombstone that page would be empty."""

    created_at: int
    file_id: str
    purpose: str
    gone_at: int | None = field(default=None, compare=False)

    @property
    def name(self) -> str:
        base = f"{self.created_at:012d}.{self.file_id}.{self.purpose}"
        return base if self.gone_at is None else f"{base}.gone{self.gone_at:012d}"

    def tombstone(self, now: float) -> IndexEntry:
        return replace(self, gone_at=int(now))

    @classmethod
    def parse(cls, name: str) -> IndexEntry | None:
        """The entry a name holds, or None for anything else (a marker, a temp file)."""
        m = _ENTRY.match(name)
        if m is None:
            return None
        return cls(int(m[1]), m[2], m[3], None if m[4] is None else int(m[4]))


@dataclass(frozen=True, slots=True, order=True)
class ExpiryEntry:
    """One file with a policy, as its `expiring/` entry tells it (sorted by time)."""

    expires_at: int
    file_id: str

    @property
    def name(self) -> str:
        return f"{self.expires_at:012d}.{self.file_id}"

    @classmethod
    def parse(cls, name: str) -> ExpiryEntry | None:
        m = _EXPIRY.match(name)
        return None if m is None else cls(int(m[1]), m[2])


@dataclass(frozen=True, slots=True, order=True)
class SizeEntry:
    """A stored file's size, as its entry in its tenant's folder of sizes tells it."""

    file_id: str
    bytes: int

    @property
    def name(self) -> str:
        return f"{self.file_id}.{self.bytes}"

    @classmethod
    def parse(cls, name: str) -> SizeEntry | None:
        m = _SIZE.match(name)
        return None if m is None else cls(m[1], int(m[2]))


@dataclass(frozen=True, slots=True)
class Unsure:
    """A listed file whose names do not settle its size: its live listing entries and
    size entries (its metadata, present or gone, says which are right)."""

    listed: list[IndexEntry]
    sizes: list[SizeEntry]


@dataclass(frozen=True, slots=True)
class Tally:
    """A tenant's storage use as its folders' names tell it (`tally`)."""

    bytes: int
    """The sizes of the listed files with one live listing entry and one size entry."""
    stale: list[SizeEntry]
    """Size entries of files no longer listed (removed, or being removed): to drop."""
    unsure: dict[str, Unsure]
    """Listed files with no size entry (stored by an older release, being stored now,
    or half removed by a crash), several (rewritten under the same id), or several
    live listing entries (rewritten by an older release, which leaves the old one)."""


def tally(listing: Iterable[str], sizes_found: Iterable[str]) -> Tally:
    """What a tenant's folders (its `listing` entries, its size entries) say its files
    hold. A size entry counts only beside a live listing entry of its file: it is
    written after that entry and removed before it, so a size entry alone is left from
    a file removed (by a crash or a race). Read the sizes first: then a file stored
    between the two reads is never taken for a removed one."""
    live: dict[str, list[IndexEntry]] = {}
    sizes: dict[str, list[SizeEntry]] = {}
    for name in sizes_found:
        if (size := SizeEntry.parse(name)) is not None:
            sizes.setdefault(size.file_id, []).append(size)
    for name in listing:
        if (entry := IndexEntry.parse(name)) is not None and entry.gone_at is None:
            live.setdefault(entry.file_id, []).append(entry)
    stale = [s for fid, found in sizes.items() if fid not in live for s in found]
    total, unsure = 0, {}
    for fid in sorted(live):
        found = sizes.get(fid, [])
        if len(found) == 1 and len(live[fid]) == 1:
            total += found[0].bytes
        else:
            unsure[fid] = Unsure(live[fid], found)
    return Tally(total, stale, unsure)


def tenant_folder(tenant: str) -> str:
    return f"{INDEX_DIR}/{tenant_dir(tenant)}"


def tenant_key(tenant: str, entry: IndexEntry) -> str:
    return f"{tenant_folder(tenant)}/{entry.name}"


def size_folder(tenant: str) -> str:
    return f"{SIZES_DIR}/{tenant_dir(tenant)}"


def size_key(tenant: str, entry: SizeEntry) -> str:
    return f"{size_folder(tenant)}/{entry.name}"


def expiry_key(entry: ExpiryEntry) -> str:
    return f"{EXPIRY_DIR}/{entry.name}"


def listing_order(
    entries: Iterable[IndexEntry], *, purpose: str | None, after: str | None, order: str
) -> list[IndexEntry]:
    """The live entries a listing walks, in creation `order`, from just after the file
    id `after`, found among live entries and tombstones alike (none when it is in
    neither: OpenAI's cursor is an id)."""
    mine = sorted(
        (e for e in entries if purpose is None or e.purpose == purpose),
        reverse=order != "asc",
    )
    if after is not None:
        ids = [e.file_id for e in mine]
        mine = mine[ids.index(after) + 1 :] if after in ids else []
    return [e for e in mine if e.gone_at is None]


def orphan_ids(objects: Iterable[tuple[str, float]], before: float) -> Iterator[tuple[str, float]]:
    """(id, modified time) of the data objects modified before `before` with no
    metadata beside them, from `files/`'s (name, modified time) in ascending order: a
    file's `.data` sorts just before its `.json`, so one pass holding one name finds
    them."""
    pending: tuple[str, float] | None = None  # a data object whose metadata may follow
    for name, modified in objects:
        stem, _, kind = name.rpartition(".")
        if pending is not None and (kind, stem) != ("json", pending[0]) and pending[1] < before:
            yield pending
        pending = (stem, modified) if kind == "data" and FILE_ID.match(stem) else None
    if pending is not None and pending[1] < before:
        yield pending


__all__ = [
    "EXPIRY_DIR",
    "FILE_ID",
    "INDEX_DIR",
    "MARKER_KEY",
    "MARKER_KEYS",
    "PURPOSE",
    "REINDEXED",
    "SIZES_DIR",
    "TOMBSTONE_TTL_S",
    "ExpiryEntry",
    "IndexEntry",
    "SizeEntry",
    "Tally",
    "Unsure",
    "expiry_key",
    "listing_order",
    "orphan_ids",
    "size_folder",
    "size_key",
    "tally",
    "tenant_dir",
    "tenant_folder",
    "tenant_key",
]
