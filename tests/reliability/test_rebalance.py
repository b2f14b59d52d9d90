"""Scenario 2: a rebalance mid-stream. Worker A runs; worker B joins the group; A leaves.

All requests belong to one job whose `total` is N, so the job hash proves once-only:
`succeeded == N` and the job stream holds exactly N entries (a result written twice
would count twice). Re-runs are read from each worker's
`qbatch_duplicates_skipped_total` (a redelivered request found answered at admission,
or a re-run whose write was refused by SET NX).
"""

from __future__ import annotations

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

JOB = "job-rebalance"


def run_rebalance(
    lane: EnvLane, r: redis.Redis, spawn: Any, n: int, delay_ms: int, inflight: int
) -> None:
    new_job(r, lane.prefix, JOB, n)
    envelopes = [chat(f"rb{i}", f"rebalance {i}", job_id=JOB) for i in range(n)]
    produce_envelopes(lane, envelopes)
    flags = ("--echo-delay-ms", str(delay_ms), "--max-inflight", str(inflight))
    drain_timeout = 30
    port_a, port_b = free_port(), free_port()
    a = spawn(lane, *flags, "--drain-timeout-s", str(drain_timeout), name="A", metrics_port=port_a)
    wait_http(port_a)
    t0 = time.monotonic()
    assert wait_job(r, lane.prefix, JOB, n * 15 // 100, 120) >= n * 15 // 100
    b = spawn(lane, *flags, name="B", metrics_port=port_b)
    wait_http(port_b)
    # B must own partitions (and have done work) before A leaves
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and scrape(port_b, "qbatch_records_consumed_total") == 0:
        time.sleep(0.2)
    at_join = job_finished(r, lane.prefix, JOB)
    assert scrape(port_b, "qbatch_records_consumed_total") > 0, "B never received records"
    assert at_join < n, "the stream finished before B joined: slow the engine down"
    wait_job(r, lane.prefix, JOB, n * 55 // 100, 120)
    dup_a = scrape(port_a, "qbatch_duplicates_skipped_total")
    consumed_a = scrape(port_a, "qbatch_records_consumed_total")
    at_leave = job_finished(r, lane.prefix, JOB)
    t_term = time.monotonic()
    a.send_signal(signal.SIGTERM)
    rc_a = a.wait(drain_timeout + 15)
    a_exit_s = time.monotonic() - t_term
    done = wait_job(r, lane.prefix, JOB, n, 180)
    elapsed = time.monotonic() - t0
    assert wait_committed(lane, 60), "offsets did not reach the log end"
    dup_b = scrape(port_b, "qbatch_duplicates_skipped_total")
    consumed_b = scrape(port_b, "qbatch_records_consumed_total")
    job = r.hgetall(f"{lane.prefix}:job:{JOB}")
    stream_len = r.xlen(f"{lane.prefix}:job:{JOB}:done")
    lengths = done_lengths(r, lane.prefix, [e["request_id"] for e in envelopes])
    figures(
        f"rebalance_{n}",
        sent=n,
        results=sum(1 for x in lengths if x >= 1),
        lost=sum(1 for x in lengths if x == 0),
        written_twice=sum(1 for x in lengths if x > 1),
        succeeded=job.get("succeeded"),
        stream_len=stream_len,
        done_when_B_joined=at_join,
        done_when_A_left=at_leave,
        consumed_A=int(consumed_a),
        consumed_B=int(consumed_b),
        redelivered=int(consumed_a + consumed_b - n),
        re_run_skipped_A=int(dup_a),
        re_run_skipped_B=int(dup_b),
        A_exit_rc=rc_a,
        A_exit_s=a_exit_s,
        total_s=elapsed,
    )
    assert rc_a == 0 and a_exit_s < drain_timeout, "A did not drain and exit 0 in time"
    assert b.poll() is None
    assert done == n
    assert all(x == 1 for x in lengths), "lost or doubly written results"
    assert int(job["succeeded"]) == n and stream_len == n
    assert job["status"] == "completed"


def test_rebalance_2k(lane: EnvLane, redis_client: redis.Redis, spawn: Any) -> None:
    run_rebalance(lane, redis_client, spawn, 2_000, delay_ms=300, inflight=64)


@pytest.mark.slow
def test_rebalance_10k(lane: EnvLane, redis_client: redis.Redis, spawn: Any) -> None:
    run_rebalance(lane, redis_client, spawn, 10_000, delay_ms=200, inflight=128)
