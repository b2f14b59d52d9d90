"""JSON Schemas that arrive inside requests (tool `parameters`, `response_format` schemas).

A schema is data from a stranger that the worker later executes: its `pattern`s become
regular expressions matched against model output. Three things can go wrong, and each
once stopped a worker for good (the record was never committed, so every restart died
on it again):

* the checker itself raising something other than `SchemaError`: `re.compile` of
  `a{99999999999}` raises `OverflowError`, a deeply nested schema `RecursionError`;
* a pattern that compiles but backtracks catastrophically (`(a+)+$`) when the model's
  arguments are matched against it: the writer thread would spin forever;
* a pattern one regex engine accepts and the other refuses.

So `check()` is the one edge check (Draft 2020-12 meta-schema, every pattern compiled by
the engine that will later run it, any exception turned into a `ValueError` that names
the problem), and `validator()` builds the validator the worker runs, whose regex
searches are time-limited. Both are cached by the schema's JSON text: a bulk job repeats
the same tools on every line.
"""

from __future__ import annotations

import functools
import json
import re
import types
from typing import Any

import regex
from jsonschema import Draft202012Validator, FormatChecker
from jsonschema.exceptions import SchemaError

__all__ = ["REGEX_TIMEOUT_S", "RegexTimeout", "check", "validator"]

REGEX_TIMEOUT_S = 0.05
"""Budget of one `pattern` search against model output; past it the call is refused."""

RegexTimeout = TimeoutError
"""What a search past its budget raises (the `regex` module's own exception)."""


def _compile_regex(value: object) -> bool:
    if isinstance(value, str):
        regex.compile(value)
    return True


_FORMATS = FormatChecker(formats=())
_FORMATS.checks("regex", raises=(regex.error, OverflowError, ValueError, RecursionError))(
    _compile_regex
)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, SchemaError):
        return f"not a valid JSON Schema: {exc.message}"
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    return f"not a usable JSON Schema: {type(exc).__name__}: {exc}"


@functools.lru_cache(maxsize=2048)
def _check_text(text: str) -> str | None:
    try:
        Draft202012Validator.check_schema(json.loads(text), format_checker=_FORMATS)
    except Exception as exc:  # any failure of the checker is the schema's fault
        return _reason(exc)
    return None


def _key(schema: dict[str, Any]) -> str:
    try:
        return json.dumps(schema, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (ValueError, TypeError, RecursionError) as exc:
        raise ValueError(_reason(exc)) from None


def check(schema: dict[str, Any]) -> None:
    """Raise `ValueError` (its message says what is wrong) unless `schema` is usable."""
    reason = _check_text(_key(schema))
    if reason is not None:
        raise ValueError(reason)


# ---------------------------------------------------------------- time-limited matching


class _TimeLimitedRe(types.ModuleType):
    """Stands in for `re` inside jsonschema's keyword modules: `search` runs on the `regex`
    engine with a timeout (raising `TimeoutError`); everything else is plain `re`.

    jsonschema matches `pattern`, `patternProperties` (and, through them,
    `additionalProperties` / `unevaluatedProperties`) with `re.search` and offers no
    hook for another engine, so its two modules that do are given this object as their
    `re`. Checked by tests/unit/test_json_schema.py (a catastrophic pattern is refused
    within the budget), so a jsonschema that moves its matching elsewhere fails there.
    """

    def __init__(self) -> None:
        super().__init__("re")

    def __getattr__(self, name: str) -> Any:
        return getattr(re, name)

    @staticmethod
    def search(pattern: str, string: str, flags: int = 0) -> Any:
        return regex.search(pattern, string, flags, timeout=REGEX_TIMEOUT_S)


def _install_time_limit() -> None:
    from jsonschema import _keywords, _utils

    for module in (_keywords, _utils):
        if not isinstance(getattr(module, "re", None), _TimeLimitedRe):
            module.re = _TimeLimitedRe()


@functools.lru_cache(maxsize=1024)
def _validator_for(text: str) -> Draft202012Validator:
    return Draft202012Validator(json.loads(text))


def validator(schema: dict[str, Any]) -> Draft202012Validator:
    """A validator for a schema that passed `check()`; its regex searches are time-limited."""
    _install_time_limit()
    return _validator_for(_key(schema))
