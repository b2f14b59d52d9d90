"""deploy/gpu/workers.sh: N workers on one host, each pinned to its own GPUs, one group.

The data-parallel layout of issue 20, run here with the echo engine (CUDA_VISIBLE_DEVICES
is only an environment variable to it): what the script must get right is the same on a
GPU host: each worker's GPU slice, tensor-parallel size, id and metrics port; readiness
before the script returns; one group sharing the partitions; a drained stop.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import redis

from tests.integration.workers import REPO
from tests.reliability.conftest import (
    EnvLane,
    chat,
    free_port,
    log_events,
    produce_envelopes,
    wait_results,
)

SCRIPT = REPO / "deploy" / "gpu" / "workers.sh"


def workers_sh(
    lane: EnvLane, tmp_path: Path, *args: str, **env: str
) -> subprocess.CompletedProcess[str]:
    full = lane.env() | {
        "PYTHON": sys.executable,
        "QBATCH_ENGINE": "echo",
        "QBATCH_AUTO_OFFSET_RESET": "earliest",
        "QBATCH_WORKERS_DIR": str(tmp_path / "workers"),
        "QBATCH_WORKER_ID_PREFIX": f"{lane.prefix}-",
        "QBATCH_WORKER_READY_TIMEOUT_S": "60",
        **env,
    }
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        env=full,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def test_two_workers_pinned_to_their_gpus_share_one_group(
    lane: EnvLane, redis_client: redis.Redis, tmp_path: Path
) -> None:
    base = free_port()
    env = {"QBATCH_GPUS": "4,5,6,7", "QBATCH_GPUS_PER_WORKER": "2"}
    env["QBATCH_METRICS_PORT_BASE"] = str(base)
    started = workers_sh(lane, tmp_path, "start", "2", **env)
    try:
        assert started.returncode == 0, started.stderr
        assert "2 workers ready" in started.stderr
        pids = {p.stem: int(p.read_text()) for p in sorted((tmp_path / "workers").glob("w*.pid"))}
        assert sorted(pids) == ["w0", "w1"]
        seen = {name: environ_of(pid) for name, pid in pids.items()}
        assert [seen[w]["CUDA_VISIBLE_DEVICES"] for w in ("w0", "w1")] == ["4,5", "6,7"]
        assert {e["QBATCH_TENSOR_PARALLEL_SIZE"] for e in seen.values()} == {"2"}
        assert [seen[w]["QBATCH_METRICS_PORT"] for w in ("w0", "w1")] == [
            str(base),
            str(base + 1),
        ]

        rids = [f"pin{i}" for i in range(400)]
        produce_envelopes(lane, [chat(rid, f"hello {rid}") for rid in rids])
        found = wait_results(redis_client, lane.prefix, rids, timeout=90)
        assert len(found) == len(rids)
        assert {r["status"] for r in found.values()} == {"succeeded"}
        by_worker = Counter(r["worker"]["id"] for r in found.values())
        # one group: the partitions (and so the requests) are split over both workers
        assert set(by_worker) == {f"{lane.prefix}-w0", f"{lane.prefix}-w1"}, by_worker
    finally:
        stopped = workers_sh(lane, tmp_path, "stop")
    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stderr.count("stopped") == 2, stopped.stderr
    assert not list((tmp_path / "workers").glob("w*.pid"))
    for name in ("w0", "w1"):
        (event,) = log_events(tmp_path / "workers" / f"{name}.log", "worker_stopped")
        assert event["clean"] is True


@pytest.mark.parametrize("source", ["QBATCH_GPUS", "CUDA_VISIBLE_DEVICES"])
def test_too_few_gpus_start_nothing(lane: EnvLane, tmp_path: Path, source: str) -> None:
    """The GPUs to share out: QBATCH_GPUS, else an inherited CUDA_VISIBLE_DEVICES."""
    env = {source: "0,1,2", "QBATCH_GPUS_PER_WORKER": "2"}
    result = workers_sh(lane, tmp_path, "start", "2", **env)
    assert result.returncode == 2
    assert "2 workers x 2 GPUs need 4 GPUs; there are 3 (0 1 2)" in result.stderr
    assert not list((tmp_path / "workers").glob("w*.pid"))


def test_a_worker_that_cannot_start_fails_the_start(lane: EnvLane, tmp_path: Path) -> None:
    env = {"QBATCH_GPUS": "0", "QBATCH_METRICS_PORT_BASE": str(free_port())}
    try:
        result = workers_sh(lane, tmp_path, "start", "1", "--no-such-flag", **env)
    finally:
        workers_sh(lane, tmp_path, "stop")
    assert result.returncode == 2
    assert "w0 (pid" in result.stderr and "exited before it was ready" in result.stderr
    assert not list((tmp_path / "workers").glob("w*.pid"))  # the start cleaned up


def test_usage_errors(lane: EnvLane, tmp_path: Path) -> None:
    for args in (("start",), ("start", "0"), ("start", "two"), ("restart",)):
        result = workers_sh(lane, tmp_path, *args)
        assert result.returncode == 2, args
        assert "usage: workers.sh" in result.stderr
    bad_g = workers_sh(lane, tmp_path, "start", "1", QBATCH_GPUS_PER_WORKER="0")
    assert bad_g.returncode == 2 and "positive integer" in bad_g.stderr
    for flag in ("--metrics-port", "--worker-id=x", "--tensor-parallel-size"):
        own = workers_sh(lane, tmp_path, "start", "1", flag, "5", QBATCH_GPUS="0")
        assert own.returncode == 2 and "is set per worker by workers.sh" in own.stderr, flag
    assert not list((tmp_path / "workers").glob("w*.pid"))
