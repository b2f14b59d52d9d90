"""Helpers for the tests that run Debian's `prometheus` package (`prometheus`, `promtool`):
tests/unit/test_prometheus_rules.py and tests/integration/test_prometheus_live.py.
"""

from __future__ import annotations

import os
import shutil

import pytest

INSTALL_HINT = "apt-get install -y prometheus; .ci/run installs it"


def under_ci() -> bool:
    return os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def require_binary(name: str) -> str:
    """The path of `name` (`prometheus` or `promtool`). Without it the test is skipped,
    saying why, except under CI (CI=true), where it fails: CI installs the package, so a
    missing binary there is a broken setup, not a reason to skip."""
    path = shutil.which(name)
    if path:
        return path
    msg = f"no `{name}` on PATH ({INSTALL_HINT})"
    if under_ci():
        pytest.fail(f"CI: {msg}")
    pytest.skip(msg)
