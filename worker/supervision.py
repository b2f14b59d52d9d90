"""No thread dies silently, and no record stops workers for ever.

`Supervisor.guard` wraps each worker thread's loop: an unexpected exception is logged
with the thread's context, liveness turns false at once, and the worker stops cleanly
(hands back, commits what is written, exits non-zero) so its supervisor restarts it.

A record that keeps stopping workers would otherwise be a poison pill: its offset is
never committed, so every new worker meets it again. Each fault therefore gives a
*strike* to the records the failing thread was handling (kept in Redis, so strikes
survive the restart). A record with one strike runs on probation, alone in its batch and
its write, so a second fault blames it and nothing else; a record with two strikes is
not run again but dead-lettered with a `failed` result. The counting rule (`StrikeBook`)
is pure; the Redis part is a thin adapter.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from schemas.redis_conn import reply_text
from worker.logs import log

QUARANTINE_AFTER = 2
STRIKES_TTL_S = 7 * 86_400

Suspect = tuple[str, int, int, int]
"""(topic, partition, offset, CRC-32 of key and value) of a record: its content is part of
its name, so a topic deleted and created again starts clean (an ordinary request at a
quarantined offset of the old topic was failed unrun)."""


class Verdict(StrEnum):
    run = "run"
    isolate = "isolate"
    quarantine = "quarantine"


class Checked(Protocol):
    topic: str
    partition: int
    offset: int

    def checksum(self) -> int: ...


@dataclass(slots=True)
class StrikeBook:
    """Strike counts per record, and what they mean."""

    counts: dict[tuple[str, int, int], dict[int | None, int]] = field(default_factory=dict)
    """(topic, partition, offset) -> checksum -> strikes. Checksum None: an entry written
    before strikes named the content (it matches any record at that place)."""

    def verdict(self, record: Checked) -> Verdict:
        """The record's checksum is computed only when its place has strikes (rare)."""
        at = self.counts.get((record.topic, record.partition, record.offset))
        if not at:
            return Verdict.run
        strikes = at.get(None, 0) + at.get(record.checksum(), 0)
        if strikes >= QUARANTINE_AFTER:
            return Verdict.quarantine
        return Verdict.isolate if strikes else Verdict.run

    def add(self, suspects: Iterable[Suspect]) -> list[Suspect]:
        added = list(dict.fromkeys(suspects))
        for topic, partition, offset, checksum in added:
            at = self.counts.setdefault((topic, partition, offset), {})
            at[checksum] = at.get(checksum, 0) + 1
        return added

    @staticmethod
    def field_of(suspect: Suspect) -> str:
        topic, partition, offset, checksum = suspect
        return f"{topic}/{partition}/{offset}/{checksum:08x}"

    @staticmethod
    def parse(name: str) -> tuple[str, int, int, int | None] | None:
        """A field's (topic, partition, offset, checksum); None for what is not one. Topic
        names hold no `/`, so three parts are an entry of the release before checksums."""
        parts = name.split("/")
        try:
            if len(parts) == 4 and parts[0]:
                return parts[0], int(parts[1]), int(parts[2]), int(parts[3], 16)
            if len(parts) == 3 and parts[0]:
                return parts[0], int(parts[1]), int(parts[2]), None
        except ValueError:
            return None
        return None


class StrikeStore:
    """The strike book's copy in Redis (hash `{prefix}:strikes:{group}`); best effort."""

    def __init__(self, client: Any | None, key: str) -> None:
        self._client = client
        self._key = key

    def load(self) -> StrikeBook:
        book = StrikeBook()
        if self._client is None:
            return book
        try:
            raw = self._client.hgetall(self._key)
        except Exception as exc:
            log.warning("strikes_unreadable", error=str(exc))
            return book
        for name, count in raw.items():
            parsed = StrikeBook.parse(reply_text(name))
            if parsed is not None:
                topic, partition, offset, checksum = parsed
                book.counts.setdefault((topic, partition, offset), {})[checksum] = int(count)
        return book

    def record(self, suspects: Iterable[Suspect]) -> None:
        if self._client is None:
            return
        try:
            pipe = self._client.pipeline(transaction=False)
            for suspect in suspects:
                pipe.hincrby(self._key, StrikeBook.field_of(suspect), 1)
            pipe.expire(self._key, STRIKES_TTL_S)
            pipe.execute()
        except Exception as exc:  # Redis may be what failed; the log still names them
            log.error("strikes_not_recorded", error=str(exc))


class Supervisor:
    """Runs the worker's loops; the first fault in any of them stops the worker."""

    def __init__(self, on_fault: Callable[[str], None], store: StrikeStore) -> None:
        self._on_fault = on_fault
        self._store = store
        self.book = store.load()
        self.fault: str | None = None
        self._lock = threading.Lock()

    def guard(
        self, name: str, loop: Callable[[], None], blame: Callable[[], Iterable[Suspect]]
    ) -> Callable[[], None]:
        """`loop` wrapped: returns normally, or reports its fault and returns."""

        def run() -> None:
            try:
                loop()
            except BaseException as exc:
                self.report(name, exc, blame())

        return run

    def report(self, name: str, exc: BaseException, suspects: Iterable[Suspect]) -> None:
        with self._lock:
            blamed = self.book.add(suspects)
            first = self.fault is None
            if first:
                self.fault = f"{name}: {type(exc).__name__}: {exc}"
        log.error(
            "thread_failed",
            thread=name,
            error=f"{type(exc).__name__}: {exc}",
            blamed=[StrikeBook.field_of(s) for s in blamed[:20]],
            blamed_count=len(blamed),
            exc_info=exc,
        )
        self._store.record(blamed)
        if first:
            self._on_fault(self.fault or name)


__all__ = ["StrikeBook", "StrikeStore", "Supervisor", "Verdict"]
