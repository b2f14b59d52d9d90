"""Opening a Redis connection from a `QBATCH_REDIS_URL`: one server, a Redis Cluster, or
the master that Redis Sentinel names.

A URL whose scheme is `redis+cluster://` (or `rediss+cluster://` for TLS) names a cluster:
one or more seed nodes, comma-separated (`redis+cluster://10.0.0.1:6379,10.0.0.2:6379`),
from which redis-py discovers the rest and follows MOVED/ASK redirections and failovers.
The key layout follows the URL (`RedisKeys(cluster=True)`, hash tags), so every script
touches keys of one slot.

A `redis+sentinel://` URL (`rediss+sentinel://` for TLS) names the sentinels and the
monitored service, `redis+sentinel://[user:pass@]s1:26379,s2:26379/<service>[/<db>]`: the
client asks the sentinels for the master and asks again after a failover (redis-py's
`Sentinel.master_for`). It is one server to qbatch: the standalone key layout, every
script unchanged. The user and password are the master's; the sentinels' own go in
`?sentinel_username=` / `?sentinel_password=`. Anything else is handed to
`redis.Redis.from_url` unchanged.

Producer-side clients of both kinds wait out a failover (`failover_wait_s`, see
`FailoverCluster` and `FailoverRedis`); the worker's sink passes 0 and pauses instead.

The few multi-key reads that span slots (`MGET` of many results) go through `mget`, which
splits them by slot on a cluster; pipelines of scripts go through `eval_many`, since
redis-py's cluster pipeline refuses `EVALSHA` but routes a plain `EVAL` by its first key.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import parse_url
from redis.sentinel import Sentinel, SentinelConnectionPool

__all__ = [
    "FailoverCluster",
    "FailoverRedis",
    "SentinelNoReplicas",
    "SentinelTarget",
    "address_remap",
    "connect",
    "eval_many",
    "is_cluster",
    "is_cluster_url",
    "is_sentinel_url",
    "mget",
    "parse_sentinel_url",
    "reply_text",
    "waiting_out_failover",
]

_CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
_SENTINEL_SCHEMES = {"redis+sentinel": "redis", "rediss+sentinel": "rediss"}
DEFAULT_FAILOVER_WAIT_S = 30.0
DEFAULT_SENTINEL_WAIT_S = 60.0
"""A sentinel failover takes `down-after-milliseconds` (Redis' default: 30 s) plus an
election and the promotion, so producer-side clients wait longer than on a cluster."""
DEFAULT_SENTINEL_PORT = 26379
T = TypeVar("T")


def is_cluster_url(url: str) -> bool:
    return urlsplit(url).scheme.lower() in _CLUSTER_SCHEMES


def is_sentinel_url(url: str) -> bool:
    return urlsplit(url).scheme.lower() in _SENTINEL_SCHEMES


def connect(url: str, *, failover_wait_s: float | None = None, **kwargs: Any) -> Any:
    """A `redis.Redis`, a `FailoverCluster` for a `redis+cluster://` URL or a
    `FailoverRedis` on the sentinels' master for a `redis+sentinel://` URL (same kwargs);
    `failover_wait_s`: how long a command of the last two waits out a failover (None:
    30 s on a cluster, 60 s behind sentinels; 0: not at all, for the worker).
    `address_map`: see `address_remap`."""
    url = _mapped(url, kwargs)
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme in _SENTINEL_SCHEMES:
        wait = DEFAULT_SENTINEL_WAIT_S if failover_wait_s is None else failover_wait_s
        return _sentinel_master(parse_sentinel_url(url), wait, kwargs)
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
    client.failover_wait_s = DEFAULT_FAILOVER_WAIT_S if failover_wait_s is None else failover_wait_s
    return client


@dataclass(frozen=True)
class SentinelTarget:
    """What a `redis+sentinel://` URL names (`parse_sentinel_url`)."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    master_kwargs: dict[str, Any] = field(default_factory=dict)
    """For the master's connections: db, username, password, the query's options, ssl."""
    sentinel_kwargs: dict[str, Any] = field(default_factory=dict)
    """For the sentinels' connections: their own credentials, TLS like the master's."""


def parse_sentinel_url(url: str) -> SentinelTarget:
    """`redis+sentinel://[user:pass@]host:port[,host:port...]/<service>[/<db>][?opts]`.

    A host without a port is on 26379. The query takes what a `redis://` URL takes
    (redis-py's parser reads it), plus `sentinel_username` / `sentinel_password`."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in _SENTINEL_SCHEMES:
        raise ValueError(f"not a redis+sentinel:// URL: {scheme}://")
    userinfo, _, hosts = parts.netloc.rpartition("@")
    sentinels = tuple(
        _address(h, default_port=DEFAULT_SENTINEL_PORT) for h in hosts.split(",") if h.strip()
    )
    if not sentinels:
        raise ValueError("a redis+sentinel:// URL needs at least one sentinel host:port")
    path = [unquote(p) for p in parts.path.split("/") if p]
    if not path or len(path) > 2:
        raise ValueError(f"a redis+sentinel:// URL's path is /<service>[/<db>], got {parts.path!r}")
    if len(path) == 2 and not path[1].isdigit():
        raise ValueError(f"the database must be a number, got {path[1]!r}")
    query = parse_qsl(parts.query, keep_blank_values=False)
    own = {k: v for k, v in query if k in ("sentinel_username", "sentinel_password")}
    rest = urlencode([(k, v) for k, v in query if k not in own])
    base = _SENTINEL_SCHEMES[scheme]
    netloc = f"{userinfo}@localhost" if userinfo else "localhost"
    db = path[1] if len(path) == 2 else "0"
    master = parse_url(urlunsplit((base, netloc, f"/{db}", rest, "")))
    for placed in ("host", "port", "connection_class"):
        master.pop(placed, None)  # the sentinels name the master; the pool picks the class
    tls = base == "rediss"
    if tls:
        master["ssl"] = True
    via: dict[str, Any] = {k[len("sentinel_") :]: v for k, v in own.items()}
    if tls:
        via.update({k: v for k, v in master.items() if k.startswith("ssl")})
    return SentinelTarget(sentinels, path[0], master, via)


def _sentinel_master(target: SentinelTarget, wait_s: float, kwargs: dict[str, Any]) -> Any:
    """The master's client: the caller's kwargs (socket timeouts, credentials, decoding),
    the URL's over them as `from_url` does; the sentinels get the socket options too."""
    merged = {**kwargs, **target.master_kwargs}
    via = {k: v for k, v in merged.items() if k.startswith("socket_")}
    via.update(target.sentinel_kwargs)
    if merged.get("ssl"):
        via.update({k: v for k, v in merged.items() if k.startswith("ssl")})
    sentinel = Sentinel(list(target.sentinels), sentinel_kwargs=via)
    client = sentinel.master_for(target.service, redis_class=FailoverRedis, **merged)
    client.failover_wait_s = wait_s
    return client


class FailoverRedis(redis.Redis):
    """The client of a master that Redis Sentinel names, waiting out its failover.

    While the master is down the sentinels still name it until `down-after-milliseconds`
    has passed and a replica is promoted; redis-py then raises `ConnectionError` (or
    `MasterNotFoundError`, one) and, on a demoted master that still answers, turns its
    `READONLY` into a `ConnectionError` after dropping the connection. A command retries
    those with jittered backoff for `failover_wait_s`, as `FailoverCluster` does (0: not
    at all, for the worker's sink, which pauses intake instead). Every retried command is
    safe to repeat: qbatch's scripts are idempotent, as on a cluster.

    The old master of a `SENTINEL FAILOVER` (or one cut off by a partition) stays a master
    for ~10 s after the sentinels promoted its replica, and redis-py keeps its connections
    to it: writes land there and are dropped when it is turned into a replica (measured
    here: every write of those seconds lost). With `min-replicas-to-write` it refuses
    them with NOREPLICAS instead, which this client, like READONLY, turns into a
    `ConnectionError` after dropping its idle connections, so the next try asks the
    sentinels for the master again (`SentinelNoReplicas`)."""

    failover_wait_s: float = DEFAULT_SENTINEL_WAIT_S
    _scripts: dict[str, str]

    def register_script(self, script: Any) -> Any:
        """redis-py's Script, its body remembered by SHA for `execute_command`."""
        registered = super().register_script(script)
        if not hasattr(self, "_scripts"):
            self._scripts = {}
        body = registered.script
        self._scripts[registered.sha] = reply_text(body)
        return registered

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        def once() -> Any:
            try:
                return super(FailoverRedis, self).execute_command(*args, **kwargs)
            except redis.exceptions.NoScriptError:
                # A promoted replica has an empty script cache (SCRIPT LOAD is not
                # replicated). redis-py's Script reloads once, but mid-failover its
                # SCRIPT LOAD and the EVALSHA after it can reach two different masters
                # (CI saw 'No matching script' fail `bulk run`): load the body here, on
                # whatever master this attempt reached, and let the loop try again.
                body = self._script_of(args)
                if body is None:
                    raise
                super(FailoverRedis, self).execute_command("SCRIPT", "LOAD", body)
                raise SentinelNoReplicas("NOSCRIPT after a failover: script loaded") from None
            except redis.ResponseError as exc:
                if not str(exc).startswith("NOREPLICAS"):
                    raise
                self.connection_pool.disconnect(inuse_connections=False)
                raise SentinelNoReplicas(str(exc)) from exc

        return waiting_out_failover(self, once)

    def _script_of(self, args: tuple[Any, ...]) -> str | None:
        if len(args) < 2 or str(args[0]).upper() != "EVALSHA":
            return None
        sha = args[1].decode() if isinstance(args[1], bytes) else str(args[1])
        return getattr(self, "_scripts", {}).get(sha)

    def close(self) -> None:
        super().close()
        pool = self.connection_pool
        if isinstance(pool, SentinelConnectionPool):  # the sentinels' own connections
            for node in pool.sentinel_manager.sentinels:
                node.close()


class SentinelNoReplicas(redis.ConnectionError):
    """NOREPLICAS from the master a sentinel client is connected to: perhaps no longer the
    master the sentinels name; an outage either way, never a refusal of the command. Also
    raised (to be retried) after a script missing on a promoted master was loaded."""


_FAILOVER_ERRORS = (*RedisCluster.ERRORS_ALLOW_RETRY, redis.exceptions.ReadOnlyError)


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
        return waiting_out_failover(
            self, lambda: super(FailoverCluster, self).execute_command(*args, **kwargs)
        )


def waiting_out_failover(client: Any, fn: Callable[[], T], at_least_s: float = 0.0) -> T:
    """`fn()`, retried on the errors a failover raises until `client.failover_wait_s` has
    passed (redis-py's own jittered backoff: the bare client install has no tenacity).
    `at_least_s` lengthens that wait for a client that waits at all (never for the
    worker's sink, whose client waits 0 and pauses instead)."""
    wait_s = getattr(client, "failover_wait_s", 0.0)
    if wait_s <= 0:
        return fn()
    wait_s = max(wait_s, at_least_s)
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


def address_remap(mapping: Mapping[str, str]) -> Callable[[tuple[str, int]], tuple[str, int]]:
    """`QBATCH_REDIS_ADDRESS_MAP` as redis-py's `address_remap`: each "host:port" a node
    announces (in CLUSTER SLOTS) to the "host:port" this client reaches it at, for nodes
    behind NAT, a port-forward or a proxy; other addresses unchanged. Raises ValueError on
    an entry that is not host:port."""
    table = {_address(k): _address(v) for k, v in mapping.items()}

    def remap(address: tuple[str, int]) -> tuple[str, int]:
        key = (address[0], int(address[1]))
        return table.get(key, key)

    return remap


def _mapped(url: str, kwargs: dict[str, Any]) -> str:
    """The URL with its host(s) mapped by `kwargs.pop("address_map")`; on a cluster URL
    every node the client learns goes through the map too. redis-py maps the addresses
    of CLUSTER SLOTS but not those of a MOVED reply (redis/redis-py#3382), so a client
    that followed one would reach the node directly: with a map, a MOVED reloads the slot
    map instead (`reinitialize_steps=1`). An ASK (only while slots migrate) is not mapped.
    Sentinel URLs are refused: the sentinels name the master, not the map."""
    mapping = kwargs.pop("address_map", None)
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if not mapping or not parts.netloc:
        return url
    if scheme in _SENTINEL_SCHEMES:
        raise ValueError("a Redis address map is not supported with a redis+sentinel:// URL")
    remap = address_remap(mapping)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    seeds = [h.strip() for h in hosts.split(",") if h.strip()]
    if scheme in _CLUSTER_SCHEMES:
        kwargs["address_remap"] = remap
        kwargs.setdefault("reinitialize_steps", 1)
    mapped = []
    for seed in seeds:
        host, port = remap(_address(seed, default_port=6379))
        mapped.append(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    return urlunsplit(parts._replace(netloc=f"{userinfo}{at}{','.join(mapped)}"))


_HOST = re.compile(r"[A-Za-z0-9._-]+|\[[0-9A-Fa-f:.%]+\]|[0-9A-Fa-f:.%]*:[0-9A-Fa-f:.%]*")
"""A host name, an IPv4 address or an IPv6 one (bracketed or bare): nothing that could
change a URL's user info, path, query or list of seeds when pasted into it."""


def _address(text: str, default_port: int | None = None) -> tuple[str, int]:
    host, sep, port = text.strip().rpartition(":")
    if default_port is not None and (not sep or "]" in port or host.endswith(":")):
        host, port = text.strip(), str(default_port)  # no port (or a bare IPv6 address)
    if not host or not port.isdigit() or not _HOST.fullmatch(host):
        raise ValueError(f"not a host:port address: {text!r}")
    return host.strip("[]"), int(port)


def _node(seed: str) -> ClusterNode:
    host, _, port = seed.rpartition(":")
    return ClusterNode(host.strip("[]") or seed, int(port) if port else 6379)


def reply_text(raw: Any) -> str:
    """A Redis reply as text, whether the client was built with `decode_responses` (str)
    or without it (bytes): qbatch's clients are built both ways."""
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def is_cluster(client: Any) -> bool:
    return isinstance(client, RedisCluster)


def mget(client: Any, keys: Sequence[str]) -> list[Any]:
    """`MGET`, split by slot on a cluster (not atomic there; every caller only reads)."""
    if not keys:
        return []
    if is_cluster(client):
        return waiting_out_failover(client, lambda: list(client.mget_nonatomic(list(keys))))
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

    return waiting_out_failover(client, run)  # each script is idempotent: a whole retry is safe
