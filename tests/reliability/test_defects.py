"""Single records that once stopped a worker for good, cancelled another job or stranded
one (issue 22), each replayed against the real Kafka and Redis with an echo worker.

Every case ends the same way: the record gets its one visible outcome, the worker keeps
answering the records after it, and every partition's committed offset reaches the log
end (nothing blocks a partition).
"""

from __future__ import annotations

import json
from typing import Any

import redis

from producer.collect import collect_job
from producer.jobs import JobStore
from schemas import RedisKeys
from tests.reliability.conftest import (
    EnvLane,
    chat,
    dlq_count,
    dlq_sources,
    figures,
    new_job,
    produce,
    produce_envelopes,
    wait_committed,
    wait_job,
    wait_results,
)

TOOL_F = {
    "type": "function",
    "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {}}}},
}


def j(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def test_hostile_records_are_answered_and_the_worker_goes_on(
    lane: EnvLane, redis_client: redis.Redis, spawn: Any
) -> None:
    p = lane.prefix
    keys = RedisKeys(p)
    new_job(redis_client, p, "vic", 4)
    new_job(redis_client, p, "kj", 1)
    worker = spawn(lane)
    produce_envelopes(lane, [chat("vic-1", "first", job_id="vic")])
    assert wait_results(redis_client, p, ["vic-1"], 60)
    assert redis_client.type(keys.job_stream("vic")) == "stream"

    nan_call = '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>'
    records = [
        # 1. job ids naming job vic's own keys
        (b"col-done", j(chat("col-done", "x", job_id="vic:done"))),
        (b"col-cancel", j(chat("col-cancel", "x", job_id="vic:cancel"))),
        # 2. a 5,000-digit integer
        (b"huge", j(chat("huge", "x", metadata={"n": 1})).replace(b'"n": 1', b'"n": ' + b"9" * 5000)),
        # 3. a tool schema whose pattern overflows the regex compiler
        (
            b"pattern",
            j(chat("pattern", "x", body={"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "string", "pattern": "a{99999999999}"}}}}}]})),
        ),
        # 4. rejected after decoding (key differs from request_id): keeps its job
        (b"other-key", j(chat("mis", "x", job_id="kj", custom_id="row-9", metadata={"m": 1}, result_ttl_s=900))),
        # 5. tool-call arguments that are not JSON
        (b"nan", j(chat("nan", nan_call, body={"tools": [TOOL_F]}))),
        # and job vic goes on, not cancelled
        *[(f"vic-{i}".encode(), j(chat(f"vic-{i}", "more", job_id="vic"))) for i in (2, 3, 4)],
    ]  # fmt: skip
    produce(lane, records)
    ids = ["col-done", "col-cancel", "huge", "pattern", "mis", "nan", "vic-2", "vic-3", "vic-4"]
    results = wait_results(redis_client, p, ids, 60)
    assert set(results) == set(ids), f"missing: {set(ids) - set(results)}"
    assert worker.poll() is None, "the worker stopped"
    assert wait_committed(lane, 30), "a partition is blocked"

    for rid in ("col-done", "col-cancel"):
        assert results[rid]["status"] == "failed"
        assert results[rid]["error"]["param"] == "job_id"
    assert redis_client.type(keys.job_stream("vic")) == "stream"
    assert redis_client.type(keys.job_cancel("vic")) == "none"
    assert results["huge"]["error"]["param"] == "(envelope)"
    assert results["pattern"]["error"]["param"] == "body.tools[0].function.parameters"
    mis = results["mis"]
    assert mis["status"] == "failed" and mis["error"]["param"] == "request_id"
    assert (mis["job_id"], mis["custom_id"], mis["metadata"]) == ("kj", "row-9", {"m": 1})
    assert 800 < redis_client.ttl(keys.result("mis")) <= 900
    assert redis_client.hget(keys.job("kj"), "status") == "completed_with_errors"
    nan = results["nan"]
    assert nan["status"] == "succeeded"
    assert nan["tool_call_errors"][0]["reason"].startswith("not valid JSON")
    assert "tool_calls" not in nan["response"]["choices"][0]["message"]
    for rid in ("vic-2", "vic-3", "vic-4"):
        assert results[rid]["status"] == "succeeded"
    assert redis_client.hget(keys.job("vic"), "status") == "completed"

    dead = dlq_count(lane, timeout=20, expected=5)
    ids_dead = {dict(r.headers).get("qbatch.request_id") for r in dead}
    assert ids_dead == {b"col-done", b"col-cancel", b"huge", b"pattern", b"mis"}
    figures("defects_hostile", answered=len(results), dead_letters=len(dlq_sources(dead)))


def test_a_request_id_reused_in_another_job_fails_for_that_job(
    lane: EnvLane, redis_client: redis.Redis, spawn: Any, tmp_path: Any
) -> None:
    """Job a (any producer) happens to use an id that job b's bulk line 1 also gets."""
    p = lane.prefix
    keys = RedisKeys(p)
    shared = "job-b.1"
    new_job(redis_client, p, "job-a", 1)
    new_job(redis_client, p, "job-b", 2)
    spawn(lane)
    produce_envelopes(lane, [chat(shared, "from a", job_id="job-a")])
    first = wait_results(redis_client, p, [shared], 60)[shared]
    assert first["job_id"] == "job-a"
    produce_envelopes(
        lane, [chat(shared, "from b", job_id="job-b"), chat("job-b.2", "own", job_id="job-b")]
    )
    assert wait_job(redis_client, p, "job-b", 2, 60) == 2
    # the result key still holds job a's answer: written once
    assert json.loads(redis_client.get(keys.result(shared)))["job_id"] == "job-a"
    job_b = redis_client.hgetall(keys.job("job-b"))
    assert (job_b["succeeded"], job_b["failed"]) == ("1", "1")
    assert job_b["status"] == "completed_with_errors"
    assert redis_client.hget(keys.job("job-a"), "status") == "completed"
    # redelivered: counted once
    produce_envelopes(lane, [chat(shared, "from b again", job_id="job-b")])
    produce_envelopes(lane, [chat("marker", "after", job_id="other")])
    assert wait_results(redis_client, p, ["marker"], 60)
    assert redis_client.hget(keys.job("job-b"), "failed") == "1"
    assert len(redis_client.xrange(keys.job_stream("job-b"))) == 2
    # bulk collect gives job b's line its own error (inline in the stream), not a's answer
    store = JobStore(redis.Redis.from_url(lane.redis_url), keys)
    report = collect_job(store, "job-b", tmp_path / "b.jsonl", timeout=10)
    assert report.complete and report.counts["failed"] == 1
    lines = [json.loads(x) for x in (tmp_path / "b.jsonl").read_text().splitlines()]
    assert [line["custom_id"] for line in lines] == [None, None]
    assert lines[0]["response"]["status_code"] == 409
    assert lines[0]["error"]["code"] == "duplicate_request_id"
    assert lines[1]["response"]["status_code"] == 200


def test_keys_of_the_wrong_type_cost_only_their_own_requests(
    lane: EnvLane, redis_client: redis.Redis, spawn: Any
) -> None:
    p = lane.prefix
    keys = RedisKeys(p)
    redis_client.set(keys.job("jbad"), "not a hash")
    redis_client.rpush(keys.result("rbad"), "not a string")
    worker = spawn(lane)
    good = [chat(f"ok{i}", "fine") for i in range(20)]
    produce_envelopes(
        lane, [*good[:10], chat("rj", "x", job_id="jbad"), chat("rbad", "x"), *good[10:]]
    )
    results = wait_results(redis_client, p, [e["request_id"] for e in good] + ["rj"], 60)
    assert all(results[e["request_id"]]["status"] == "succeeded" for e in good)
    rj = results["rj"]
    assert rj["status"] == "failed" and rj["error"]["code"] == "internal_error"
    assert "job key holds a Redis string" in rj["error"]["message"]
    assert redis_client.get(keys.job("jbad")) == "not a hash"  # the script wrote nothing there
    assert redis_client.llen(keys.done("rj")) == 1
    assert redis_client.lrange(keys.result("rbad"), 0, -1) == ["not a string"]
    dead = dlq_count(lane, timeout=20, expected=2)
    assert {dict(r.headers)["qbatch.request_id"] for r in dead} == {b"rj", b"rbad"}
    # scripts flushed from the server (restart, failover, SCRIPT FLUSH): reloaded, not fatal
    redis_client.script_flush()
    produce_envelopes(lane, [chat("after-flush", "x")])
    assert (
        wait_results(redis_client, p, ["after-flush"], 60)["after-flush"]["status"] == "succeeded"
    )
    assert worker.poll() is None
    assert wait_committed(lane, 30)
