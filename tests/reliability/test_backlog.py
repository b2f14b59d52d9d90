"""Scenario 5: a large backlog already on the topic; one worker with --max-inflight 512.

The worker's RSS (/proc/PID/status VmRSS) is sampled every 0.5 s and the job's
finished count with it. Memory must stay bounded (peak < 400 MB and the mean of the
last third of the run not above 1.5x the first third) and throughput must not
collapse (no 10% slice below a fifth of the median slice rate).
"""

from __future__ import annotations

import itertools
import json
import statistics
import time
from typing import Any

import pytest
import redis

from tests.reliability.conftest import (
    EnvLane,
    RssSampler,
    chat,
    figures,
    job_finished,
    new_job,
    produce,
    wait_committed,
)

JOB = "job-backlog"


def run_backlog(lane: EnvLane, r: redis.Redis, spawn: Any, n: int) -> None:
    new_job(r, lane.prefix, JOB, n)
    t_produce = time.monotonic()
    template = chat("X", "backlog request number {i}", job_id=JOB)
    records = []
    for i in range(n):
        env = dict(template, request_id=f"bl{i}")
        env["body"] = {
            **template["body"],
            "messages": [{"role": "user", "content": f"backlog {i}"}],
        }
        records.append((env["request_id"].encode(), json.dumps(env).encode()))
    produce(lane, records)
    del records
    produce_s = time.monotonic() - t_produce
    worker = spawn(lane, "--max-inflight", "512")
    progress: list[tuple[float, int]] = []
    t0 = time.monotonic()
    with RssSampler(worker.pid, 0.5) as rss:
        deadline = t0 + max(120, n / 300)
        while time.monotonic() < deadline:
            done = job_finished(r, lane.prefix, JOB)
            progress.append((time.monotonic(), done))
            if done >= n:
                break
            assert worker.poll() is None, "worker died"
            time.sleep(0.1)
    assert progress[-1][1] == n, f"only {progress[-1][1]} of {n} finished"
    assert wait_committed(lane, 60)
    first = next(t for t, d in progress if d > 0)
    # throughput per 10% slice: the time at which the finished count crossed each 10%
    marks = [first]
    for k in range(1, 11):
        marks.append(next(t for t, d in progress if d >= n * k // 10))
    rates = [n / 10 / max(b - a, 0.25) for a, b in itertools.pairwise(marks)]
    samples = [mb for t, mb in rss.samples if t >= first]
    third = max(1, len(samples) // 3)
    first_mean = statistics.mean(samples[:third])
    last_mean = statistics.mean(samples[-third:])
    elapsed = progress[-1][0] - first
    job = r.hgetall(f"{lane.prefix}:job:{JOB}")
    figures(
        f"backlog_{n}",
        sent=n,
        results=job.get("succeeded"),
        lost=n - int(job.get("succeeded", 0)),
        produce_s=produce_s,
        drain_s=elapsed,
        req_per_s=n / elapsed,
        slice_req_per_s=[round(x) for x in rates],
        peak_rss_mb=rss.peak,
        rss_first_third_mb=first_mean,
        rss_last_third_mb=last_mean,
    )
    assert int(job["succeeded"]) == n and r.xlen(f"{lane.prefix}:job:{JOB}:done") == n
    assert rss.peak < 400, f"peak RSS {rss.peak:.0f} MB"
    assert last_mean <= 1.5 * first_mean, (first_mean, last_mean)
    assert min(rates) >= 0.2 * statistics.median(rates), rates


def test_backlog_20k(lane: EnvLane, redis_client: redis.Redis, spawn: Any) -> None:
    run_backlog(lane, redis_client, spawn, 20_000)


@pytest.mark.slow
def test_backlog_100k(lane: EnvLane, redis_client: redis.Redis, spawn: Any) -> None:
    run_backlog(lane, redis_client, spawn, 100_000)
