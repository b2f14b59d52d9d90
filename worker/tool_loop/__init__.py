"""The tool loop, in one place: what a model's tool calls become until its final answer.

- `routing`: in the worker, a finished turn that called tools becomes a turn event on the
  tool-calls topic (else the request's result); `forced_calls`: a forced tool choice as
  constrained JSON and back.
- `executor` (`qbatch tools serve`): consumes turn events, runs the calls once each
  (`runner`, a ledger in Redis), and publishes the continuation (`continuation`) to the
  requests topic.
- `spec`, `registry`, `http`: the tools themselves, Python functions (`ToolRegistry`) and
  HTTP endpoints from a config file.

The wire format (turn events, call records, loop state, signed loops) is `schemas`'; this
package imports nothing from `producer`. The tool-author API is re-exported here and, for
code written against earlier releases, as `producer.tools`.
"""

from worker.tool_loop.registry import FunctionTool, ToolRegistry, load_registry
from worker.tool_loop.spec import (
    InvalidArguments,
    PermissionHook,
    ToolCallContext,
    ToolError,
    ToolSpec,
    refuse_sensitive,
)

__all__ = [
    "FunctionTool",
    "InvalidArguments",
    "PermissionHook",
    "ToolCallContext",
    "ToolError",
    "ToolRegistry",
    "ToolSpec",
    "load_registry",
    "refuse_sensitive",
]
