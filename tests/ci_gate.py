"""One rule for a test whose tool is missing (promtool, prometheus, Chromium, kubectl):
skipped, saying why, on a developer's machine; failed under CI (CI=true), where `.ci/run`
installs the tool, so a missing one is a broken setup, and a skip there would let the
test vanish without anyone noticing."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def under_ci() -> bool:
    return os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def tool_missing(msg: str) -> NoReturn:
    if under_ci():
        pytest.fail(f"CI: {msg}")
    pytest.skip(msg)
