"""deploy/local/stack.sh refuses what it does not know, before starting anything."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

STACK = Path(__file__).resolve().parents[2] / "deploy" / "local" / "stack.sh"


@pytest.mark.parametrize(
    ("args", "word"),
    [(["up", "--brokers", "5"], "--brokers 5"), (["up", "--brokers=2"], "--brokers 2"),
     (["down", "--redis-cluster"], "--redis-cluster"), (["status", "--brokers", "3"], "--brokers"),
     (["kill-broker", "one"], "one"), (["start-redis", "17000", "17001"], "17001"),
     (["down", "--sasl"], "--sasl"), (["status", "--wipe"], "--wipe"),
     (["logs", "--sentinel"], "--sentinel"), (["kill-redis", "16479", "16480"], "16480")],
)  # fmt: skip
def test_unknown_flags_are_refused(args: list[str], word: str, tmp_path: Path) -> None:
    proc = subprocess.run(
        ["bash", str(STACK), *args],
        capture_output=True,
        text=True,
        timeout=30,
        env={"PATH": "/usr/bin:/bin", "QBATCH_STACK_DIR": str(tmp_path)},
    )
    assert proc.returncode == 2
    assert f"does not take '{word}'" in proc.stderr
    assert not (tmp_path / "run").exists()  # nothing was started


def test_one_redis_url_at_a_time(tmp_path: Path) -> None:
    """--redis-cluster and --redis-sentinel would both set QBATCH_REDIS_URL."""
    proc = subprocess.run(
        ["bash", str(STACK), "up", "--redis-cluster", "--redis-sentinel"],
        capture_output=True,
        text=True,
        timeout=30,
        env={"PATH": "/usr/bin:/bin", "QBATCH_STACK_DIR": str(tmp_path)},
    )
    assert proc.returncode == 2
    assert "pick one" in proc.stderr
    assert not (tmp_path / "run").exists()
