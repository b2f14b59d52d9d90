"""`deploy/local/stack.sh up --brokers 3 --redis-cluster`: a three-node KRaft cluster
(replication 3, min.insync.replicas 2) and a six-node Redis Cluster (3 masters + 3
replicas), next to the single-node stack, brought up by the `cluster_stack` fixture.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer
from kafka.admin import ConfigResource, ConfigResourceType
from redis.cluster import ClusterNode, RedisCluster

from tests.integration.cluster_stack import STACK_SH, UP_ARGS, ClusterStack, run_stack

TOPICS = {
    "qbatch.requests": 8,
    "qbatch.requests.bulk": 8,
    "qbatch.requests.dlq": 1,
    "qbatch.results": 8,
    "qbatch.tool-calls": 8,
}


@pytest.fixture(scope="module")
def admin(cluster_stack: ClusterStack) -> Iterator[KafkaAdminClient]:
    client = KafkaAdminClient(
        bootstrap_servers=cluster_stack.kafka_bootstrap, client_id="qbt-cluster"
    )
    try:
        yield client
    finally:
        client.close()


def _topic_configs(admin: KafkaAdminClient, topic: str) -> dict[str, str]:
    """Every config of `topic` (defaults included) as name -> value."""
    resp = admin.describe_configs(
        [ConfigResource(ConfigResourceType.TOPIC, topic)], config_filter="all"
    )
    (per_name,) = resp.values()  # {"topic": {name: {key: {"value": ..., ...}}}}
    return {k: str(v["value"]) for k, v in per_name[topic].items()}


def test_exports_point_at_the_cluster(cluster_stack: ClusterStack) -> None:
    assert cluster_stack.kafka_bootstrap == "127.0.0.1:19092,127.0.0.1:19093,127.0.0.1:19094"
    seeds = ",".join(f"127.0.0.1:{p}" for p in range(17000, 17006))
    assert cluster_stack.redis_url == f"redis+cluster://{seeds}/0"  # every node a seed
    assert cluster_stack.env["QBATCH_TOPIC"] == "qbatch.requests"
    assert cluster_stack.redis_ports == list(range(17000, 17006))
    assert all(cluster_stack.broker_pid(n) for n in (1, 2, 3))
    assert all(cluster_stack.redis_pid(p) for p in cluster_stack.redis_ports)


def test_three_brokers_in_the_metadata(admin: KafkaAdminClient) -> None:
    cluster = admin.describe_cluster()
    assert sorted((b["broker_id"], b["port"]) for b in cluster["brokers"]) == [
        (1, 19092),
        (2, 19093),
        (3, 19094),
    ]
    assert cluster["controller_id"] in {1, 2, 3}


def test_qbatch_topics_have_replication_3_and_min_isr_2(admin: KafkaAdminClient) -> None:
    described = {t["name"]: t for t in admin.describe_topics(list(TOPICS))}
    assert set(described) == set(TOPICS)
    for name, partitions in TOPICS.items():
        parts = described[name]["partitions"]
        assert len(parts) == partitions, name
        for p in parts:
            assert sorted(p["replica_nodes"]) == [1, 2, 3], (name, p)
            assert p["leader_id"] in {1, 2, 3}
        configs = _topic_configs(admin, name)
        assert configs["min.insync.replicas"] == "2", name
        assert configs["unclean.leader.election.enable"] == "false", name


def test_produce_consume_with_acks_all(
    cluster_stack: ClusterStack, admin: KafkaAdminClient
) -> None:
    topic = f"qbt-cluster-{uuid.uuid4().hex[:8]}"
    admin.create_topics({topic: {"num_partitions": 3, "replication_factor": 3}}, timeout_ms=30_000)
    try:
        admin.wait_for_topics([topic], timeout_ms=30_000)
        producer = KafkaProducer(
            bootstrap_servers=cluster_stack.kafka_bootstrap,
            acks="all",
            linger_ms=5,
            key_serializer=str.encode,
            value_serializer=str.encode,
        )
        try:
            futures = [producer.send(topic, key=f"k{i % 7}", value=f"v{i}") for i in range(60)]
            producer.flush(timeout=30)
            assert all(f.get(timeout=30).offset >= 0 for f in futures)
        finally:
            producer.close(timeout=10)
        consumer = KafkaConsumer(
            topic,
            bootstrap_servers=cluster_stack.kafka_bootstrap,
            group_id=f"{topic}-g",
            auto_offset_reset="earliest",
            enable_auto_commit=False,
            value_deserializer=bytes.decode,
        )
        try:
            got: list[str] = []
            deadline = time.monotonic() + 30
            while len(got) < 60 and time.monotonic() < deadline:
                for recs in consumer.poll(timeout_ms=500).values():
                    got.extend(r.value for r in recs)
            assert sorted(got) == sorted(f"v{i}" for i in range(60))
            consumer.commit()
        finally:
            consumer.close(autocommit=False)
        # the consumer offsets topic is replicated 3 ways too
        offsets = admin.describe_topics(["__consumer_offsets"])[0]["partitions"]
        assert all(len(p["replica_nodes"]) == 3 for p in offsets)
    finally:
        with contextlib.suppress(Exception):
            admin.delete_topics([topic], timeout_ms=30_000)


def test_redis_cluster_three_masters_three_replicas(cluster_stack: ClusterStack) -> None:
    host, port = cluster_stack.redis_nodes[0]
    rc = RedisCluster(
        startup_nodes=[ClusterNode(h, p) for h, p in cluster_stack.redis_nodes],
        decode_responses=True,
    )
    try:
        info: Any = rc.cluster_info(target_nodes=RedisCluster.RANDOM)
        assert info["cluster_state"] == "ok"
        assert int(info["cluster_known_nodes"]) == 6
        assert int(info["cluster_slots_assigned"]) == 16384
        assert len(rc.get_primaries()) == 3
        assert len(rc.get_replicas()) == 3
        # keys spread over all three masters, read back through the cluster client
        prefix = f"qbt-cluster-{uuid.uuid4().hex[:8]}"
        keys = [f"{prefix}:{i}" for i in range(30)]
        for k in keys:
            rc.set(k, k, ex=60)
        assert len({rc.keyslot(k) // 5462 for k in keys}) == 3
        assert [rc.get(k) for k in keys] == keys
        rc.delete(*keys)
    finally:
        rc.close()
    # every node agrees
    for h, p in cluster_stack.redis_nodes:
        node = redis.Redis(host=h, port=p, decode_responses=True)
        try:
            node_info: Any = node.cluster("INFO")
            assert node_info["cluster_state"] == "ok", p
        finally:
            node.close()
    assert (host, port) == ("127.0.0.1", 17000)


def test_second_up_reuses_the_running_cluster(cluster_stack: ClusterStack) -> None:
    pids = [cluster_stack.broker_pid(n) for n in (1, 2, 3)]
    pids += [cluster_stack.redis_pid(p) for p in cluster_stack.redis_ports]
    t0 = time.monotonic()
    proc = run_stack(*UP_ARGS, timeout=120)
    took = time.monotonic() - t0
    assert took < 15, f"second `up` took {took:.1f}s"
    assert "already running" in proc.stderr
    assert "creating the redis cluster" not in proc.stderr
    assert [cluster_stack.broker_pid(n) for n in (1, 2, 3)] + [
        cluster_stack.redis_pid(p) for p in cluster_stack.redis_ports
    ] == pids
    assert f"export QBATCH_KAFKA_BOOTSTRAP={cluster_stack.kafka_bootstrap}" in proc.stdout
    assert f"export QBATCH_REDIS_URL={cluster_stack.redis_url}" in proc.stdout
    status = subprocess.run(
        ["bash", str(STACK_SH), "status", "--cluster"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert status.returncode == 0, status.stdout + status.stderr
    assert "cluster_state=ok masters=3 replicas=3" in status.stdout


@pytest.mark.slow  # kills nodes of the shared cluster: not while others use it (nor in CI)
def test_a_killed_broker_and_redis_master_come_back(
    cluster_stack: ClusterStack, admin: KafkaAdminClient
) -> None:
    """kill -9 of node 3 keeps acks=all writes going (2 in sync >= min.insync.replicas);
    `start_broker` brings it back into every ISR. kill -9 of a Redis master: its replica
    takes over, the restarted node rejoins as a replica."""
    topic = f"qbt-cluster-{uuid.uuid4().hex[:8]}"
    admin.create_topics({topic: {"num_partitions": 2, "replication_factor": 3}}, timeout_ms=30_000)
    admin.wait_for_topics([topic], timeout_ms=30_000)
    killed = False
    try:
        cluster_stack.kill_broker(3)
        killed = True
        assert cluster_stack.broker_pid(3) is None
        producer = KafkaProducer(
            bootstrap_servers=cluster_stack.kafka_bootstrap,
            acks="all",
            retries=20,
            request_timeout_ms=15_000,
        )
        try:
            for i in range(20):
                producer.send(topic, value=b"x%d" % i).get(timeout=60)
        finally:
            producer.close(timeout=10)
        cluster_stack.start_broker(3)
        killed = False
        cluster_stack.wait_in_sync([topic], timeout=90)
    finally:
        if killed:
            cluster_stack.start_broker(3)
        with contextlib.suppress(Exception):
            admin.delete_topics([topic], timeout_ms=30_000)

    # a Redis master: kill it, its replica takes over, the restarted node rejoins as replica
    victim = next(p for p in cluster_stack.redis_ports if _role(p) == "master")
    cluster_stack.kill_redis(victim)
    try:
        survivors = [p for p in cluster_stack.redis_ports if p != victim]
        deadline = time.monotonic() + 60
        while not _failed_over(survivors, victim):
            assert time.monotonic() < deadline, "no failover within 60 s"
            time.sleep(0.3)
    finally:
        cluster_stack.start_redis(victim)
    cluster_stack.wait_redis_ok(timeout=60)
    assert _role(victim) == "slave"


def _role(port: int) -> str:
    node = redis.Redis(port=port, decode_responses=True)
    try:
        return str(node.execute_command("ROLE")[0])
    finally:
        node.close()


def _failed_over(survivors: list[int], victim: int) -> bool:
    """Every survivor says ok, sees the victim failed and 3 working masters."""
    for port in survivors:
        node = redis.Redis(port=port, decode_responses=True)
        try:
            info: Any = node.cluster("INFO")
            if info["cluster_state"] != "ok":
                return False
            nodes: Any = node.cluster("NODES")
        finally:
            node.close()
        flags = {
            int(addr.rsplit(":", 1)[1]): set(v["flags"].split(",")) for addr, v in nodes.items()
        }
        if "fail" not in flags[victim]:  # "fail?" (PFAIL) is not enough
            return False
        if sum("master" in f and not f & {"fail", "fail?"} for f in flags.values()) != 3:
            return False
    return True
