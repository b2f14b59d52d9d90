"""Scenario 4: fuzzing the two parsers that read untrusted input (hypothesis).

* `schemas.decode_request` on arbitrary bytes, on JSON-ish text, and on VALID envelopes
  mutated field by field (drop / insert / replace with random JSON, at any depth):
  nothing but `ContractError` escapes; an accepted envelope re-encodes and decodes to
  itself; a rejection names a field, carries a well-formed (or no) request_id and
  builds the `ErrorInfo` the worker writes.
* `worker.toolcalls.parse_output` on model output mixing random `<tool_call>`,
  `</tool_call>`, `<think>` fragments, JSON-ish junk and tool calls generated VALID
  against random tool schemas, then mutated (missing required key, wrong type, extra
  key under additionalProperties false, unknown tool, truncated JSON): never raises;
  every returned call names an offered tool and its arguments validate against that
  tool's schema; every `<tool_call>` opener is accounted for; an unmutated valid call
  always comes back as a call with the same arguments.

The fast variants (~300 examples each) run in CI; the `slow` ones run 10,000 each.
"""

from __future__ import annotations

import collections
import copy
import json
import re
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from schemas import ContractError, decode_request, limits
from schemas.decode import encode_request
from schemas.request import Tool
from tests.reliability.conftest import figures, fuzz_settings
from worker.toolcalls import TOOL_CALL_OPEN, parse_output

STATS: collections.Counter[str] = collections.Counter()


@pytest.fixture(scope="module", autouse=True)
def _print_figures() -> Any:
    yield
    figures("fuzz", **dict(sorted(STATS.items())))


FAST = fuzz_settings(300)
LONG = fuzz_settings(10_000)
ID_RE = re.compile(limits.ID_PATTERN)

# ------------------------------------------------------------------ envelopes

VALID_CHAT: dict[str, Any] = {
    "v": 1,
    "request_id": "fz-1",
    "endpoint": "/v1/chat/completions",
    "body": {
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": [{"type": "text", "text": "Weather in Oslo?"}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": "Weather for a city",
                    "parameters": {
                        "type": "object",
                        "properties": {"city": {"type": "string"}},
                        "required": ["city"],
                    },
                },
            }
        ],
        "tool_choice": "auto",
        "max_tokens": 64,
        "temperature": 0.7,
        "top_p": 0.9,
        "stop": ["\n\n"],
        "seed": 7,
        "response_format": {"type": "text"},
        "chat_template_kwargs": {"enable_thinking": False},
    },
    "job_id": "job-fz",
    "custom_id": "row-1",
    "priority": 2,
    "deadline": "2030-01-01T00:00:00Z",
    "result_ttl_s": 600,
    "metadata": {"team": "fuzz", "n": [1, 2]},
    "submitted_at": "2026-12-02T01:00:00.123Z",
}
VALID_COMPLETION: dict[str, Any] = {
    "request_id": "fz-2",
    "endpoint": "/v1/completions",
    "body": {"prompt": [1, 2, 3], "max_tokens": 5, "echo": False},
}

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["", "user", "tool", "function", "/v1/completions", "fz-1", "*", "{"]),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=12,
)


def _paths(doc: Any, here: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [here]
    if isinstance(doc, dict):
        for key, value in doc.items():
            out += _paths(value, (*here, key))
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            out += _paths(value, (*here, i))
    return out


def _get(doc: Any, path: tuple[Any, ...]) -> Any:
    for part in path:
        doc = doc[part]
    return doc


@st.composite
def mutated_envelopes(draw: st.DrawFn) -> tuple[dict[str, Any] | Any, bytes | None]:
    doc: Any = copy.deepcopy(draw(st.sampled_from([VALID_CHAT, VALID_COMPLETION])))
    for _ in range(draw(st.integers(1, 4))):
        paths = _paths(doc)
        path = draw(st.sampled_from(paths))
        op = draw(st.sampled_from(["drop", "insert", "replace", "replace", "dup_list"]))
        if not path:  # the root
            if op == "replace":
                doc = draw(json_values)
            continue
        parent, last = _get(doc, path[:-1]), path[-1]
        if op == "drop":
            del parent[last]
        elif op == "insert":
            if isinstance(parent, dict):
                parent[draw(st.text(max_size=10))] = draw(json_values)
            else:
                parent.insert(last, draw(json_values))
        elif op == "dup_list" and isinstance(parent, list):
            parent.extend([copy.deepcopy(parent[last])] * draw(st.integers(1, 3)))
        else:
            parent[last] = draw(json_values)
        if not isinstance(doc, dict | list):
            break
    rid = doc.get("request_id") if isinstance(doc, dict) else None
    key = draw(
        st.one_of(
            st.none(),
            st.just(rid.encode("utf-8", "surrogatepass") if isinstance(rid, str) else b"fz-1"),
            st.binary(max_size=20),
        )
    )
    return doc, key


def check_decode(raw: bytes, key: bytes | None) -> None:
    STATS["decode_cases"] += 1
    try:
        envelope = decode_request(raw, key)
    except ContractError as error:
        STATS["decode_rejected"] += 1
        assert error.message
        assert error.param is None or isinstance(error.param, str)
        assert error.request_id is None or ID_RE.fullmatch(error.request_id)
        info = error.info()  # what the worker writes into the failed result
        assert info.code == error.code
        json.loads(info.model_dump_json())
        return
    STATS["decode_accepted"] += 1
    assert ID_RE.fullmatch(envelope.request_id)
    if key is not None:
        assert key == envelope.request_id.encode()
    again = decode_request(encode_request(envelope), key)
    assert again == envelope


@FAST
@given(st.binary(max_size=3000), st.one_of(st.none(), st.binary(max_size=40)))
def test_decode_arbitrary_bytes(raw: bytes, key: bytes | None) -> None:
    check_decode(raw, key)


jsonish = st.lists(
    st.one_of(
        st.sampled_from(['{', '}', '[', ']', ':', ',', '"request_id"', '"body"', '"messages"',
                         '"fz-1"', "null", "1e999", "-0", '"\\ud800"', "\\", '"', "NaN"]),
        st.text(max_size=6),
    ),
    max_size=60,
).map("".join)  # fmt: skip


@FAST
@given(jsonish, st.sampled_from([None, b"fz-1"]))
def test_decode_jsonish_text(text: str, key: bytes | None) -> None:
    check_decode(text.encode("utf-8", "surrogatepass"), key)


@FAST
@given(mutated_envelopes())
def test_decode_mutated_valid_envelopes(case: tuple[Any, bytes | None]) -> None:
    doc, key = case
    check_decode(json.dumps(doc).encode("utf-8", "surrogatepass"), key)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@LONG
@given(st.binary(max_size=3000), st.one_of(st.none(), st.binary(max_size=40)))
def test_decode_arbitrary_bytes_long(raw: bytes, key: bytes | None) -> None:
    check_decode(raw, key)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@LONG
@given(mutated_envelopes())
def test_decode_mutated_valid_envelopes_long(case: tuple[Any, bytes | None]) -> None:
    doc, key = case
    check_decode(json.dumps(doc).encode("utf-8", "surrogatepass"), key)


# ------------------------------------------------------------------ hostile envelopes (issue 22)

KEY_PIECES = [":", "done", "cancel", "result", "job", "vic", "-", ".", "1", "::"]
colliding_ids = st.lists(st.sampled_from(KEY_PIECES), min_size=1, max_size=5).map("".join)
PATTERNS = ["a{99999999999}", "(", "(?<", "^(a|aa)+(?=c)", "[", "\\", "a{2,1}", "(?P<x>a)(?P<x>b)"]
huge_numbers = st.sampled_from(["9" * 5000, "-" + "9" * 4301, "1" * 1001, "1e999", "-1e999"])


@st.composite
def hostile_envelopes(draw: st.DrawFn) -> bytes:
    env: dict[str, Any] = copy.deepcopy(VALID_CHAT)
    env["request_id"] = draw(colliding_ids)
    env["job_id"] = draw(colliding_ids)
    placeholders: dict[str, str] = {}
    if draw(st.booleans()):
        env["metadata"] = {"n": "<huge>"}
        placeholders["huge"] = draw(huge_numbers)
    if draw(st.booleans()):
        depth = draw(st.sampled_from([10, 1_000, 100_000]))
        env["metadata"] = {"deep": "<deep>"}
        placeholders["deep"] = "[" * depth + "]" * depth
    if draw(st.booleans()):
        params = env["body"]["tools"][0]["function"]["parameters"]
        where = draw(st.sampled_from(["pattern", "patternProperties"]))
        pattern = draw(st.sampled_from(PATTERNS))
        if where == "pattern":
            params["properties"]["city"]["pattern"] = pattern
        else:
            params["patternProperties"] = {pattern: {"type": "string"}}
    text = json.dumps(env)
    for name, literal in placeholders.items():
        text = text.replace(f'"<{name}>"', literal)
    return text.encode()


def check_hostile(raw: bytes) -> None:
    check_decode(raw, None)
    try:
        envelope = decode_request(raw, None)
    except ContractError:
        STATS["hostile_rejected"] += 1
        return
    STATS["hostile_accepted"] += 1
    assert envelope.job_id is None or not envelope.job_id.endswith(limits.RESERVED_JOB_SUFFIXES)


@FAST
@given(hostile_envelopes())
def test_decode_hostile_envelopes(raw: bytes) -> None:
    check_hostile(raw)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@LONG
@given(hostile_envelopes())
def test_decode_hostile_envelopes_long(raw: bytes) -> None:
    check_hostile(raw)


def test_valid_bases_decode() -> None:
    """The bases the strategies mutate are themselves valid, or every hostile case would
    be refused for the base's fault, not its own."""
    for base in (VALID_CHAT, VALID_COMPLETION):
        env = decode_request(json.dumps(base).encode(), base["request_id"].encode())
        assert env.request_id == base["request_id"]
        assert env.endpoint == base["endpoint"]
        assert env.body.model_dump(exclude_unset=True) == base["body"]


# ------------------------------------------------------------------ tool calls

PROP_TYPES: dict[str, tuple[dict[str, Any], st.SearchStrategy[Any], Any]] = {
    # type: (schema, valid values, a value of the wrong type)
    "string": ({"type": "string"}, st.text(max_size=8), 12),
    "integer": ({"type": "integer"}, st.integers(-1000, 1000), "x"),
    "number": ({"type": "number"}, st.floats(-1e6, 1e6, allow_nan=False), "1.5"),
    "boolean": ({"type": "boolean"}, st.booleans(), "yes"),
    "array": ({"type": "array", "items": {"type": "string"}}, st.lists(st.text(max_size=4), max_size=3), {"a": 1}),
    "enum": ({"type": "string", "enum": ["c", "f"]}, st.sampled_from(["c", "f"]), "kelvin"),
}  # fmt: skip
TOOL_NAMES = ["get_weather", "get_time", "lookup", "a-b_c"]


@st.composite
def tool_specs(draw: st.DrawFn) -> dict[str, Any]:
    names = draw(st.lists(st.sampled_from(["city", "unit", "n", "tags", "flag", "x"]),
                          min_size=0, max_size=4, unique=True))  # fmt: skip
    kinds = {name: draw(st.sampled_from(list(PROP_TYPES))) for name in names}
    required = [n for n in names if draw(st.booleans())]
    closed = draw(st.booleans())
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {n: PROP_TYPES[k][0] for n, k in kinds.items()},
        "required": required,
    }
    if closed:
        schema["additionalProperties"] = False
    return {"kinds": kinds, "required": required, "closed": closed, "schema": schema}


@st.composite
def tool_sets(draw: st.DrawFn) -> list[tuple[str, dict[str, Any]]]:
    names = draw(st.lists(st.sampled_from(TOOL_NAMES), min_size=1, max_size=3, unique=True))
    return [(name, draw(tool_specs())) for name in names]


def as_tools(tool_set: list[tuple[str, dict[str, Any]]]) -> list[Tool]:
    return [
        Tool.model_validate(
            {"type": "function", "function": {"name": n, "parameters": spec["schema"]}}
        )
        for n, spec in tool_set
    ]


@st.composite
def valid_args(draw: st.DrawFn, spec: dict[str, Any]) -> dict[str, Any]:
    args = {}
    for name, kind in spec["kinds"].items():
        if name in spec["required"] or draw(st.booleans()):
            args[name] = draw(PROP_TYPES[kind][1])
    return args


def block(name: Any, args: Any, *, args_as_string: bool = False, spaced: bool = True) -> str:
    payload = json.dumps({"name": name, "arguments": json.dumps(args) if args_as_string else args})
    return (
        f"{TOOL_CALL_OPEN}\n{payload}\n</tool_call>"
        if spaced
        else f"<tool_call>{payload}</tool_call>"
    )


@st.composite
def call_blocks(draw: st.DrawFn, tool_set: list[tuple[str, dict[str, Any]]]) -> tuple[str, bool]:
    """(block text, still valid?) for a call generated valid, then maybe mutated."""
    name, spec = draw(st.sampled_from(tool_set))
    args = draw(valid_args(spec))
    mutation = draw(st.sampled_from(
        ["none", "none", "drop_required", "wrong_type", "extra_key", "unknown_tool",
         "truncate", "args_not_object", "no_name"]))  # fmt: skip
    valid = True
    if mutation == "drop_required" and spec["required"]:
        args.pop(draw(st.sampled_from(spec["required"])), None)
        valid = False
    elif mutation == "wrong_type" and args:
        key = draw(st.sampled_from(sorted(args)))
        args[key] = PROP_TYPES[spec["kinds"][key]][2]
        valid = False
    elif mutation == "extra_key" and spec["closed"]:
        args["zz_extra"] = 1
        valid = False
    elif mutation == "unknown_tool":
        name, valid = "not_offered", False
    elif mutation == "args_not_object":
        return block(name, [1, 2]), False
    elif mutation == "no_name":
        return f"{TOOL_CALL_OPEN}\n{json.dumps({'arguments': args})}\n</tool_call>", False
    text = block(name, args, args_as_string=draw(st.booleans()), spaced=draw(st.booleans()))
    if mutation == "truncate":
        # cut before the payload's final "}": a prefix of a JSON object is never valid JSON
        cut = draw(st.integers(len(TOOL_CALL_OPEN) + 1, text.rindex("}")))
        text, valid = text[:cut] + "</tool_call>", False
    return text, valid


JUNK = ["<tool_call>", "</tool_call>", "<think>", "</think>", "\n", " ", "{", "}", '"name"',
        ":", '"arguments"', ",", "[", "]", "null", '"', "\\", "é", "text", "<tool_", "call>"]  # fmt: skip


@st.composite
def outputs(draw: st.DrawFn) -> tuple[str, list[tuple[str, dict[str, Any]]]]:
    tool_set = draw(tool_sets())
    pieces = draw(st.lists(
        st.one_of(st.sampled_from(JUNK), st.text(max_size=8),
                  call_blocks(tool_set).map(lambda b: b[0])),
        max_size=30))  # fmt: skip
    return "".join(pieces), tool_set


def check_parse(text: str, tool_set: list[tuple[str, dict[str, Any]]], reasoning: bool) -> None:
    tools = as_tools(tool_set) if tool_set else None
    out = parse_output(text, tools=tools, reasoning_enabled=reasoning)
    STATS["parse_cases"] += 1
    STATS["parse_tool_calls"] += len(out.tool_calls)
    STATS["parse_tool_call_errors"] += len(out.errors)
    schemas = {n: spec["schema"] for n, spec in tool_set}
    in_reasoning = (out.reasoning_content or "").count(TOOL_CALL_OPEN)
    assert text.count(TOOL_CALL_OPEN) == in_reasoning + len(out.tool_calls) + len(out.errors)
    for call in out.tool_calls:
        assert call.function.name in schemas
        args = json.loads(call.function.arguments)
        assert isinstance(args, dict)
        assert not list(Draft202012Validator(schemas[call.function.name]).iter_errors(args))
    for error in out.errors:
        assert error.raw.startswith(TOOL_CALL_OPEN) and error.reason


@FAST
@given(outputs(), st.booleans(), st.booleans())
def test_parse_output_mixed(case: Any, reasoning: bool, with_tools: bool) -> None:
    text, tool_set = case
    check_parse(text, tool_set if with_tools else [], reasoning)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@LONG
@given(outputs(), st.booleans(), st.booleans())
def test_parse_output_mixed_long(case: Any, reasoning: bool, with_tools: bool) -> None:
    text, tool_set = case
    check_parse(text, tool_set if with_tools else [], reasoning)


@st.composite
def clean_outputs(draw: st.DrawFn) -> tuple[str, list[tuple[str, dict[str, Any]]], list[bool]]:
    tool_set = draw(tool_sets())
    blocks = draw(st.lists(call_blocks(tool_set), min_size=1, max_size=4))
    prose = st.text(st.characters(blacklist_characters="<>"), max_size=10)
    text = "".join(draw(prose) + b for b, _ in blocks) + draw(prose)
    return text, tool_set, [v for _, v in blocks]


def check_clean(case: Any) -> None:
    text, tool_set, validity = case
    out = parse_output(text, tools=as_tools(tool_set), reasoning_enabled=False)
    STATS["generated_cases"] += 1
    STATS["generated_valid_calls"] += sum(validity)
    STATS["generated_mutants"] += len(validity) - sum(validity)
    assert len(out.tool_calls) == sum(validity), (text, out)
    assert len(out.errors) == len(validity) - sum(validity), (text, out)


@FAST
@given(clean_outputs())
def test_generated_valid_calls_are_calls_and_mutants_errors(case: Any) -> None:
    check_clean(case)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@LONG
@given(clean_outputs())
def test_generated_valid_calls_are_calls_and_mutants_errors_long(case: Any) -> None:
    check_clean(case)
