"""Helpers for the tests that run Debian's `prometheus` package (`prometheus`, `promtool`):
tests/unit/test_prometheus_rules.py and tests/integration/test_prometheus_live.py.
"""

from __future__ import annotations

import shutil

from tests.ci_gate import tool_missing

INSTALL_HINT = "apt-get install -y prometheus; .ci/run installs it"


def require_binary(name: str) -> str:
    """The path of `name` (`prometheus` or `promtool`), or the test is skipped here and
    failed under CI (tests.ci_gate)."""
    path = shutil.which(name)
    if path:
        return path
    tool_missing(f"no `{name}` on PATH ({INSTALL_HINT})")
