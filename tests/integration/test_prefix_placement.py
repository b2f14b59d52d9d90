"""Prefix-aware placement end to end: `qbatch bulk run` on a 6-partition bulk topic with an
echo worker (its simulated prefix cache on), read back record by record from Kafka.

With `--placement prefix` (the default) every family below the cap lands on its home
partition as one contiguous block in file order, the record key stays the request_id,
every line gets its result and the worker counts prefix-cache hits; with `--placement
none` records go where Kafka's key partitioner puts them, as before, and the simulated
cache (room for about one family's prefix) hits far less (measured: 0.91 vs 0.41).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kafka import KafkaConsumer, TopicPartition
from kafka.partitioner import murmur2

from producer.placement import family_key, home_partition
from tests.integration.workers import (
    Lane,
    free_port,
    metric_value,
    qbatch,
    start_worker,
    stop_worker,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("stack")]

PARTITIONS = 6
FAMILIES = 4
PER_FAMILY = 12  # below the cap (64): one run each
SHORT = 5  # lines too short to have a family


def policy(family: int) -> str:
    return f"Policy {family}: answer in the house style, cite the rule you used. " * 80


def write_input(path: Path) -> dict[int, int | None]:
    """A shuffled file (families interleaved line by line); returns line -> family."""
    family_of: dict[int, int | None] = {}
    with path.open("w") as fh:
        for i in range(FAMILIES * PER_FAMILY + SHORT):
            fam = i % FAMILIES if i < FAMILIES * PER_FAMILY else None
            system = policy(fam) if fam is not None else "Be brief."
            body = {
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": f"question {i}"},
                ],
                "max_tokens": 16,
            }
            row = {"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions"}
            fh.write(json.dumps({**row, "body": body}) + "\n")
            family_of[i + 1] = fam  # request ids are {job}.{physical line}, 1-based
    return family_of


Records = dict[int, list[tuple[int, str, dict[str, Any]]]]


def topic_records(lane: Lane, job: str) -> Records:
    """partition -> [(offset, key, envelope)] of `job`'s records on the bulk topic."""
    consumer = KafkaConsumer(bootstrap_servers=lane.bootstrap.split(","), enable_auto_commit=False)
    try:
        parts = [TopicPartition(lane.bulk_topic, p) for p in range(PARTITIONS)]
        consumer.assign(parts)
        consumer.seek_to_beginning(*parts)
        ends = consumer.end_offsets(parts)
        out: Records = {p: [] for p in range(PARTITIONS)}
        deadline = time.monotonic() + 30
        while any(consumer.position(tp) < ends[tp] for tp in parts):
            assert time.monotonic() < deadline, "could not read the bulk topic back"
            for tp, records in consumer.poll(timeout_ms=500).items():
                for rec in records:
                    env = json.loads(rec.value)
                    if env["job_id"] == job:
                        out[tp.partition].append((rec.offset, rec.key.decode(), env))
        return out
    finally:
        consumer.close()


@pytest.fixture
def lane() -> Iterator[Lane]:
    lane = Lane.new("qpl")
    lane.create_topics(partitions=PARTITIONS)
    yield lane
    lane.delete_topics()
    lane.clean_redis()


def run_job(lane: Lane, src: Path, out: Path, job: str, *extra: str) -> dict[str, Any]:
    done = qbatch(
        lane, "-q", "--json", "bulk", "run", str(src), "--out", str(out), "--job", job,
        "--timeout", "120", *extra,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["custom_id"] for x in lines] == [f"c{i}" for i in range(len(lines))]
    assert all(x["response"]["status_code"] == 200 for x in lines)  # every line answered
    assert len(lines) == FAMILIES * PER_FAMILY + SHORT
    return json.loads(done.stdout.splitlines()[0])["submit"]


def test_families_land_together_on_their_partition(lane: Lane, tmp_path: Path) -> None:
    family_of = write_input(tmp_path / "in.jsonl")
    port = free_port()
    # A simulated cache of ~1.4 family prefixes (each ~1,400 tokens): family order keeps
    # hitting it, interleaved families evict each other.
    worker = start_worker(
        lane, "--echo-prefix-cache-tokens", "2000", log=tmp_path / "w.log", metrics_port=port
    )
    try:
        report = run_job(lane, tmp_path / "in.jsonl", tmp_path / "out.jsonl", "fam")
        assert report["placement"] == "prefix"
        assert (report["families"], report["placed"]) == (FAMILIES, FAMILIES * PER_FAMILY)
        hits = metric_value(port, "qbatch_engine_prefix_cache_hits_tokens_total")
        queries = metric_value(port, "qbatch_engine_prefix_cache_queries_tokens_total")
        assert 0 < hits <= queries
        plain = run_job(
            lane, tmp_path / "in.jsonl", tmp_path / "out2.jsonl", "plain", "--placement", "none"
        )
        assert (plain["placement"], plain["placed"]) == ("none", 0)
        hits2 = metric_value(port, "qbatch_engine_prefix_cache_hits_tokens_total") - hits
        queries2 = metric_value(port, "qbatch_engine_prefix_cache_queries_tokens_total") - queries
        # the cache's capacity, reported with the consumer lag (every 5 s)
        capacity = "qbatch_engine_kv_cache_capacity_tokens"
        wait_for(capacity, lambda: metric_value(port, capacity) > 0, 15)
        assert metric_value(port, capacity) == 2000  # --echo-prefix-cache-tokens, 16-token blocks
    finally:
        stop_worker(worker)
    with_placement, without = hits / queries, hits2 / queries2
    assert with_placement > without + 0.3, (with_placement, without)

    # prefix: one partition per family, its home; the family contiguous and in file order
    records = topic_records(lane, "fam")
    seen = 0
    for partition, recs in records.items():
        seen += len(recs)
        for _offset, key, env in recs:
            assert key == env["request_id"]  # the record key is still the request_id
        lines = [int(env["request_id"].rsplit(".", 1)[1]) for _o, _k, env in recs]
        fams = [family_of[n] for n in lines]
        for fam in set(fams) - {None}:
            at = [i for i, f in enumerate(fams) if f == fam]
            assert at == list(range(at[0], at[0] + PER_FAMILY)), f"family {fam} not contiguous"
            assert [lines[i] for i in at] == sorted(lines[i] for i in at)
            fkey = family_key(recs[at[0]][2]["body"])
            assert fkey is not None and home_partition(fkey, PARTITIONS) == partition
    assert seen == len(family_of)
    assert sum(1 for f in family_of.values() if f is not None) == FAMILIES * PER_FAMILY

    # none: Kafka's key partitioner (murmur2 of the request id), file order per partition
    records = topic_records(lane, "plain")
    spread: dict[int, set[int]] = {fam: set() for fam in range(FAMILIES)}
    for partition, recs in records.items():
        lines = [int(env["request_id"].rsplit(".", 1)[1]) for _o, _k, env in recs]
        assert lines == sorted(lines)
        for _offset, key, _env in recs:
            assert (murmur2(key.encode()) & 0x7FFFFFFF) % PARTITIONS == partition
        for n in lines:
            fam = family_of[n]
            if fam is not None:
                spread[fam].add(partition)
    assert sum(len(recs) for recs in records.values()) == len(family_of)
    assert all(len(parts) > 1 for parts in spread.values())  # families scattered, as before
