"""The storage benchmark (`tests/benchmarks/bench_serve_storage.py`) at a tiny size, so it
cannot rot between the runs that give its figures: it runs, and what it prints is what
the store did (round trips counted)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.benchmarks import bench_serve_storage


def test_the_benchmark_runs_and_reports_what_the_store_did(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out.json"
    argv = ["bench", "--files", "40", "--s3-files", "--others", "5", "--repeat", "1"]
    monkeypatch.setattr(sys, "argv", [*argv, "--redis", "fake", "--json-out", str(out)])
    assert bench_serve_storage.main() == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["backend"] == "local" and row["files"] == 40
    # a page: one ZRANGE of 21 members, one pipeline of their records (no object read)
    assert row["list_page_calls"] == {"redis": 2}
    assert row["usage_calls"] == {"redis": 1}  # one HGET
    assert "local" in capsys.readouterr().out
