"""Parse Qwen3 / Hermes-style model output into OpenAI message fields. Pure; never raises.

Reasoning (when the prompt left thinking enabled):

* `<think>...</think>` -> `reasoning_content`; the content is what follows `</think>`, stripped
  of leading newlines. Text before `<think>` (rare) is kept in the content.
* `</think>` without an opener (the template put `<think>` in the prompt): everything before
  it is reasoning.
* `<think>` never closed (cut by max_tokens): everything after it is reasoning; content None.
* No think tags at all: everything is content.

With thinking disabled the text is left alone, except that a leading empty
`<think>\\n\\n</think>\\n\\n` (what Qwen3 emits in non-thinking mode) is removed.

Tool calls are looked for in the content only (a call "thought about" in the reasoning is not
a call). Every `<tool_call>` opener starts one block, which ends at the next `</tool_call>`;
a block that reaches another `<tool_call>` or the end of the text first is unclosed. Blocks
are numbered 0, 1, ... in order of appearance; that number is `ToolCallError.index`.

A block becomes an OpenAI `ToolCall` when it is a JSON object `{"name": str, "arguments":
object}` (arguments may also be a JSON string holding an object, or absent/null for `{}`),
names one of the offered tools, and its arguments validate against that tool's `parameters`
(JSON Schema draft 2020-12). Every other block -- unclosed, bad JSON, unknown tool, no tools
offered, invalid arguments -- is REMOVED from the content and reported as a `ToolCallError`
carrying the raw block text and a reason. Nothing is dropped silently: the text of each block
is either a tool call or an error. The content is the text outside the blocks, stripped; it
is None when it is empty and there are tool calls (OpenAI's shape). Output without any block
is returned as is (only the reasoning split above touches it).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from jsonschema.exceptions import best_match
from pydantic import ValidationError

from schemas import json_schema
from schemas.limits import MAX_TOOLS
from schemas.request import FunctionCall, Tool, ToolCall
from schemas.result import ToolCallError

__all__ = [
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "IdFactory",
    "ParsedOutput",
    "new_call_id",
    "parse_output",
    "seeded_id_factory",
    "split_reasoning",
    "turn_call_ids",
]

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

IdFactory = Callable[[], str]

_EMPTY_THINK = re.compile(r"\A\s*<think>\s*</think>\s*")
_ID_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
_MAX_RAW_CHARS = 65_536


@dataclass(slots=True)
class ParsedOutput:
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    errors: list[ToolCallError] = field(default_factory=list)


def new_call_id() -> str:
    """`call_` + 24 random hex characters."""
    return "call_" + secrets.token_hex(12)


def seeded_id_factory(seed: int) -> IdFactory:
    """Deterministic call ids (`call_` + 24 alphanumerics) for tests and replays."""
    rng = random.Random(seed)

    def make() -> str:
        return "call_" + "".join(rng.choice(_ID_ALPHABET) for _ in range(24))

    return make


def turn_call_ids(request_id: str, turn: int) -> IdFactory:
    """Call ids derived from (request_id, turn, index) for a tool loop's turns: a turn run
    again after a redelivery names its calls as before, so the executor's records of them
    are found and the tools do not run twice (`call_` + 24 hex characters)."""
    counter = iter(range(10**6))

    def make() -> str:
        seed = f"{request_id}\0{turn}\0{next(counter)}".encode()
        return "call_" + hashlib.sha256(seed).hexdigest()[:24]

    return make


def split_reasoning(text: str, *, reasoning_enabled: bool) -> tuple[str | None, str | None]:
    """(reasoning_content, content) as described in the module docstring."""
    if not reasoning_enabled:
        return None, _EMPTY_THINK.sub("", text, count=1)
    close = text.find(THINK_CLOSE)
    if close >= 0:
        head, tail = text[:close], text[close + len(THINK_CLOSE) :]
        open_ = head.find(THINK_OPEN)
        prefix = ""
        if open_ >= 0:
            prefix, head = head[:open_], head[open_ + len(THINK_OPEN) :]
        reasoning = head.strip("\n") or None
        content = tail.lstrip("\n")
        if prefix.strip():
            content = prefix + content
        return reasoning, content
    open_ = text.find(THINK_OPEN)
    if open_ >= 0:
        prefix = text[:open_]
        reasoning = text[open_ + len(THINK_OPEN) :].strip("\n") or None
        return reasoning, (prefix if prefix.strip() else None)
    return None, text


def _split_blocks(text: str) -> tuple[list[str], list[tuple[str, bool]]]:
    """Text pieces outside blocks, and (block inner text, closed) for each block."""
    outside: list[str] = []
    blocks: list[tuple[str, bool]] = []
    pos = 0
    while True:
        start = text.find(TOOL_CALL_OPEN, pos)
        if start < 0:
            outside.append(text[pos:])
            return outside, blocks
        outside.append(text[pos:start])
        inner_start = start + len(TOOL_CALL_OPEN)
        close = text.find(TOOL_CALL_CLOSE, inner_start)
        next_open = text.find(TOOL_CALL_OPEN, inner_start)
        if close >= 0 and (next_open < 0 or close < next_open):
            blocks.append((text[inner_start:close], True))
            pos = close + len(TOOL_CALL_CLOSE)
        else:
            end = next_open if next_open >= 0 else len(text)
            blocks.append((text[inner_start:end], False))
            pos = end


class _Validators:
    """Argument validators of one response, per tool (compiled once per schema, with
    time-limited regex matching: see `schemas.json_schema`)."""

    def __init__(self, tools: list[Tool]) -> None:
        self.tools = {tool.function.name: tool for tool in tools}
        self.budget = json_schema.StepBudget()
        """One budget for the whole response: its calls draw on it in order, so many
        costly calls hold the writer no longer than one would (~1 s)."""

    def validate(self, tool: Tool, arguments: dict[str, Any]) -> str | None:
        schema = tool.function.parameters
        if schema is None:
            return None
        try:
            found = json_schema.errors(json_schema.validator(schema), arguments, self.budget)
        except json_schema.TooCostly as exc:
            return f"arguments invalid: too costly to check against the tool's schema ({exc})"
        error = best_match(found)
        if error is None:
            return None
        return f"arguments invalid: {error.message} at {error.json_path}"


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of the range of a JSON number")
    return value


def strict_json(text: str) -> Any:
    """`json.loads` refusing what JSON does not have (NaN, Infinity, 1e999): arguments are
    handed to strict parsers in other languages."""
    return json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)


def _parse_block(
    inner: str, tools: _Validators | None
) -> tuple[str | None, dict[str, Any] | None, str | None]:
    """(name, arguments, error reason) for one closed block."""
    try:
        obj = strict_json(inner)
    except ValueError as exc:
        return None, None, f"not valid JSON: {exc}"
    except RecursionError:
        return None, None, "not valid JSON: nested too deeply"
    if not isinstance(obj, dict):
        return None, None, f"expected a JSON object, got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None, None, "missing 'name' (a non-empty string)"
    arguments = obj.get("arguments")
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):
        try:
            arguments = strict_json(arguments)
        except (ValueError, RecursionError):
            return name, None, "'arguments' is a string that is not JSON"
    if not isinstance(arguments, dict):
        return name, None, f"'arguments' must be a JSON object, got {type(arguments).__name__}"
    if tools is None or not tools.tools:
        return name, arguments, "no tools were offered"
    tool = tools.tools.get(name)
    if tool is None:
        known = ", ".join(tools.tools)
        return name, arguments, f"unknown tool {name!r}; known: {known}"
    reason = tools.validate(tool, arguments)
    return name, arguments, reason


def parse_output(
    text: str,
    *,
    tools: list[Tool] | None,
    reasoning_enabled: bool,
    id_factory: IdFactory | None = None,
    single_call: bool = False,
) -> ParsedOutput:
    """Split reasoning, extract and validate tool calls. Never raises (see module docstring).

    `single_call` (`parallel_tool_calls: false`): valid calls after the first are reported
    as errors saying so, not run and not dropped."""
    make_id = id_factory or new_call_id
    try:
        reasoning, rest = split_reasoning(text, reasoning_enabled=reasoning_enabled)
    except Exception:  # pragma: no cover - defensive: str methods only
        reasoning, rest = None, text
    if rest is None:
        return ParsedOutput(content=None, reasoning_content=reasoning)
    outside, blocks = _split_blocks(rest)
    validators = _Validators(tools) if tools else None
    calls: list[ToolCall] = []
    errors: list[ToolCallError] = []
    for index, (inner, closed) in enumerate(blocks):
        raw = TOOL_CALL_OPEN + inner + (TOOL_CALL_CLOSE if closed else "")
        raw_out = raw if len(raw) <= _MAX_RAW_CHARS else raw[:_MAX_RAW_CHARS] + "...(truncated)"
        if not closed:
            errors.append(
                ToolCallError(
                    index=index,
                    raw=raw_out,
                    reason="unclosed <tool_call> (output cut short or malformed)",
                )
            )
            continue
        try:
            name, arguments, reason = _parse_block(inner, validators)
            if reason is None and single_call and calls:
                reason = "not run: parallel_tool_calls is false and only the first call is kept"
            if reason is None and len(calls) >= MAX_TOOLS:
                # a turn's record holds at most this many calls (schemas.tool_loop)
                reason = f"not run: a turn holds at most {MAX_TOOLS} tool calls"
            if reason is None and name is not None and arguments is not None:
                calls.append(
                    ToolCall(
                        id=make_id(),
                        type="function",
                        function=FunctionCall(
                            name=name,
                            arguments=json.dumps(arguments, ensure_ascii=False, allow_nan=False),
                        ),
                    )
                )
                continue
        except ValidationError as exc:
            name, reason = None, f"tool call does not fit the schema: {exc.errors()[0]['msg']}"
        except Exception as exc:  # a schema the validator chokes on, a bad regex, ...
            name, reason = None, f"could not check the tool call: {type(exc).__name__}: {exc}"
        errors.append(
            ToolCallError(index=index, raw=raw_out, reason=reason or "invalid", name=name)
        )
    content: str | None = "".join(outside)
    if blocks:
        content = (content or "").strip()
        if not content and calls:
            content = None
    return ParsedOutput(
        content=content, reasoning_content=reasoning, tool_calls=calls, errors=errors
    )
