"""Issue 39, Kafka side, on the shared Kafka and Redis (echo workers): what a record can do
to a worker before it is even run.

- records of an aborted transaction are not answered (the consumer is read_committed);
- a DLQ that refuses every letter holds commits only until dlq_give_up_s, and only its
  own partitions' (6 bad records stopped every commit of every partition for good);
- a 1,048,401-byte record and a gzip record of 100 MB decompressed go to the DLQ cut to
  fit, marked so, and are committed; the worker's memory comes back down, and a restart
  reads nothing twice;
- records of 500,000 headers each cost no memory in flight;
- partitions added to a topic are served within seconds (metadata refresh), not minutes;
- strikes name the record's content: after a topic is deleted and created again, an
  ordinary request at a quarantined offset runs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from kafka import KafkaAdminClient, KafkaProducer
from kafka.admin import NewPartitions

from schemas import RedisKeys
from tests.integration.workers import create_topic, delete_topics, stop_worker
from tests.reliability.conftest import (
    EnvLane,
    RssSampler,
    chat,
    committed_vs_end,
    dlq_count,
    encode,
    figures,
    free_port,
    make_lane,
    produce,
    produce_envelopes,
    rss_mb,
    scrape,
    wait_committed,
    wait_http,
    wait_results,
)


@pytest.fixture
def lane1(stack: Any) -> Iterator[EnvLane]:
    """A private lane whose topics have one partition (records keep their order)."""
    lane = make_lane("qbi", stack.kafka_bootstrap, stack.redis_url)
    lane.create_topics(partitions=1)
    yield lane
    lane.clean_redis()
    lane.delete_topics()


def _admin(lane: EnvLane) -> KafkaAdminClient:
    return KafkaAdminClient(bootstrap_servers=lane.bootstrap.split(","))


def test_an_aborted_transaction_is_not_answered(
    lane1: EnvLane, redis_client: redis.Redis, spawn: Any
) -> None:
    spawn(lane1)
    producer = KafkaProducer(
        bootstrap_servers=lane1.bootstrap, transactional_id=f"{lane1.group}-txn"
    )
    try:
        producer.init_transactions()
        producer.begin_transaction()
        for i in range(5):
            key, value = encode(chat(f"aborted{i}", "x"))
            producer.send(lane1.topic, key=key, value=value)
        producer.flush()
        producer.abort_transaction()
    finally:
        producer.close()
    produce_envelopes(lane1, [chat("after", "marker")])  # behind them in the partition
    assert wait_results(redis_client, lane1.prefix, ["after"], 60)
    assert wait_committed(lane1, 30)  # every record up to the marker was handled
    answered = redis_client.exists(*[f"{lane1.prefix}:result:aborted{i}" for i in range(5)])
    figures("aborted_transaction", answered=answered)
    assert answered == 0


def test_a_dlq_that_refuses_every_letter_holds_commits_only_for_a_while(
    lane: EnvLane, redis_client: redis.Redis, spawn: Any
) -> None:
    """The DLQ topic takes no record over 512 bytes: every letter is refused, halved down
    to 1 KiB, refused again, and given up after --dlq-give-up-s; meanwhile good requests
    are answered and the partitions without a letter commit."""
    admin = _admin(lane)
    try:
        admin.delete_topics([lane.dlq_topic])
        from kafka.admin import NewTopic

        deadline = time.monotonic() + 30
        while True:  # deletion is asynchronous: create again once it is gone
            try:
                admin.create_topics(
                    [NewTopic(lane.dlq_topic, 1, 1, topic_configs={"max.message.bytes": "512"})]
                )
                break
            except Exception:
                assert time.monotonic() < deadline
                time.sleep(0.5)
    finally:
        admin.close()
    port = free_port()
    worker = spawn(lane, "--dlq-give-up-s", "4", metrics_port=port)
    wait_http(port)
    good = [chat(f"g{i}", f"q{i}") for i in range(300)]
    bad = [(f"bad{i}".encode(), b"{not json" + b"!" * 2000) for i in range(6)]
    produce(lane, [*[encode(e) for e in good[:150]], *bad, *[encode(e) for e in good[150:]]])
    rids = [e["request_id"] for e in good] + [f"bad{i}" for i in range(6)]
    results = wait_results(redis_client, lane.prefix, rids, 60)
    assert wait_committed(lane, 60), "commits stayed held"
    lost = scrape(port, "qbatch_dead_letters_lost_total")
    figures("dlq_unwritable", answered=len(results), letters_lost=lost)
    assert len(results) == 306 and worker.poll() is None
    assert all(results[f"bad{i}"]["status"] == "failed" for i in range(6))
    assert lost == 6


def test_records_too_large_for_the_dlq_go_there_cut_and_are_committed(
    lane: EnvLane, redis_client: redis.Redis, spawn: Any, tmp_path: Path
) -> None:
    port = free_port()
    worker = spawn(lane, metrics_port=port)
    wait_http(port)
    base = rss_mb(worker.pid) or 0.0
    big = (b"big", b"x" * 1_048_401)  # under the broker's 1 MiB, over the envelope bound
    produce(lane, [big])
    bomb = (b"bomb", b"a" * 100_000_000)  # ~100 KB on the wire
    with RssSampler(worker.pid, 0.2) as rss:
        produce(lane, [bomb], compression_type="gzip", max_request_size=200_000_000)
        produce_envelopes(lane, [chat("after-bomb", "x")])
        results = wait_results(redis_client, lane.prefix, ["big", "bomb", "after-bomb"], 60)
        assert wait_committed(lane, 60), "a partition's commits are held"
    after = rss_mb(worker.pid) or 0.0
    letters = dlq_count(lane, timeout=20, expected=2)
    headers = {dict(r.headers)["qbatch.request_id"]: (dict(r.headers), r) for r in letters}
    figures(
        "dlq_oversized",
        rss_base_mb=base,
        rss_peak_mb=rss.peak,
        rss_after_mb=after,
        letter_bytes={k.decode(): len(r.value) for k, (_, r) in headers.items()},
    )
    assert results["big"]["status"] == "failed" and results["bomb"]["status"] == "failed"
    assert results["after-bomb"]["status"] == "succeeded"
    for rid, size in ((b"big", b"1048401"), (b"bomb", b"100000000")):
        fields, record = headers[rid]
        assert fields["qbatch.value.truncated"] == b"1" and fields["qbatch.value.bytes"] == size
        assert len(record.value) < 1_040_000
    assert after < base + 150, "the worker kept the decompressed value"
    stop_worker(worker)
    again_port = free_port()
    spawn(lane, metrics_port=again_port, name="restarted")
    wait_http(again_port)
    produce_envelopes(lane, [chat("marker", "x")])
    assert wait_results(redis_client, lane.prefix, ["marker"], 60)
    assert scrape(again_port, "qbatch_records_consumed_total") == 1  # nothing read twice


def test_records_with_500k_headers_cost_no_memory_in_flight(
    lane: EnvLane, redis_client: redis.Redis, spawn: Any
) -> None:
    port = free_port()
    worker = spawn(lane, "--echo-delay-ms", "3000", metrics_port=port)
    wait_http(port)
    base = rss_mb(worker.pid) or 0.0
    headers = [("", b"")] * 500_000
    producer = KafkaProducer(bootstrap_servers=lane.bootstrap, max_request_size=2_000_000)
    try:
        for i in range(10):
            key, value = encode(chat(f"hdr{i}", "x"))
            producer.send(lane.topic, key=key, value=value, headers=headers)
        producer.flush(timeout=120)
    finally:
        producer.close()
    rids = [f"hdr{i}" for i in range(10)]
    with RssSampler(worker.pid, 0.2) as rss:
        results = wait_results(redis_client, lane.prefix, rids, 90)
    figures("header_bomb", records=10, rss_base_mb=base, rss_peak_mb=rss.peak)
    assert len(results) == 10 and all(r["status"] == "succeeded" for r in results.values())
    assert rss.peak < base + 100, "the records' headers were kept"


def test_partitions_added_to_a_topic_are_served_within_seconds(
    lane1: EnvLane, redis_client: redis.Redis, spawn: Any
) -> None:
    spawn(lane1)
    produce_envelopes(lane1, [chat("p0", "x")])
    assert wait_results(redis_client, lane1.prefix, ["p0"], 60)
    admin = _admin(lane1)
    try:
        admin.create_partitions({lane1.topic: NewPartitions(total_count=4)})
    finally:
        admin.close()
    start = time.monotonic()
    producer = KafkaProducer(bootstrap_servers=lane1.bootstrap)
    try:
        deadline = time.monotonic() + 30
        while 3 not in (producer.partitions_for(lane1.topic) or set()):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        key, value = encode(chat("p3", "on a new partition"))
        producer.send(lane1.topic, key=key, value=value, partition=3).get(timeout=30)
    finally:
        producer.close()
    found = wait_results(redis_client, lane1.prefix, ["p3"], 45)
    figures("new_partition", served_s=time.monotonic() - start)
    assert "p3" in found, "a record on a new partition was not served within 45 s"


def test_strikes_do_not_outlive_a_recreated_topic(
    lane1: EnvLane, redis_client: redis.Redis, spawn: Any, tmp_path: Path
) -> None:
    """A poison record (a failpoint) is struck twice and quarantined; the topic is deleted
    and created again; an ordinary request at the same offset is run, not failed unrun."""
    import dataclasses

    poisoned = dataclasses.replace(lane1, extra_env={"QBATCH_FAILPOINTS": "dispatch=poison"})
    produce_envelopes(lane1, [chat("poison", "x")])
    for n in range(2):
        worker = spawn(poisoned, name=f"struck{n}")
        assert worker.wait(timeout=60) == 70
    worker = spawn(poisoned, name="quarantines")
    quarantined = wait_results(redis_client, lane1.prefix, ["poison"], 60)["poison"]
    assert "not run again" in quarantined["error"]["message"]
    assert wait_committed(lane1, 30)
    stop_worker(worker)
    delete_topics([lane1.topic], lane1.bootstrap)
    admin = _admin(lane1)
    try:
        deadline = time.monotonic() + 60
        while lane1.topic in admin.list_topics():  # deletion is asynchronous
            assert time.monotonic() < deadline, "the topic was not deleted"
            time.sleep(0.5)
    finally:
        admin.close()
    create_topic(lane1.topic, 1, lane1.bootstrap)
    keys = RedisKeys(lane1.prefix)
    strikes = redis_client.hgetall(keys.strikes(lane1.group))
    assert any(f.startswith(f"{lane1.topic}/0/0/") for f in strikes)
    spawn(poisoned, name="recreated")
    produce_envelopes(lane1, [chat("ordinary", "x")])  # offset 0 of the new topic
    result = wait_results(redis_client, lane1.prefix, ["ordinary"], 60)["ordinary"]
    committed, end = committed_vs_end(lane1)
    figures("recreated_topic", status=result["status"], committed=committed, end=end)
    assert result["status"] == "succeeded"
