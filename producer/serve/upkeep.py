"""Upkeep of `qbatch serve`'s file storage, on threads of its own so that no batch waits
behind it (on S3 a pass is a LIST per 1,000 objects and more): indexing a store once
(`FileStore.reindex`), then removing expired files every `expiry_interval_s`
(`FileStore.sweep_expired`) and what crashes left every `leftover_interval_s`
(`FileStore.sweep_leftovers`), each job on its own thread. Every replica runs it;
each step is safe to run on several replicas at once (each re-checks a file before
removing it) and beside this process's requests and batch runner (the storage's
per-file locks).
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

    def run(self) -> None:
        """Once; a failure is logged (the next run, or the next start for a one-off,
        tries again)."""
        try:
            count = self.action()
        except Exception:
            log.exception("serve storage: %s failed; trying again later", self.name)
            return
        if count:
            log.info("serve storage: %d %s", count, self.did)


class Upkeep:
    """The storage's upkeep jobs, each on a thread of its own: a long one (a forced
    index or a leftover pass over a large bucket) never holds the expiry sweep."""

    def __init__(
        self,
        storage: FileStore,
        *,
        reindex_force: bool = False,
        expiry_interval_s: float = 300.0,
        leftover_interval_s: float = 3_600.0,
    ) -> None:
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
        self._threads: list[threading.Thread] = []

    def _loop(self, job: Job) -> None:
        while not self._stop.is_set():
            job.run()
            if job.every_s is None or self._stop.wait(job.every_s):
                return

    def start(self) -> None:
        for job in self.jobs:
            name = f"qbatch-serve-upkeep-{job.name.replace(' ', '-')}"
            thread = threading.Thread(target=self._loop, args=(job,), name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self, timeout: float = 10.0) -> None:
        """No job starts again; returns once each is done or `timeout` has passed (a
        pass under way is not cut: its thread is a daemon, and every step of a pass is
        safe to stop anywhere, as a crash would)."""
        self._stop.set()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    @property
    def alive(self) -> list[str]:
        """The jobs whose threads still run."""
        return [t.name for t in self._threads if t.is_alive()]


__all__ = ["Job", "Upkeep"]
