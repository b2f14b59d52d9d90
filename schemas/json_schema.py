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

A valid schema can still make checking one instance cost exponential time: recursive
`$ref`s through `anyOf` are retried branch by branch at every level, so ~90 characters
of nested arrays held a writer for minutes. `errors()` therefore checks within a budget
of keyword evaluations (`STEP_BUDGET`) and raises `TooCostly` past it.
"""

from __future__ import annotations

import functools
import json
import re
import threading
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import regex
from jsonschema import Draft202012Validator, FormatChecker, validators
from jsonschema.exceptions import SchemaError, ValidationError
from jsonschema.protocols import Validator
from referencing import Registry
from referencing.exceptions import Unresolvable
from referencing.jsonschema import DRAFT202012

__all__ = [
    "REGEX_TIMEOUT_S",
    "STEP_BUDGET",
    "RegexTimeout",
    "StepBudget",
    "TooCostly",
    "check",
    "errors",
    "validator",
]

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


class _Refused(ValueError):
    """A reason of our own, worded for the caller."""


def _refs(schema: Any) -> tuple[list[str], bool]:
    """Every `$ref` in `schema`, and whether any subschema sets its own `$id`."""
    refs: list[str] = []
    has_id = False
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str):
                refs.append(ref)
            has_id = has_id or "$id" in node
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return refs, has_id


def _check_refs(schema: dict[str, Any]) -> None:
    """A `$ref` must resolve inside the schema: the worker never fetches another document,
    and a dangling reference would only fail when the model calls the tool."""
    refs, has_id = _refs(schema)
    if not refs or has_id:  # with nested $id the base URI moves; left to validation
        return
    base = "urn:qbatch:schema"
    resolver = Registry().with_resource(base, DRAFT202012.create_resource(schema)).resolver(base)
    for ref in refs:
        if not ref.startswith("#"):
            raise _Refused(f"$ref {ref[:80]!r} points outside the schema (not supported)")
        try:
            resolver.lookup(ref)
        except Unresolvable:
            raise _Refused(f"$ref {ref[:80]!r} does not resolve inside the schema") from None


@functools.lru_cache(maxsize=2048)
def _check_text(text: str) -> str | None:
    try:
        schema = json.loads(text)
        Draft202012Validator.check_schema(schema, format_checker=_FORMATS)
        _check_refs(schema)
    except _Refused as exc:
        return str(exc)
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


# ---------------------------------------------------------------- bounded checking

STEP_BUDGET = 100_000
"""Keyword evaluations one `errors()` call may make (~1 s; a tool call's arguments of
ordinary size take a few hundred)."""


class TooCostly(Exception):
    """Checking this instance against this schema would take more than the budget."""


_budget = threading.local()

Keyword = Callable[[Any, Any, Any, dict[str, Any]], Iterator[ValidationError] | None]


def _counted(keyword: Keyword) -> Keyword:
    def run(validator: Any, value: Any, instance: Any, schema: dict[str, Any]) -> Any:
        left: int | None = getattr(_budget, "left", None)
        if left is not None:
            if left <= 0:
                raise TooCostly
            _budget.left = left - 1
        return keyword(validator, value, instance, schema)

    return run


def _json_key(value: Any) -> Any:
    """A hashable key equal for JSON-equal values (1 and 1.0 alike, true and 1 not; key
    order ignored), so uniqueness is one pass over a set."""
    if isinstance(value, bool) or value is None:
        return ("c", value)
    if isinstance(value, int | float):
        return ("n", int(value) if isinstance(value, float) and value.is_integer() else value)
    if isinstance(value, str):
        return ("s", value)
    if isinstance(value, list):
        return ("a", tuple(_json_key(item) for item in value))
    if isinstance(value, dict):
        return ("o", frozenset((k, _json_key(v)) for k, v in value.items()))
    return ("?", repr(value))


def _unique_items(
    validator: Any, unique: Any, instance: Any, schema: dict[str, Any]
) -> Iterator[ValidationError]:
    """`uniqueItems` in linear time. jsonschema's own falls back to comparing every pair
    when items are not all sortable (arrays mixed with objects): 8,000 such items in the
    model's arguments took 36 s of the writer's time as one keyword evaluation, out of
    reach of the step budget."""
    if not unique or not validator.is_type(instance, "array"):
        return
    seen: set[Any] = set()
    for item in instance:
        key = _json_key(item)
        if key in seen:
            yield ValidationError(f"{instance!r} has non-unique elements")
            return
        seen.add(key)


_Budgeted = validators.extend(
    Draft202012Validator,
    {
        name: _counted(_unique_items if name == "uniqueItems" else fn)
        for name, fn in Draft202012Validator.VALIDATORS.items()
    },
)


@functools.lru_cache(maxsize=1024)
def _validator_for(text: str) -> Validator:
    return _Budgeted(json.loads(text))


def validator(schema: dict[str, Any]) -> Validator:
    """A validator for a schema that passed `check()`; its regex searches are time-limited
    and, through `errors()`, its whole check is bounded."""
    _install_time_limit()
    return _validator_for(_key(schema))


@dataclass
class StepBudget:
    """Keyword evaluations several `errors()` calls share: one model response's tool calls
    draw on one budget, so a response of a hundred costly calls costs what one does."""

    total: int = STEP_BUDGET
    left: int = field(init=False)

    def __post_init__(self) -> None:
        self.left = self.total


def errors(
    checker: Validator, instance: Any, budget: int | StepBudget = STEP_BUDGET
) -> list[ValidationError]:
    """Every error of `instance`, or `TooCostly` once the budget's keyword evaluations are
    spent (per thread: the writer and the tool executor check concurrently). An `int` is a
    budget for this check alone; a `StepBudget` is drawn down and keeps what is left."""
    shared = budget if isinstance(budget, StepBudget) else StepBudget(budget)
    start = shared.left
    _budget.left = start
    try:
        return list(checker.iter_errors(instance))
    except TooCostly:
        spent = shared.total - start
        earlier = f" ({spent:,} of {shared.total:,} spent by earlier checks)" if spent else ""
        raise TooCostly(f"more than {start:,} steps to check{earlier}") from None
    except RecursionError:
        # jsonschema (and `_json_key`) descend recursively: a value nested a few hundred
        # levels deep, which JSON allows, must be a refusal, not an exception that stops
        # the caller (the tool executor's loop).
        raise TooCostly("nested too deeply to check") from None
    finally:
        shared.left = max(int(_budget.left or 0), 0)
        _budget.left = None
