"""Expiration policies of `qbatch serve`'s files (OpenAI's `expires_after` on an upload,
`output_expires_after` on a batch's output and error files).

Both are `{"anchor": "created_at", "seconds": N}` with N from 3,600 (an hour) to
2,592,000 (30 days), as OpenAI takes them. A file's `expires_at` is its `created_at`
plus N; from then on the store treats it as gone (a 404, not listed) and removes it when
the upkeep's periodic sweep comes to it (`FileStore.sweep_expired`, `producer.serve.upkeep`).

Without a policy a file is kept until deleted. OpenAI expires `batch` uploads after 30
days by default; qbatch does not delete what its users did not ask it to.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from producer.serve.errors import ApiError

MIN_SECONDS = 3_600
MAX_SECONDS = 2_592_000
ANCHOR = "created_at"


def policy_seconds(value: Any, param: str) -> int | None:
    """The seconds of a policy object (None for an absent one); ApiError naming `param`
    (and its part) for anything else."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise _bad(f"{param} must be an object with 'anchor' and 'seconds'", param)
    unknown = sorted(set(value) - {"anchor", "seconds"})
    if unknown:
        raise _bad(f"unknown field {unknown[0]!r} in {param}", f"{param}.{unknown[0]}")
    if value.get("anchor") != ANCHOR:
        raise _bad(f"{param}.anchor must be {ANCHOR!r}", f"{param}.anchor")
    seconds = value.get("seconds")
    if isinstance(seconds, str) and re.fullmatch(r"[0-9]{1,10}", seconds):
        seconds = int(seconds)  # a multipart form sends every value as text
    if (
        not isinstance(seconds, int)
        or isinstance(seconds, bool)
        or not MIN_SECONDS <= seconds <= MAX_SECONDS
    ):
        raise _bad(
            f"{param}.seconds must be an integer from {MIN_SECONDS} to {MAX_SECONDS}",
            f"{param}.seconds",
        )
    return seconds


def form_policy(fields: Mapping[str, str], name: str) -> dict[str, str] | None:
    """A policy sent in a multipart form, where clients flatten the object into
    `name[anchor]` and `name[seconds]` fields (the `openai` SDK does); None if absent."""
    if name in fields:
        raise _bad(f"{name} must be sent as {name}[anchor] and {name}[seconds]", name)
    prefix = f"{name}["
    parts = {
        key[len(prefix) : -1]: value
        for key, value in fields.items()
        if key.startswith(prefix) and key.endswith("]")
    }
    return parts or None


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, message, code="invalid_request", param=param)


__all__ = ["ANCHOR", "MAX_SECONDS", "MIN_SECONDS", "form_policy", "policy_seconds"]
