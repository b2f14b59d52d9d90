"""Scenario 6: kill -9 of the worker mid-stream with 10,000 requests, then a restart.

The job's `total` is N, so `succeeded == N` and the job stream's length N prove that
every request was written once. Re-runs are counted by the restarted worker's
`qbatch_duplicates_skipped_total` (redelivered records whose result was already in
Redis: skipped at admission, not run again).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
import redis

from tests.reliability.conftest import (
    EnvLane,
    chat,
    done_lengths,
    figures,
    free_port,
    job_finished,
    new_job,
    produce_envelopes,
    scrape,
    wait_committed,
    wait_http,
    wait_job,
)

JOB = "job-kill9"


@pytest.mark.slow
def test_kill_9_at_10k(lane: EnvLane, redis_client: redis.Redis, spawn: Any) -> None:
    r, n = redis_client, 10_000
    new_job(r, lane.prefix, JOB, n)
    envelopes = [chat(f"k{i}", f"survive {i}", job_id=JOB) for i in range(n)]
    produce_envelopes(lane, envelopes)
    first = spawn(lane, "--echo-delay-ms", "20", "--max-inflight", "512", name="first")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and job_finished(r, lane.prefix, JOB) < n * 4 // 10:
        time.sleep(0.02)
    os.kill(first.pid, signal.SIGKILL)
    first.wait(10)
    at_kill = job_finished(r, lane.prefix, JOB)
    assert 0 < at_kill < n, "the kill must land mid-stream"
    port = free_port()
    t_restart = time.monotonic()
    second = spawn(lane, name="second", metrics_port=port)
    wait_http(port)
    done = wait_job(r, lane.prefix, JOB, n, 180)
    catch_up_s = time.monotonic() - t_restart
    assert wait_committed(lane, 60)
    skipped = scrape(port, "qbatch_duplicates_skipped_total")
    consumed = scrape(port, "qbatch_records_consumed_total")
    job = r.hgetall(f"{lane.prefix}:job:{JOB}")
    stream_len = r.xlen(f"{lane.prefix}:job:{JOB}:done")
    lengths = done_lengths(r, lane.prefix, [e["request_id"] for e in envelopes])
    figures(
        "kill9_10k",
        sent=n,
        results=sum(1 for x in lengths if x >= 1),
        lost=sum(1 for x in lengths if x == 0),
        written_twice=sum(1 for x in lengths if x > 1),
        done_at_kill=at_kill,
        redelivered_to_second=int(consumed - (n - at_kill)),
        re_run_skipped=int(skipped),
        succeeded=job.get("succeeded"),
        stream_len=stream_len,
        catch_up_s=catch_up_s,
    )
    assert second.poll() is None
    assert done == n and all(x == 1 for x in lengths)
    assert int(job["succeeded"]) == n and stream_len == n
    assert job["status"] == "completed"
