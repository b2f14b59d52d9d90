"""Envelopes from what a caller holds: a body, maybe an id and endpoint, and request options.

`QBatchClient.submit`/`submit_many` and the summariser build their envelopes here, so the
summariser needs the `Request` type without importing the client that runs it.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from schemas import ContractError, RequestEnvelope, validate_envelope
from schemas.endpoints import path_for
from schemas.request import OPTION_NAMES


def new_request_id() -> str:
    """A fresh request id: `req-` + 32 hex digits."""
    return f"req-{uuid.uuid4().hex}"


def now_utc() -> datetime:
    return datetime.now(UTC)


def build_envelope(
    body: Mapping[str, Any],
    *,
    request_id: str | None = None,
    endpoint: str | None = None,
    submitted_at: datetime | None = None,
    **options: Any,
) -> RequestEnvelope:
    """A validated envelope (ContractError naming the field if not valid).

    `options` are `schemas.RequestOptions` fields (job_id, custom_id, priority, deadline,
    result_ttl_s, metadata); None means "not set". An unknown name is a ContractError.
    """
    return Request(body=body, request_id=request_id, endpoint=endpoint, **options).envelope(
        submitted_at
    )


class Request:
    """One request for `submit_many`: a body, optionally its id and endpoint, and any
    `schemas.RequestOptions` (the same names `submit` takes; None means "not set")."""

    __slots__ = ("body", "endpoint", "options", "request_id")

    def __init__(
        self,
        body: Mapping[str, Any],
        *,
        request_id: str | None = None,
        endpoint: str | None = None,
        **options: Any,
    ) -> None:
        unknown = sorted(set(options) - set(OPTION_NAMES))
        if unknown:
            raise ContractError(
                f"unknown request option(s) {', '.join(unknown)}; known: {', '.join(OPTION_NAMES)}",
                param=unknown[0],
            )
        self.body = body
        self.request_id = request_id
        self.endpoint = endpoint
        self.options = {k: v for k, v in options.items() if v is not None}

    def __repr__(self) -> str:
        return f"Request(request_id={self.request_id!r}, options={self.options!r})"

    def envelope(self, submitted_at: datetime | None = None) -> RequestEnvelope:
        data: dict[str, Any] = {
            "request_id": self.request_id if self.request_id is not None else new_request_id(),
            "endpoint": self.endpoint or path_for(self.body),
            "body": dict(self.body),
            "submitted_at": (submitted_at or now_utc()).isoformat(),
        }
        for name, value in self.options.items():
            data[name] = value.isoformat() if isinstance(value, datetime) else value
        return validate_envelope(data)


__all__ = ["Request", "build_envelope", "new_request_id", "now_utc"]
