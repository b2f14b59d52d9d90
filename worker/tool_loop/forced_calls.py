"""Forced tool calls: `tool_choice: "required"` or a named function, made structural.

Rendering alone cannot make a model call a tool. For a forced choice the request's
sampling gets a JSON Schema (vLLM structured outputs, as vLLM's own OpenAI server does),
so the model's output *is* the call, with no `<tool_call>` tags and no `<think>` part:

* a named function: the output is that function's arguments object
  (`parameters`, or any object when the tool has none);
* `"required"`: the output is a non-empty array of `{"name": <an offered tool>,
  "arguments": {...}}`, one item per call.

`as_blocks` turns such output back into the `<tool_call>` blocks `worker.toolcalls` parses,
so forced and free calls are validated, reported and given ids by one parser. Engines
without guided decoding (transformers, echo) run the request unconstrained; what they emit
is parsed the same way, and output that is not the forced JSON is reported as a
`ToolCallError`. Pure.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from schemas.request import ChatCompletionBody, NamedToolChoice, Tool
from worker.toolcalls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

__all__ = ["ForcedCall", "as_blocks", "forced_call", "forced_schema"]

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True, slots=True)
class ForcedCall:
    name: str | None
    """The named function, or None for `"required"` (any offered tool, one or more)."""


def forced_call(body: ChatCompletionBody) -> ForcedCall | None:
    if not body.tools:
        return None
    if isinstance(body.tool_choice, NamedToolChoice):
        return ForcedCall(body.tool_choice.function.name)
    if body.tool_choice == "required":
        return ForcedCall(None)
    return None


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or _ANY_OBJECT


def forced_schema(forced: ForcedCall, tools: list[Tool]) -> dict[str, Any]:
    """The JSON Schema the output must match."""
    if forced.name is not None:
        tool = next(t for t in tools if t.function.name == forced.name)
        return _parameters(tool)
    return {
        "type": "array",
        "minItems": 1,
        "items": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"const": tool.function.name},
                        "arguments": _parameters(tool),
                    },
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for tool in tools
            ]
        },
    }


def _block(name: Any, arguments: Any) -> str:
    return TOOL_CALL_OPEN + json.dumps({"name": name, "arguments": arguments}) + TOOL_CALL_CLOSE


def as_blocks(text: str, forced: ForcedCall) -> str:
    """Forced output -> `<tool_call>` blocks; text that is not the forced JSON is kept as
    one block the parser will refuse (so it is reported, not dropped)."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return TOOL_CALL_OPEN + text + TOOL_CALL_CLOSE
    if forced.name is not None:
        return _block(forced.name, value)
    if not isinstance(value, list) or not value:
        return TOOL_CALL_OPEN + text + TOOL_CALL_CLOSE
    blocks = []
    for item in value:
        if isinstance(item, dict):
            blocks.append(_block(item.get("name"), item.get("arguments")))
        else:
            blocks.append(TOOL_CALL_OPEN + json.dumps(item) + TOOL_CALL_CLOSE)
    return "".join(blocks)
