"""The asyncio twin of `schemas.redis_conn.connect`, for code that waits on Redis from an
event loop (`qbatch serve`'s sync requests: `producer.serve.result_wait`): the same
`QBATCH_REDIS_URL` forms (one server, `redis+cluster://`, `redis+sentinel://`) opened
with `redis.asyncio`. Failovers are the caller's to wait out (it retries its reads
until its own deadline); an address map is not supported here."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.sentinel import Sentinel

from schemas.redis_conn import is_cluster_url, is_sentinel_url, parse_sentinel_url

__all__ = ["connect_async"]


def connect_async(url: str, **kwargs: Any) -> Any:
    """A `redis.asyncio` client for `url` (the kwargs of `Settings.redis_kwargs` and
    connection-pool options such as `max_connections`)."""
    kwargs.pop("address_map", None)
    if is_sentinel_url(url):
        target = parse_sentinel_url(url)
        via = {k: v for k, v in kwargs.items() if k.startswith("socket_")}
        sentinel = Sentinel(
            list(target.sentinels), sentinel_kwargs={**via, **target.sentinel_kwargs}
        )
        return sentinel.master_for(target.service, **{**kwargs, **target.master_kwargs})
    if not is_cluster_url(url):
        return redis.asyncio.Redis.from_url(url, **kwargs)
    parts = urlsplit(url)
    scheme = "rediss" if parts.scheme.lower().startswith("rediss") else "redis"
    userinfo, _, hosts = parts.netloc.rpartition("@")
    seeds = [h.strip() for h in hosts.split(",") if h.strip()]
    if not seeds:
        raise ValueError("a redis+cluster:// URL needs at least one host:port")
    first = urlunsplit(
        (scheme, f"{userinfo}@{seeds[0]}" if userinfo else seeds[0], "", parts.query, "")
    )
    kwargs.pop("health_check_interval", None)
    nodes = [ClusterNode(*_host_port(seed)) for seed in seeds]
    return RedisCluster.from_url(first, startup_nodes=nodes, **kwargs)


def _host_port(seed: str) -> tuple[str, int]:
    host, _, port = seed.rpartition(":")
    return (host.strip("[]"), int(port)) if host else (seed, 6379)
