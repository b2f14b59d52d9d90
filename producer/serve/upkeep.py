"""Upkeep of `qbatch serve`'s file storage, on threads of its own so that no batch waits
behind it (on S3 the orphan sweep is a LIST per 1,000 objects): importing a store
written by an older release once (`producer.serve.legacy_import`), then removing
expired files every `expiry_interval_s` (`FileStore.sweep_expired`) and what crashes
left every `leftover_interval_s` (`FileStore.sweep_orphans`), each job on its own
thread. Each step is safe beside this process's requests and batch runner: a record
is removed only if it still names the bytes the sweep read (`FileRecords.remove`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from producer.serve.legacy_import import import_legacy
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

    retry_s: float = 60.0
    """A one-off that failed runs again this much later (the import: old files answer 404
    until it is done, so it is not left for the next start)."""

    def run(self) -> bool:
        """Once; a failure is logged (the next run tries again). Whether it succeeded."""
        try:
            count = self.action()
        except Exception:
            log.exception("serve storage: %s failed; trying again later", self.name)
            return False
        if count:
            log.info("serve storage: %d %s", count, self.did)
        return True


def storage_jobs(
    storage: FileStore,
    *,
    reindex_force: bool = False,
    expiry_interval_s: float = 300.0,
    leftover_interval_s: float = 3_600.0,
) -> list[Job]:
    """The file store's upkeep: the import once, then the two sweeps."""
    return [
        Job(
            "import",
            lambda: import_legacy(storage, force=reindex_force),
            None,
            "files of an older release's store imported",
        ),
        Job("expiry sweep", storage.sweep_expired, expiry_interval_s, "expired files removed"),
        Job(
            "leftover sweep",
            storage.sweep_orphans,
            leftover_interval_s,
            "leftovers of crashes removed (objects no record names, old temp files)",
        ),
    ]


class Upkeep:
    """Upkeep jobs, each on a thread of its own: a long one (an import or an orphan pass
    over a large bucket) never holds the expiry sweep."""

    def __init__(self, jobs: list[Job]) -> None:
        self.jobs = jobs
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def _loop(self, job: Job) -> None:
        while not self._stop.is_set():
            done = job.run()
            if (job.every_s is None and done) or self._stop.wait(job.every_s or job.retry_s):
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


__all__ = ["Job", "Upkeep", "storage_jobs"]
