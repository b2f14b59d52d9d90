"""schemas.json_schema: a stranger's JSON Schema can neither stop nor hang a process."""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import json_schema


@pytest.mark.parametrize(
    ("schema", "why"),
    [
        (
            {
                "type": "object",
                "properties": {"a": {"type": "string", "pattern": "a{99999999999}"}},
            },
            "regex",
        ),
        ({"type": "object", "patternProperties": {"(": {"type": "string"}}}, "regex"),
        ({"type": "object", "properties": {"a": {"type": 12}}}, "not a valid JSON Schema"),
        ({"type": "object", "properties": {"a": {"minLength": -1}}}, "not a valid JSON Schema"),
    ],
)
def test_check_refuses_with_a_reason(schema: dict, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        json_schema.check(schema)


def test_check_survives_deep_nesting() -> None:
    schema: dict = {"type": "object"}
    node = schema
    for _ in range(5_000):
        node["properties"] = {"a": {"type": "object"}}
        node = node["properties"]["a"]
    with pytest.raises(ValueError):
        json_schema.check(schema)


def test_check_accepts_an_ordinary_schema_and_caches_it() -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Z]"}}}
    json_schema.check(schema)
    before = json_schema._check_text.cache_info().hits
    json_schema.check(dict(schema))
    assert json_schema._check_text.cache_info().hits == before + 1


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"a": {"type": "string", "pattern": "^(a|aa)+(?=c)"}}},
        {"type": "object", "patternProperties": {"^(a|aa)+(?=c)": {"type": "string"}}},
        {
            "type": "object",
            "patternProperties": {"^(a|aa)+(?=c)": {"type": "string"}},
            "additionalProperties": False,
        },
    ],
)
def test_a_catastrophic_pattern_is_cut_off_within_its_budget(schema: dict) -> None:
    # With the stdlib `re` each of these takes exponential time on 60 "a"s.
    json_schema.check(schema)
    validator = json_schema.validator(schema)
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        list(validator.iter_errors({"a": "a" * 60, "a" * 60: "x"}))
    assert time.monotonic() - started < 2.0


def test_patterns_still_match_normally() -> None:
    schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}}}
    validator = json_schema.validator(schema)
    assert not list(validator.iter_errors({"code": "OSL"}))
    assert list(validator.iter_errors({"code": "oslo"}))


# A valid schema whose check is exponential in the instance's depth: each level tries the
# three `anyOf` branches in full before failing (jsonschema collects every branch's errors).
EXPONENTIAL = {
    "type": "object",
    "properties": {"a": {"$ref": "#/$defs/t"}},
    "$defs": {"t": {"type": "array", "items": {"anyOf": [{"$ref": "#/$defs/t"}] * 3}}},
}


def nested(depth: int) -> dict:
    value: object = 1
    for _ in range(depth):
        value = [value]
    return {"a": value}


def test_an_exponential_check_is_cut_off_at_its_step_budget() -> None:
    json_schema.check(EXPONENTIAL)  # the schema itself is fine
    checker = json_schema.validator(EXPONENTIAL)
    assert json_schema.errors(checker, nested(4))  # shallow: checked in full, and invalid
    with pytest.raises(json_schema.TooCostly, match="more than 20,000 steps"):
        json_schema.errors(checker, nested(30), budget=20_000)
    # the budget is per call: the next check starts afresh
    assert json_schema.errors(checker, {"a": []}) == []


def test_a_step_budget_is_drawn_down_across_checks() -> None:
    checker = json_schema.validator({"type": "array", "items": {"type": "integer"}})
    budget = json_schema.StepBudget(10_000)
    assert json_schema.errors(checker, list(range(4_000)), budget) == []
    first = budget.left
    assert 0 < first < 10_000 - 4_000  # at least one step per item was spent
    assert json_schema.errors(checker, list(range(4_000)), budget) == []
    assert budget.left < first
    with pytest.raises(json_schema.TooCostly, match="of 10,000 spent by earlier checks"):
        json_schema.errors(checker, list(range(4_000)), budget)
    assert budget.left == 0
    with pytest.raises(json_schema.TooCostly):  # spent: even a tiny check is refused now
        json_schema.errors(checker, [1], budget)


def test_one_response_s_tool_calls_share_one_budget() -> None:
    """Before, each call had the full budget: a response of n costly calls held the
    writer n times as long. Now the third of three calls that each fit alone is refused."""
    from schemas.messages import Tool
    from worker.toolcalls import parse_output

    schema = {
        "type": "object",
        "properties": {"xs": {"type": "array", "items": {"type": "integer"}}},
    }
    tool = Tool.model_validate(
        {"type": "function", "function": {"name": "f", "parameters": schema}}
    )
    size = json_schema.STEP_BUDGET * 2 // 5  # each call alone is well inside the budget
    block = (
        '<tool_call>{"name": "f", "arguments": ' + json.dumps({"xs": [1] * size}) + "}</tool_call>"
    )
    alone = parse_output(block, tools=[tool], reasoning_enabled=False)
    assert len(alone.tool_calls) == 1 and alone.errors == []
    parsed = parse_output(block * 3, tools=[tool], reasoning_enabled=False)
    assert len(parsed.tool_calls) == 2
    (error,) = parsed.errors
    assert error.index == 2 and "too costly to check" in error.reason


def test_a_tool_call_too_costly_to_check_is_an_error_not_a_hang() -> None:
    from schemas.messages import Tool
    from worker.toolcalls import parse_output

    tool = Tool.model_validate(
        {"type": "function", "function": {"name": "f", "parameters": EXPONENTIAL}}
    )
    text = '<tool_call>{"name": "f", "arguments": ' + json.dumps(nested(40)) + "}</tool_call>"
    # unbounded, depth 40 would take ~3^40 branch checks; the budget ends it as an error
    parsed = parse_output(text, tools=[tool], reasoning_enabled=False)
    assert parsed.tool_calls == []
    (error,) = parsed.errors
    assert "too costly to check" in error.reason


# ---------------------------------------------------------------- uniqueItems

_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-3, 3)
    | st.sampled_from([0.0, -0.0, 1.0, 2.5, 1e20, 10**20])
    | st.sampled_from(["", "a", "1"]),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from(["a", "b"]), inner, max_size=2)
    ),
    max_leaves=8,
)


@settings(max_examples=400, deadline=None)
@given(st.lists(_json, max_size=6))
def test_unique_items_agrees_with_jsonschema(items: list) -> None:
    """JSON equality as jsonschema has it: 1 == 1.0, true != 1, key order ignored."""
    from jsonschema import Draft202012Validator

    reference = bool(list(Draft202012Validator({"uniqueItems": True}).iter_errors(items)))
    checker = json_schema.validator({"uniqueItems": True})
    assert bool(json_schema.errors(checker, items)) == reference


def test_unique_items_never_compares_every_pair(monkeypatch: pytest.MonkeyPatch) -> None:
    """jsonschema's own `uniqueItems` compares every pair when the items are not all
    sortable: 8,000 arrays and objects took 36 s of a writer's time as one keyword step
    (`python -m tests.benchmarks.bench_unique_items`). The budgeted validator has its
    own, linear one; jsonschema's is made to fail here to show it is never reached."""
    import jsonschema._keywords

    def quadratic(_container: object) -> bool:
        raise AssertionError("jsonschema's pairwise uniq was called")

    monkeypatch.setattr(jsonschema._keywords, "uniq", quadratic)  # the name it calls
    checker = json_schema.validator({"type": "array", "uniqueItems": True})
    mixed = [{"a": i} if i % 2 else [i] for i in range(8_000)]
    assert json_schema.errors(checker, mixed) == []
    (error,) = json_schema.errors(checker, [*mixed, {"a": 1}])
    assert "non-unique elements" in error.message


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}},
        {"$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}}}, "$ref": "#/$defs/n"},
    ],
)
def test_a_value_nested_too_deep_to_check_is_too_costly_not_a_crash(schema: dict) -> None:
    """JSON allows values nested far deeper than the checks can descend (uniqueItems'
    keys, jsonschema's own recursion): RecursionError escaped `errors()` and stopped the
    tool executor, which catches only TooCostly."""
    value: object = 1
    for _ in range(3_000):
        value = [value]
    instance = {"tags": [value]} if "properties" in schema else value
    checker = json_schema.validator(schema)
    with pytest.raises(json_schema.TooCostly, match="nested too deeply"):
        json_schema.errors(checker, instance)
