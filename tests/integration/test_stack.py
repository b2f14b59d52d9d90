"""Round trips against the real local Kafka (KRaft) and Redis started by stack.sh.

These also pin down that kafka-python (the client qbatch uses) works with the
broker version deploy/local/stack.sh runs: produce, group consume with manual
commits, committed offsets survive a re-open, admin calls, pause/resume.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest
from kafka import KafkaConsumer, KafkaProducer
from kafka.structs import OffsetAndMetadata, TopicPartition

from schemas.kafka_compat import resume_partitions
from schemas.redis_conn import connect
from tests.integration.cluster_stack import ON_CLUSTER

REPO_ROOT = Path(__file__).resolve().parents[2]
STACK_SH = REPO_ROOT / "deploy" / "local" / "stack.sh"

N_RECORDS = 100
N_KEYS = 10


def _producer(bootstrap: str) -> KafkaProducer:
    return KafkaProducer(
        bootstrap_servers=bootstrap,
        acks="all",
        linger_ms=5,
        key_serializer=str.encode,
        value_serializer=str.encode,
    )


def _consumer(bootstrap: str, group: str, **kw: Any) -> KafkaConsumer:
    return KafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id=group,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        key_deserializer=bytes.decode,
        value_deserializer=bytes.decode,
        **kw,
    )


def _poll_until(consumer: KafkaConsumer, want: int, timeout_s: float = 30.0) -> list[Any]:
    out: list[Any] = []
    deadline = time.monotonic() + timeout_s
    while len(out) < want and time.monotonic() < deadline:
        for recs in consumer.poll(timeout_ms=500).values():
            out.extend(recs)
    return out


def _produce_keyed(bootstrap: str, topic: str, n: int, start: int = 0) -> dict[str, int]:
    """Sends n keyed records; returns key -> partition as acked by the broker."""
    producer = _producer(bootstrap)
    try:
        futures = [
            (f"k{i % N_KEYS}", producer.send(topic, key=f"k{i % N_KEYS}", value=f"v{i}"))
            for i in range(start, start + n)
        ]
        producer.flush(timeout=30)
        key_partition: dict[str, int] = {}
        for key, fut in futures:
            md = fut.get(timeout=30)
            assert md.topic == topic
            assert md.offset >= 0
            # the default partitioner keeps a key on one partition
            assert key_partition.setdefault(key, md.partition) == md.partition
        return key_partition
    finally:
        producer.close(timeout=10)


@pytest.mark.skipif(
    ON_CLUSTER,
    reason="checks the single stack's `stack.sh status` (one Kafka, one Redis, redis:// URL); "
    "the cluster's own checks are test_cluster_stack.py's",
)
def test_stack_status_reports_healthy(stack: Any) -> None:
    proc = subprocess.run(
        ["bash", str(STACK_SH), "status"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "kafka: running" in proc.stdout and "redis: running" in proc.stdout
    assert proc.stdout.count("healthy") == 2
    assert stack.kafka_bootstrap.startswith("127.0.0.1:")
    assert stack.redis_url.startswith("redis://127.0.0.1:")


def test_produce_consume_manual_commit_roundtrip(
    kafka_bootstrap: str, kafka_admin: Any, fresh_topic: Any, prefix: str
) -> None:
    topic = fresh_topic(4)
    group = f"{prefix}-group"
    key_partition = _produce_keyed(kafka_bootstrap, topic, N_RECORDS)
    assert len(set(key_partition.values())) > 1, "10 keys should spread over >1 of 4 partitions"

    consumer = _consumer(kafka_bootstrap, group)
    consumer.subscribe([topic])
    try:
        records = _poll_until(consumer, N_RECORDS)
        assert len(records) == N_RECORDS
        assert sorted(int(r.value[1:]) for r in records) == list(range(N_RECORDS))
        for r in records:
            assert r.partition == key_partition[r.key]
        # per partition, offsets arrive in order without gaps
        by_part: dict[int, list[int]] = defaultdict(list)
        for r in records:
            by_part[r.partition].append(r.offset)
        for offsets in by_part.values():
            assert offsets == list(range(len(offsets)))
        assert {tp.partition for tp in consumer.assignment()} == {0, 1, 2, 3}

        # manual commit with explicit offsets (next offset to read)
        commit = {
            TopicPartition(topic, p): OffsetAndMetadata(offs[-1] + 1, "qbatch-test", -1)
            for p, offs in by_part.items()
        }
        consumer.commit(offsets=commit)
        for tp, om in commit.items():
            assert consumer.committed(tp) == om.offset
    finally:
        consumer.close(autocommit=False)

    # the admin view of the group's committed offsets matches what we committed
    committed = kafka_admin.list_group_offsets({group: None})[group]
    assert {tp: om.offset for tp, om in committed.items()} == {
        tp: om.offset for tp, om in commit.items()
    }
    assert sum(om.offset for om in committed.values()) == N_RECORDS

    # re-open the group: nothing is re-delivered, and only new records arrive
    consumer = _consumer(kafka_bootstrap, group)
    consumer.subscribe([topic])
    try:
        again = _poll_until(consumer, 1, timeout_s=6)
        assert again == [], f"re-delivered {len(again)} committed records"
        _produce_keyed(kafka_bootstrap, topic, 5, start=N_RECORDS)
        fresh = _poll_until(consumer, 5)
        assert sorted(r.value for r in fresh) == [f"v{i}" for i in range(N_RECORDS, N_RECORDS + 5)]
        consumer.commit()
        ends = consumer.end_offsets([TopicPartition(topic, p) for p in range(4)])
        assert sum(ends.values()) == N_RECORDS + 5
        for tp, end in ends.items():
            assert consumer.committed(tp) == end
    finally:
        consumer.close(autocommit=False)


def _fill_two_partitions(bootstrap: str, topic: str) -> None:
    producer = _producer(bootstrap)
    try:
        for p in (0, 1):
            for i in range(10):
                producer.send(topic, key=f"p{p}", value=f"p{p}-{i}", partition=p)
        producer.flush(timeout=30)
    finally:
        producer.close(timeout=10)


def resume_workaround(consumer: KafkaConsumer, *partitions: TopicPartition) -> None:
    """The worker's own resume (worker.kafka_io.resume_partitions), tested here directly."""
    resume_partitions(consumer, *partitions)


def test_pause_resume_assigned(kafka_bootstrap: str, fresh_topic: Any, prefix: str) -> None:
    """pause() before anything is fetched: the paused partition yields nothing until resumed."""
    topic = fresh_topic(2)
    _fill_two_partitions(kafka_bootstrap, topic)
    tp0, tp1 = TopicPartition(topic, 0), TopicPartition(topic, 1)
    consumer = _consumer(kafka_bootstrap, f"{prefix}-pause")
    consumer.assign([tp0, tp1])
    try:
        consumer.pause(tp0)
        assert consumer.paused() == {tp0}
        got = _poll_until(consumer, 10, timeout_s=15)
        got += _poll_until(consumer, 1, timeout_s=2)  # anything extra would be from tp0
        assert Counter(r.partition for r in got) == Counter({1: 10})
        assert consumer.position(tp0) == 0

        consumer.resume(tp0)
        assert consumer.paused() == set()
        got0 = _poll_until(consumer, 10, timeout_s=15)
        assert [r.value for r in got0] == [f"p0-{i}" for i in range(10)]
        consumer.commit()
        assert consumer.committed(tp0) == 10 and consumer.committed(tp1) == 10
    finally:
        consumer.close(autocommit=False)


def test_pause_resume_with_buffered_records(
    kafka_bootstrap: str, fresh_topic: Any, prefix: str
) -> None:
    """pause() while records are already buffered (the backpressure case) in a group.

    Needs resume_workaround() on kafka-python 3.0.12: with a plain resume() the
    resumed partition stalls forever in about half of the runs.
    """
    topic = fresh_topic(2)
    _fill_two_partitions(kafka_bootstrap, topic)
    tp0, tp1 = TopicPartition(topic, 0), TopicPartition(topic, 1)
    consumer = _consumer(kafka_bootstrap, f"{prefix}-pause-buf", max_poll_records=1)
    consumer.subscribe([topic])
    try:
        first: list[Any] = []
        deadline = time.monotonic() + 30
        while not first and time.monotonic() < deadline:
            for recs in consumer.poll(timeout_ms=200).values():
                first.extend(recs)
        assert consumer.assignment() == {tp0, tp1}
        assert len(first) == 1
        for tp in (tp0, tp1):  # start both partitions from 0 again
            consumer.seek(tp, 0)
        consumer.pause(tp0)
        got = _poll_until(consumer, 10, timeout_s=15)
        got += _poll_until(consumer, 1, timeout_s=2)
        assert Counter(r.partition for r in got) == Counter({1: 10})

        resume_workaround(consumer, tp0)
        got0 = _poll_until(consumer, 10, timeout_s=15)
        assert [r.value for r in got0] == [f"p0-{i}" for i in range(10)]
    finally:
        consumer.close(autocommit=False)


def test_admin_list_describe(
    stack: Any, kafka_bootstrap: str, kafka_admin: Any, fresh_topic: Any, prefix: str
) -> None:
    topic = fresh_topic(3)
    topics = set(kafka_admin.list_topics())
    assert {topic, stack.topic, stack.dlq_topic} <= topics

    described = {t["name"]: t for t in kafka_admin.describe_topics([topic, stack.topic])}
    assert described[topic]["error_code"] == 0
    assert sorted(p["partition_index"] for p in described[topic]["partitions"]) == [0, 1, 2]
    brokers = [1, 2, 3] if ON_CLUSTER else [1]
    assert all(p["leader_id"] in brokers for p in described[topic]["partitions"])
    assert len(described[stack.topic]["partitions"]) >= 1

    cluster = kafka_admin.describe_cluster()
    assert sorted(b["broker_id"] for b in cluster["brokers"]) == brokers
    assert cluster["controller_id"] in brokers
    assert cluster["cluster_id"]

    # a group with a commit shows up in list_groups / describe_groups
    group = f"{prefix}-admin"
    _produce_keyed(kafka_bootstrap, topic, 3)
    consumer = _consumer(kafka_bootstrap, group)
    consumer.subscribe([topic])
    try:
        assert len(_poll_until(consumer, 3)) == 3
        consumer.commit()
        listed = kafka_admin.list_groups()
        ids = {g.get("group_id") or g.get("group") for g in listed}
        assert group in ids
        desc = kafka_admin.describe_groups([group])
        assert desc, "describe_groups returned nothing"
    finally:
        consumer.close(autocommit=False)

    offsets = kafka_admin.list_group_offsets({group: None})[group]
    assert sum(om.offset for om in offsets.values()) == 3


def test_redis_roundtrip(redis_client: Any, redis_url: str, prefix: str) -> None:
    r = redis_client
    assert r.ping() is True

    assert r.set(f"{prefix}:s", "hello", ex=60) is True
    assert r.get(f"{prefix}:s") == "hello"
    assert 0 < r.ttl(f"{prefix}:s") <= 60

    assert r.hincrby(f"{prefix}:h", "n", 2) == 2
    assert r.hincrby(f"{prefix}:h", "n", 5) == 7
    assert r.hgetall(f"{prefix}:h") == {"n": "7"}

    ids = [r.xadd(f"{prefix}:x", {"i": str(i)}) for i in range(3)]
    assert r.xlen(f"{prefix}:x") == 3
    assert [e[1]["i"] for e in r.xrange(f"{prefix}:x")] == ["0", "1", "2"]
    assert [e[0] for e in r.xrange(f"{prefix}:x")] == ids

    # BLPOP: times out on an empty list, then wakes up on a push from another client
    assert r.blpop([f"{prefix}:q"], timeout=0.2) is None
    pusher = connect(redis_url, decode_responses=True)

    def push() -> None:
        time.sleep(0.3)
        pusher.rpush(f"{prefix}:q", "reply-1")

    t = threading.Thread(target=push)
    t0 = time.monotonic()
    t.start()
    got = r.blpop([f"{prefix}:q"], timeout=5)
    t.join()
    pusher.close()
    assert got == (f"{prefix}:q", "reply-1")
    assert 0.2 < time.monotonic() - t0 < 5

    assert sorted(r.scan_iter(match=f"{prefix}*")) == sorted(
        [f"{prefix}:s", f"{prefix}:h", f"{prefix}:x"]
    )
