"""Fixtures for tests that talk to the real local stack (deploy/local/stack.sh).

The `stack` fixture runs `deploy/local/stack.sh up` once per session (it reuses a
running stack and returns in about a second). If the stack cannot start the
fixture raises, so every integration test errors: nothing is skipped silently.
`cluster_stack` does the same for `stack.sh up --brokers 3 --redis-cluster`.

With `QBATCH_TEST_STACK=cluster`, `stack` is that cluster instead (3 Kafka brokers, a
`redis+cluster://` URL), so the whole suite runs against it; tests that only make sense
on one server skip with the reason (deploy/local/README.md, "Cluster modes").
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from redis.cluster import RedisCluster

from schemas import RedisKeys
from schemas.redis_conn import connect, is_cluster_url
from tests.integration.cluster_stack import (
    ON_CLUSTER,
    ClusterStack,
    cluster_up,
    parse_exports,
    run_stack,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
STACK_SH = REPO_ROOT / "deploy" / "local" / "stack.sh"
HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.integration)


@dataclass(frozen=True)
class Stack:
    kafka_bootstrap: str
    redis_url: str
    topic: str
    dlq_topic: str
    env: dict[str, str]


@pytest.fixture(scope="session")
def stack() -> Stack:
    if ON_CLUSTER:
        cluster = cluster_up()
        return Stack(
            kafka_bootstrap=cluster.kafka_bootstrap,
            redis_url=cluster.redis_url,
            topic=cluster.topic,
            dlq_topic=cluster.dlq_topic,
            env=cluster.env,
        )
    proc = subprocess.run(
        ["bash", str(STACK_SH), "up"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"deploy/local/stack.sh up failed (exit {proc.returncode}):\n"
            f"{proc.stderr[-4000:]}\n{proc.stdout[-2000:]}"
        )
    env = parse_exports(proc.stdout)
    missing = {"QBATCH_KAFKA_BOOTSTRAP", "QBATCH_REDIS_URL"} - env.keys()
    if missing:
        raise RuntimeError(f"stack.sh up printed no {sorted(missing)}; stdout was:\n{proc.stdout}")
    return Stack(
        kafka_bootstrap=env["QBATCH_KAFKA_BOOTSTRAP"],
        redis_url=env["QBATCH_REDIS_URL"],
        topic=env.get("QBATCH_TOPIC", os.environ.get("QBATCH_TOPIC", "qbatch.requests")),
        dlq_topic=env.get("QBATCH_DLQ_TOPIC", "qbatch.requests.dlq"),
        env=env,
    )


@pytest.fixture(scope="session")
def cluster_stack() -> ClusterStack:
    """The three-broker Kafka + six-node Redis Cluster of `stack.sh up --brokers 3
    --redis-cluster` (next to the single-node stack): a `ClusterStack` with
    `kafka_bootstrap`, `redis_url` (`redis+cluster://...`) and the chaos helpers
    (kill/stop/start_broker, kill/start_redis; tests/integration/cluster_stack.py).
    Raises, never skips, if the cluster cannot start."""
    return cluster_up()


@pytest.fixture
def cluster(cluster_stack: ClusterStack) -> Iterator[tuple[Any, RedisKeys]]:
    """A cluster client and a fresh hash-tagged key layout on the Redis Cluster; deletes
    the layout's keys afterwards."""
    url = cluster_stack.redis_url
    assert is_cluster_url(url), url
    client = connect(url)
    assert isinstance(client, RedisCluster)
    keys = RedisKeys(f"qbc_{uuid.uuid4().hex[:10]}", cluster=True)
    try:
        yield client, keys
    finally:
        doomed = list(client.scan_iter(match=f"{keys.prefix}:*", count=1000))
        if doomed:
            client.delete(*doomed)
        client.close()


@pytest.fixture(scope="module")
def sentinel_url() -> Iterator[str]:
    """The Sentinel set's `redis+sentinel://` URL (`stack.sh up --redis-sentinel`, started
    here, idempotent, so a clean clone runs its tests); left whole at the end."""
    url = parse_exports(run_stack("up", "--redis-sentinel", timeout=300).stdout).get(
        "QBATCH_REDIS_URL", ""
    )
    assert url.startswith("redis+sentinel://"), url
    yield url
    run_stack("status", "--sentinel", timeout=60)  # left whole: master, replicas, sentinels


@pytest.fixture(scope="session")
def kafka_bootstrap(stack: Stack) -> str:
    return stack.kafka_bootstrap


@pytest.fixture(scope="session")
def redis_url(stack: Stack) -> str:
    return stack.redis_url


@pytest.fixture
def prefix() -> str:
    """Unique per test: use it for Redis keys, topic names and group ids."""
    return f"qbt-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def redis_client(redis_url: str, prefix: str) -> Iterator[Any]:
    """redis-py client (decode_responses=True; a cluster client for a `redis+cluster://`
    URL); deletes the keys under `prefix` afterwards."""
    client = connect(redis_url, decode_responses=True)
    client.ping()
    try:
        yield client
    finally:
        keys = list(client.scan_iter(match=f"{prefix}*", count=500))
        if keys:
            client.delete(*keys)
        client.close()


@pytest.fixture(scope="session")
def kafka_admin(kafka_bootstrap: str) -> Iterator[Any]:
    from kafka import KafkaAdminClient

    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap, client_id="qbatch-tests")
    try:
        yield admin
    finally:
        admin.close()


@pytest.fixture
def fresh_topic(kafka_admin: Any, prefix: str) -> Iterator[Callable[..., str]]:
    """Factory: fresh_topic(partitions=1, name=None) -> a new, ready topic name.

    Names are `<prefix>.<n>` unless given; the topics are deleted at teardown
    (best-effort).
    """
    admin = kafka_admin
    created: list[str] = []

    def make(partitions: int = 1, name: str | None = None) -> str:
        topic = name or f"{prefix}.t{len(created)}"
        admin.create_topics(
            {topic: {"num_partitions": partitions, "replication_factor": 3 if ON_CLUSTER else 1}},
            timeout_ms=30_000,
        )
        created.append(topic)
        admin.wait_for_topics([topic], timeout_ms=30_000)
        return topic

    yield make
    if created:
        with contextlib.suppress(Exception):  # best-effort cleanup
            admin.delete_topics(created, timeout_ms=30_000, raise_errors=False)
