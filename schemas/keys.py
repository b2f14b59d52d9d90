"""Redis key layout of the v1 contract, in one place.

Every key is built here from a validated id (`[A-Za-z0-9_.:-]`), so no
request can make a worker write outside its prefix.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class JobField(StrEnum):
    """Fields of the `{prefix}:job:{job_id}` hash."""

    total = "total"
    succeeded = "succeeded"
    failed = "failed"
    expired = "expired"
    cancelled = "cancelled"
    created_at = "created_at"
    updated_at = "updated_at"
    submitted = "submitted"
    status = "status"


class JobStatus(StrEnum):
    submitting = "submitting"
    running = "running"
    cancelling = "cancelling"
    completed = "completed"
    completed_with_errors = "completed_with_errors"
    cancelled = "cancelled"


@dataclass(frozen=True, slots=True)
class RedisKeys:
    prefix: str = "qbatch"

    def result(self, request_id: str) -> str:
        return f"{self.prefix}:result:{request_id}"

    def done(self, request_id: str) -> str:
        return f"{self.prefix}:done:{request_id}"

    def job(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}"

    def job_stream(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}:done"

    def job_cancel(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}:cancel"


DONE_TOKEN = "1"
"""What the worker pushes onto `{prefix}:done:{request_id}`."""
