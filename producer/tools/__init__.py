"""The tool-author API under its earlier name: `worker.tool_loop` is the loop's home (the
registry, HTTP tools, the runner and the executor); this module re-exports its public
names so registries written as `from producer.tools import ToolRegistry` keep working."""

from worker import tool_loop as _home
from worker.tool_loop import *  # noqa: F403

__all__ = list(_home.__all__)
