"""Shared helpers for the reliability scenarios (faults, poison input, load).

Everything here runs against the real local stack (deploy/local/stack.sh) or a
PRIVATE stack started from the same script on other ports, so a scenario that
stops a broker never touches the shared one. Every test under tests/reliability
is marked `integration`; the long ones are also marked `slow`.

Each scenario prints one line starting with `FIGURES` (run pytest with `-s` to see
them); tests/reliability/README.md collects the measured figures.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, settings
from kafka import KafkaConsumer, KafkaProducer
from kafka.structs import TopicPartition

import tests.integration.conftest as _shared
from tests.integration.cluster_stack import parse_exports
from tests.integration.conftest import STACK_SH, Stack
from tests.integration.workers import REPO, Lane, start_worker, stop_worker

HERE = Path(__file__).resolve().parent

# tests/integration/conftest.py's fixtures are not visible from this tree: re-export them.
stack = _shared.stack
kafka_bootstrap = _shared.kafka_bootstrap
cluster_stack = _shared.cluster_stack
redis_client = _shared.redis_client
sentinel_url = _shared.sentinel_url
# `prefix` and `redis_url` are also parameter names of the helpers below (ruff F811)
globals().update(prefix=_shared.prefix, redis_url=_shared.redis_url)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.integration)


# ---------------------------------------------------------------------------- figures


def fuzz_settings(max_examples: int) -> settings:
    """Hypothesis settings of the fuzz tests: no deadline (a busy CI machine stalls an
    example), no health check (the strategies build large inputs on purpose), no example
    database (every run explores afresh)."""
    from hypothesis import settings

    return settings(
        max_examples=max_examples,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
    )


def figures(scenario: str, **values: Any) -> str:
    """Print (and return) the one-line figure summary of a scenario."""
    parts = []
    for key, value in values.items():
        if isinstance(value, float):
            value = f"{value:.2f}"
        elif isinstance(value, dict):
            value = json.dumps(value, sort_keys=True, separators=(",", ":"))
        parts.append(f"{key}={value}")
    line = f"FIGURES {scenario}: " + " ".join(parts)
    print("\n" + line, flush=True)
    sink = os.environ.get("QBATCH_FIGURES_FILE")
    if sink:
        with open(sink, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"scenario": scenario, **values}, default=str) + "\n")
    return line


# ---------------------------------------------------------------------------- requests


def chat(rid: str, text: str, **extra: Any) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 64}
    body.update(extra.pop("body", {}))
    return {"request_id": rid, "body": body, **extra}


def encode(envelope: dict[str, Any]) -> tuple[bytes, bytes]:
    return envelope["request_id"].encode(), json.dumps(envelope).encode()


def produce(
    lane: Lane,
    records: Sequence[tuple[bytes | None, bytes]],
    topic: str | None = None,
    **kafka_kwargs: Any,
) -> None:
    """Send `records` to `topic` (default: the lane's interactive topic) and flush."""
    config: dict[str, Any] = {
        "linger_ms": 20,
        "batch_size": 256 * 1024,
        "acks": "all",
        "max_request_size": 2_000_000,
        **kafka_kwargs,
    }
    producer = KafkaProducer(bootstrap_servers=lane.bootstrap, **config)
    try:
        for key, value in records:
            producer.send(topic or lane.topic, key=key, value=value)
        producer.flush(timeout=120)
    finally:
        producer.close()


def produce_envelopes(
    lane: Lane, envelopes: Sequence[dict[str, Any]], topic: str | None = None
) -> None:
    produce(lane, [encode(e) for e in envelopes], topic)


def fetch_results(r: redis.Redis, prefix: str, rids: Sequence[str]) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    for start in range(0, len(rids), 2000):
        chunk = rids[start : start + 2000]
        for rid, raw in zip(chunk, r.mget([f"{prefix}:result:{x}" for x in chunk]), strict=True):
            if raw is not None:
                found[rid] = json.loads(raw)
    return found


def wait_results(
    r: redis.Redis, prefix: str, rids: Sequence[str], timeout: float = 120
) -> dict[str, dict[str, Any]]:
    deadline = time.monotonic() + timeout
    found: dict[str, dict[str, Any]] = {}
    while True:
        missing = [rid for rid in rids if rid not in found]
        if missing:
            found.update(fetch_results(r, prefix, missing))
        if len(found) == len(rids) or time.monotonic() > deadline:
            return found
        time.sleep(0.3)


def done_lengths(r: redis.Redis, prefix: str, rids: Sequence[str]) -> list[int]:
    """LLEN of every request's wake-up list (1 = written exactly once)."""
    out: list[int] = []
    for start in range(0, len(rids), 2000):
        pipe = r.pipeline(transaction=False)
        for rid in rids[start : start + 2000]:
            pipe.llen(f"{prefix}:done:{rid}")
        out.extend(pipe.execute())
    return out


def job_finished(r: redis.Redis, prefix: str, job: str) -> int:
    h = r.hmget(f"{prefix}:job:{job}", "succeeded", "failed", "expired", "cancelled")
    return sum(int(x or 0) for x in h)


def wait_job(r: redis.Redis, prefix: str, job: str, n: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    done = 0
    while time.monotonic() < deadline:
        done = job_finished(r, prefix, job)
        if done >= n:
            break
        time.sleep(0.25)
    return done


def new_job(r: redis.Redis, prefix: str, job: str, total: int) -> None:
    r.hset(f"{prefix}:job:{job}", mapping={"total": total, "status": "running"})


# ---------------------------------------------------------------------------- Kafka offsets


def _consumer(lane: Lane, **kwargs: Any) -> KafkaConsumer:
    return KafkaConsumer(bootstrap_servers=lane.bootstrap, group_id=lane.group, **kwargs)


def committed_vs_end(lane: Lane, **kafka_kwargs: Any) -> tuple[int, int]:
    """(sum of committed offsets, sum of log-end offsets) of the lane's topic."""
    consumer = _consumer(lane, **kafka_kwargs)
    try:
        parts = [TopicPartition(lane.topic, p) for p in consumer.partitions_for_topic(lane.topic)]
        ends = consumer.end_offsets(parts)
        committed = sum(consumer.committed(tp) or 0 for tp in parts)
        return committed, sum(ends.values())
    finally:
        consumer.close()


def wait_committed(lane: Lane, timeout: float = 30, **kafka_kwargs: Any) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        committed, end = committed_vs_end(lane, **kafka_kwargs)
        if committed == end:
            return True
        time.sleep(0.5)
    return False


def dlq_count(lane: Lane, timeout: float = 10, expected: int | None = None) -> list[Any]:
    consumer = KafkaConsumer(
        lane.dlq_topic,
        bootstrap_servers=lane.bootstrap,
        auto_offset_reset="earliest",
        group_id=None,
    )
    records: list[Any] = []
    deadline = time.monotonic() + timeout
    idle = 0
    try:
        while time.monotonic() < deadline:
            got = consumer.poll(timeout_ms=500)
            for batch in got.values():
                records.extend(batch)
            if expected is not None and len(records) >= expected:
                break
            idle = 0 if got else idle + 1
            if expected is None and idle >= 4 and records:
                break
    finally:
        consumer.close()
    return records


def dlq_sources(records: Sequence[Any]) -> set[tuple[bytes, bytes]]:
    """Distinct (source partition, source offset) of dead letters (redeliveries repeat)."""
    return {
        (dict(r.headers)["qbatch.source.partition"], dict(r.headers)["qbatch.source.offset"])
        for r in records
    }


# ---------------------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class RssSampler:
    """Samples a process's VmRSS every `interval` s in a thread: (t, MB) pairs."""

    def __init__(self, pid: int, interval: float = 0.5) -> None:
        self.pid = pid
        self.interval = interval
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.is_set():
            value = rss_mb(self.pid)
            if value is not None:
                self.samples.append((time.monotonic(), value))
            self._stop.wait(self.interval)

    @property
    def peak(self) -> float:
        return max((mb for _, mb in self.samples), default=0.0)

    def peak_between(self, t0: float, t1: float) -> float:
        return max((mb for t, mb in self.samples if t0 <= t <= t1), default=0.0)


def scrape(port: int, name: str) -> float:
    """Sum of a Prometheus metric (all label sets) from a worker's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and re.match(rf"{re.escape(name)}(\{{| )", line):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_http(port: int, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1).read()
            return
        time.sleep(0.1)
    raise RuntimeError(f"worker metrics port {port} did not answer")


def tail(path: Path, lines: int = 60) -> str:
    if not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def log_events(path: Path, event: str) -> list[dict[str, Any]]:
    out = []
    if not path.exists():
        return out
    for line in path.read_text(errors="replace").splitlines():
        if f'"{event}"' in line:
            with contextlib.suppress(json.JSONDecodeError):
                out.append(json.loads(line))
    return out


@dataclass
class EnvLane(Lane):
    """A Lane with extra environment for the worker (security settings, ...: `Lane.extra_env`)
    and topics of replication 1 that have leaders before it returns."""

    def create_topics(self, partitions: int = 8) -> None:
        """Create the topics and wait until every partition has a leader.

        A worker that subscribes before the new topic is in the broker's metadata is
        assigned nothing and (kafka-python) only notices the topic at its next metadata
        refresh, up to `metadata_max_age_ms` (5 min) later: so wait first.
        """
        from kafka import KafkaAdminClient

        admin = KafkaAdminClient(bootstrap_servers=self.bootstrap.split(","))
        try:
            admin.create_topics(
                {
                    self.topic: {"num_partitions": partitions, "replication_factor": 1},
                    self.bulk_topic: {"num_partitions": partitions, "replication_factor": 1},
                    self.dlq_topic: {"num_partitions": 1, "replication_factor": 1},
                },
                timeout_ms=30_000,
            )
            admin.wait_for_topics([self.topic, self.bulk_topic, self.dlq_topic], timeout_ms=30_000)
        finally:
            admin.close()


def make_lane(name: str, bootstrap: str, redis_url: str, **extra_env: str) -> EnvLane:
    base = Lane.new(name)
    return EnvLane(
        topic=base.topic,
        dlq_topic=base.dlq_topic,
        group=base.group,
        prefix=base.prefix,
        bootstrap=bootstrap,
        redis_url=redis_url,
        extra_env=dict(extra_env),
    )


@pytest.fixture
def lane(stack: Stack, tmp_path: Path) -> Iterator[EnvLane]:
    """A private topic (8 partitions) / group / prefix on the shared stack."""
    lane = make_lane("qbr", stack.kafka_bootstrap, stack.redis_url)
    lane.create_topics(partitions=8)
    yield lane
    lane.clean_redis()
    lane.delete_topics()


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Any]:
    """spawn(lane, *flags, name="w", metrics_port=0) -> Popen; stopped (SIGTERM) at teardown.

    The worker's log goes to tmp_path/<name>.log; its tail is printed when the test fails.
    """
    procs: list[tuple[subprocess.Popen[bytes], Path]] = []

    def make(
        lane: Lane, *extra: str, name: str = "worker", metrics_port: int = 0
    ) -> subprocess.Popen[bytes]:
        log = tmp_path / f"{name}.log"
        proc = start_worker(lane, *extra, log=log, metrics_port=metrics_port)
        procs.append((proc, log))
        return proc

    yield make
    for proc, log in procs:
        stop_worker(proc)
        print(f"---- {log.name} (tail) ----\n{tail(log, 40)}")


def _redis_ready(port: int, timeout: float = 10) -> None:
    """Until the server answers (any answer: a NOAUTH error means it is up too)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(64):
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"private redis-server on {port} did not start")


def private_redis(port: int, data_dir: Path, *extra: str) -> subprocess.Popen[bytes]:
    """A Redis we may stop: append-only so its data survives a SHUTDOWN and restart."""
    data_dir.mkdir(parents=True, exist_ok=True)
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "yes", "--appendfsync", "everysec", "--dir", str(data_dir), *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    _redis_ready(port)
    return server


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 10) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


# ---------------------------------------------------------------------------- private stack


class PrivateStack:
    """A second Kafka + Redis from deploy/local/stack.sh, on its own ports and directory.

    The shared stack is never touched: `stop_kafka` signals only this stack's broker
    (its pid file), and `start` brings it back on the same data directory.
    """

    def __init__(self, root: Path, *, sasl: bool = False) -> None:
        self.root = root
        self.kafka_port = free_port()
        self.controller_port = free_port()
        self.redis_port = free_port()
        self.sasl = sasl
        self.env_vars: dict[str, str] = {}

    @property
    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        for key in [k for k in env if k.startswith("QBATCH_KAFKA_SASL") or k in {
            "QBATCH_KAFKA_SECURITY_PROTOCOL", "QBATCH_TOPIC", "QBATCH_DLQ_TOPIC"}]:  # fmt: skip
            env.pop(key)
        env.update(
            QBATCH_STACK_DIR=str(self.root),
            QBATCH_KAFKA_PORT=str(self.kafka_port),
            QBATCH_KAFKA_CONTROLLER_PORT=str(self.controller_port),
            QBATCH_REDIS_PORT=str(self.redis_port),
            QBATCH_KAFKA_HEAP_OPTS="-Xms128m -Xmx512m",
            QBATCH_PARTITIONS="4",
        )
        if self.sasl:
            env["QBATCH_KAFKA_SASL"] = "1"
        return env

    def _run(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            ["bash", str(STACK_SH), *args],
            cwd=REPO,
            env=self._env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"stack.sh {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
        return proc

    def start(self) -> dict[str, str]:
        self.env_vars = parse_exports(self._run("up").stdout)
        return self.env_vars

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.kafka_port}"

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    @property
    def kafka_pid_file(self) -> Path:
        return self.root / "run" / "kafka" / "kafka.pid"

    def stop_kafka(self, timeout: float = 60) -> None:
        """SIGTERM this stack's broker (its process group) and wait until it is gone."""
        pid = int(self.kafka_pid_file.read_text().strip())
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)
        os.killpg(pid, signal.SIGKILL)

    def down(self) -> None:
        with contextlib.suppress(Exception):
            self._run("down", "--wipe", timeout=90)
        shutil.rmtree(self.root, ignore_errors=True)

    def server_log(self) -> str:
        path = self.root / "run" / "kafka" / "logs" / "server.log"
        return path.read_text(errors="replace") if path.exists() else ""


@contextlib.contextmanager
def private_stack(name: str, *, sasl: bool = False) -> Iterator[PrivateStack]:
    root = Path(f"/tmp/qbatch-rel-{name}-{os.getpid()}")
    shutil.rmtree(root, ignore_errors=True)
    ps = PrivateStack(root, sasl=sasl)
    try:
        ps.start()
        yield ps
    finally:
        ps.down()
