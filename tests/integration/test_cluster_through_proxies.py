"""`QBATCH_REDIS_ADDRESS_MAP` on the real Redis Cluster (`stack.sh up --redis-cluster`): a
client whose every node sits behind a proxy (tests/reliability/tcp_proxy.py, standing in
for NAT or a port-forward) reaches the cluster only through the proxies, after a MOVED
too, and an echo worker given the map answers requests without a single direct
connection to a node."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from schemas.redis_conn import connect
from tests.integration.workers import Lane, echo_worker, unique
from tests.reliability.tcp_proxy import DelayProxy, address_map, proxies_for

pytestmark = pytest.mark.integration


@pytest.fixture
def proxies(cluster_stack: Any) -> Iterator[dict[int, DelayProxy]]:
    cluster_stack.wait_redis_ok()  # every node known to CLUSTER SLOTS, so to a new client
    out = proxies_for(cluster_stack.redis_nodes)
    try:
        yield out
    finally:
        for proxy in out.values():
            proxy.close()


def _ports(client: Any) -> set[int]:
    return {int(node.port) for node in client.get_nodes()}


def _remote_ports(pid: int) -> set[int]:
    """Remote ports of the process's established TCP connections (from /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                cols = line.split()
                if cols[3] == "01" and cols[9] in inodes:  # ESTABLISHED
                    ports.add(int(cols[2].rsplit(":", 1)[1], 16))
    return ports


def _force_moved(client: Any, key: str) -> None:
    """Point the client's slot map for `key` at a master that does not own it, so the
    next command on it gets a MOVED naming the owner's announced (real) address."""
    slot = client.keyslot(key)
    owner = client.nodes_manager.slots_cache[slot][0]
    other = next(n for n in client.get_primaries() if n.name != owner.name)
    client.nodes_manager.slots_cache[slot] = [other]


def test_a_moved_reply_is_followed_through_the_map(
    cluster_stack: Any, proxies: dict[int, DelayProxy]
) -> None:
    mapping = address_map(proxies)
    proxied = {p.port for p in proxies.values()}
    key = f"{unique('qbam')}:k"
    client = connect(cluster_stack.redis_url, address_map=mapping)
    try:
        assert _ports(client) == proxied  # the seeds and CLUSTER SLOTS, mapped
        client.set(key, "v", ex=60)
        _force_moved(client, key)
        assert client.get(key) == b"v"
        assert _ports(client) <= proxied  # the MOVED reloaded the map: still proxies only
        client.delete(key)
    finally:
        client.close()
    # Why connect() sets reinitialize_steps=1: redis-py does not map a MOVED's address
    # (redis/redis-py#3382), so a client that patches its slot map from the reply
    # (its default) reaches the node directly. If this starts failing, redis-py maps
    # MOVED now and the setting can go.
    raw = connect(cluster_stack.redis_url, address_map=mapping, reinitialize_steps=5)
    try:
        raw.set(key, "v", ex=60)
        _force_moved(raw, key)
        assert raw.get(key) == b"v"
        assert _ports(raw) - proxied, "redis-py now maps MOVED replies itself"
        raw.delete(key)
    finally:
        raw.close()


def test_a_worker_through_proxies_answers_requests(
    cluster_stack: Any, stack: Any, proxies: dict[int, DelayProxy], tmp_path: Path
) -> None:
    """An echo worker with `QBATCH_REDIS_ADDRESS_MAP` pointing every node at its proxy
    (each adding 20 ms each way): every request answered, every master's proxy carried
    traffic, and the worker holds no connection to a node's own port."""
    for proxy in proxies.values():
        proxy.set_delay(0.02)
    lane = Lane.on(stack.kafka_bootstrap, cluster_stack.redis_url, "qbam")
    lane.extra_env["QBATCH_REDIS_ADDRESS_MAP"] = json.dumps(address_map(proxies))
    lane.create_topics(4)
    direct = connect(cluster_stack.redis_url)
    masters = {int(n.port) for n in direct.get_primaries()}
    direct.close()
    try:
        with echo_worker(lane, log=tmp_path / "worker.log") as proc, lane.client() as qb:
            ids = qb.submit_many(
                [{"messages": [{"role": "user", "content": f"p{i}"}]} for i in range(60)]
            )
            got = qb.wait_many(ids, timeout=90)
            assert all(r is not None and r.ok for r in got.values()), got
            remote = _remote_ports(proc.pid)
        assert remote & {p.port for p in proxies.values()}, remote
        assert not remote & set(cluster_stack.redis_ports), remote  # never a node directly
        for port in masters:  # results spread over the masters: each proxy carried some
            assert proxies[port].bytes["to_server"] > 0, port
    finally:
        lane.clean_redis()
        lane.delete_topics()
