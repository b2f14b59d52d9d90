"""Upkeep of `qbatch serve`'s file storage, on a thread of its own so that no batch waits
behind it (on S3 a pass is a LIST per 1,000 objects and more): indexing a store once
(`FileStore.reindex`), then removing expired files every `expiry_interval_s`
(`FileStore.sweep_expired`) and what crashes left every `leftover_interval_s`
(`FileStore.sweep_leftovers`). Every replica runs it; each step is safe to run on
several replicas at once (each re-checks a file before removing it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from producer.serve.storage import FileStore

log = logging.getLogger("qbatch.serve")


@dataclass
class Job:
    """One upkeep step: `action` returns how many things it did; `every_s` None: once."""

    name: str
    action: Callable[[], int]
    every_s: float | None
    did: str
    """The log line's text after the count, when the count is not 0."""
    due: float = 0.0
    done: bool = False


class Upkeep:
    """The storage's upkeep jobs and the thread that runs them when due (`run_due`, with
    an injected `clock`, is what the thread calls: tests call it directly)."""

    def __init__(
        self,
        storage: FileStore,
        *,
        reindex_force: bool = False,
        expiry_interval_s: float = 300.0,
        leftover_interval_s: float = 3_600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.clock = clock
        self.jobs = [
            Job("index", lambda: storage.reindex(force=reindex_force), None, "files indexed"),
            Job("expiry sweep", storage.sweep_expired, expiry_interval_s, "expired files removed"),
            Job(
                "leftover sweep",
                storage.sweep_leftovers,
                leftover_interval_s,
                "leftovers of crashes removed (data without metadata, old temp files)",
            ),
        ]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def run_due(self) -> float:
        """Run each job whose time has come, in order; a failing one is logged and tried
        again at its next time (a failed index: at the next start). Returns the seconds
        until the next job is due."""
        for job in self.jobs:
            if job.done or self.clock() < job.due or self._stop.is_set():
                continue
            try:
                count = job.action()
            except Exception:
                log.exception("serve storage: %s failed; trying again later", job.name)
            else:
                if count:
                    log.info("serve storage: %d %s", count, job.did)
            if job.every_s is None:
                job.done = True
            else:
                job.due = self.clock() + job.every_s
        waiting = [job.due for job in self.jobs if not job.done]
        return max(0.0, min(waiting) - self.clock()) if waiting else 3_600.0

    def start(self) -> None:
        def run() -> None:
            while not self._stop.is_set():
                self._stop.wait(self.run_due())

        self._thread = threading.Thread(target=run, name="qbatch-serve-upkeep", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stops between jobs (one under way finishes first, up to `timeout`)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)


__all__ = ["Job", "Upkeep"]
