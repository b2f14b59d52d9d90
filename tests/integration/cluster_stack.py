"""The cluster modes of deploy/local/stack.sh, for tests (and chaos scenarios).

    stack.sh up --brokers 3 --redis-cluster
        three KRaft nodes (broker+controller) on 127.0.0.1:19092-19094, replication 3,
        min.insync.replicas 2; six cluster-enabled Redis on 127.0.0.1:17000-17005
        (3 masters + 3 replicas). Both coexist with the single-node stack (9092 / 6379).

`cluster_up()` runs that (idempotent: about 1 s when it already runs) and returns a
`ClusterStack`; it raises when the script fails, so a test that needs the cluster errors
instead of skipping. The session fixture `cluster_stack` (tests/integration/conftest.py)
wraps it.

Chaos: `ClusterStack.kill_broker(n)` (SIGKILL to node n's process group),
`stop_broker(n)` (SIGTERM, controlled shutdown), `start_broker(n)` (same data dir; returns
once the node serves metadata on its own port), `kill_redis(port)` / `start_redis(port)`
(rejoins from its nodes.conf; a killed master's replica takes over after the node timeout,
5 s). They call `stack.sh kill-broker N` etc., which only signal the pids in the cluster's
pid files. `wait_in_sync()` waits until every partition has its full ISR again (after a
restart), `wait_redis_ok()` until every running Redis node says `cluster_state:ok`.
Leave the cluster as you found it: restart what you killed (a `finally`), other tests
share it.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

REPO_ROOT = Path(__file__).resolve().parents[2]
STACK_SH = REPO_ROOT / "deploy" / "local" / "stack.sh"
UP_ARGS = ("up", "--brokers", "3", "--redis-cluster")
REDIS_NODES = 6


def _test_stack_mode() -> str:
    mode = os.environ.get("QBATCH_TEST_STACK", "").strip().lower() or "single"
    if mode not in ("single", "cluster"):
        raise RuntimeError(f"QBATCH_TEST_STACK must be 'single' or 'cluster', got {mode!r}")
    return mode


ON_CLUSTER = _test_stack_mode() == "cluster"
"""`QBATCH_TEST_STACK=cluster`: the integration suite's `stack` fixture and the module
defaults of tests/integration/workers.py point at this cluster instead of the single
stack (deploy/local/README.md, "Cluster modes")."""


def parse_exports(text: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("export ") and "=" in line:
            key, _, value = line[len("export ") :].partition("=")
            env[key.strip()] = value.strip().strip("'\"")
    return env


def run_stack(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """Runs deploy/local/stack.sh ARGS; raises RuntimeError (with its stderr) on failure."""
    proc = subprocess.run(
        ["bash", str(STACK_SH), *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"deploy/local/stack.sh {' '.join(args)} failed (exit {proc.returncode}):\n"
            f"{proc.stderr[-4000:]}\n{proc.stdout[-2000:]}"
        )
    return proc


def _run_dir() -> Path:
    stack_dir = os.environ.get("QBATCH_STACK_DIR") or str(REPO_ROOT / "deploy" / "local" / ".cache")
    return Path(stack_dir) / "run" / "cluster"


def _read_pid(path: Path) -> int | None:
    """The pid in `path` if that process runs (a zombie, not yet reaped, does not)."""
    try:
        pid = int(path.read_text().strip())
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    return None if stat.rsplit(")", 1)[1].split()[0] == "Z" else pid


@dataclass(frozen=True)
class ClusterStack:
    kafka_bootstrap: str  # "127.0.0.1:19092,127.0.0.1:19093,127.0.0.1:19094"
    redis_url: str  # "redis+cluster://127.0.0.1:17000/0"
    topic: str
    dlq_topic: str
    env: dict[str, str] = field(repr=False)

    @property
    def bootstrap(self) -> str:
        return self.kafka_bootstrap

    @property
    def broker_ports(self) -> list[int]:
        """Node n (1-based) listens on broker_ports[n - 1]."""
        return [int(hp.rsplit(":", 1)[1]) for hp in self.kafka_bootstrap.split(",")]

    @property
    def redis_nodes(self) -> list[tuple[str, int]]:
        """(host, port) of every node (the URL names them all as seeds)."""
        seeds = urlsplit(self.redis_url).netloc.rpartition("@")[2].split(",")
        return [(h, int(p)) for h, _, p in (seed.rpartition(":") for seed in seeds)]

    @property
    def redis_ports(self) -> list[int]:
        return [port for _, port in self.redis_nodes]

    # ---------------------------------------------------------------- chaos

    def kill_broker(self, node: int) -> None:
        """SIGKILL Kafka node `node` (1-3); returns once the process is gone."""
        run_stack("kill-broker", str(node), timeout=90)

    def stop_broker(self, node: int) -> None:
        """SIGTERM (controlled shutdown) of node `node`; returns once it exited."""
        run_stack("stop-broker", str(node), timeout=90)

    def start_broker(self, node: int, timeout: float = 180) -> None:
        """Starts node `node` again on its data dir; returns once it serves metadata."""
        run_stack("start-broker", str(node), timeout=timeout + 30)

    def kill_redis(self, port: int) -> None:
        """SIGKILL the cluster Redis on `port` (17000-17005)."""
        run_stack("kill-redis", str(port), timeout=60)

    def start_redis(self, port: int) -> None:
        """Starts the Redis on `port` again; it rejoins the cluster from its nodes.conf."""
        run_stack("start-redis", str(port), timeout=90)

    def broker_pid(self, node: int) -> int | None:
        return _read_pid(_run_dir() / f"kafka-{node}" / "kafka.pid")

    def redis_pid(self, port: int) -> int | None:
        return _read_pid(_run_dir() / f"redis-{port}" / "redis.pid")

    def broker_node_of_port(self, port: int) -> int:
        return self.broker_ports.index(port) + 1

    def wait_in_sync(self, topics: list[str] | None = None, timeout: float = 90) -> None:
        """Waits until every partition of `topics` (default: all) has ISR == replicas."""
        from kafka import KafkaAdminClient

        deadline = time.monotonic() + timeout
        lagging: list[str] = []
        while True:
            admin = KafkaAdminClient(bootstrap_servers=self.kafka_bootstrap, client_id="qbt-isr")
            try:
                described = admin.describe_topics(topics)
            finally:
                admin.close()
            lagging = [
                f"{t.get('name') or t.get('topic')}/{p['partition_index']}"
                for t in described
                for p in t["partitions"]
                if set(p["isr_nodes"]) != set(p["replica_nodes"])
            ]
            if not lagging:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"partitions still under-replicated: {lagging[:20]}")
            time.sleep(0.5)

    def wait_redis_ok(self, timeout: float = 60) -> None:
        """Waits until every running node says cluster_state:ok, sees 3 masters + 3 replicas,
        and lists all six in CLUSTER SLOTS (a replica there only once it has synced)."""
        import redis

        deadline = time.monotonic() + timeout
        last: Any = None
        while True:
            states = {}
            for host, port in self.redis_nodes:
                if self.redis_pid(port) is None:
                    continue
                try:
                    client = redis.Redis(host=host, port=port, socket_timeout=2)
                    try:
                        info = client.cluster("INFO")
                        nodes = client.cluster("NODES")
                        served = _slot_ports(client.execute_command("CLUSTER", "SLOTS"))
                    finally:
                        client.close()
                except redis.RedisError as exc:
                    states[port] = repr(exc)
                    continue
                states[port] = _redis_node_state(info, nodes)
                if states[port] == "ok" and len(served) < len(self.redis_nodes):
                    # a replica still syncing is left out of CLUSTER SLOTS: clients
                    # seeded now would not know it
                    states[port] = f"CLUSTER SLOTS names {sorted(served)}"
            if states and all(s == "ok" for s in states.values()):
                return
            last = states
            if time.monotonic() > deadline:
                raise TimeoutError(f"redis cluster not ok: {last}")
            time.sleep(0.3)


def _slot_ports(slots: Any) -> set[int]:
    """The node ports a CLUSTER SLOTS reply names (masters and the replicas it lists)."""
    return {int(node[1]) for entry in slots for node in entry[2:]}


def _redis_node_state(info: Any, nodes: Any) -> str:
    if isinstance(info, bytes | str):
        text = info.decode() if isinstance(info, bytes) else info
        info = dict(line.split(":", 1) for line in text.split() if ":" in line)
    state = str(info.get("cluster_state"))
    if state != "ok":
        return f"cluster_state={state}"
    flags = [v.get("flags", "") for v in nodes.values()] if isinstance(nodes, dict) else []
    masters = sum("master" in f and "fail" not in f for f in flags)
    replicas = sum("slave" in f and "fail" not in f for f in flags)
    return "ok" if (masters, replicas) == (3, 3) else f"masters={masters} replicas={replicas}"


def cluster_up(timeout: float = 600) -> ClusterStack:
    """`stack.sh up --brokers 3 --redis-cluster`; raises RuntimeError if it fails."""
    proc = run_stack(*UP_ARGS, timeout=timeout)
    env = parse_exports(proc.stdout)
    missing = {"QBATCH_KAFKA_BOOTSTRAP", "QBATCH_REDIS_URL"} - env.keys()
    if missing:
        raise RuntimeError(f"stack.sh up printed no {sorted(missing)}; stdout was:\n{proc.stdout}")
    if not env["QBATCH_REDIS_URL"].startswith("redis+cluster://"):
        raise RuntimeError(f"not a cluster URL: {env['QBATCH_REDIS_URL']}")
    return ClusterStack(
        kafka_bootstrap=env["QBATCH_KAFKA_BOOTSTRAP"],
        redis_url=env["QBATCH_REDIS_URL"],
        topic=env.get("QBATCH_TOPIC", "qbatch.requests"),
        dlq_topic=env.get("QBATCH_DLQ_TOPIC", "qbatch.requests.dlq"),
        env=env,
    )
