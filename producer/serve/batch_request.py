"""A create-batch request of `qbatch serve` (`POST /v1/batches`) checked and turned into
its `BatchRecord`: every refusal is an OpenAI error naming the field at fault, and
nothing is stored until the whole body is good."""

from __future__ import annotations

import time
from typing import Any

from producer.serve.batches import (
    ENDPOINTS,
    BatchRecord,
    BatchStatus,
    new_batch_id,
    window_seconds,
)
from producer.serve.errors import ApiError, not_found
from producer.serve.expiry import policy_seconds
from producer.serve.storage import PURPOSE_BATCH, FileStore

INPUT_MARGIN_S = 3_600
"""How long an input file must outlive its batch's window: the runner may read it again
after the window (to answer lines nobody answered, `expiry_grace_s` later)."""
METADATA_PAIRS = 16
METADATA_KEY_CHARS = 64
METADATA_VALUE_CHARS = 512
"""OpenAI's metadata limits: 16 pairs, 64-character keys, 512-character values (a batch
record echoes its metadata with every read)."""
BATCH_FIELDS = {
    "input_file_id",
    "endpoint",
    "completion_window",
    "metadata",
    "output_expires_after",
}


def new_batch_record(storage: FileStore, tenant: str, body: Any) -> BatchRecord:
    """Check a create-batch body (each refusal names its field) and build the record."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_request")
    unknown = sorted(set(body) - BATCH_FIELDS)
    if unknown:
        raise ApiError(
            400, f"unknown field {unknown[0]!r}", code="unknown_parameter", param=unknown[0]
        )
    for name in ("input_file_id", "endpoint", "completion_window"):
        if not isinstance(body.get(name), str):
            raise ApiError(
                400, f"{name} is required (a string)", code="invalid_request", param=name
            )
    endpoint = body["endpoint"]
    if endpoint not in ENDPOINTS:
        raise ApiError(
            400,
            f"endpoint {endpoint!r} is not served by qbatch; use one of {', '.join(ENDPOINTS)}",
            code="invalid_endpoint",
            param="endpoint",
        )
    try:
        window = window_seconds(body["completion_window"])
    except ValueError as exc:
        raise ApiError(400, str(exc), code="invalid_request", param="completion_window") from None
    metadata = body.get("metadata")
    if metadata is not None and not (
        isinstance(metadata, dict)
        and len(metadata) <= METADATA_PAIRS
        and all(
            isinstance(k, str)
            and isinstance(v, str)
            and len(k) <= METADATA_KEY_CHARS
            and len(v) <= METADATA_VALUE_CHARS
            for k, v in metadata.items()
        )
    ):
        raise ApiError(
            400,
            f"metadata must be at most {METADATA_PAIRS} string keys of at most "
            f"{METADATA_KEY_CHARS} characters with string values of at most "
            f"{METADATA_VALUE_CHARS} (OpenAI's limits)",
            code="invalid_request",
            param="metadata",
        )
    output_expires_after_s = policy_seconds(
        body.get("output_expires_after"), "output_expires_after"
    )
    stored = storage.get(body["input_file_id"], tenant)
    if stored is None:
        raise not_found("File", body["input_file_id"])
    if stored.purpose != PURPOSE_BATCH:
        raise ApiError(
            400,
            f"file {stored.id} has purpose {stored.purpose!r}; a batch needs a 'batch' file",
            code="invalid_input_file",
            param="input_file_id",
        )
    now = int(time.time())
    if stored.expires_at is not None and stored.expires_at < now + window + INPUT_MARGIN_S:
        raise ApiError(
            400,
            f"file {stored.id} expires (expires_at {stored.expires_at}) less than an hour "
            f"after the batch's completion window ends ({now + window}); upload it with a "
            "longer expires_after",
            code="invalid_input_file",
            param="input_file_id",
        )
    return BatchRecord(
        id=new_batch_id(),
        tenant=tenant,
        endpoint=endpoint,
        input_file_id=stored.id,
        completion_window=body["completion_window"],
        status=BatchStatus.validating,
        created_at=now,
        expires_at=now + window,
        metadata=metadata,
        output_expires_after_s=output_expires_after_s,
    )


__all__ = ["BATCH_FIELDS", "INPUT_MARGIN_S", "new_batch_record"]
