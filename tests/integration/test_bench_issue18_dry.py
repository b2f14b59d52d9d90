"""The issue-18 GPU benchmarks' `--dry` runs, end to end on the local stack (echo engine).

Marked `benchmark`, so CI's `-m "not slow and not gpu and not benchmark"` leaves them out;
run them before spending device time on the real thing (`pytest -m benchmark -k issue18`).
They go through the same code paths as on the GPU (the input files, `qbatch bulk run` as a
subprocess against in-process workers, the run-batch subprocess and its progress lines,
the JSON, the report); run-batch is the labelled CPU stand-in. The figures mean nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.cluster_stack import ON_CLUSTER
from tests.integration.conftest import Stack

REPO = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.benchmark,
    pytest.mark.skipif(
        ON_CLUSTER, reason="the issue-18 dry runs were written and tried on the single stack"
    ),
]


def bench(stack: Stack, module: str, *args: str) -> str:
    env = os.environ | {
        "QBATCH_KAFKA_BOOTSTRAP": stack.kafka_bootstrap,
        "QBATCH_REDIS_URL": stack.redis_url,
    }
    proc = subprocess.run(
        [sys.executable, "-m", f"tests.benchmarks.{module}", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_runbatch_dry_runs_both_sides_on_the_same_file(stack: Stack, tmp_path: Path) -> None:
    out = bench(stack, "bench_runbatch", "all", "--dry", "--n", "60", "--warmup", "8",
                "--out", str(tmp_path), "--work", str(tmp_path / "work"))  # fmt: skip
    summary = json.loads((tmp_path / "summary.json").read_text())
    q, runs = summary["qbatch"], summary["runbatch"]
    assert (q["lines"], q["answered"], q["tool_lines"], q["tool_answered"]) == (60, 60, 6, 6)
    assert q["completion_tokens"] > 0 and q["wall_s"] > 0
    assert set(runs) == {"defaults", "tools"}
    for variant, r in runs.items():
        assert r["standin"] is True and r["exit"] == 0, r
        assert r["progress_lines"] >= 2 and r["completed"] == r["total"] == 60
        assert 0 < r["processing_s"] < r["wall_s"] and r["engine_start_s"] > 0
        assert r["lines"] == 60
        # without a tool parser run-batch refuses the tool lines, as vLLM does
        expected = (60, 6) if variant == "tools" else (54, 0)
        assert (r["answered"], r["tool_answered"]) == expected
    assert set(summary["ratios"]) == {"defaults", "tools"}
    assert all(x["processing_out_tok_s"] > 0 for x in summary["ratios"].values())
    report = (tmp_path / "report.md").read_text()
    assert "STAND-IN" in report and "| qbatch bulk run |" in report
    assert "STAND-IN" in out
    # the file both sides ran: W's lengths as chat lines, every 10th with a tool
    lines = (tmp_path / "work" / "w-chat.jsonl").read_text().splitlines()
    assert len(lines) == 60 and sum('"tools"' in x for x in lines) == 6


def test_prefix_dry_runs_raw_and_both_placements_for_one_and_two_workers(
    stack: Stack, tmp_path: Path
) -> None:
    # 800 words (~5,600 characters) a prefix: past placement's 4,096-character family key;
    # the echo engine's simulated cache holds ~3 of the 6 families' prefixes
    common = ["--dry", "--families", "6", "--per-family", "4", "--prefix-tokens", "800",
              "--w", "20", "--warmup", "8", "--echo-prefix-cache-tokens", "4000",
              "--out", str(tmp_path), "--work", str(tmp_path / "work")]  # fmt: skip
    bench(stack, "bench_gpu_prefix", "raw", *common)
    bench(stack, "bench_gpu_prefix", "qbatch", "--workers", "1", *common)
    bench(stack, "bench_gpu_prefix", "qbatch", "--workers", "2", "--gpu-mem", "0.45", *common)
    bench(stack, "bench_gpu_prefix", "report", "--out", str(tmp_path))
    raw = json.loads((tmp_path / "raw.json").read_text())["runs"]
    assert raw["P"]["n"] == 24 and raw["W"]["n"] == 20
    for workers in (1, 2):
        doc = json.loads((tmp_path / f"qbatch-{workers}w.json").read_text())
        assert doc["workers"] == workers and len(doc["engine_start_s"]) == workers
        runs = doc["runs"]
        assert [name for name in runs if name.startswith("P-")] == ["P-prefix", "P-none"]
        assert any(name.startswith("W-") for name in runs)
        for row in runs.values():
            assert row["answered"] == row["n"] == (24 if row["name"].startswith("P") else 20)
            assert row["exit"] == 0 and row["out_tok_per_s"] > 0
    one = json.loads((tmp_path / "qbatch-1w.json").read_text())["runs"]
    # families published together find their prefix cached; a shuffled file mostly does not
    assert one["P-prefix"]["prefix_cache_hit_rate"] > one["P-none"]["prefix_cache_hit_rate"]
    assert one["P-prefix"]["worker_metrics_hit_rate"] is not None
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["ratios"]) == {"1 worker(s)", "2 worker(s)"}
    for r in summary["ratios"].values():
        assert "W qbatch/raw" in r and "target W >= 0.97x raw" in r
    report = (tmp_path / "report.md").read_text()
    assert "| 2 | P-" in report and "KV cache tokens" in report


def test_embed_dry_runs_raw_and_qbatch_and_reports_the_ratio(stack: Stack, tmp_path: Path) -> None:
    common = ("--dry", "--n", "120", "--out", str(tmp_path), "--work", str(tmp_path / "work"))
    bench(stack, "bench_gpu_embed", "raw", *common)
    bench(stack, "bench_gpu_embed", "qbatch", *common)
    printed = bench(stack, "bench_gpu_embed", "report", "--out", str(tmp_path))
    doc = json.loads((tmp_path / "report.json").read_text())
    assert doc["raw"]["inputs"] == doc["qbatch"]["inputs"] == 120
    assert doc["raw"]["prompt_tokens"] == doc["qbatch"]["prompt_tokens"] > 120 * 32
    assert set(doc["ratios"]) == {"inputs_per_s", "tokens_per_s"} and "qbatch / raw" in printed
