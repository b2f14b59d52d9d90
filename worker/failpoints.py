"""Named fault-injection points, for tests that kill each worker thread in turn.

`QBATCH_FAILPOINTS` (read once, at import) is a comma-separated list of `point` or
`point=request_id`; a point fires (raises `FailpointError`) when the code reaches it with
that request_id among the ids it is handling (or with any ids, when none is named).
Points: `accept` (main loop, one record, once decoded), `dispatch` (dispatcher, one
micro-batch), `write` (writer, one chunk, for requests that succeeded: a fault in how a
response is written), `executor` (the tool executor, one poll's events), and `qbatch
serve`'s file store with file ids: `serve_put_record` (an upload's bytes are written, its
record not yet), `serve_delete_bytes` (a file's record is removed, its bytes not yet).
Unset in production: `hit()` is then a dict lookup. In-process tests arm points with
`armed(...)` instead of the variable.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

__all__ = ["FailpointError", "armed", "hit"]


class FailpointError(RuntimeError):
    """An injected fault."""


def _parse(text: str) -> dict[str, set[str] | None]:
    points: dict[str, set[str] | None] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, rid = item.partition("=")
        if not rid:
            points[name] = None
        else:
            ids = points.setdefault(name, set())
            if ids is not None:
                ids.add(rid)
    return points


_POINTS = _parse(os.environ.get("QBATCH_FAILPOINTS", ""))


def hit(point: str, request_ids: Iterable[str | None] = ()) -> None:
    """Raise `FailpointError` if `point` is armed for one of `request_ids`."""
    if point not in _POINTS:
        return
    wanted = _POINTS[point]
    if wanted is None or wanted.intersection(request_ids):
        raise FailpointError(f"failpoint {point} fired")


@contextmanager
def armed(spec: str) -> Iterator[None]:
    """Arm `spec` (the variable's syntax) for the block, on top of what is armed."""
    saved = {name: None if ids is None else set(ids) for name, ids in _POINTS.items()}
    for name, ids in _parse(spec).items():
        current = _POINTS.get(name, set())
        _POINTS[name] = None if ids is None or current is None else current | ids
    try:
        yield
    finally:
        _POINTS.clear()
        _POINTS.update(saved)
