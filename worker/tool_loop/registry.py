"""Tools as code: the registry the tool executor runs calls from.

A tool is a typed Python function (`@registry.tool`, its JSON Schema derived from the
signature by pydantic, its description from the docstring) or an HTTP endpoint from a
config file (`worker.tool_loop.http`). The same registry gives the OpenAI `tools` list a
request offers the model (`registry.openai_tools()`), so what the model is told and what
the executor accepts cannot drift apart.

Per tool: `timeout_s` (default 5), `max_result_bytes` (default 16 KiB) and `sensitive`.
A sensitive tool (payments, deletes) runs only when the registry's permission hook
approves the call; the default hook refuses every sensitive call, and the model is told
why, so a deployment has to opt in explicitly.
"""

from __future__ import annotations

import importlib
import inspect
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar, overload

from griffe import Docstring, DocstringSectionKind, parse_auto
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from schemas import limits
from schemas.request import FunctionDef
from worker.tool_loop.http import load_http_tools
from worker.tool_loop.spec import (
    DEFAULT_TIMEOUT_S,
    InvalidArguments,
    PermissionHook,
    ToolCallContext,
    ToolSpec,
    refuse_sensitive,
    result_text,
)

F = TypeVar("F", bound=Callable[..., Any])


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
        self.timeout_s = timeout_s
        self.max_result_bytes = max_result_bytes
        self.sensitive = sensitive
        try:  # string annotations (`from __future__ import annotations`) resolved here
            signature = inspect.signature(fn, eval_str=True)
        except NameError as exc:
            raise TypeError(f"tool {self.name}: an annotation does not resolve: {exc}") from None
        params = list(signature.parameters.values())
        self.takes_context = bool(params) and params[0].annotation is ToolCallContext
        """The first parameter is typed `ToolCallContext`: the call's context is passed
        there (the idempotency key, the request and job), and the model never sees it."""
        if self.takes_context:
            params = params[1:]
        summary, described = docstring_parts(inspect.getdoc(fn) or "")
        self.description = description or summary
        fields: dict[str, Any] = {}
        for param in params:
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                raise TypeError(f"tool {self.name}: *args/**kwargs cannot be described")
            if param.annotation is ToolCallContext:
                raise TypeError(f"tool {self.name}: only the first parameter may take the context")
            annotation = Any if param.annotation is param.empty else param.annotation
            default = ... if param.default is param.empty else param.default
            fields[param.name] = (
                annotation,
                Field(default, description=described.get(param.name)),
            )
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
        arguments = {name: getattr(validated, name) for name in type(validated).model_fields}
        return self.fn(call, **arguments) if self.takes_context else self.fn(**arguments)


def docstring_parts(doc: str) -> tuple[str, dict[str, str]]:
    """A docstring's text (the tool's description) and its parameters' descriptions, in
    any style griffe recognises (Google, NumPy, Sphinx)."""
    if not doc.strip():
        return "", {}
    sections = parse_auto(Docstring(doc), default="sphinx", per_style_options=_QUIET)
    text = "\n\n".join(s.value for s in sections if s.kind is DocstringSectionKind.text)
    params = {
        p.name: p.description
        for s in sections
        if s.kind is DocstringSectionKind.parameters
        for p in s.value
        if p.description
    }
    return text.strip(), params


_QUIET: Any = {"google": {"warn_missing_types": False}, "numpy": {"warn_missing_types": False}}
logging.getLogger("griffe").setLevel(logging.ERROR)  # a docstring's style nits are not ours


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
        """Add the HTTP tools of a YAML or JSON config file (see `worker.tool_loop.http`)."""
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
