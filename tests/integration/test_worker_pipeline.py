"""The worker end to end against the real local Kafka and Redis (echo engine).

The client side of these tests is written only from the documented contract
(schemas/README.md): plain kafka-python records in, plain redis-py reads out, so they
also prove a non-qbatch producer can use the service. The only qbatch imports name the
documented key layout (`RedisKeys`, hash-tagged on a Redis Cluster) and open the client
(`connect`, `mget`), so the same tests run with `QBATCH_TEST_STACK=cluster`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import pytest
import redis
from kafka import KafkaConsumer, KafkaProducer
from kafka.structs import TopicPartition

from schemas.keys import RedisKeys
from schemas.redis_conn import is_cluster, is_cluster_url, mget
from tests.integration.cluster_stack import ON_CLUSTER
from tests.integration.workers import Lane, free_port, metric_value, stop_worker, wait_for
from tests.integration.workers import start_worker as _start_worker

_current_tmp: ContextVar[Path] = ContextVar("tmp")


@pytest.fixture(autouse=True)
def _remember_tmp(tmp_path: Path) -> None:
    _current_tmp.set(tmp_path)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


@pytest.fixture
def lane(stack: Any, tmp_path: Path) -> Iterator[Lane]:
    lane = Lane.new("qbw")
    lane.create_topics(partitions=4)
    yield lane
    log = tmp_path / "worker.log"
    if log.exists():  # shown by pytest only when the test failed
        print("---- worker log (tail) ----")
        print("\n".join(log.read_text(errors="replace").splitlines()[-60:]))
    lane.clean_redis()
    lane.delete_topics()


def start_worker(lane: Lane, *extra: str, metrics_port: int = 0) -> subprocess.Popen[bytes]:
    """An echo worker logging to the test's tmp dir (printed on failure)."""
    return _start_worker(
        lane, *extra, log=_current_tmp.get() / "worker.log", metrics_port=metrics_port
    )


def keys(lane: Lane) -> RedisKeys:
    """The lane's key layout (ids in hash tags on a Redis Cluster; schemas/README.md)."""
    return RedisKeys(lane.prefix, cluster=is_cluster_url(lane.redis_url))


def chat(rid: str, text: str, **extra: Any) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 64}
    body.update(extra.pop("body", {}))
    return {"request_id": rid, "body": body, **extra}


def produce(
    lane: Lane, records: list[tuple[bytes | None, bytes]], timestamp_ms: int | None = None
) -> None:
    """Send and flush; `timestamp_ms` back-dates the records' CreateTime (default: now)."""
    producer = KafkaProducer(
        bootstrap_servers=lane.bootstrap, linger_ms=5, acks="all", max_request_size=2_000_000
    )
    for key, value in records:
        producer.send(lane.topic, key=key, value=value, timestamp_ms=timestamp_ms)
    producer.flush()
    producer.close()


def produce_envelopes(lane: Lane, envelopes: list[dict[str, Any]]) -> None:
    produce(lane, [(e["request_id"].encode(), json.dumps(e).encode()) for e in envelopes])


def wait_results(
    r: redis.Redis, prefix: str, rids: list[str], timeout: float = 120
) -> dict[str, dict[str, Any]]:
    deadline = time.monotonic() + timeout
    found: dict[str, dict[str, Any]] = {}
    layout = RedisKeys(prefix, cluster=is_cluster(r))
    while time.monotonic() < deadline:
        missing = [rid for rid in rids if rid not in found]
        if not missing:
            break
        for start in range(0, len(missing), 1000):
            chunk = missing[start : start + 1000]
            for rid, raw in zip(chunk, mget(r, [layout.result(x) for x in chunk]), strict=True):
                if raw is not None:
                    found[rid] = json.loads(raw)
        time.sleep(0.2)
    return found


def committed_equals_end(lane: Lane) -> bool:
    consumer = KafkaConsumer(bootstrap_servers=lane.bootstrap, group_id=lane.group)
    try:
        parts = [TopicPartition(lane.topic, p) for p in consumer.partitions_for_topic(lane.topic)]
        ends = consumer.end_offsets(parts)
        return all((consumer.committed(tp) or 0) == ends[tp] for tp in parts)
    finally:
        consumer.close()


def wait_committed(lane: Lane, timeout: float = 20) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if committed_equals_end(lane):
            return True
        time.sleep(0.3)
    return False


def test_n_requests_in_n_results_out(lane: Lane, redis_client: redis.Redis) -> None:
    n = 2000
    envelopes = []
    for i in range(n):
        if i % 5 == 0:
            env = {
                "request_id": f"c{i}",
                "endpoint": "/v1/completions",
                "body": {"prompt": f"count {i}", "max_tokens": 8},
            }
        else:
            env = chat(f"c{i}", f"hello number {i}", metadata={"i": i}, priority=i % 3)
        envelopes.append(env)
    produce_envelopes(lane, envelopes)
    worker = start_worker(lane)
    try:
        results = wait_results(redis_client, lane.prefix, [e["request_id"] for e in envelopes])
        assert len(results) == n
        assert wait_committed(lane), "offsets were not committed up to the log end"
    finally:
        stop_worker(worker)
    assert worker.returncode == 0
    for env in envelopes:
        res = results[env["request_id"]]
        assert res["status"] == "succeeded", res
        assert res["request_id"] == env["request_id"]
        if env.get("endpoint") == "/v1/completions":
            assert res["response"]["object"] == "text_completion"
            assert res["response"]["choices"][0]["text"] == env["body"]["prompt"]
        else:
            assert res["response"]["object"] == "chat.completion"
            assert (
                res["response"]["choices"][0]["message"]["content"]
                == (env["body"]["messages"][0]["content"])
            )
            assert res["metadata"] == env["metadata"]
        usage = res["response"]["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert 1 <= res["worker"]["batch_size"] <= 64
        # one wake-up token per request, and a TTL on both keys
        assert redis_client.llen(keys(lane).done(env["request_id"])) == 1
        assert 0 < redis_client.ttl(keys(lane).result(env["request_id"])) <= 86_400


def test_tool_calls_are_extracted_and_checked(lane: Lane, redis_client: redis.Redis) -> None:
    good = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"town": 3}}\n</tool_call>'
    envelopes = [
        chat("t-good", good, body={"tools": TOOLS}),
        chat("t-bad", f"Let me check.\n{bad}", body={"tools": TOOLS}),
        chat("t-think", "<think>\nreasoning here\n</think>\n\nThe answer.", body={}),
    ]
    produce_envelopes(lane, envelopes)
    worker = start_worker(lane)
    try:
        results = wait_results(redis_client, lane.prefix, [e["request_id"] for e in envelopes])
    finally:
        stop_worker(worker)
    choice = results["t-good"]["response"]["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    call = choice["message"]["tool_calls"][0]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    bad_res = results["t-bad"]
    assert bad_res["status"] == "succeeded"
    assert bad_res["response"]["choices"][0]["finish_reason"] == "stop"
    assert len(bad_res["tool_call_errors"]) == 1
    assert "city" in bad_res["tool_call_errors"][0]["reason"]
    assert '"town": 3' in bad_res["tool_call_errors"][0]["raw"]
    think = results["t-think"]["response"]["choices"][0]["message"]
    assert think["reasoning_content"].strip() == "reasoning here"
    assert think["content"] == "The answer."


def _dlq_records(lane: Lane, expected: int, timeout: float = 30) -> list[Any]:
    consumer = KafkaConsumer(
        lane.dlq_topic,
        bootstrap_servers=lane.bootstrap,
        auto_offset_reset="earliest",
        group_id=None,
        consumer_timeout_ms=2000,
    )
    records: list[Any] = []
    deadline = time.monotonic() + timeout
    try:
        while len(records) < expected and time.monotonic() < deadline:
            for batch in consumer.poll(timeout_ms=500).values():
                records.extend(batch)
    finally:
        consumer.close()
    return records


def test_every_kind_of_bad_input_is_answered_or_dead_lettered(
    lane: Lane, redis_client: redis.Redis
) -> None:
    r = redis_client
    r.set(keys(lane).job_cancel("cancelled-job"), "1", ex=600)
    long_prompt = " ".join(["word"] * 300)
    bad: dict[str, tuple[bytes | None, bytes, str]] = {
        # rid: (key, value, expected error param or code)
        "b-json": (b"b-json", b"{not json", "(envelope)"),
        "b-array": (b"b-array", b"[1, 2, 3]", "(envelope)"),
        "b-encoding": (b"b-encoding", '{"request_id": "b-encoding", "x": "\xe9"}'.encode("latin-1"), "(envelope)"),
        "b-unknown-field": (b"b-unknown-field", json.dumps({**chat("b-unknown-field", "x"), "colour": "red"}).encode(), "colour"),
        "b-body-field": (b"b-body-field", json.dumps(chat("b-body-field", "x", body={"max_token": 5})).encode(), "body.max_token"),
        "b-neg-tokens": (b"b-neg-tokens", json.dumps(chat("b-neg-tokens", "x", body={"max_tokens": -1})).encode(), "body.max_tokens"),
        "b-huge-tokens": (b"b-huge-tokens", json.dumps(chat("b-huge-tokens", "x", body={"max_tokens": 10**9})).encode(), "body.max_tokens"),
        "b-empty-messages": (b"b-empty-messages", json.dumps({"request_id": "b-empty-messages", "body": {"messages": []}}).encode(), "body.messages"),
        "b-role": (b"b-role", json.dumps({"request_id": "b-role", "body": {"messages": [{"role": "robot", "content": "x"}]}}).encode(), "body.messages[0]"),
        "b-tool-schema": (b"b-tool-schema", json.dumps(chat("b-tool-schema", "x", body={"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}]})).encode(), "body.tools[0].function.parameters"),
        "b-tool-msg": (b"b-tool-msg", json.dumps({"request_id": "b-tool-msg", "body": {"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "r"}]}}).encode(), "body.messages[1].tool_call_id"),
        "b-temperature": (b"b-temperature", json.dumps(chat("b-temperature", "x", body={"temperature": 9})).encode(), "body.temperature"),
        "b-oversize": (b"b-oversize", json.dumps(chat("b-oversize", "x" * 1_010_000)).encode(), "(envelope)"),
        "b-key-mismatch": (b"b-other-key", json.dumps(chat("b-key-mismatch", "x")).encode(), "request_id"),
        "b-model": (b"b-model", json.dumps(chat("b-model", "x", body={"model": "gpt-17"})).encode(), "unknown_model"),
        "b-context": (b"b-context", json.dumps(chat("b-context", long_prompt, body={"max_tokens": 100})).encode(), "context_length_exceeded"),
        "b-expired": (b"b-expired", json.dumps(chat("b-expired", "x", deadline="2020-01-01T00:00:00Z")).encode(), "deadline_exceeded"),
        "b-cancelled": (b"b-cancelled", json.dumps(chat("b-cancelled", "x", job_id="cancelled-job")).encode(), "cancelled"),
    }  # fmt: skip
    no_rid = [(None, b"\x00\x01garbage"), (b"bad key!", b"{}"), (None, b"")]
    good = [chat(f"g{i}", f"fine {i}") for i in range(50)]
    records: list[tuple[bytes | None, bytes]] = []
    for i, env in enumerate(good):
        records.append((env["request_id"].encode(), json.dumps(env).encode()))
        if i < len(bad):
            key, value, _ = list(bad.values())[i]
            records.append((key, value))
    records.extend(no_rid)
    records.append((b"g0", json.dumps(good[0]).encode()))  # a duplicate request_id
    produce(lane, records)
    worker = start_worker(lane, "--max-model-len", "256")
    try:
        rids = [e["request_id"] for e in good] + list(bad)
        results = wait_results(r, lane.prefix, rids, timeout=60)
        assert wait_committed(lane), "a bad record blocked its partition"
    finally:
        stop_worker(worker)
    assert worker.returncode == 0
    for env in good:
        assert results[env["request_id"]]["status"] == "succeeded"
    for rid, (_, _, expect) in bad.items():
        res = results.get(rid)
        assert res is not None, f"{rid} got no result"
        error = res["error"]
        assert error["message"], rid
        if expect in {"unknown_model", "context_length_exceeded", "deadline_exceeded", "cancelled"}:
            assert error["code"] == expect, (rid, error)
        else:
            assert error["code"] == "invalid_request", (rid, error)
            assert error["param"] == expect, (rid, error)
            assert error["message"].startswith(expect), (rid, error)
    assert results["b-expired"]["status"] == "expired"
    assert results["b-cancelled"]["status"] == "cancelled"
    assert r.llen(keys(lane).done("g0")) == 1  # the duplicate was not answered twice
    dead = _dlq_records(lane, expected=len(bad) - 2 + len(no_rid))
    # expired and cancelled are outcomes, not bad input: they are not dead-lettered
    assert len(dead) == len(bad) - 2 + len(no_rid)
    headers = dict(dead[0].headers)
    assert {"qbatch.error.code", "qbatch.error.message", "qbatch.source.partition",
            "qbatch.source.offset"} <= set(headers)  # fmt: skip
    originals = {value for _, value in records}
    assert all(rec.value in originals for rec in dead), "DLQ values must be the original bytes"


def test_redelivered_request_is_not_run_again(lane: Lane, redis_client: redis.Redis) -> None:
    envelopes = [chat(f"d{i}", f"once {i}", job_id="job-d") for i in range(200)]
    redis_client.hset(keys(lane).job("job-d"), mapping={"total": 200, "status": "running"})
    produce_envelopes(lane, envelopes)
    worker = start_worker(lane)
    try:
        first = wait_results(redis_client, lane.prefix, [e["request_id"] for e in envelopes])
    finally:
        stop_worker(worker)
    assert len(first) == 200
    assert redis_client.hget(keys(lane).job("job-d"), "status") == "completed"
    # The same records again, as a producer retry would send them.
    produce_envelopes(lane, envelopes)
    worker = start_worker(lane)
    try:
        assert wait_committed(lane, timeout=60)
    finally:
        stop_worker(worker)
    again = wait_results(redis_client, lane.prefix, [e["request_id"] for e in envelopes], 5)
    assert again == first  # untouched: same batch ids, same timings
    job = redis_client.hgetall(keys(lane).job("job-d"))
    assert job["succeeded"] == "200"
    assert redis_client.xlen(keys(lane).job_stream("job-d")) == 200
    for env in envelopes[:20]:
        assert redis_client.llen(keys(lane).done(env["request_id"])) == 1


def test_batch_window_counts_the_time_a_record_spent_in_kafka(
    lane: Lane, redis_client: redis.Redis
) -> None:
    """The window runs from the record's Kafka timestamp: a fresh lone record waits the
    window at the worker, one that already sat in Kafka longer than the window does not."""
    worker = start_worker(lane, "--batch-max-wait-ms", "3000")

    def send(rid: str, timestamp_ms: int | None = None) -> dict[str, Any]:
        produce(lane, [(rid.encode(), json.dumps(chat(rid, "hello")).encode())], timestamp_ms)
        found = wait_results(redis_client, lane.prefix, [rid], timeout=60)
        assert rid in found, f"no result for {rid}"
        return found[rid]["timings"]

    try:
        send("warm-up")  # the worker is consuming from here on
        fresh = send("fresh")
        stale = send("stale", timestamp_ms=int(time.time() * 1000) - 10_000)
    finally:
        stop_worker(worker)
    assert fresh["dispatched"] - fresh["dequeued"] >= 2500  # the window, less the hop
    assert stale["dispatched"] - stale["dequeued"] < 1500  # 10 s in Kafka: due at once


def test_kill_9_mid_stream_loses_nothing(lane: Lane, redis_client: redis.Redis) -> None:
    n = 6000
    envelopes = [chat(f"k{i}", f"survive {i}", job_id="job-k") for i in range(n)]
    redis_client.hset(keys(lane).job("job-k"), mapping={"total": n, "status": "running"})
    produce_envelopes(lane, envelopes)
    worker = start_worker(lane, "--echo-delay-ms", "20", "--max-inflight", "512")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done = int(redis_client.hget(keys(lane).job("job-k"), "succeeded") or 0)
        if done >= n // 4:
            break
        time.sleep(0.05)
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait(10)
    assert 0 < done < n, "the kill must land mid-stream"
    worker = start_worker(lane)
    try:
        results = wait_results(redis_client, lane.prefix, [e["request_id"] for e in envelopes])
        assert wait_committed(lane)
    finally:
        stop_worker(worker)
    assert len(results) == n
    job = redis_client.hgetall(keys(lane).job("job-k"))
    assert int(job["succeeded"]) == n  # written once each, counted once each
    assert redis_client.xlen(keys(lane).job_stream("job-k")) == n
    assert job["status"] == "completed"


def test_sigterm_drains_in_flight_work(lane: Lane, redis_client: redis.Redis) -> None:
    envelopes = [chat(f"s{i}", f"drain {i}") for i in range(300)]
    produce_envelopes(lane, envelopes)
    port = free_port()
    worker = start_worker(
        lane, "--echo-delay-ms", "1500", "--drain-timeout-s", "30", metrics_port=port
    )
    # SIGTERM once the worker has taken records (answers take 1.5 s each, so they are
    # still in flight): what it took must be finished, written and committed first
    wait_for("the worker to take records", lambda: _consumed(port) > 0, 60)
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(40) == 0
    rids = [e["request_id"] for e in envelopes]
    results = wait_results(redis_client, lane.prefix, rids, 2)
    taken = committed_total(lane)
    # What the worker took before SIGTERM was finished, written and committed; anything
    # else is still on Kafka, uncommitted, for the next worker.
    assert taken > 0
    assert taken == len(results)
    worker = start_worker(lane)
    try:
        assert len(wait_results(redis_client, lane.prefix, rids)) == 300
    finally:
        stop_worker(worker)


def _consumed(port: int) -> float:
    try:
        return metric_value(port, "qbatch_records_consumed_total")
    except OSError:  # not listening yet
        return 0.0


def committed_total(lane: Lane) -> int:
    consumer = KafkaConsumer(bootstrap_servers=lane.bootstrap, group_id=lane.group)
    try:
        parts = [TopicPartition(lane.topic, p) for p in consumer.partitions_for_topic(lane.topic)]
        return sum(consumer.committed(tp) or 0 for tp in parts)
    finally:
        consumer.close()


def _private_redis(port: int, data_dir: Any) -> subprocess.Popen[bytes]:
    """A Redis we may stop: append-only, so its data survives a SHUTDOWN and restart."""
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "yes", "--appendfsync", "always", "--dir", str(data_dir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    client = redis.Redis(port=port)
    for _ in range(100):
        try:
            client.ping()
            return server
        except redis.ConnectionError:
            time.sleep(0.05)
    raise RuntimeError("private redis-server did not start")


@pytest.mark.skipif(
    ON_CLUSTER,
    reason="starts, SHUTDOWNs and restarts a private single redis-server; Redis node kills "
    "on the cluster are the chaos soak's (tests/reliability/soak.py)",
)
def test_redis_outage_pauses_then_catches_up(lane: Lane, tmp_path: Any) -> None:
    """While Redis is down: results held, nothing committed, worker alive; then it catches up."""
    port = 26379 + os.getpid() % 1000
    server = _private_redis(port, tmp_path)
    private = dataclasses.replace(lane, redis_url=f"redis://127.0.0.1:{port}/0")
    r = redis.Redis(port=port)
    n = 3000
    envelopes = [chat(f"o{i}", f"outage {i}") for i in range(n)]
    rids = [e["request_id"] for e in envelopes]
    worker = start_worker(private, "--echo-delay-ms", "5")
    try:
        produce_envelopes(lane, envelopes[: n // 2])
        assert len(wait_results(r, lane.prefix, rids[:100], 30)) == 100
        r.shutdown(nosave=False)
        server.wait(10)
        produce_envelopes(lane, envelopes[n // 2 :])
        time.sleep(2)
        committed_during = committed_total(lane)
        time.sleep(3)
        assert committed_total(lane) == committed_during, "committed while Redis was down"
        assert committed_during < n
        assert worker.poll() is None, "the worker must survive a Redis outage"
        server = _private_redis(port, tmp_path)
        results = wait_results(r, lane.prefix, rids, 90)
        assert wait_committed(lane, timeout=30)
    finally:
        stop_worker(worker)
        if server.poll() is None:
            server.terminate()
            server.wait(10)
    assert len(results) == n
    assert all(res["status"] == "succeeded" for res in results.values())
    assert worker.returncode == 0
