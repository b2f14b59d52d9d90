"""Results acknowledged by Redis replicas (`--redis-wait-replicas`, `schemas.replica_ack`)
on the real single server and the real Redis Cluster.

The end-to-end case replays what the long chaos soak (seed 459465639) found: a master
acknowledged results its replica never received, the worker committed past them, the
master was killed, the replica took over without them: lost. Here the replica is frozen
(SIGSTOP) behind a 48 MB write, so that window is certain rather than a race: the
results reach the master only, the master is killed, the replica resumes and is promoted. Without the setting
this test loses every result of that master's slots (checked by hand: 21 of 60 lost, the
worker had committed past all 60); with it the worker commits nothing the replica lacks,
writes the results again on the promoted replica, and all 60 arrive.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from kafka import TopicPartition
from redis.cluster import RedisCluster
from redis.crc import key_slot

from schemas import ErrorCode, RedisKeys, RequestEnvelope, ResultEnvelope
from schemas.redis_conn import connect, reply_text
from schemas.replica_ack import ReplicaAck, ReplicasBehind, eval_acked
from schemas.replies import ResultWriter, WriteStatus
from schemas.result import Status
from tests.integration.cluster_stack import ON_CLUSTER
from tests.integration.workers import Lane, echo_worker
from worker.records import Reply
from worker.sinks.base import SinkUnavailable
from worker.sinks.redis_sink import RedisSink

pytestmark = pytest.mark.integration

TTL = 600
BALLAST_BYTES = 48 << 20
SET_KEY = "return redis.call('SET', KEYS[1], ARGV[1])"


def envelope(rid: str, job: str | None = None) -> RequestEnvelope:
    return RequestEnvelope.model_validate(
        {
            "request_id": rid,
            "job_id": job,
            "body": {"messages": [{"role": "user", "content": "hi"}]},
        }
    )


def ok(rid: str, job: str | None = None) -> ResultEnvelope:
    return ResultEnvelope.for_request(envelope(rid, job), Status.succeeded)


def failed(rid: str) -> ResultEnvelope:
    return ResultEnvelope.failure(envelope(rid), ErrorCode.engine_error, "boom")


# ------------------------------------------------------------------ one server


ONE_SERVER = pytest.mark.skipif(
    ON_CLUSTER, reason="needs the single Redis without replicas (QBATCH_TEST_STACK=cluster)"
)


@ONE_SERVER
def test_a_server_without_replicas_cannot_acknowledge(redis_client: Any, prefix: str) -> None:
    """The local Redis has no replica: WAIT 1 answers 0, the write is an outage (the sink
    says unavailable, so the worker pauses and commits nothing), and the result that did
    reach the master is found there on the retry, not written twice."""
    client, keys = redis_client, RedisKeys(prefix)
    ack = ReplicaAck(replicas=1, timeout_ms=50)
    t0 = time.monotonic()
    with pytest.raises(ReplicasBehind, match="0 of 1 Redis replicas"):
        eval_acked(client, keys, ack, [(SET_KEY, [f"{keys.prefix}:x"], ["1"])])
    assert time.monotonic() - t0 >= 0.05  # WAIT waited its timeout
    assert client.get(f"{keys.prefix}:x") == "1"  # on the master, not acknowledged
    assert client.pttl(keys.ack()) > 0  # the ack key, short-lived

    sink = RedisSink(client, keys, ack=ack)
    reply = Reply(tp=TopicPartition("t", 0), offset=0, record=None, result=ok("a1"), ttl_s=TTL)
    with pytest.raises(SinkUnavailable, match="replicas"):
        sink.write([reply], now_ms=1)
    assert client.get(keys.result("a1")) is not None
    # without the setting the same sink writes as before; the earlier write is found
    plain = RedisSink(client, keys)
    assert [v.status for v in plain.write([reply], now_ms=2)] == [WriteStatus.existed]


@ONE_SERVER
def test_zero_replicas_writes_as_before(redis_client: Any, prefix: str) -> None:
    client, keys = redis_client, RedisKeys(prefix)
    writer = ResultWriter(client, keys, ReplicaAck(replicas=0))
    replies = writer.write([(ok("z1", "jz"), TTL), (failed("z2"), TTL)], now_ms=1)
    assert [r.status for r in replies] == [WriteStatus.written, WriteStatus.written]
    assert client.exists(keys.ack()) == 0  # no WAIT, no ack key


# ------------------------------------------------------------------ cluster


def _topology(client: RedisCluster) -> tuple[dict[str, int], dict[str, int]]:
    """(master node name -> port of its replica, master node name -> port)."""
    nodes: Any = client.cluster_nodes()
    by_id = {v["node_id"]: addr for addr, v in nodes.items()}
    replica_of: dict[str, int] = {}
    for addr, v in nodes.items():
        if "slave" in v["flags"] and "fail" not in v["flags"] and v.get("master_id") in by_id:
            replica_of[by_id[v["master_id"]]] = int(addr.rsplit(":", 1)[1])
    masters = {
        addr: int(addr.rsplit(":", 1)[1])
        for addr, v in nodes.items()
        if "master" in v["flags"] and "fail" not in v["flags"]
    }
    return replica_of, masters


def test_results_and_job_counts_acknowledged_on_every_master(
    cluster: tuple[Any, RedisKeys],
) -> None:
    """Results over all three masters and their job's counters, WAIT 1 on each: written
    once, counted once; a second write finds them (and still waits, on its ack key)."""
    client, keys = cluster
    writer = ResultWriter(client, keys, ReplicaAck(replicas=1, timeout_ms=2000))
    batch = [(ok(f"r{i}", "jc"), TTL) for i in range(30)]
    assert {client.keyslot(keys.result(f"r{i}")) // 5462 for i in range(30)} == {0, 1, 2}
    replies = writer.write(batch, now_ms=1)
    assert [r.status for r in replies] == [WriteStatus.written] * 30
    assert [r.status for r in writer.write(batch, now_ms=2)] == [WriteStatus.existed] * 30
    h = {k.decode(): v.decode() for k, v in client.hgetall(keys.job("jc")).items()}
    assert h["succeeded"] == "30", h
    assert client.xlen(keys.job_stream("jc")) == 30


@pytest.mark.parametrize("replicas", [0, 1])
def test_a_migrating_slot_pauses_its_writes_until_the_slot_is_stable(
    cluster: tuple[Any, RedisKeys], replicas: int
) -> None:
    """A resharding moves one slot at a time. While a slot migrates, its old master answers
    ASK for keys it does not hold (every new result), and the importing master, asked
    with ASKING, answers a multi-key script whose keys it lacks (every result script)
    TRYAGAIN. So following the ASK gains nothing for results (tried in session 14): the
    sink reports an outage, the worker pauses and writes the chunk again, and once the
    slot is stable the result is written, once."""
    client, keys = cluster
    slot = key_slot(keys.result("mig-0").encode())
    source = client.get_node_from_key(keys.result("mig-0"))
    target = next(n for n in client.get_primaries() if n.name != source.name)
    src, dst = client.get_redis_connection(source), client.get_redis_connection(target)
    src_id, dst_id = (reply_text(n.execute_command("CLUSTER", "MYID")) for n in (src, dst))
    sink = RedisSink(client, keys, ack=ReplicaAck(replicas=replicas, timeout_ms=2000))
    reply = Reply(tp=TopicPartition("t", 0), offset=0, record=None, result=ok("mig-0"), ttl_s=TTL)
    try:  # the shared cluster gets its slot back whatever fails here
        dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
        src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
        with pytest.raises(SinkUnavailable):
            sink.write([reply], now_ms=1)
        for node in (src, dst):  # (EXISTS on the old master would answer ASK)
            held = node.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
            assert not [k for k in map(reply_text, held) if k.startswith(keys.prefix)], held
    finally:
        for node in (src, dst):
            with contextlib.suppress(redis.RedisError):
                node.execute_command("CLUSTER", "SETSLOT", slot, "STABLE")
    assert [v.status for v in sink.write([reply], now_ms=2)] == [WriteStatus.written]
    assert [v.status for v in sink.write([reply], now_ms=3)] == [WriteStatus.existed]


def test_a_frozen_replica_makes_its_masters_writes_an_outage(
    cluster: tuple[Any, RedisKeys], cluster_stack: Any
) -> None:
    """While one master's replica is stopped, a write touching that master raises
    ReplicasBehind (the sink's outage); once it runs again the same write succeeds."""
    client, keys = cluster
    replica_of, _ = _topology(client)
    rid = "frozen-1"
    master = client.get_node_from_key(keys.result(rid)).name
    replica_pid = cluster_stack.redis_pid(replica_of[master])
    assert replica_pid is not None
    # the worker sink's client: it waits out nothing (the sink pauses instead), where a
    # producer-side client would retry for PRODUCER_ACK_WAIT_S (120 s) before raising
    sink_client = connect(cluster_stack.redis_url, failover_wait_s=0)
    writer = ResultWriter(sink_client, keys, ReplicaAck(replicas=1, timeout_ms=300))
    os.kill(replica_pid, signal.SIGSTOP)
    try:
        with pytest.raises(ReplicasBehind):
            writer.write([(ok(rid), TTL)], now_ms=1)
    finally:
        os.kill(replica_pid, signal.SIGCONT)
    try:
        written = writer.write([(ok(rid), TTL)], now_ms=2)
    finally:
        sink_client.close()
    assert [r.status for r in written] == [WriteStatus.existed]


def test_a_master_killed_with_unreplicated_results_loses_none(
    cluster_stack: Any, stack: Any, tmp_path: Path
) -> None:
    """The soak's loss, made certain (see the module docstring): replica frozen, results
    on its master only, master killed, replica resumed and promoted. The worker runs with
    --redis-wait-replicas 1; every request gets its result."""
    lane = Lane.on(stack.kafka_bootstrap, cluster_stack.redis_url, "qbra")
    lane.create_topics(4)
    keys = RedisKeys(lane.prefix, cluster=True)
    client = connect(cluster_stack.redis_url)
    replica_of, masters = _topology(client)
    # the master of the first request's key: about a third of the requests land there
    victim = client.get_node_from_key(keys.result("v0")).name
    victim_port, replica_port = masters[victim], replica_of[victim]
    replica_pid = cluster_stack.redis_pid(replica_port)
    assert replica_pid is not None
    ids = [f"v{i}" for i in range(60)]
    on_victim = [r for r in ids if client.get_node_from_key(keys.result(r)).name == victim]
    log = tmp_path / "worker.log"
    frozen = False
    try:
        with (
            echo_worker(
                lane, "--redis-wait-replicas", "1", "--redis-wait-timeout-ms", "200", log=log
            ),
            lane.client() as qb,
        ):
            os.kill(replica_pid, signal.SIGSTOP)
            frozen = True
            # A frozen replica alone loses nothing: the kernel still takes the replication
            # stream into its socket buffers, and the replica reads it when it runs again.
            # A write larger than those buffers (a few MB) stays in the master's output
            # buffer, and every write after it with it: the replica lags for real.
            client.set(f"{lane.prefix}:ballast:{{v0}}", b"x" * BALLAST_BYTES, ex=600)
            for rid in ids:
                qb.submit({"messages": [{"role": "user", "content": rid}]}, request_id=rid)
            master = redis.Redis(port=victim_port)
            # results reach the master, unreplicated (with WAIT the worker keeps retrying its
            # first chunk, so the later ones may not get there: 3 s after the first is enough)
            t0, deadline, seen = time.monotonic(), time.monotonic() + 30, 0
            while time.monotonic() < deadline and seen < len(on_victim):
                seen = sum(bool(master.exists(keys.result(r))) for r in on_victim)
                if not seen:
                    t0 = time.monotonic()
                elif time.monotonic() - t0 > 3:
                    break
                time.sleep(0.2)
            master.close()
            assert seen, "no result reached the master: nothing was tested"
            cluster_stack.kill_redis(victim_port)
            os.kill(replica_pid, signal.SIGCONT)
            frozen = False
            promoted = redis.Redis(port=replica_port)
            deadline = time.monotonic() + 60
            while promoted.execute_command("ROLE")[0] != b"master":
                assert time.monotonic() < deadline, "the replica was not promoted in 60 s"
                time.sleep(0.2)
            promoted.close()
            # back as the promoted replica's own replica: WAIT 1 is met there again
            cluster_stack.start_redis(victim_port)
            got = qb.wait_many(ids, timeout=120)
        missing = [rid for rid, r in got.items() if r is None]
        assert not missing, f"{len(missing)} of {len(ids)} lost, e.g. {missing[:5]}"
        assert all(r is not None and r.status is Status.succeeded for r in got.values())
        print(f"{seen} of {len(on_victim)} results were on the killed master only; none lost")
    finally:
        if frozen:
            os.kill(replica_pid, signal.SIGCONT)
        if cluster_stack.redis_pid(victim_port) is None:
            cluster_stack.start_redis(victim_port)
        cluster_stack.wait_redis_ok(timeout=90)
        client.close()
        lane.clean_redis()
        lane.delete_topics()
