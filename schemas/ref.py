"""What a result echoes from its request, known even when the request itself is refused.

A record that fails validation still names its request_id, job, custom_id, metadata and
TTL (most often only one field is wrong). Its `failed` result must carry them, or its
job's counters never move and the job never finishes. `schemas.decode.recover_ref`
salvages each field on its own, keeping only values that are valid by themselves.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from schemas import limits


class RequestRef(BaseModel):
    """The parts of a request its result echoes (and that move its job's counters)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    request_id: str
    job_id: str | None = None
    custom_id: str | None = None
    metadata: dict[str, Any] | None = None
    result_ttl_s: int = limits.DEFAULT_RESULT_TTL_S

    @classmethod
    def of(cls, envelope: Any) -> RequestRef:
        """The reference of a valid `RequestEnvelope`."""
        return cls(
            request_id=envelope.request_id,
            job_id=envelope.job_id,
            custom_id=envelope.custom_id,
            metadata=envelope.metadata,
            result_ttl_s=envelope.result_ttl_s,
        )
