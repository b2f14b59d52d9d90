"""Helpers for producer integration tests: a unique topic and an echo worker subprocess.

Used by `tests/integration/test_producer_*.py` and `tests/benchmarks/bench_bulk.py`.
Everything is keyed by a unique name so tests never see each other's records or keys.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from producer.client import QBatchClient
from tests.integration.cluster_stack import ON_CLUSTER, cluster_up

REPO = Path(__file__).resolve().parents[2]
if ON_CLUSTER:  # QBATCH_TEST_STACK=cluster: the 3-broker Kafka + Redis Cluster
    _cluster = cluster_up()
    BOOTSTRAP, REDIS_URL, REPLICATION = _cluster.kafka_bootstrap, _cluster.redis_url, 3
else:
    BOOTSTRAP = os.environ.get("QBATCH_KAFKA_BOOTSTRAP", "127.0.0.1:9092")
    REDIS_URL = os.environ.get("QBATCH_REDIS_URL", "redis://127.0.0.1:6379/0")
    REPLICATION = 1


TEST_SESSION_TIMEOUT_MS = 10_000


def unique(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:10]}"


def create_topic(
    name: str, partitions: int = 8, bootstrap: str = BOOTSTRAP, replication: int = REPLICATION
) -> str:
    from kafka.admin import KafkaAdminClient, NewTopic
    from kafka.errors import TopicAlreadyExistsError

    admin = KafkaAdminClient(bootstrap_servers=bootstrap.split(","))
    try:
        with contextlib.suppress(TopicAlreadyExistsError):
            admin.create_topics([NewTopic(name, partitions, replication)])
    finally:
        admin.close()
    return name


def delete_topics(names: Sequence[str], bootstrap: str = BOOTSTRAP) -> None:
    from kafka.admin import KafkaAdminClient

    with contextlib.suppress(Exception):
        admin = KafkaAdminClient(bootstrap_servers=bootstrap.split(","))
        try:
            admin.delete_topics(list(names))
        finally:
            admin.close()


@dataclass
class Lane:
    """A private lane: topic, DLQ topic, consumer group and Redis prefix."""

    topic: str
    dlq_topic: str
    group: str
    prefix: str
    bootstrap: str = BOOTSTRAP
    redis_url: str = REDIS_URL
    bulk_topic: str = ""
    tool_calls_topic: str = ""
    extra_env: dict[str, str] = field(default_factory=dict)
    """More environment for the processes this lane starts (workers, the CLI), e.g.
    `QBATCH_REDIS_ADDRESS_MAP`; not used by `client()` or `clean_redis()`."""

    def __post_init__(self) -> None:
        if not self.bulk_topic:
            self.bulk_topic = f"{self.topic}.bulk"
        if not self.tool_calls_topic:
            self.tool_calls_topic = f"{self.topic}.tool-calls"

    @classmethod
    def new(cls, name: str = "qbp") -> Lane:
        base = unique(name)
        return cls(
            topic=f"{base}.requests",
            dlq_topic=f"{base}.requests.dlq",
            group=f"{base}-workers",
            prefix=base.replace("-", "_"),
        )

    @classmethod
    def on(cls, bootstrap: str, redis_url: str, name: str = "qbp") -> Lane:
        """A new lane on other servers (e.g. the cluster of `stack.sh up --brokers 3
        --redis-cluster`)."""
        lane = cls.new(name)
        lane.bootstrap, lane.redis_url = bootstrap, redis_url
        return lane

    @classmethod
    @contextlib.contextmanager
    def private(cls, name: str, partitions: int = 8) -> Iterator[Lane]:
        """A new lane with its topics, deleted with its Redis keys afterwards."""
        lane = cls.new(name)
        lane.create_topics(partitions=partitions)
        try:
            yield lane
        finally:
            lane.delete_topics()
            lane.clean_redis()

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            QBATCH_KAFKA_BOOTSTRAP=self.bootstrap,
            QBATCH_REDIS_URL=self.redis_url,
            QBATCH_TOPIC=self.topic,
            QBATCH_BULK_TOPIC=self.bulk_topic,
            QBATCH_DLQ_TOPIC=self.dlq_topic,
            QBATCH_GROUP=self.group,
            QBATCH_PREFIX=self.prefix,
            QBATCH_TOOL_CALLS_TOPIC=self.tool_calls_topic,
            QBATCH_TOOLS_GROUP=f"{self.group}-tools",
            PYTHONPATH=str(REPO),
        )
        env.update(self.extra_env)
        return env

    def client(self, **extra: Any) -> QBatchClient:
        """A producer client on this lane's topics, Redis and prefix."""
        return QBatchClient(
            bootstrap=self.bootstrap,
            redis_url=self.redis_url,
            topic=self.topic,
            bulk_topic=self.bulk_topic,
            prefix=self.prefix,
            **extra,
        )

    def cli_args(self) -> list[str]:
        return [
            "--bootstrap",
            self.bootstrap,
            "--redis-url",
            self.redis_url,
            "--topic",
            self.topic,
            "--bulk-topic",
            self.bulk_topic,
            "--prefix",
            self.prefix,
        ]

    def create_topics(self, partitions: int = 8, replication: int = REPLICATION) -> None:
        for topic, n in (
            (self.topic, partitions),
            (self.bulk_topic, partitions),
            (self.dlq_topic, 1),
            (self.tool_calls_topic, partitions),
        ):
            create_topic(topic, n, self.bootstrap, replication)

    def delete_topics(self) -> None:
        delete_topics(
            [self.topic, self.bulk_topic, self.dlq_topic, self.tool_calls_topic], self.bootstrap
        )

    def clean_redis(self) -> None:
        from schemas.redis_conn import connect

        client = connect(self.redis_url)
        try:
            keys = list(client.scan_iter(match=f"{self.prefix}:*", count=10_000))
            for start in range(0, len(keys), 5_000):
                client.delete(*keys[start : start + 5_000])
        finally:
            client.close()


def wait_for(what: str, check: Any, timeout: float) -> float:
    """Seconds until `check()` is true; raises TimeoutError naming `what` after `timeout`."""
    t0 = time.monotonic()
    while not check():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)
    return time.monotonic() - t0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def metric_value(port: int, name: str) -> float:
    """The sum of a Prometheus sample `name` (all its label sets) on 127.0.0.1:`port`."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith((name + " ", name + "{"))
    )


def start_worker(
    lane: Lane, *extra: str, log: Path | None = None, metrics_port: int = 0
) -> subprocess.Popen[bytes]:
    """An echo-engine worker for `lane` (stop it with `stop_worker`)."""
    cmd = [
        sys.executable,
        "-m",
        "worker",
        "--engine",
        "echo",
        "--auto-offset-reset",
        "earliest",
        "--metrics-port",
        str(metrics_port),
        # A killed worker's partitions move to the others once the broker gives up on it:
        # 10 s, not the production 45 s, so the kill -9 tests do not sit out 45 s each
        # (a test's own --session-timeout-ms in `extra` wins: the last flag does).
        "--session-timeout-ms",
        str(TEST_SESSION_TIMEOUT_MS),
        *extra,
    ]
    sink = log.open("ab") if log is not None else subprocess.DEVNULL
    return subprocess.Popen(cmd, env=lane.env(), cwd=REPO, stdout=sink, stderr=sink)


def stop_worker(proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


@contextlib.contextmanager
def echo_worker(
    lane: Lane, *extra: str, log: Path | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    proc = start_worker(lane, *extra, log=log)
    try:
        time.sleep(0.2)
        if proc.poll() is not None:
            raise RuntimeError(f"worker exited at once with {proc.returncode} (log: {log})")
        yield proc
    finally:
        stop_worker(proc)


def start_executor(
    lane: Lane,
    registry: str = "tests.tool_fixtures:registry",
    *extra: str,
    log: Path | None = None,
    pythonpath: Path | None = None,
) -> subprocess.Popen[bytes]:
    """`qbatch tools serve` for `lane` (stop it with `stop_worker`); `pythonpath`: where
    a registry module outside the repo lives."""
    cmd = [
        sys.executable,
        "-m",
        "producer.cli",
        *lane.cli_args(),
        "tools",
        "serve",
        "--registry",
        registry,
        "--metrics-port",
        "0",
        *extra,
    ]
    sink = log.open("ab") if log is not None else subprocess.DEVNULL
    env = lane.env()
    # as the workers': a killed executor's partitions move in 10 s, not 45
    env.setdefault("QBATCH_TOOLS_SESSION_TIMEOUT_MS", str(TEST_SESSION_TIMEOUT_MS))
    if pythonpath is not None:
        env["PYTHONPATH"] = f"{pythonpath}{os.pathsep}{env['PYTHONPATH']}"
    return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=sink, stderr=sink)


def qbatch(lane: Lane, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """Run the `qbatch` CLI for `lane` as a subprocess."""
    return subprocess.run(
        [sys.executable, "-m", "producer.cli", *lane.cli_args(), *args],
        env=lane.env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def qbatch_popen(lane: Lane, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "producer.cli", *lane.cli_args(), *args],
        env=lane.env(),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
