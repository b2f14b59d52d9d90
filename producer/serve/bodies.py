"""Request bodies read with a ceiling.

Starlette's `request.body()` / `request.json()` buffer whatever the client sends before
the route can look at its size, so a sign-in form (no key needed) or a batch body of a
few gigabytes would sit in the server's memory first. Every route that reads a whole
body reads it here instead: a declared `Content-Length` over the limit is refused
before a byte is read, and a body streamed without one (chunked) is refused as soon as
it passes the limit.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request

from producer.serve.errors import ApiError
from schemas.limits import MAX_ENVELOPE_BYTES, MAX_METADATA_BYTES

BATCH_BODY_BYTES = MAX_METADATA_BYTES + 16 * 1024
"""A create-batch body: ids, endpoint, window and at most 16 KiB of metadata."""
SYNC_BODY_BYTES = MAX_ENVELOPE_BYTES
"""A sync chat/completions body becomes one envelope, which may not exceed this."""


def too_large(limit: int) -> ApiError:
    return ApiError(
        413,
        f"the request body is over this endpoint's limit of {limit} bytes",
        code="request_too_large",
    )


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, or 413 `request_too_large` once it is known to exceed `limit`."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large(limit)
    parts: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        parts.append(chunk)
    return b"".join(parts)


async def json_body(request: Request, limit: int) -> Any:
    """The body parsed as JSON (400 `invalid_json` when it is not)."""
    raw = await read_body(request, limit)
    try:
        return json.loads(raw)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError both
        raise ApiError(400, "the request body is not JSON", code="invalid_json") from None
    except RecursionError:  # nested past the parser's depth: the body's fault, not a 500
        raise ApiError(
            400, "the request body is nested too deeply to read", code="invalid_json"
        ) from None


__all__ = ["BATCH_BODY_BYTES", "SYNC_BODY_BYTES", "json_body", "read_body", "too_large"]
