"""Tools as code: the registry the tool executor runs calls from.

A tool is a typed Python function (`@registry.tool`, its JSON Schema derived from the
signature by pydantic, its description from the docstring) or an HTTP endpoint from a
config file (`producer.tools.http`). The same registry gives the OpenAI `tools` list a
request offers the model (`registry.openai_tools()`), so what the model is told and what
the executor accepts cannot drift apart.

Per tool: `timeout_s` (default 5), `max_result_bytes` (default 16 KiB) and `sensitive`.
A sensitive tool (payments, deletes) runs only when the registry's permission hook
approves the call; the default hook refuses every sensitive call, and the model is told
why, so a deployment has to opt in explicitly.
"""

from __future__ import annotations

import abc
import importlib
import inspect
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar, overload

from pydantic import BaseModel, ConfigDict, ValidationError, create_model
from pydantic_core import to_json

from schemas import limits

F = TypeVar("F", bound=Callable[..., Any])

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


class ToolSpec(abc.ABC):
    """One tool the executor can run."""

    name: str
    description: str
    parameters: dict[str, Any]
    timeout_s: float
    max_result_bytes: int
    sensitive: bool

    def openai(self) -> dict[str, Any]:
        """The tool as an OpenAI `tools` entry."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
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


class FunctionTool(ToolSpec):
    """A Python function; its parameters become a pydantic model (extra fields refused)."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_result_bytes: int = limits.DEFAULT_TOOL_RESULT_BYTES,
        sensitive: bool = False,
    ) -> None:
        self.fn = fn
        self.name = name or fn.__name__
        self.description = description or inspect.getdoc(fn) or ""
        self.timeout_s = timeout_s
        self.max_result_bytes = max_result_bytes
        self.sensitive = sensitive
        fields: dict[str, Any] = {}
        try:  # string annotations (`from __future__ import annotations`) resolved here
            signature = inspect.signature(fn, eval_str=True)
        except NameError as exc:
            raise TypeError(f"tool {self.name}: an annotation does not resolve: {exc}") from None
        for param in signature.parameters.values():
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                raise TypeError(f"tool {self.name}: *args/**kwargs cannot be described")
            annotation = Any if param.annotation is param.empty else param.annotation
            default = ... if param.default is param.empty else param.default
            fields[param.name] = (annotation, default)
        self.model: type[BaseModel] = create_model(
            f"{self.name}_arguments", __config__=ConfigDict(extra="forbid"), **fields
        )
        schema = self.model.model_json_schema()
        schema.pop("title", None)
        for prop in schema.get("properties", {}).values():
            prop.pop("title", None)
        self.parameters = schema

    def validate(self, arguments: Mapping[str, Any]) -> BaseModel:
        try:
            return self.model.model_validate(dict(arguments))
        except ValidationError as exc:
            raise InvalidArguments(_describe(exc)) from None

    def invoke(self, validated: Any, call: ToolCallContext) -> Any:
        return self.fn(**{name: getattr(validated, name) for name in type(validated).model_fields})


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors(include_url=False)[:3]:
        where = ".".join(str(p) for p in err["loc"]) or "(arguments)"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)


@dataclass
class ToolRegistry:
    """Tools by name, and the hook that decides sensitive calls."""

    permission: PermissionHook = refuse_sensitive
    _tools: dict[str, ToolSpec] = field(default_factory=dict)

    @overload
    def tool(self, fn: F) -> F: ...

    @overload
    def tool(
        self,
        fn: None = None,
        *,
        name: str | None = None,
        description: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_result_bytes: int = limits.DEFAULT_TOOL_RESULT_BYTES,
        sensitive: bool = False,
    ) -> Callable[[F], F]: ...

    def tool(
        self,
        fn: F | None = None,
        *,
        name: str | None = None,
        description: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_result_bytes: int = limits.DEFAULT_TOOL_RESULT_BYTES,
        sensitive: bool = False,
    ) -> F | Callable[[F], F]:
        """Register a function: `@registry.tool` or `@registry.tool(timeout_s=2, ...)`."""

        def register(f: F) -> F:
            self.add(
                FunctionTool(
                    f,
                    name=name,
                    description=description,
                    timeout_s=timeout_s,
                    max_result_bytes=max_result_bytes,
                    sensitive=sensitive,
                )
            )
            return f

        return register(fn) if fn is not None else register

    def add(self, spec: ToolSpec) -> None:
        if spec.name in self._tools:
            raise ValueError(f"tool {spec.name!r} is registered twice")
        from schemas.request import FunctionDef

        FunctionDef(name=spec.name, description=spec.description, parameters=spec.parameters)
        if spec.timeout_s <= 0 or spec.max_result_bytes < 1:
            raise ValueError(f"tool {spec.name!r}: timeout_s and max_result_bytes must be > 0")
        self._tools[spec.name] = spec

    def get(self, name: str) -> ToolSpec | None:
        return self._tools.get(name)

    @property
    def names(self) -> list[str]:
        return sorted(self._tools)

    def openai_tools(self, *names: str) -> list[dict[str, Any]]:
        """The OpenAI `tools` list for a request body (all tools, or the ones named)."""
        chosen = names or tuple(self._tools)
        unknown = [n for n in chosen if n not in self._tools]
        if unknown:
            raise KeyError(f"no such tool(s): {', '.join(unknown)}")
        return [self._tools[n].openai() for n in chosen]

    def load_config(self, path: str) -> ToolRegistry:
        """Add the HTTP tools of a YAML or JSON config file (see `producer.tools.http`)."""
        from producer.tools.http import load_http_tools

        for spec in load_http_tools(path):
            self.add(spec)
        return self


def load_registry(ref: str) -> ToolRegistry:
    """`package.module:attribute` -> the ToolRegistry it names (a factory is called)."""
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--registry wants module:attribute, got {ref!r}")
    value: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        value = getattr(value, part)
    if callable(value) and not isinstance(value, ToolRegistry):
        value = value()
    if not isinstance(value, ToolRegistry):
        raise TypeError(f"{ref} is a {type(value).__name__}, not a ToolRegistry")
    return value


def parse_arguments(text: str) -> dict[str, Any]:
    """OpenAI's JSON-text arguments -> an object (raise InvalidArguments)."""
    try:
        value = json.loads(text) if text.strip() else {}
    except (ValueError, RecursionError) as exc:
        raise InvalidArguments(f"arguments are not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidArguments("arguments must be a JSON object")
    return value


__all__ = [
    "DEFAULT_TIMEOUT_S",
    "FunctionTool",
    "InvalidArguments",
    "PermissionHook",
    "ToolCallContext",
    "ToolRegistry",
    "ToolSpec",
    "load_registry",
    "parse_arguments",
    "refuse_sensitive",
    "result_text",
]
