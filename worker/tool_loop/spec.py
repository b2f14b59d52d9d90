"""What a tool is, apart from how tools are registered: the `ToolSpec` interface the
executor runs (a Python function in `worker.tool_loop.registry`, an HTTP endpoint in
`worker.tool_loop.http`), the per-call context a hook or tool sees, and the rule that turns
a return value into the `tool` message's text. Both kinds of tool build on this module,
so neither imports the other's module."""

from __future__ import annotations

import abc
import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic_core import to_json

DEFAULT_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class ToolCallContext:
    """What a permission hook (and an HTTP tool's headers) know about one call."""

    request_id: str
    turn: int
    call_id: str
    name: str
    arguments: Mapping[str, Any]
    job_id: str | None = None
    metadata: Mapping[str, Any] | None = None

    @property
    def idempotency_key(self) -> str:
        """Stable across redeliveries of the same turn: `{request_id}:{turn}:{call_id}`."""
        return f"{self.request_id}:{self.turn}:{self.call_id}"


PermissionHook = Callable[[ToolCallContext], bool | str]
"""True approves; False or a string (the reason, told to the model) refuses."""


def refuse_sensitive(call: ToolCallContext) -> str:
    """The default hook: no sensitive call runs until a deployment says which may."""
    return (
        f"{call.name!r} is a sensitive tool and this executor has no permission hook that "
        "approves it; ask the user to do it themselves"
    )


class InvalidArguments(ValueError):
    """The call's arguments do not match the tool's schema."""


class ToolError(Exception):
    """Raised by a tool to tell the model what went wrong: its message becomes the call's
    `tool` message (`{"error": {"type": "exception", "message": ...}}`). Any other
    exception is an internal fault of the tool: the model gets a generic message and the
    executor logs the exception, so no exception text (paths, hosts, secrets in a
    repr) lands in a stored transcript."""


class ToolSpec(abc.ABC):
    """One tool the executor can run."""

    name: str
    description: str
    parameters: dict[str, Any]
    timeout_s: float
    max_result_bytes: int
    sensitive: bool

    def openai(self) -> dict[str, Any]:
        """The tool as an OpenAI `tools` entry: a copy, so a caller that edits it (adds a
        field to a request's schema) does not change what the executor checks calls
        against. Handing out `parameters` itself once let one test's edit make every later
        request in the process offer `step` with a string `n`."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": copy.deepcopy(self.parameters),
            },
        }

    @abc.abstractmethod
    def validate(self, arguments: Mapping[str, Any]) -> Any:
        """Checked arguments (raise InvalidArguments)."""

    @abc.abstractmethod
    def invoke(self, validated: Any, call: ToolCallContext) -> Any:
        """Run the call (in a thread of its own; may be a coroutine function's result)."""


def result_text(value: Any) -> str:
    """A tool's return value as the `tool` message's content: text as is, else JSON."""
    if isinstance(value, str):
        return value
    if isinstance(value, BaseModel):
        return value.model_dump_json()
    return to_json(value).decode()


__all__ = [
    "DEFAULT_TIMEOUT_S",
    "InvalidArguments",
    "PermissionHook",
    "ToolCallContext",
    "ToolError",
    "ToolSpec",
    "refuse_sensitive",
    "result_text",
]
