"""Every Lua script of the Redis contract, loaded from `schemas/lua/` in one place.

The scripts name hash fields, job states and stream fields through `${...}`
placeholders filled from the enums in `schemas.keys` and `schemas.result`, so a name
lives once, in Python; a script using a placeholder that no enum provides fails to
load (tests/unit/test_scripts.py loads them all and checks no name is hard-coded).
`finalize.lua`, `keytypes.lua` and `result_head.lua` are shared functions, prepended
where a script calls them.
"""

from __future__ import annotations

import functools
from importlib import resources
from string import Template

from schemas.keys import DONE_TOKEN, DUPLICATE_FIELD_PREFIX, JobField, JobStatus, StreamField
from schemas.result import RESULT_HEAD_BYTES, ResultEnvelope, Status

__all__ = ["SCRIPT_NAMES", "function", "lua", "placeholders"]

_FUNCTIONS = {"finalize": "finalize(", "keytypes": "wrong_type(", "result_head": "result_head("}

SCRIPT_NAMES = (
    "write_results",
    "record_duplicate",
    "admission",
    "job_begin",
    "job_mark_submitted",
    "job_cancel",
    "job_begin_retry",
    "write_result_cluster",
    "count_results",
)


def placeholders() -> dict[str, str]:
    """`${...}` name -> value, from the enums."""
    names: dict[str, str] = {"done_token": DONE_TOKEN, "dup_prefix": DUPLICATE_FIELD_PREFIX}
    names["result_status"] = _result_field("status")
    names["head_bytes"] = str(RESULT_HEAD_BYTES)
    names.update({f"F_{f.name}": f.value for f in JobField})
    names.update({f"S_{s.name}": s.value for s in JobStatus})
    names.update({f"R_{s.name}": s.value for s in Status})
    names.update({f"X_{x.name}": x.value for x in StreamField})
    return names


def _result_field(name: str) -> str:
    """A field of the result envelope JSON a script reads (fails to load if renamed)."""
    if name not in ResultEnvelope.model_fields:
        raise KeyError(f"the result envelope has no field {name!r}")
    return name


def _source(name: str) -> str:
    return resources.files("schemas").joinpath("lua", f"{name}.lua").read_text("utf-8")


def function(name: str) -> str:
    """A shared function file (`finalize`, `keytypes`, `result_head`), placeholders filled:
    for tests that call the function on its own."""
    if name not in _FUNCTIONS:
        raise KeyError(name)
    return Template(_source(name)).substitute(placeholders())


@functools.cache
def lua(name: str) -> str:
    """The runnable text of script `name` (shared functions it calls prepended)."""
    body = _source(name)
    parts = [_source(fn) for fn, call in _FUNCTIONS.items() if fn != name and call in body]
    return Template("\n".join([*parts, body])).substitute(placeholders())
