"""Bytes off the wire -> a typed envelope, or a `ContractError` that names the fault.

The worker and the producer both validate here, so a request the producer
accepts is one the worker accepts. When the envelope is bad we still recover
what we can of it (request_id, job, custom_id, metadata, TTL: see
`schemas.ref.RequestRef`) so the caller gets a `failed` result instead of waiting
forever, and its job still finishes.

Nothing but `ContractError` leaves `decode_request` or `validate_envelope`, whatever
the bytes: a parser or validator that raises anything else (a 5,000-digit integer,
a regex the checker overflows on, nesting past the recursion limit) is a fault of
the record, and a record must never stop the process that reads it.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import TypeAdapter, ValidationError
from pydantic_core import to_json

from schemas import limits
from schemas.errors import ContractError
from schemas.ref import RequestRef
from schemas.request import RequestEnvelope

_ID_RE = re.compile(limits.ID_PATTERN)


def valid_id(value: object) -> str | None:
    """`value` if it is a well-formed request or job id, else None."""
    if isinstance(value, str) and _ID_RE.fullmatch(value):
        return value
    return None


def recover_ref(data: object, key: bytes | None) -> RequestRef | None:
    """Best effort, field by field: None when no valid request_id can be found (from the
    JSON object `data`, else from the record key)."""
    fields = data if isinstance(data, dict) else {}
    request_id = valid_id(fields.get("request_id"))
    if request_id is None and key:
        try:
            request_id = valid_id(key.decode("utf-8"))
        except UnicodeDecodeError:
            request_id = None
    if request_id is None:
        return None
    return RequestRef(
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
    adapter = _ADAPTERS.get(name)
    if adapter is None:
        info = RequestEnvelope.model_fields[name]
        adapter = _ADAPTERS[name] = TypeAdapter(info.rebuild_annotation())
    try:
        value = adapter.validate_python(data[name])
    except (ValidationError, ValueError, RecursionError):
        return None
    if name == "metadata" and len(to_json(value)) > limits.MAX_METADATA_BYTES:
        return None  # the envelope's size rule for metadata is a model validator
    return value


_ADAPTERS: dict[str, TypeAdapter[Any]] = {}


def recover_request_id(data: object, key: bytes | None) -> str | None:
    """Best effort: a well-formed request_id from the parsed JSON or the record key."""
    ref = recover_ref(data, key)
    return ref.request_id if ref is not None else None


def _why(exc: BaseException) -> str:
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    return f"{type(exc).__name__}: {exc}"[:500]


def parse_json(raw: bytes, key: bytes | None = None) -> dict[str, Any]:
    """Size, encoding and JSON shape checks, before any model validation."""
    if len(raw) > limits.MAX_ENVELOPE_BYTES:
        raise ContractError(
            f"envelope is {len(raw)} bytes, over the {limits.MAX_ENVELOPE_BYTES} byte limit",
            param="(envelope)",
            ref=recover_ref(None, key),
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ContractError(
            f"not UTF-8 at byte {exc.start}",
            param="(envelope)",
            ref=recover_ref(None, key),
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ContractError(
            f"not JSON: {exc}", param="(envelope)", ref=recover_ref(None, key)
        ) from None
    except Exception as exc:  # integers past Python's digit limit, deep nesting, ...
        raise ContractError(
            f"not JSON this service can read: {_why(exc)}",
            param="(envelope)",
            ref=recover_ref(None, key),
        ) from None
    if not isinstance(data, dict):
        raise ContractError(
            f"envelope must be a JSON object, got {type(data).__name__}",
            param="(envelope)",
            ref=recover_ref(None, key),
        )
    return data


def validate_envelope(data: dict[str, Any], key: bytes | None = None) -> RequestEnvelope:
    try:
        return RequestEnvelope.model_validate(data)
    except ValidationError as exc:
        raise ContractError.from_validation(exc, ref=_recover(data, key)) from None
    except Exception as exc:  # a validator that raised past pydantic: still the record's fault
        raise ContractError(
            f"could not be validated: {_why(exc)}", param="(envelope)", ref=_recover(data, key)
        ) from None


def _recover(data: object, key: bytes | None) -> RequestRef | None:
    try:
        return recover_ref(data, key)
    except Exception:  # salvage is best effort; never worse than no reference
        return None


def decode_request(raw: bytes, key: bytes | None = None) -> RequestEnvelope:
    """The one way a request is read off Kafka.

    The happy path parses and validates in one pass inside pydantic-core; only a
    record that fails takes the slow path that recovers a reference and words
    the error.
    """
    if len(raw) <= limits.MAX_ENVELOPE_BYTES:
        try:
            envelope = RequestEnvelope.model_validate_json(raw)
        except Exception:
            envelope = validate_envelope(parse_json(raw, key), key)
    else:
        envelope = validate_envelope(parse_json(raw, key), key)
    if key is not None and key != envelope.request_id.encode("utf-8"):
        raise ContractError(
            "record key must equal request_id",
            param="request_id",
            ref=RequestRef.of(envelope),
        )
    return envelope


def encode_request(envelope: RequestEnvelope) -> bytes:
    """Canonical bytes for the wire (None fields dropped to keep records small)."""
    return envelope.model_dump_json(exclude_none=True, by_alias=True).encode("utf-8")
