"""The result scripts' bookkeeping on the real Redis, single server and Cluster (issue 39):

- admission reads a stored result's first bytes only (`schemas/lua/result_head.lua`), so
  a result of any size costs it the same; a result whose bytes past the head are not
  JSON shows it (decoding it whole, as the script once did, finds no job there);
- a job counts each request once by request (its counted set), not by the result key's
  presence: a request redelivered after its result expired is admitted as answered, and
  a second write of it neither counts again nor adds a stream entry;
- the counted set lives as long as the job, not as long as the short-lived results.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from schemas import ErrorCode, RedisKeys, RequestEnvelope, ResultEnvelope
from schemas.redis_conn import connect
from schemas.replies import ResultWriter, WriteStatus
from schemas.result import RESULT_HEAD_BYTES, Status, result_head
from schemas.scripts import function
from tests.integration.cluster_stack import ClusterStack
from worker.sinks.redis_sink import RedisSink

pytestmark = pytest.mark.integration

HEAD = function("result_head") + "\nreturn {result_head(KEYS[1])}\n"


@pytest.fixture(params=["single", "cluster"])
def store(
    request: pytest.FixtureRequest, redis_url: str, prefix: str
) -> Iterator[tuple[Any, RedisKeys]]:
    """(client, keys) on the single server, then on the Redis Cluster."""
    if request.param == "cluster":
        url = request.getfixturevalue("cluster_stack").redis_url
        assert isinstance(request.getfixturevalue("cluster_stack"), ClusterStack)
    else:
        url = redis_url
    client = connect(url)
    keys = RedisKeys(prefix.replace("-", "_"), cluster=request.param == "cluster")
    try:
        yield client, keys
    finally:
        doomed = list(client.scan_iter(match=f"{keys.prefix}:*", count=1000))
        for key in doomed:  # one by one: a cluster refuses a DEL across slots
            client.delete(key)
        client.close()


def envelope(rid: str, job: str | None = None, custom_id: str | None = None) -> RequestEnvelope:
    return RequestEnvelope.model_validate(
        {
            "request_id": rid,
            "job_id": job,
            "custom_id": custom_id,
            "body": {"messages": [{"role": "user", "content": "hi"}]},
        }
    )


def ok(rid: str, job: str | None = None, **extra: Any) -> ResultEnvelope:
    return ResultEnvelope.for_request(envelope(rid, job, **extra), Status.succeeded)


def test_the_head_of_a_result_holds_its_job_and_status(store: tuple[Any, RedisKeys]) -> None:
    """The longest ids and a custom_id full of quotes: the head still holds both fields,
    and the Lua reader and its Python twin (the cluster's pipelines) agree."""
    client, keys = store
    cases = [
        ok("r" * 128, "j" * 128, custom_id='"status":"failed",' * 20),
        ResultEnvelope.failure(envelope("r2"), ErrorCode.cancelled, "x", status=Status.cancelled),
        ok("r3", "job.3"),
    ]
    for result in cases:
        raw = result.model_dump_json(exclude_none=True).encode()
        key = keys.result(result.request_id)
        client.set(key, raw)
        job, status = (x.decode() for x in client.eval(HEAD, 1, key))
        assert (job, status) == (result.job_id or "", result.status.value)
        assert result_head(raw[:RESULT_HEAD_BYTES]) == (job, status)


def test_admission_reads_only_the_head_of_a_stored_result(store: tuple[Any, RedisKeys]) -> None:
    """A stored result of 8 MB whose bytes after the head are not JSON: admission still
    names its job (a whole decode finds none and said "another job's result")."""
    client, keys = store
    sink = RedisSink(client, keys)
    ResultWriter(client, keys).write([(ok("big.1", "jobA"), 600)], 1)  # written and counted
    head = ok("big.1", "jobA").model_dump_json(exclude_none=True).encode()[:RESULT_HEAD_BYTES]
    client.set(keys.result("big.1"), head + b"\x00not json" * 800_000)  # then made huge
    admission = sink.admission([envelope("big.1", "jobA"), envelope("new.1", "jobA")])
    assert admission.answered_in("big.1", "jobA") is True
    assert admission.answered_in("new.1", "jobA") is None
    # the writer's "another job?" check reads the head too: same job, a plain redelivery
    (reply,) = ResultWriter(client, keys).write([(ok("big.1", "jobA"), 600)], 1)
    assert reply.status is WriteStatus.existed


def test_a_redelivery_after_the_result_expired_counts_once(store: tuple[Any, RedisKeys]) -> None:
    client, keys = store
    writer, sink = ResultWriter(client, keys), RedisSink(client, keys)
    client.hset(keys.job("jobT"), mapping={"total": 2, "status": "running"})
    client.expire(keys.job("jobT"), 7 * 86_400)
    first = writer.write([(ok("t.1", "jobT"), 2), (ok("t.2", "jobT"), 2)], 1)
    assert [r.status for r in first] == [WriteStatus.written] * 2
    client.delete(keys.result("t.1"))  # what result_ttl_s does: the result is gone
    # admission: ran before in its job, so not again
    assert sink.admission([envelope("t.1", "jobT")]).answered_in("t.1", "jobT") is True
    # a worker that raced past admission writes it again: stored, not counted again
    (again,) = writer.write([(ok("t.1", "jobT"), 2)], 2)
    assert again.status is WriteStatus.written
    assert json.loads(client.get(keys.result("t.1")))["request_id"] == "t.1"
    job = {k.decode(): v.decode() for k, v in client.hgetall(keys.job("jobT")).items()}
    assert (job["succeeded"], job["status"]) == ("2", "completed")
    assert client.xlen(keys.job_stream("jobT")) == 2
    # the counted set lives as long as the job, not as the 2-s results
    assert client.ttl(keys.job_counted("jobT")) > 86_400


def test_a_request_without_a_job_is_not_kept_in_any_set(store: tuple[Any, RedisKeys]) -> None:
    client, keys = store
    ResultWriter(client, keys).write([(ok("free.1"), 60)], 1)
    client.delete(keys.result("free.1"))
    assert (
        RedisSink(client, keys).admission([envelope("free.1")]).answered_in("free.1", None) is None
    )
    assert client.exists(keys.job_counted("-")) == 0


def test_an_id_another_job_took_after_it_expired_is_not_counted_again(
    store: tuple[Any, RedisKeys],
) -> None:
    """Job J1 answered R; R's result expired; job J2 wrote R; J1's record comes back: it
    was answered in J1 (admission says so before looking at the key J2 holds now), and a
    duplicate-id count for it adds nothing."""
    client, keys = store
    writer, sink = ResultWriter(client, keys), RedisSink(client, keys)
    for job in ("J1", "J2"):
        client.hset(keys.job(job), mapping={"total": 1, "status": "running"})
    writer.write([(ok("R", "J1"), 60)], 1)
    client.delete(keys.result("R"))
    writer.write([(ok("R", "J2"), 60)], 2)
    assert sink.admission([envelope("R", "J1")]).answered_in("R", "J1") is True
    duplicate = ResultEnvelope.failure(envelope("R", "J1"), ErrorCode.duplicate_request_id, "x")
    assert writer.record_duplicate(duplicate, 60, 3).status is WriteStatus.existed
    j1 = {k.decode(): v.decode() for k, v in client.hgetall(keys.job("J1")).items()}
    assert (j1["succeeded"], j1.get("failed"), j1["status"]) == ("1", None, "completed")


def test_publishing_keeps_the_counted_set_as_long_as_the_job(
    store: tuple[Any, RedisKeys],
) -> None:
    from producer.jobs import JobStore

    client, keys = store
    jobs = JobStore(client, keys, job_ttl_s=7 * 86_400)
    client.hset(keys.job("jm"), mapping={"total": 2, "status": "submitting"})
    client.expire(keys.job("jm"), 3600)
    ResultWriter(client, keys).write([(ok("jm.1", "jm"), 60)], 1)
    assert client.ttl(keys.job_counted("jm")) <= 3600
    jobs.mark_submitted("jm", 2)
    assert client.ttl(keys.job_counted("jm")) > 86_400
