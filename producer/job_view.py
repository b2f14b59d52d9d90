"""A job hash read at one moment, with the figures `qbatch bulk status` shows. Pure."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from rich.table import Table

from schemas import JobField, JobStatus

TERMINAL = frozenset({JobStatus.completed, JobStatus.completed_with_errors, JobStatus.cancelled})


def _int(value: object) -> int:
    if value is None:
        return 0
    if isinstance(value, bytes):
        value = value.decode()
    try:
        return int(str(value))
    except ValueError:
        return 0


@dataclass(frozen=True, slots=True)
class JobView:
    """A job hash, read at `now_ms`, with the derived figures `bulk status` shows."""

    job_id: str
    status: str
    total: int
    submitted: int
    succeeded: int
    failed: int
    expired: int
    cancelled: int
    created_at: int
    updated_at: int
    now_ms: int

    @classmethod
    def from_hash(cls, job_id: str, h: Mapping[Any, Any], now_ms: int) -> JobView:
        def get(name: str) -> object:
            if name in h:
                return h[name]
            return h.get(name.encode())

        status = get(JobField.status)
        if isinstance(status, bytes):
            status = status.decode()
        return cls(
            job_id=job_id,
            status=str(status) if status is not None else "unknown",
            total=_int(get(JobField.total)),
            submitted=_int(get(JobField.submitted)),
            succeeded=_int(get(JobField.succeeded)),
            failed=_int(get(JobField.failed)),
            expired=_int(get(JobField.expired)),
            cancelled=_int(get(JobField.cancelled)),
            created_at=_int(get(JobField.created_at)),
            updated_at=_int(get(JobField.updated_at)),
            now_ms=now_ms,
        )

    @property
    def done(self) -> int:
        return self.succeeded + self.failed + self.expired + self.cancelled

    @property
    def unsuccessful(self) -> int:
        return self.failed + self.expired + self.cancelled

    @property
    def pending(self) -> int:
        return max(self.total - self.done, 0)

    @property
    def finished(self) -> bool:
        """Every line has a result."""
        return self.total > 0 and self.done >= self.total

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL

    @property
    def all_succeeded(self) -> bool:
        return self.finished and self.unsuccessful == 0

    @property
    def progress_pct(self) -> float:
        """Done / total in percent, floored to 0.1, and never 100 while a result is missing."""
        if self.total <= 0:
            return 0.0
        if self.done >= self.total:
            return 100.0
        return min(math.floor(self.done * 1000 / self.total) / 10, 99.9)

    @property
    def elapsed_s(self) -> float:
        """From creation to the last result (finished jobs) or to now."""
        if not self.created_at:
            return 0.0
        end = self.updated_at if self.finished and self.updated_at else self.now_ms
        return max(end - self.created_at, 0) / 1000

    @property
    def rate(self) -> float | None:
        """Results per second since the job was created."""
        if self.elapsed_s <= 0 or self.done == 0:
            return None
        return self.done / self.elapsed_s

    @property
    def eta_s(self) -> float | None:
        if self.finished:
            return 0.0
        rate = self.rate
        if rate is None or self.status == JobStatus.cancelled:
            return None
        return self.pending / rate

    @property
    def label(self) -> str:
        """The status, said honestly (a finished job with failures says how many)."""
        if self.status == JobStatus.completed_with_errors or (
            self.status == JobStatus.completed and self.unsuccessful
        ):
            return (
                f"completed_with_errors ({self.succeeded} succeeded, {self.failed} failed, "
                f"{self.expired} expired, {self.cancelled} cancelled)"
            )
        if self.status == JobStatus.submitting:
            return f"submitting ({self.submitted}/{self.total} sent)"
        return self.status

    def as_dict(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "status": self.status,
            "total": self.total,
            "submitted": self.submitted,
            "succeeded": self.succeeded,
            "failed": self.failed,
            "expired": self.expired,
            "cancelled": self.cancelled,
            "done": self.done,
            "pending": self.pending,
            "progress_pct": self.progress_pct,
            "created_at": self.created_at or None,
            "updated_at": self.updated_at or None,
            "elapsed_s": round(self.elapsed_s, 3),
            "rate_per_s": round(self.rate, 3) if self.rate is not None else None,
            "eta_s": round(self.eta_s, 1) if self.eta_s is not None else None,
            "all_succeeded": self.all_succeeded,
        }


def status_table(view: JobView) -> Table:
    """`qbatch bulk status`: the job as a two-column table."""
    table = Table(title=f"job {view.job_id}", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value")

    def fmt_ms(ms: int) -> str:
        return datetime.fromtimestamp(ms / 1000).isoformat(timespec="seconds") if ms else "-"

    rows = [
        ("status", view.label),
        ("progress", f"{view.done}/{view.total} ({view.progress_pct:.1f}%)"),
        ("submitted", f"{view.submitted}/{view.total}"),
        ("succeeded", str(view.succeeded)),
        ("failed", str(view.failed)),
        ("expired", str(view.expired)),
        ("cancelled", str(view.cancelled)),
        ("pending", str(view.pending)),
        ("created", fmt_ms(view.created_at)),
        ("last result", fmt_ms(view.updated_at)),
        ("elapsed", f"{view.elapsed_s:.1f}s"),
        ("rate", f"{view.rate:.1f} results/s" if view.rate else "-"),
        ("ETA", f"{view.eta_s:.0f}s" if view.eta_s is not None else "-"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table
