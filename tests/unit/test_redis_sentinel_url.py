"""`redis+sentinel://` URLs (schemas.redis_conn): what they name, the client they open
(built without a socket: redis-py asks the sentinels only on the first command), and
how a failover's errors are taken (waited out by producer-side clients, an outage for
the worker's sink, never a refusal of a result)."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import redis
from redis.sentinel import MasterNotFoundError, SentinelConnectionPool

from schemas.redis_conn import (
    DEFAULT_SENTINEL_PORT,
    DEFAULT_SENTINEL_WAIT_S,
    FailoverRedis,
    SentinelNoReplicas,
    connect,
    is_cluster_url,
    is_sentinel_url,
    parse_sentinel_url,
    waiting_out_failover,
)
from schemas.settings import ConnectionSettings
from worker.sinks.base import SinkRefused, SinkUnavailable
from worker.sinks.redis_sink import _redacted, call

URL = "redis+sentinel://127.0.0.1:26479,127.0.0.1:26480,[::1]:26481/qbatch"


def test_the_url_names_the_sentinels_and_the_service() -> None:
    target = parse_sentinel_url(URL)
    assert target.sentinels == (("127.0.0.1", 26479), ("127.0.0.1", 26480), ("::1", 26481))
    assert target.service == "qbatch"
    assert target.master_kwargs == {"db": 0}
    assert target.sentinel_kwargs == {}
    assert is_sentinel_url(URL) and not is_cluster_url(URL)
    assert not is_sentinel_url("redis://127.0.0.1:6379/0")


def test_database_credentials_and_options() -> None:
    target = parse_sentinel_url(
        "redis+sentinel://app:s%40cret@s1,s2:5000/my-master/3"
        "?socket_timeout=2.5&sentinel_password=sp&sentinel_username=su&client_name=qb"
    )
    assert target.sentinels == (("s1", DEFAULT_SENTINEL_PORT), ("s2", 5000))
    assert target.service == "my-master"
    assert target.master_kwargs == {
        "db": 3,
        "username": "app",
        "password": "s@cret",
        "socket_timeout": 2.5,
        "client_name": "qb",
    }
    # the master's credentials are not the sentinels'; theirs come from the query
    assert target.sentinel_kwargs == {"username": "su", "password": "sp"}


def test_tls_reaches_the_master_and_the_sentinels() -> None:
    target = parse_sentinel_url("rediss+sentinel://s1:26379/svc?ssl_cert_reqs=none")
    assert target.master_kwargs["ssl"] is True
    assert target.master_kwargs["ssl_cert_reqs"] == "none"
    assert target.sentinel_kwargs == {"ssl": True, "ssl_cert_reqs": "none"}


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("redis+sentinel:///svc", "at least one sentinel"),
        ("redis+sentinel://s1:26379", "path is /<service>"),
        ("redis+sentinel://s1:26379/", "path is /<service>"),
        ("redis+sentinel://s1:26379/svc/0/extra", "path is /<service>"),
        ("redis+sentinel://s1:26379/svc/zero", "database must be a number"),
        ("redis+sentinel://s1:port/svc", "not a host:port address"),
        ("redis://s1:6379/0", "not a redis\\+sentinel"),
    ],
)
def test_malformed_urls_are_refused(url: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_sentinel_url(url)


def test_connect_builds_the_masters_client_with_the_callers_kwargs() -> None:
    client = connect(
        "redis+sentinel://:pw@127.0.0.1:26479,127.0.0.1:26480/qbatch/2",
        failover_wait_s=0,
        socket_timeout=5,
        socket_connect_timeout=5,
        health_check_interval=15,
        password="from-settings",  # the URL's wins, as with redis.Redis.from_url
        decode_responses=True,
    )
    try:
        assert isinstance(client, FailoverRedis)
        assert client.failover_wait_s == 0
        pool = client.connection_pool
        assert isinstance(pool, SentinelConnectionPool)
        assert pool.service_name == "qbatch" and pool.is_master
        kw = pool.connection_kwargs
        assert (kw["db"], kw["password"], kw["socket_timeout"]) == (2, "pw", 5)
        assert (kw["health_check_interval"], kw["decode_responses"]) == (15, True)
        nodes = pool.sentinel_manager.sentinels
        sentinel_kws = [n.connection_pool.connection_kwargs for n in nodes]
        assert [(kw["host"], kw["port"]) for kw in sentinel_kws] == [
            ("127.0.0.1", 26479),
            ("127.0.0.1", 26480),
        ]
        sentinel_kw = sentinel_kws[0]
        assert (sentinel_kw["socket_timeout"], sentinel_kw["socket_connect_timeout"]) == (5, 5)
        assert sentinel_kw.get("password") is None  # the master's password stays its own
    finally:
        client.close()
    assert connect(URL).failover_wait_s == DEFAULT_SENTINEL_WAIT_S


def test_a_sentinel_url_keeps_the_standalone_key_layout() -> None:
    settings = ConnectionSettings(redis_url=URL)
    assert settings.keys.cluster is False
    assert settings.keys.result("r.1") == "qbatch:result:r.1"


class Flaky:
    """`failover_wait_s` and a command that fails `failures` times."""

    def __init__(self, failures: int, exc: Exception, wait_s: float = 10.0) -> None:
        self.failover_wait_s = wait_s
        self.failures = failures
        self.exc = exc
        self.calls = 0

    def run(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.exc
        return "OK"


@pytest.mark.parametrize(
    "exc",
    [
        MasterNotFoundError("No master found for 'qbatch'"),
        redis.ConnectionError("The previous master is now a slave"),
        redis.exceptions.ReadOnlyError("You can't write against a read only replica."),
        redis.TimeoutError("Timeout reading from socket"),
    ],
)
def test_a_producer_side_client_waits_out_the_failover(exc: Exception) -> None:
    flaky = Flaky(2, exc)
    assert waiting_out_failover(flaky, flaky.run) == "OK" and flaky.calls == 3
    worker_side = Flaky(1, exc, wait_s=0)  # the sink's client: no waiting, it pauses
    with pytest.raises(type(exc)):
        waiting_out_failover(worker_side, worker_side.run)


def test_replicas_behind_waits_longer_on_the_producer_side_only() -> None:
    """`at_least_s` (PRODUCER_ACK_WAIT_S for writes waiting on replicas) lengthens a
    producer-side client's budget past its own failover_wait_s; the sink's stays 0."""
    from schemas.replica_ack import ReplicasBehind

    behind = ReplicasBehind("0 of 1 Redis replicas acknowledged the results within 50 ms")
    short = Flaky(50, behind, wait_s=0.05)  # 50 jittered backoffs far exceed 0.05 s
    with pytest.raises(ReplicasBehind):
        waiting_out_failover(short, short.run)
    assert short.calls < 50
    longer = Flaky(3, behind, wait_s=0.05)
    assert waiting_out_failover(longer, longer.run, at_least_s=30) == "OK"
    assert longer.calls == 4
    sink = Flaky(1, behind, wait_s=0)
    with pytest.raises(ReplicasBehind):
        waiting_out_failover(sink, sink.run, at_least_s=30)


def test_a_refusal_is_not_waited_for() -> None:
    flaky = Flaky(1, redis.ResponseError("WRONGTYPE Operation against a key"))
    with pytest.raises(redis.ResponseError):
        waiting_out_failover(flaky, flaky.run)
    assert flaky.calls == 1


@pytest.mark.parametrize(
    "exc",
    [
        MasterNotFoundError("No master found for 'qbatch'"),
        redis.ConnectionError("The previous master is now a slave"),
        redis.exceptions.ReadOnlyError("You can't write against a read only replica."),
        redis.ResponseError("NOREPLICAS Not enough good replicas to write."),
    ],
)
def test_a_sentinel_failover_is_an_outage_for_the_sink(exc: Exception) -> None:
    def fail() -> Any:
        raise exc

    with pytest.raises(SinkUnavailable):
        call(fail)


def test_a_wrong_type_behind_the_sentinels_is_still_a_refusal() -> None:
    def fail() -> Any:
        raise redis.ResponseError("WRONGTYPE Operation against a key holding the wrong kind")

    with pytest.raises(SinkRefused):
        call(fail)


def test_noreplicas_sends_the_client_back_to_the_sentinels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The old master of a failover answers NOREPLICAS (min-replicas-to-write) while the
    sentinels already name another: the client drops its idle connections, so the next
    try asks them again, and raises a ConnectionError (an outage for the sink)."""
    client = connect(URL, failover_wait_s=0)
    dropped: list[bool] = []

    def refuse(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise redis.ResponseError("NOREPLICAS Not enough good replicas to write.")

    monkeypatch.setattr(redis.Redis, "execute_command", refuse)
    monkeypatch.setattr(
        client.connection_pool,
        "disconnect",
        lambda inuse_connections=True: dropped.append(inuse_connections),
    )
    with pytest.raises(SentinelNoReplicas) as caught:
        client.set("k", "v")
    assert isinstance(caught.value, redis.ConnectionError)
    assert dropped == [False]  # idle ones only: other threads' commands finish
    with pytest.raises(SinkUnavailable):
        call(lambda: client.set("k", "v"))


def test_a_script_missing_on_the_promoted_master_is_loaded_and_retried(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A promoted replica never saw SCRIPT LOAD. Mid-failover redis-py's own reload (SCRIPT
    LOAD, then EVALSHA) can reach two masters, and CI saw `bulk run` fail with 'No matching
    script': the client loads the body on the master each attempt reached and retries."""
    client = connect(URL, failover_wait_s=5)
    scripts: dict[str, set[str]] = {"B": set(), "C": set()}
    route = iter(["B", "C"])  # then B, the master the sentinels settle on, for good
    sent: list[tuple[str, str]] = []

    def server(self: Any, *args: Any, **kwargs: Any) -> Any:
        node = next(route, "B")
        sent.append((node, str(args[0])))
        if args[0] == "SCRIPT" and args[1] == "LOAD":
            scripts[node].add(hashlib.sha1(args[2].encode()).hexdigest())
            return "sha"
        if args[0] == "EVALSHA":
            if args[1] not in scripts[node]:
                raise redis.exceptions.NoScriptError("No matching script. Please use EVAL.")
            return 7
        raise AssertionError(args)

    script = client.register_script("return 7")
    monkeypatch.setattr(redis.Redis, "execute_command", server)
    assert script(keys=["k"]) == 7
    # EVALSHA on B (none), the reload lands on C, EVALSHA on B again: redis-py alone
    # would raise here; the client loads on B and retries
    assert sent[:3] == [("B", "EVALSHA"), ("C", "SCRIPT"), ("B", "EVALSHA")]
    assert script.sha in scripts["B"] and sent[-1] == ("B", "EVALSHA")

    # the worker's client (no waiting): the load happens, the attempt is an outage
    worker_side = connect(URL, failover_wait_s=0)
    worker_script = worker_side.register_script("return 8")
    with pytest.raises(SinkUnavailable):
        call(lambda: worker_side.execute_command("EVALSHA", worker_script.sha, 0))
    assert worker_script.sha in scripts["B"]


def test_a_missing_script_is_an_outage_for_the_sink() -> None:
    def fail() -> Any:
        raise redis.exceptions.NoScriptError("No matching script. Please use EVAL.")

    with pytest.raises(SinkUnavailable):
        call(fail)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (
            "redis+sentinel://:pw@s1:26379,s2:26379/qbatch?sentinel_password=spw",
            "redis+sentinel://:***@s1:26379,s2:26379/qbatch?sentinel_password=***",
        ),
        (
            "redis+sentinel://app:pw@s1/qbatch/2?socket_timeout=5&Password=x",
            "redis+sentinel://app:***@s1/qbatch/2?socket_timeout=5&Password=***",
        ),
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    ],
)
def test_logs_never_show_a_password_of_the_url(url: str, shown: str) -> None:
    """The sink's `where` (in every redis_unavailable line a failover logs) hides the
    master's password and the sentinels' own, given in the query."""
    assert _redacted(url) == shown
