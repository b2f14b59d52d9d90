"""Qwen3/Hermes output parsing: reasoning split, tool calls, validation, fuzzing."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas.request import Tool
from worker.toolcalls import (
    TOOL_CALL_OPEN,
    new_call_id,
    parse_output,
    seeded_id_factory,
    split_reasoning,
)

WEATHER = Tool.model_validate(
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"enum": ["c", "f"]},
                },
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
)
TIME = Tool.model_validate({"type": "function", "function": {"name": "get_time"}})
TOOLS = [WEATHER, TIME]


def call(name: str, args: object) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


def test_call_ids() -> None:
    assert re.fullmatch(r"call_[0-9a-f]{24}", new_call_id())
    a, b = seeded_id_factory(1), seeded_id_factory(1)
    first = a()
    assert first == b() and re.fullmatch(r"call_[0-9A-Za-z]{24}", first)
    assert a() != first


def test_plain_text_untouched() -> None:
    out = parse_output("Hello!\n", tools=TOOLS, reasoning_enabled=False)
    assert out.content == "Hello!\n"
    assert out.reasoning_content is None and out.tool_calls == [] and out.errors == []


def test_several_calls_qwen3_format() -> None:
    text = (
        "<think>\nThe user wants weather for two cities.\n</think>\n\n"
        + call("get_weather", {"city": "Paris"})
        + "\n"
        + call("get_weather", {"city": "Zürich", "unit": "c"})
    )
    out = parse_output(text, tools=TOOLS, reasoning_enabled=True, id_factory=seeded_id_factory(0))
    assert out.reasoning_content == "The user wants weather for two cities."
    assert out.content is None
    assert out.errors == []
    assert [c.function.name for c in out.tool_calls] == ["get_weather", "get_weather"]
    assert json.loads(out.tool_calls[1].function.arguments) == {"city": "Zürich", "unit": "c"}
    assert "Zürich" in out.tool_calls[1].function.arguments  # ensure_ascii=False
    assert out.tool_calls[0].id != out.tool_calls[1].id
    assert all(c.type == "function" for c in out.tool_calls)


def test_calls_inside_text() -> None:
    text = "Let me check.\n" + call("get_time", {}) + "\nOne moment."
    out = parse_output(text, tools=TOOLS, reasoning_enabled=False)
    assert out.content == "Let me check.\n\nOne moment."
    assert len(out.tool_calls) == 1 and out.tool_calls[0].function.arguments == "{}"


def test_malformed_json() -> None:
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
    out = parse_output(
        "ok " + bad + " " + call("get_time", {}), tools=TOOLS, reasoning_enabled=False
    )
    assert len(out.tool_calls) == 1 and out.tool_calls[0].function.name == "get_time"
    assert len(out.errors) == 1
    err = out.errors[0]
    assert err.index == 0 and err.raw == bad and err.reason.startswith("not valid JSON")
    assert out.content == "ok"


def test_unknown_tool() -> None:
    out = parse_output(call("launch", {"x": 1}), tools=TOOLS, reasoning_enabled=False)
    assert out.tool_calls == []
    (err,) = out.errors
    assert err.name == "launch"
    assert err.reason == "unknown tool 'launch'; known: get_weather, get_time"
    assert out.content == ""


def test_schema_invalid_arguments() -> None:
    out = parse_output(
        call("get_weather", {"unit": "c"}) + call("get_weather", {"city": "X", "unit": "k"}),
        tools=TOOLS,
        reasoning_enabled=False,
    )
    assert out.tool_calls == []
    first, second = out.errors
    assert first.index == 0 and first.name == "get_weather"
    assert first.reason == "arguments invalid: 'city' is a required property at $"
    assert second.index == 1 and second.reason.startswith("arguments invalid:")
    assert second.reason.endswith("at $.unit")


def test_arguments_as_json_string() -> None:
    inner = json.dumps({"name": "get_weather", "arguments": json.dumps({"city": "Oslo"})})
    text = f"<tool_call>\n{inner}\n</tool_call>"
    out = parse_output(text, tools=TOOLS, reasoning_enabled=False)
    assert out.errors == []
    assert json.loads(out.tool_calls[0].function.arguments) == {"city": "Oslo"}


def test_arguments_wrong_type_and_missing_name() -> None:
    out = parse_output(
        '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>'
        '<tool_call>{"arguments": {}}</tool_call>'
        "<tool_call>[1, 2]</tool_call>"
        '<tool_call>{"name": "get_time", "arguments": "nope"}</tool_call>',
        tools=TOOLS,
        reasoning_enabled=False,
    )
    reasons = [e.reason for e in out.errors]
    assert reasons == [
        "'arguments' must be a JSON object, got list",
        "missing 'name' (a non-empty string)",
        "expected a JSON object, got list",
        "'arguments' is a string that is not JSON",
    ]
    assert [e.index for e in out.errors] == [0, 1, 2, 3]


def test_missing_arguments_means_empty_object() -> None:
    out = parse_output(
        '<tool_call>{"name": "get_time"}</tool_call>', tools=TOOLS, reasoning_enabled=False
    )
    assert out.errors == [] and out.tool_calls[0].function.arguments == "{}"


def test_no_tools_offered() -> None:
    block = call("get_weather", {"city": "Paris"})
    for tools in (None, []):
        out = parse_output("Sure. " + block, tools=tools, reasoning_enabled=False)
        assert out.tool_calls == []
        (err,) = out.errors
        assert err.reason == "no tools were offered" and err.raw == block
        assert err.name == "get_weather"
        assert out.content == "Sure."


def test_unclosed_tool_call_cut_by_length() -> None:
    text = call("get_time", {}) + '\n<tool_call>\n{"name": "get_weather", "argu'
    out = parse_output(text, tools=TOOLS, reasoning_enabled=False)
    assert len(out.tool_calls) == 1
    (err,) = out.errors
    assert err.index == 1
    assert err.raw == '<tool_call>\n{"name": "get_weather", "argu'
    assert "unclosed" in err.reason
    assert out.content is None


def test_block_interrupted_by_another_opener() -> None:
    text = "<tool_call>garbage" + call("get_time", {})
    out = parse_output(text, tools=TOOLS, reasoning_enabled=False)
    assert [e.raw for e in out.errors] == ["<tool_call>garbage"]
    assert len(out.tool_calls) == 1


def test_think_closed() -> None:
    out = parse_output(
        "<think>\nhmm\n</think>\n\nThe answer is 4.", tools=None, reasoning_enabled=True
    )
    assert out.reasoning_content == "hmm"
    assert out.content == "The answer is 4."


def test_think_without_opener() -> None:
    out = parse_output("hmm, 2+2\n</think>\n\n4", tools=None, reasoning_enabled=True)
    assert out.reasoning_content == "hmm, 2+2" and out.content == "4"


def test_think_unclosed_is_all_reasoning() -> None:
    out = parse_output(
        "<think>\nlong thought " + call("get_time", {}), tools=TOOLS, reasoning_enabled=True
    )
    assert out.reasoning_content is not None
    assert out.reasoning_content.startswith("long thought")
    assert out.content is None and out.tool_calls == [] and out.errors == []


def test_empty_think_in_thinking_mode() -> None:
    out = parse_output("<think>\n\n</think>\n\nHi", tools=None, reasoning_enabled=True)
    assert out.reasoning_content is None and out.content == "Hi"


def test_no_think_tags_in_thinking_mode() -> None:
    out = parse_output("Just an answer", tools=None, reasoning_enabled=True)
    assert out.reasoning_content is None and out.content == "Just an answer"


def test_reasoning_disabled_strips_only_leading_empty_think() -> None:
    out = parse_output("<think>\n\n</think>\n\nHi", tools=None, reasoning_enabled=False)
    assert out.content == "Hi" and out.reasoning_content is None
    kept = "<think>\nreal\n</think>\nHi"
    assert parse_output(kept, tools=None, reasoning_enabled=False).content == kept


def test_split_reasoning_keeps_prefix() -> None:
    assert split_reasoning("pre <think>r</think>post", reasoning_enabled=True) == ("r", "pre post")


def test_tool_call_inside_reasoning_is_not_a_call() -> None:
    text = "<think>\nmaybe " + call("get_time", {}) + "\n</think>\n\n" + call("get_time", {})
    out = parse_output(text, tools=TOOLS, reasoning_enabled=True)
    assert len(out.tool_calls) == 1 and out.errors == []
    assert TOOL_CALL_OPEN in (out.reasoning_content or "")


def test_validator_errors_are_reported_not_raised() -> None:
    """A pattern that backtracks catastrophically on the model's arguments: the check is cut
    off (schemas.json_schema) and reported, the parser does not hang or raise."""
    slow = Tool.model_validate(
        {
            "type": "function",
            "function": {
                "name": "w",
                "parameters": {
                    "type": "object",
                    "properties": {"s": {"type": "string", "pattern": "^(a|aa)+(?=c)"}},
                },
            },
        }
    )
    out = parse_output(call("w", {"s": "a" * 60}), tools=[slow], reasoning_enabled=False)
    assert out.tool_calls == [] and len(out.errors) == 1
    assert out.errors[0].reason.startswith("could not check the tool call: TimeoutError")


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999", "-1e400"])
def test_arguments_must_be_strict_json(literal: str) -> None:
    """What Python's json reads but JSON does not have is refused, not written back out."""
    text = f'<tool_call>{{"name": "get_time", "arguments": {{"x": {literal}}}}}</tool_call>'
    out = parse_output(text, tools=TOOLS, reasoning_enabled=False)
    assert out.tool_calls == []
    assert len(out.errors) == 1 and out.errors[0].reason.startswith("not valid JSON")
    as_string = json.dumps({"name": "get_time", "arguments": f'{{"x": {literal}}}'})
    out = parse_output(f"<tool_call>{as_string}</tool_call>", tools=TOOLS, reasoning_enabled=False)
    assert out.tool_calls == [] and "not JSON" in out.errors[0].reason


def test_huge_integer_arguments_are_an_error_not_a_crash() -> None:
    text = '<tool_call>{"name": "get_time", "arguments": {"x": %s}}</tool_call>' % ("9" * 5000)
    out = parse_output(text, tools=TOOLS, reasoning_enabled=False)
    assert out.tool_calls == [] and out.errors[0].reason.startswith("not valid JSON")


# ------------------------------------------------------------------ fuzzing

FRAGMENTS = [
    "<tool_call>",
    "</tool_call>",
    "<think>",
    "</think>",
    "\n",
    " ",
    "{",
    "}",
    '"name"',
    ":",
    '"get_weather"',
    '"get_time"',
    '"arguments"',
    ",",
    '{"city": "Paris"}',
    "[",
    "]",
    "null",
    '"',
    "\\",
    "é",
    "text",
    call("get_weather", {"city": "Rome"}),
    call("get_time", {}),
    call("nope", {}),
]
fuzz_text = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=8)), max_size=40).map(
    "".join
)


def check_invariants(text: str, reasoning_enabled: bool, with_tools: bool) -> None:
    out = parse_output(
        text, tools=TOOLS if with_tools else None, reasoning_enabled=reasoning_enabled
    )
    # every <tool_call> opener is a call, an error, or part of the reasoning
    in_reasoning = (out.reasoning_content or "").count(TOOL_CALL_OPEN)
    assert text.count(TOOL_CALL_OPEN) == in_reasoning + len(out.tool_calls) + len(out.errors)
    if not with_tools:
        assert out.tool_calls == []
    for c in out.tool_calls:
        assert isinstance(json.loads(c.function.arguments), dict)
    for e in out.errors:
        assert e.raw.startswith(TOOL_CALL_OPEN) and e.reason
        if not reasoning_enabled:  # think tags inside blocks can reshape the content otherwise
            assert e.raw in text


@settings(suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(fuzz_text, st.booleans(), st.booleans())
def test_fuzz_never_raises(text: str, reasoning_enabled: bool, with_tools: bool) -> None:
    check_invariants(text, reasoning_enabled, with_tools)


@pytest.mark.slow
@settings(max_examples=10_000, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(fuzz_text, st.booleans(), st.booleans())
def test_fuzz_never_raises_long(text: str, reasoning_enabled: bool, with_tools: bool) -> None:
    check_invariants(text, reasoning_enabled, with_tools)
