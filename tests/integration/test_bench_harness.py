"""The GPU benchmark's harness, run on the CPU with the echo engine (`--engine echo`).

Device time is scarce (30 minutes a session), so a harness bug found there costs a call.
These runs go through the same code paths as on the GPU (child processes per engine,
records pre-loaded on Kafka, results read back from Redis, the lone-request breakdown,
the reports) with a stand-in engine; the figures themselves mean nothing here.
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
from tests.integration.workers import Lane
from tests.reliability.conftest import free_port

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration


def bench(stack: Stack, out: Path, *args: str) -> str:
    env = os.environ | {
        "QBATCH_KAFKA_BOOTSTRAP": stack.kafka_bootstrap,
        "QBATCH_REDIS_URL": stack.redis_url,
    }
    proc = subprocess.run(
        [sys.executable, "-m", "tests.benchmarks.bench_gpu", *args, "--engine", "echo",
         "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_full_run_measures_a_b_and_c_on_the_same_requests(stack: Stack, tmp_path: Path) -> None:
    bench(stack, tmp_path, "full", "--n", "160", "--budget-s", "240", "--warmup", "32")
    summary = json.loads((tmp_path / "summary.json").read_text())
    runs = summary["runs"]
    assert set(runs) == {"A", "B16", "B64", "C"}
    assert runs["C"]["succeeded"] == runs["C"]["n"] == 160
    assert runs["B64"]["succeeded"] == 160 and runs["B16"]["succeeded"] == 160  # n < 320
    assert runs["B16"]["mean_batch_size"] <= 16
    assert set(summary["ratios"]) == {"C/A", "C/B64", "C/B16"}
    assert all(v > 0 for v in summary["ratios"].values())
    assert "C/A = " in (tmp_path / "report.md").read_text()
    # the warm-up ran through both engines and is not among the measured runs
    for phase in ("static", "continuous"):
        assert json.loads((tmp_path / f"{phase}.json").read_text())["warmup"] == 32


def test_lone_latency_and_wait_sweep(stack: Stack, tmp_path: Path) -> None:
    bench(stack, tmp_path, "continuous", "--n", "0", "--lone", "2", "--sweep", "100")
    doc = json.loads((tmp_path / "continuous.json").read_text())
    assert [row["batch_max_wait_ms"] for row in doc["lone"]] == [0, 10, 50]
    for row in doc["lone"]:
        parts = row["parts_ms_p50"]
        assert set(parts) == {"kafka", "batching", "engine", "reply", "reach", "outside"}
        # a lone request is held for the window since it was submitted, never much less
        # (the window counts its time in Kafka, so the worker itself holds it less)
        assert parts["reach"] >= row["batch_max_wait_ms"] - 1
    sweep = {row["settings"]["batch_max_wait_ms"]: row for row in doc["sweep"]}
    assert set(sweep) == {0, 10, 50}
    assert all(row["succeeded"] == 100 for row in sweep.values())
    # a pre-loaded backlog fills batches even with no wait: records fetched together
    # are batched together
    assert sweep[0]["mean_batch_size"] > 8


def test_knobs_run_each_configuration_in_its_own_process(stack: Stack, tmp_path: Path) -> None:
    bench(stack, tmp_path, "knobs", "--configs", "base,no-chunked-prefill", "--budget-s", "240")
    doc = json.loads((tmp_path / "knobs.json").read_text())
    configs = {c["config"]: c for c in doc["configs"]}
    assert set(configs) == {"base", "no-chunked-prefill"}
    assert configs["no-chunked-prefill"]["engine_overrides"] == {
        "enable_chunked_prefill": False,
        "max_num_batched_tokens": 16384,
    }
    base = {run["workload"]: run for run in configs["base"]["runs"]}
    assert set(base) == {"prefix", "w400", "long"}
    assert all(run["succeeded"] == run["n"] for run in base.values())
    assert set(base["long"]["latency_s_by_group"]) == {"long", "short"}  # 8K-16K prompts fit
    table = (tmp_path / "knobs.md").read_text()
    assert "| long | no-chunked-prefill |" in table


def test_knobs_fp8_profile_runs_the_picked_workload_and_the_drift_probe(
    stack: Stack, tmp_path: Path
) -> None:
    """The issue-18 fp8 call: base and fp8 on W only, warmed up, each engine's greedy probe
    (twice on base: the floor), compared in knobs.json and the table."""
    bench(stack, tmp_path, "knobs", "--configs", "base,fp8", "--workloads", "w400",
          "--warmup", "4", "--drift", "6", "--budget-s", "240")  # fmt: skip
    doc = json.loads((tmp_path / "knobs.json").read_text())
    configs = {c["config"]: c for c in doc["configs"]}
    assert configs["fp8"]["engine_overrides"] == {"quantization": "fp8"}
    for cfg in configs.values():
        assert [run["workload"] for run in cfg["runs"]] == ["w400"]
        assert cfg["warmup"] == 4
    assert len(configs["base"]["drift"]) == 2 and len(configs["fp8"]["drift"]) == 1
    assert all(len(probe) == 6 for probe in configs["base"]["drift"] + configs["fp8"]["drift"])
    assert [row["compare"] for row in doc["drift"]] == ["base vs base (rerun)", "fp8 vs base"]
    assert all(row["n"] == 6 for row in doc["drift"])
    assert configs["base"]["drift_failed"] == [0, 0] and configs["fp8"]["drift_failed"] == [0]
    assert "Greedy drift (6 prompts of W" in (tmp_path / "knobs.md").read_text()


def test_lanes_run_one_worker_per_bulk_cap_on_one_engine(stack: Stack, tmp_path: Path) -> None:
    bench(
        stack,
        tmp_path,
        "lanes",
        "--n",
        "40",
        "--every-s",
        "0.2",
        "--bulk-max-inflight",
        "default,8",
    )
    doc = json.loads((tmp_path / "lanes.json").read_text())
    assert [run["bulk_max_inflight"] for run in doc["runs"]] == [None, 8]
    for run in doc["runs"]:
        assert len(run["idle_s"]) == 15
        assert run["bulk_alone"]["n"] == run["bulk_with_interactive"]["n"] == 40
        assert run["summary"]["bulk_alone_req_per_s"] > 0


def test_external_measures_workers_started_by_workers_sh(stack: Stack, tmp_path: Path) -> None:
    """The data-parallel layout: two pinned workers (deploy/gpu/workers.sh), one group."""
    lane = Lane.new("qbx")
    lane.bootstrap, lane.redis_url = stack.kafka_bootstrap, stack.redis_url
    lane.create_topics()
    env = lane.env() | {
        "PYTHON": sys.executable,
        "QBATCH_ENGINE": "echo",
        "QBATCH_AUTO_OFFSET_RESET": "earliest",
        "QBATCH_WORKERS_DIR": str(tmp_path / "workers"),
        "QBATCH_GPUS": "0,1",
        "QBATCH_METRICS_PORT_BASE": str(free_port()),
        "QBATCH_WORKER_READY_TIMEOUT_S": "60",
        "QBATCH_WORKER_ID_PREFIX": f"{lane.prefix}-",
    }
    workers = ["bash", str(REPO / "deploy" / "gpu" / "workers.sh")]
    started = subprocess.run(
        [*workers, "start", "2"], env=env, capture_output=True, text=True, timeout=120
    )
    try:
        assert started.returncode == 0, started.stderr
        proc = subprocess.run(
            [sys.executable, "-m", "tests.benchmarks.bench_gpu", "external", "--n", "200",
             "--label", "dp2", "--warmup", "16", "--engine", "echo", "--out", str(tmp_path)],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
    finally:
        subprocess.run([*workers, "stop"], env=env, capture_output=True, timeout=200)
        lane.clean_redis()
        lane.delete_topics()
    doc = json.loads((tmp_path / "external-dp2.json").read_text())
    assert doc["succeeded"] == doc["n"] == 200
    assert doc["topic"] == lane.topic
    assert sorted(doc["by_worker"]) == [f"{lane.prefix}-w0", f"{lane.prefix}-w1"]
    assert sum(doc["by_worker"].values()) == 200


@pytest.mark.skipif(
    ON_CLUSTER,
    reason="the A/B run checks out HEAD's tree and runs bench_worker_echo, whose key names "
    "and replication-1 topics are the single server's",
)
def test_ab_worker_echo_alternates_two_trees_and_reports_ratios(
    stack: Stack, tmp_path: Path
) -> None:
    """The before/after comparison of the echo benchmark (here HEAD against itself)."""
    out = tmp_path / "ab.json"
    env = os.environ | {
        "QBATCH_KAFKA_BOOTSTRAP": stack.kafka_bootstrap,
        "QBATCH_REDIS_URL": stack.redis_url,
    }
    proc = subprocess.run(
        [sys.executable, "-m", "tests.benchmarks.ab_worker_echo", "--base", "HEAD",
         "--pairs", "2", "--n", "3000", "--json-out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert [(r["pair"], r["side"]) for r in summary["runs"]] == [
        (1, "base"), (1, "new"), (2, "new"), (2, "base"),
    ]  # fmt: skip
    assert all(r["req_per_s"] > 0 for r in summary["runs"])
    assert summary["req_per_s"]["ratio_geomean"] > 0 and summary["req_per_s"]["ratio_median"] > 0
    listed = subprocess.run(["git", "worktree", "list"], cwd=REPO, capture_output=True, text=True)
    assert "qbatch-ab-" not in listed.stdout  # the base worktree is removed again
