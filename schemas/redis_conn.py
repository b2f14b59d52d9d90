"""Opening a Redis connection from a `QBATCH_REDIS_URL`: one server or a Redis Cluster.

A URL whose scheme is `redis+cluster://` (or `rediss+cluster://` for TLS) names a cluster:
one or more seed nodes, comma-separated (`redis+cluster://10.0.0.1:6379,10.0.0.2:6379`),
from which redis-py discovers the rest and follows MOVED/ASK redirections and failovers.
The key layout follows the URL (`RedisKeys(cluster=True)`, hash tags), so every script
touches keys of one slot. Anything else is handed to `redis.Redis.from_url` unchanged.

The few multi-key reads that span slots (`MGET` of many results) go through `mget`, which
splits them by slot on a cluster; pipelines of scripts go through `eval_many`, since
redis-py's cluster pipeline refuses `EVALSHA` but routes a plain `EVAL` by its first key.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.cluster import ClusterNode, RedisCluster

__all__ = ["FailoverCluster", "connect", "eval_many", "is_cluster", "is_cluster_url", "mget"]

_CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
DEFAULT_FAILOVER_WAIT_S = 30.0
T = TypeVar("T")


def is_cluster_url(url: str) -> bool:
    return urlsplit(url).scheme.lower() in _CLUSTER_SCHEMES


def connect(url: str, *, failover_wait_s: float = DEFAULT_FAILOVER_WAIT_S, **kwargs: Any) -> Any:
    """A `redis.Redis`, or a `FailoverCluster` for a `redis+cluster://` URL (same kwargs);
    `failover_wait_s`: how long a cluster command waits out a failover (see there)."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in _CLUSTER_SCHEMES:
        return redis.Redis.from_url(url, **kwargs)
    if parts.path.strip("/") not in ("", "0"):
        raise ValueError(f"a Redis Cluster has database 0 only, got {parts.path!r} in the URL")
    kwargs.pop("health_check_interval", None)  # per-connection on a cluster; not accepted
    userinfo, _, hosts = parts.netloc.rpartition("@")
    seeds = [h.strip() for h in hosts.split(",") if h.strip()]
    if not seeds:
        raise ValueError("a redis+cluster:// URL needs at least one host:port")
    first = urlunsplit(
        (
            _CLUSTER_SCHEMES[scheme],
            f"{userinfo}@{seeds[0]}" if userinfo else seeds[0],
            "",
            parts.query,
            "",
        )
    )
    if len(seeds) > 1:
        kwargs["startup_nodes"] = [_node(seed) for seed in seeds]
    client = FailoverCluster.from_url(first, **kwargs)
    client.failover_wait_s = failover_wait_s
    return client


_FAILOVER_ERRORS = RedisCluster.ERRORS_ALLOW_RETRY


class FailoverCluster(RedisCluster):
    """A `RedisCluster` that waits out a master's failover instead of failing the command.

    When a master dies, its replica takes over after the cluster's node timeout (5-15 s).
    redis-py retries a command a few times at once, re-reading the slot map between tries,
    and then raises: the map still names the dead master until the failover is done. The
    chaos soak found `qbatch bulk submit` and `bulk cancel` failing half-way through a job
    that way. This client retries connection errors, timeouts, CLUSTERDOWN and uncovered
    slots with jittered backoff for `failover_wait_s` (0: redis-py's behaviour, for the
    worker, whose sink has its own outage handling: it pauses intake and retries)."""

    failover_wait_s: float = DEFAULT_FAILOVER_WAIT_S

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        return _waiting(self, lambda: super(FailoverCluster, self).execute_command(*args, **kwargs))


def _waiting(client: Any, fn: Callable[[], T]) -> T:
    """`fn()`, retried on the errors a failover raises until `client.failover_wait_s` has
    passed (redis-py's own jittered backoff: the bare client install has no tenacity)."""
    wait_s = getattr(client, "failover_wait_s", 0.0)
    if wait_s <= 0:
        return fn()
    backoff = ExponentialWithJitterBackoff(base=0.1, cap=2.0)
    deadline = time.monotonic() + wait_s
    failures = 0
    while True:
        try:
            return fn()
        except _FAILOVER_ERRORS:
            failures += 1
            pause = backoff.compute(failures)
            if time.monotonic() + pause > deadline:
                raise
            time.sleep(pause)


def _node(seed: str) -> ClusterNode:
    host, _, port = seed.rpartition(":")
    return ClusterNode(host.strip("[]") or seed, int(port) if port else 6379)


def is_cluster(client: Any) -> bool:
    return isinstance(client, RedisCluster)


def mget(client: Any, keys: Sequence[str]) -> list[Any]:
    """`MGET`, split by slot on a cluster (not atomic there; every caller only reads)."""
    if not keys:
        return []
    if is_cluster(client):
        return _waiting(client, lambda: list(client.mget_nonatomic(list(keys))))
    return list(client.mget(list(keys)))


def eval_many(
    client: Any, script: str, calls: Sequence[tuple[Sequence[Any], Sequence[Any]]]
) -> list[Any]:
    """Run `script` once per (keys, args) in one pipeline, each call's keys in one slot;
    the replies in order (an error reply is returned in place, not raised)."""

    def run() -> list[Any]:
        pipe = client.pipeline(transaction=False)
        for keys, args in calls:
            pipe.execute_command("EVAL", script, len(keys), *keys, *args)
        return list(pipe.execute(raise_on_error=False))

    return _waiting(client, run)  # each script is idempotent: a whole retry is safe
