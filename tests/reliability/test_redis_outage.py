"""Scenario 7: the worker's Redis is down for 15 s mid-stream (a private redis-server).

While Redis is down: nothing is committed, the worker stays alive, its memory stays
bounded (results held are bounded by max_inflight; fetching is paused). After the
restart: every request has exactly one result. Figures: peak RSS during the outage
and the recovery time (Redis back -> results flowing again).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.reliability.conftest import (
    EnvLane,
    RssSampler,
    chat,
    committed_vs_end,
    done_lengths,
    figures,
    free_port,
    job_finished,
    make_lane,
    private_redis,
    produce_envelopes,
    stop_process,
    wait_committed,
    wait_job,
)

JOB = "job-redis-outage"


@pytest.mark.slow
def test_redis_down_15s(lane: EnvLane, spawn: Any, tmp_path: Path) -> None:
    port = free_port()
    server = private_redis(port, tmp_path / "redis")
    private = make_lane("qbro", lane.bootstrap, f"redis://127.0.0.1:{port}/0")
    private.topic, private.dlq_topic, private.group = lane.topic, lane.dlq_topic, lane.group
    r = redis.Redis(port=port, decode_responses=True)
    n = 6000
    envelopes = [chat(f"ro{i}", f"outage {i}", job_id=JOB) for i in range(n)]
    rids = [e["request_id"] for e in envelopes]
    r.hset(f"{private.prefix}:job:{JOB}", mapping={"total": n, "status": "running"})
    worker = spawn(private, "--echo-delay-ms", "5", "--max-inflight", "1024")
    try:
        with RssSampler(worker.pid, 0.5) as rss:
            produce_envelopes(private, envelopes[: n // 2])
            assert wait_job(r, private.prefix, JOB, 300, 60) >= 300
            before = job_finished(r, private.prefix, JOB)
            r.shutdown(nosave=False)
            server.wait(10)
            t_down = time.monotonic()
            produce_envelopes(private, envelopes[n // 2 :])
            time.sleep(2)
            committed_early, _ = committed_vs_end(private)
            time.sleep(13)
            committed_late, end = committed_vs_end(private)
            alive = worker.poll() is None
            t_up = time.monotonic()
            server = private_redis(port, tmp_path / "redis")
            at_up = job_finished(r, private.prefix, JOB)
            recovered = None
            while time.monotonic() < t_up + 60:
                if job_finished(r, private.prefix, JOB) > at_up:
                    recovered = time.monotonic()
                    break
                time.sleep(0.05)
            done = wait_job(r, private.prefix, JOB, n, 120)
            t_done = time.monotonic()
        assert wait_committed(private, 60)
        lengths = done_lengths(r, private.prefix, rids)
        job = r.hgetall(f"{private.prefix}:job:{JOB}")
        figures(
            "redis_outage_15s",
            sent=n,
            results=sum(1 for x in lengths if x >= 1),
            lost=sum(1 for x in lengths if x == 0),
            written_twice=sum(1 for x in lengths if x > 1),
            done_before_outage=before,
            outage_s=t_up - t_down,
            committed_during_outage=committed_late - committed_early,
            uncommitted_during_outage=end - committed_late,
            peak_rss_before_mb=rss.peak_between(0, t_down),
            peak_rss_outage_mb=rss.peak_between(t_down, t_up),
            peak_rss_mb=rss.peak,
            recovery_s=(recovered - t_up) if recovered else None,
            catch_up_s=t_done - t_up,
        )
        assert alive, "the worker must survive a Redis outage"
        assert committed_late == committed_early, "committed while Redis was down"
        assert recovered is not None
        assert done == n and all(x == 1 for x in lengths)
        assert int(job["succeeded"]) == n
        assert rss.peak_between(t_down, t_up) < 400
    finally:
        stop_process(server)
