"""The Redis contract on a real Redis Cluster (three masters, three replicas; `stack.sh up
--redis-cluster`): hash-tagged keys, the two-step result write, its crash window, racing
writers, broken keys, and the pipeline end to end (echo worker, bulk job, client).

The cluster's layout must keep every promise of the single-server one: one result per
request, counters equal to the results, a duplicate id counted once in its own job.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
from redis.cluster import RedisCluster

from schemas import ErrorCode, RedisKeys, RequestEnvelope, ResultEnvelope
from schemas.redis_conn import connect, eval_many
from schemas.replies import ResultWriter, WriteStatus
from schemas.result import Status
from schemas.scripts import lua
from tests.integration.workers import Lane, echo_worker, qbatch
from worker.sinks.redis_sink import RedisSink

pytestmark = pytest.mark.integration

TTL = 600


def envelope(rid: str, job: str | None = None) -> RequestEnvelope:
    return RequestEnvelope.model_validate(
        {
            "request_id": rid,
            "job_id": job,
            "custom_id": f"c-{rid}",
            "body": {"messages": [{"role": "user", "content": "hi"}]},
        }
    )


def ok(rid: str, job: str | None = None) -> ResultEnvelope:
    return ResultEnvelope.for_request(envelope(rid, job), Status.succeeded)


def failed(rid: str, job: str | None = None) -> ResultEnvelope:
    return ResultEnvelope.failure(envelope(rid, job), ErrorCode.engine_error, "boom")


def counters(client: Any, keys: RedisKeys, job: str) -> dict[str, str]:
    raw = client.hgetall(keys.job(job))
    return {k.decode(): v.decode() for k, v in raw.items()}


def test_keys_a_script_touches_share_a_slot(cluster: tuple[Any, RedisKeys]) -> None:
    client, keys = cluster
    slot = client.keyslot
    assert slot(keys.result("r.1")) == slot(keys.done("r.1"))
    job = {slot(k("j.1")) for k in (keys.job, keys.job_stream, keys.job_cancel, keys.job_counted)}
    assert len(job) == 1
    serve = {
        slot(keys.serve_batch("batch_1")),
        slot(keys.serve_tenant_batches("t")),
        slot(keys.serve_tenant_active("t")),
        slot(keys.serve_active()),
    }
    assert len(serve) == 1
    assert slot(keys.serve_usage("t", "2026-12-05")) == slot(
        keys.serve_usage_counted("t", "2026-12-05")
    )
    # and results of one job are spread over the cluster, not piled on one node
    assert len({slot(keys.result(f"job7.{i}")) for i in range(64)}) > 32


def test_results_written_once_and_counted_once(cluster: tuple[Any, RedisKeys]) -> None:
    client, keys = cluster
    writer = ResultWriter(client, keys)
    batch = [(ok(f"j1.{i}", "j1"), TTL) for i in range(40)]
    batch += [(failed(f"j1.f{i}", "j1"), TTL) for i in range(5)]
    batch += [(ok(f"solo.{i}"), TTL) for i in range(5)]
    replies = writer.write(batch, now_ms=1)
    assert [r.status for r in replies] == [WriteStatus.written] * 50
    again = writer.write(batch, now_ms=2)  # a redelivery of the whole chunk
    assert [r.status for r in again] == [WriteStatus.existed] * 50
    c = counters(client, keys, "j1")
    assert (c.get("succeeded"), c.get("failed")) == ("40", "5")
    assert client.xlen(keys.job_stream("j1")) == 45
    assert client.scard(keys.job_counted("j1")) == 45
    assert client.get(keys.result("solo.3")) is not None
    assert client.llen(keys.done("j1.7")) == 1
    assert 0 < client.ttl(keys.job_counted("j1")) <= TTL


def test_the_job_counts_its_results_when_a_crash_split_the_two_steps(
    cluster: tuple[Any, RedisKeys],
) -> None:
    """Step 1 (the result's keys) ran, the worker died before step 2 (the job's counters):
    the admission calls the request unanswered, the rerun's write finds the stored result
    and counts it, with the stored status (not the rerun's), exactly once."""
    client, keys = cluster
    first = ok("j2.0", "j2")
    [raw] = eval_many(
        client,
        lua("write_result_cluster"),
        [([keys.result("j2.0"), keys.done("j2.0")], [first.model_dump_json(), TTL, "j2"])],
    )
    assert raw[0] == 1
    sink = RedisSink(client, keys)
    env = envelope("j2.0", "j2")
    assert sink.admission([env]).answered_in("j2.0", "j2") is None  # not counted: run again
    rerun = failed("j2.0", "j2")
    assert ResultWriter(client, keys).write([(rerun, TTL)], now_ms=5)[0].status is (
        WriteStatus.existed
    )
    c = counters(client, keys, "j2")
    assert c.get("succeeded") == "1" and "failed" not in c
    assert sink.admission([env]).answered_in("j2.0", "j2") is True  # counted now: skip it
    assert client.xlen(keys.job_stream("j2")) == 1


def test_racing_writers_count_each_result_once(cluster: tuple[Any, RedisKeys]) -> None:
    """A zombie and the partition's new owner write the same chunk at the same moment."""
    client, keys = cluster
    batch = [(ok(f"j3.{i}", "j3"), TTL) for i in range(200)]
    written: list[int] = []

    def write() -> None:
        replies = ResultWriter(connect(client_url(client)), keys).write(batch, now_ms=1)
        written.append(sum(r.fresh for r in replies))

    threads = [threading.Thread(target=write) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(written) == 200
    assert counters(client, keys, "j3")["succeeded"] == "200"
    assert client.xlen(keys.job_stream("j3")) == 200


def client_url(client: RedisCluster) -> str:
    node = client.get_default_node()
    return f"redis+cluster://{node.host}:{node.port}"


def test_another_jobs_result_and_broken_keys(cluster: tuple[Any, RedisKeys]) -> None:
    client, keys = cluster
    writer = ResultWriter(client, keys)
    assert writer.write([(ok("shared.1", "ja"), TTL)], now_ms=1)[0].fresh
    dup = writer.write([(ok("shared.1", "jb"), TTL)], now_ms=2)[0]
    assert dup.status is WriteStatus.other_job
    assert "succeeded" not in counters(client, keys, "jb")
    # a job whose hash an attacker (or an operator) turned into a list refuses its results
    client.rpush(keys.job("jbad"), "x")
    bad = writer.write([(ok("jbad.1", "jbad"), TTL), (ok("fine.1", "jfine"), TTL)], now_ms=3)
    assert bad[0].status is WriteStatus.wrong_type and "list" in bad[0].detail
    assert client.get(keys.result("jbad.1")) is None  # nothing half-written
    assert bad[1].fresh
    client.rpush(keys.result("lst.1"), "x")
    assert writer.write([(ok("lst.1"), TTL)], now_ms=4)[0].status is WriteStatus.wrong_type


def test_pipeline_end_to_end_on_the_cluster(cluster_stack: Any, stack: Any, tmp_path: Path) -> None:
    """An echo worker, the client and `qbatch bulk run`, with the single broker for Kafka
    and the Redis Cluster for results: every request answered, the job's counters exact,
    the output file complete and in input order."""
    lane = Lane.on(stack.kafka_bootstrap, cluster_stack.redis_url, "qbrc")
    lane.create_topics(4)
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    with src.open("w") as fh:
        for i in range(300):
            body = {"messages": [{"role": "user", "content": f"b{i}"}]}
            line = {"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions"}
            fh.write(json.dumps({**line, "body": body}) + "\n")
    try:
        with echo_worker(lane, log=tmp_path / "worker.log"), lane.client() as qb:
            ids = qb.submit_many(
                [{"messages": [{"role": "user", "content": f"n{i}"}]} for i in range(60)]
            )
            got = qb.wait_many(ids, timeout=90)
            assert all(r is not None and r.ok for r in got.values()), got
            run = qbatch(
                lane,
                "-q",
                "bulk",
                "run",
                str(src),
                "--out",
                str(out),
                "--job",
                "cj",
                "--timeout",
                "90",
            )
            assert run.returncode == 0, run.stderr
        lines = [json.loads(x) for x in out.read_text().splitlines()]
        assert [x["custom_id"] for x in lines] == [f"c{i}" for i in range(300)]
        assert all(x["error"] is None for x in lines)
        client = connect(cluster_stack.redis_url)
        keys = RedisKeys(lane.prefix, cluster=True)
        h = counters(client, keys, "cj")
        assert (h["status"], h["succeeded"], h["total"]) == ("completed", "300", "300")
        assert client.xlen(keys.job_stream("cj")) == 300
        client.close()
    finally:
        lane.clean_redis()
        lane.delete_topics()


def test_serve_batches_and_usage_on_the_cluster(cluster: tuple[Any, RedisKeys]) -> None:
    """`qbatch serve`'s records: the WATCH/MULTI create and compare-and-set transition run
    on one slot (tag `{serve}`), usage is counted once per request and read back."""
    from producer.serve.batches import BatchRecord, BatchStore
    from producer.usage import UsageStore

    client, keys = cluster
    store = BatchStore(client, keys)

    def record(n: int) -> BatchRecord:
        return BatchRecord(
            id=f"batch_{n:032x}",
            tenant="team-a",
            endpoint="/v1/chat/completions",
            input_file_id="file-1",
            completion_window="24h",
            status="validating",
            created_at=1,
            expires_at=2,
        )

    assert store.create(record(1), max_active=2) is None
    assert store.create(record(2), max_active=2) is None
    assert store.create(record(3), max_active=2) == "active"  # the tenant's limit holds
    assert store.transition(record(1).id, {"validating"}, status="in_progress")
    assert not store.transition(record(1).id, {"validating"}, status="failed")
    loaded = store.load(record(1).id)
    assert loaded is not None and loaded.status == "in_progress"

    usage = UsageStore(client, keys)
    res = ResultEnvelope.model_validate(
        {
            "request_id": "u.1",
            "status": "succeeded",
            "worker": {"id": "w", "model": "m"},
            "timings": {"finished": 1_780_000_000_000},
            "response": {
                "id": "x",
                "created": 1,
                "model": "m",
                "choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
            },
        }
    )
    assert usage.record("team-a", res) is not None
    assert usage.record("team-a", res) is None  # counted once
    assert usage.tenants() == ["team-a"]
