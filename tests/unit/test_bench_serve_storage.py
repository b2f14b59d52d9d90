"""The storage benchmark (`tests/benchmarks/bench_serve_storage.py`) at a tiny size, so it
cannot rot between the runs that give its figures: it runs, and what it prints is what
the store did (request counts included)."""

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
    monkeypatch.setattr(sys, "argv", [*argv, "--json-out", str(out)])
    assert bench_serve_storage.main() == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["backend"] == "local" and row["files"] == 40
    assert row["list_page_calls"] == {"walks": 1, "read_meta": 21}
    assert row["usage_calls"] == {"walks": 2}
    mended = bench_serve_storage.MEND_PER_COUNT
    assert row["first_usage_calls"] == {"walks": 2, "read_meta": mended, "mark": mended}
    assert "local" in capsys.readouterr().out
