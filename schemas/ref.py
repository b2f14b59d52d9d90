"""What a result echoes from its request, known even when the request itself is refused.

A record that fails validation still names its request_id, job, custom_id, metadata and
TTL (most often only one field is wrong). Its `failed` result must carry them, or its
job's counters never move and the job never finishes. `RequestRef.recover` salvages each
field on its own, keeping only values that are valid by themselves.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError
from pydantic_core import to_json

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

    @classmethod
    def recover(cls, data: object, key: bytes | None) -> RequestRef | None:
        """Best effort, field by field: None when no valid request_id can be found (from the
        JSON object `data`, else from the record key)."""
        from schemas.decode import valid_id

        fields = data if isinstance(data, dict) else {}
        request_id = valid_id(fields.get("request_id"))
        if request_id is None and key:
            try:
                request_id = valid_id(key.decode("utf-8"))
            except UnicodeDecodeError:
                request_id = None
        if request_id is None:
            return None
        return cls(
            request_id=request_id,
            job_id=_field("job_id", fields),
            custom_id=_field("custom_id", fields),
            metadata=_field("metadata", fields),
            result_ttl_s=_field("result_ttl_s", fields) or limits.DEFAULT_RESULT_TTL_S,
        )


def _field(name: str, data: dict[str, Any]) -> Any:
    """`data[name]` if it is valid under the envelope's own rule for that field, else None."""
    if name not in data:
        return None
    from schemas.request import RequestEnvelope

    info = RequestEnvelope.model_fields[name]
    adapter = _ADAPTERS.get(name)
    if adapter is None:
        adapter = _ADAPTERS[name] = TypeAdapter(info.rebuild_annotation())
    try:
        value = adapter.validate_python(data[name])
    except (ValidationError, ValueError, RecursionError):
        return None
    if name == "metadata" and len(to_json(value)) > limits.MAX_METADATA_BYTES:
        return None  # the envelope's size rule for metadata is a model validator
    return value


_ADAPTERS: dict[str, TypeAdapter[Any]] = {}
