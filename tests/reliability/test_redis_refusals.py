"""Issue 39, Redis side, on a private redis-server and the shared Kafka (echo workers):

- a Redis that answers BUSY (another client's script past busy-reply-threshold) or MISCONF
  (a failed RDB write) while results are in flight: every result is written once it
  passes, none is answered `failed` or dead-lettered, nothing is committed meanwhile (the
  worker took both for refusals: 40 of 40 and 50 of 50 results lost);
- a bulk job whose results expire before a redelivery (a short result_ttl_s, a worker
  killed before its commit): the redelivered records neither run again nor count again
  (the job counted 4,024 of 4,000);
- a Redis that takes connections but never answers: the worker does not retry for ever,
  it stops (exit 70) once its calls have only timed out for redis_stall_timeout_s.
- (issue 40) a Redis that takes at most 1 MB a value: results are bounded under it,
  refused before they run or answered `result_too_large`, never a write retried for ever.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import redis

from schemas import RedisKeys
from tests.reliability.conftest import (
    EnvLane,
    chat,
    committed_vs_end,
    dlq_count,
    figures,
    free_port,
    log_events,
    make_lane,
    private_redis,
    produce_envelopes,
    scrape,
    stop_process,
    wait_committed,
    wait_http,
    wait_job,
    wait_results,
)
from tests.reliability.redis_faults import busy, misconf
from tests.reliability.tcp_proxy import DelayProxy


def _wait_metric(port: int, name: str, want: float, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if scrape(port, name) == want:
            return True
        time.sleep(0.05)
    return False


def _private(lane: EnvLane, tmp_path: Path, *extra: str) -> tuple[Any, EnvLane, redis.Redis]:
    port = free_port()
    server = private_redis(port, tmp_path / "redis", *extra)
    private = make_lane("qbrr", lane.bootstrap, f"redis://127.0.0.1:{port}/0")
    private.topic, private.dlq_topic, private.group = lane.topic, lane.dlq_topic, lane.group
    private.bulk_topic = lane.bulk_topic
    return server, private, redis.Redis(port=port, decode_responses=True)


@pytest.mark.parametrize("fault", ["BUSY", "MISCONF"])
def test_results_wait_out_a_redis_that_says_not_now(
    fault: str, lane: EnvLane, spawn: Any, tmp_path: Path
) -> None:
    """BUSY: another client's script past busy-reply-threshold (every command refused).
    MISCONF: a failed RDB save (writes and PING refused, reads not: admission runs, each
    write is refused until a save succeeds). 40 requests in flight either way."""
    server, private, r = _private(lane, tmp_path)
    port = free_port()
    try:
        spawn(private, metrics_port=port)
        wait_http(port)
        produce_envelopes(private, [chat("warm", "w")])
        assert wait_results(r, private.prefix, ["warm"], 60)
        node = r.connection_pool.connection_kwargs["port"]
        end_fault = busy(node, hold_s=6) if fault == "BUSY" else misconf(node)
        with pytest.raises(redis.ResponseError, match=rf"^{fault}"):
            r.set("probe", "1")
        committed_before, _ = committed_vs_end(private)
        envelopes = [chat(f"nn{i}", f"q{i}") for i in range(40)]
        produce_envelopes(private, envelopes)
        refused_seen = _wait_metric(port, "qbatch_redis_up", 0.0, timeout=10)
        committed_during, _ = committed_vs_end(private)
        end_fault()
        rids = [e["request_id"] for e in envelopes]
        results = wait_results(r, private.prefix, rids, 60)
        assert wait_committed(private, 30)
        failed = [rid for rid, res in results.items() if res["status"] != "succeeded"]
        figures(f"redis_{fault.lower()}", results=len(results), failed=len(failed))
        assert refused_seen, f"the worker never met the {fault} server"
        assert committed_during == committed_before, f"committed while Redis said {fault}"
        assert len(results) == 40 and failed == []
        assert dlq_count(private, timeout=3) == []
    finally:
        stop_process(server)


def test_a_redelivery_after_the_results_expired_counts_once(
    lane: EnvLane, redis_client: redis.Redis, spawn: Any
) -> None:
    """What a worker killed before its commit and restarted after a short result_ttl_s
    does to a job, replayed exactly: the records come again and their results are gone."""
    keys = RedisKeys(lane.prefix)
    job, n = "short-ttl", 200
    redis_client.hset(keys.job(job), mapping={"total": n, "status": "running"})
    redis_client.expire(keys.job(job), 3600)
    envelopes = [chat(f"st{i}", f"q{i}", job_id=job, result_ttl_s=60) for i in range(n)]
    port = free_port()
    spawn(lane, metrics_port=port)
    wait_http(port)
    produce_envelopes(lane, envelopes)
    assert wait_job(redis_client, lane.prefix, job, n, 60) == n
    assert wait_committed(lane, 30)
    rids = [e["request_id"] for e in envelopes]
    redis_client.delete(*[keys.result(rid) for rid in rids])  # expired
    skipped_before = scrape(port, "qbatch_duplicates_skipped_total")
    produce_envelopes(lane, envelopes)  # redelivered (to the worker, the same records)
    assert _wait_metric(port, "qbatch_duplicates_skipped_total", skipped_before + n, 60)
    assert wait_committed(lane, 30)
    counts = redis_client.hgetall(keys.job(job))
    figures("short_ttl_redelivery", succeeded=counts.get("succeeded"), total=n)
    assert counts["succeeded"] == str(n) and "failed" not in counts
    assert counts["status"] == "completed"
    assert redis_client.xlen(keys.job_stream(job)) == n
    assert redis_client.exists(*[keys.result(rid) for rid in rids]) == 0  # not run again


def test_a_redis_that_never_answers_stops_the_worker(
    lane: EnvLane, redis_client: redis.Redis, spawn: Any, tmp_path: Path
) -> None:
    """Its calls only time out: a fault after redis_stall_timeout_s (exit 70, so the
    supervisor restarts it), where it retried for ever before."""
    host, _, port_text = lane.redis_url.removeprefix("redis://").partition(":")
    target = (host, int(port_text.split("/")[0]))
    with DelayProxy(target) as proxy:
        slow = make_lane("qbst", lane.bootstrap, f"redis://{proxy.address}/0")
        slow.topic, slow.dlq_topic, slow.group = lane.topic, lane.dlq_topic, lane.group
        slow.prefix, slow.bulk_topic = lane.prefix, lane.bulk_topic
        port = free_port()
        worker = spawn(slow, "--redis-stall-timeout-s", "8", metrics_port=port, name="stalled")
        wait_http(port)
        produce_envelopes(slow, [chat("before", "b")])
        assert wait_results(redis_client, lane.prefix, ["before"], 60)
        proxy.set_delay(3600)  # connections accepted, nothing answered
        produce_envelopes(slow, [chat("stuck", "s")])
        code = worker.wait(timeout=90)
        faults = log_events(tmp_path / "stalled.log", "thread_failed")
        figures("redis_stall", exit=code, faults=len(faults))
        assert code == 70
        assert faults and "Stalled" in faults[0]["error"]


def test_a_result_larger_than_redis_takes_is_refused_not_retried(
    lane: EnvLane, spawn: Any, tmp_path: Path
) -> None:
    """Issue 40, item 5: Redis resets the connection on a value over proto-max-bulk-len,
    and the worker took that for an outage and retried it for ever, intake paused. On a
    Redis taking at most 1 MB a value the worker bounds results under it: a request that
    asks for more (n 8 x max_tokens 20,000) is refused before it runs, naming `n`; one that
    sets no max_tokens and still comes out larger (the echo model's 10-character words
    are more bytes a token than the bound reckons) is answered `result_too_large` instead
    of written; the next request is answered, and every record is committed."""
    server, private, r = _private(lane, tmp_path, "--proto-max-bulk-len", "1mb")
    port = free_port()
    over = chat("over", "hello", body={"n": 8, "max_tokens": 20_000})
    # the echo engine answers each choice with the prompt, up to max_tokens words
    implicit = chat("implicit", "abcdefghij " * 14_000, body={"n": 8})
    del implicit["body"]["max_tokens"]
    try:
        spawn(private, metrics_port=port)
        wait_http(port)
        produce_envelopes(private, [over, implicit, chat("after", "hello")])
        found = wait_results(r, private.prefix, ["over", "implicit", "after"], 60)
        assert set(found) == {"over", "implicit", "after"}, sorted(found)
        for rid, param in (("over", "body.n"), ("implicit", None)):
            assert found[rid]["status"] == "failed", found[rid]
            assert found[rid]["error"]["code"] == "result_too_large", found[rid]
            assert found[rid]["error"].get("param") == param, found[rid]
        assert "came out" in found["implicit"]["error"]["message"]
        assert found["after"]["status"] == "succeeded"
        assert wait_committed(private, 30)
    finally:
        stop_process(server)
