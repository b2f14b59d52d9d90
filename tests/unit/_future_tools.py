"""A tool module written with `from __future__ import annotations` (string annotations)."""

from __future__ import annotations

from typing import Literal

from producer.tools import ToolRegistry

registry = ToolRegistry()


@registry.tool
def forecast(city: Literal["Oslo", "Paris"], days: int = 1) -> str:
    """Forecast."""
    return f"{city}:{days}"
