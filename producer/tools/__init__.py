"""Tools for qbatch's tool loop: the registry (`ToolRegistry`), HTTP tools from a config
file, and the call runner the executor (`qbatch tools serve`) uses."""

from producer.tools.registry import (
    FunctionTool,
    InvalidArguments,
    PermissionHook,
    ToolCallContext,
    ToolRegistry,
    ToolSpec,
    load_registry,
    refuse_sensitive,
)

__all__ = [
    "FunctionTool",
    "InvalidArguments",
    "PermissionHook",
    "ToolCallContext",
    "ToolRegistry",
    "ToolSpec",
    "load_registry",
    "refuse_sensitive",
]
