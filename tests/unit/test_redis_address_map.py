"""`QBATCH_REDIS_ADDRESS_MAP` (schemas.settings, schemas.redis_conn): the pure mapping,
how it rewrites a URL's hosts, what it hands redis-py for a cluster, and the setting
read from the environment. No sockets: a standalone client connects lazily, and the
cluster's keyword arguments are checked before any client is built. A cluster reached
through proxies is tests/integration/test_cluster_through_proxies.py."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from schemas.redis_conn import _mapped, address_remap, connect
from schemas.settings import ConnectionSettings

MAP = {"10.0.0.1:6379": "127.0.0.1:27000", "10.0.0.2:6379": "127.0.0.1:27001"}


def test_remap_maps_listed_addresses_and_leaves_others() -> None:
    remap = address_remap(MAP)
    assert remap(("10.0.0.1", 6379)) == ("127.0.0.1", 27000)
    assert remap(("10.0.0.2", 6379)) == ("127.0.0.1", 27001)
    assert remap(("10.0.0.1", 6380)) == ("10.0.0.1", 6380)  # the port is part of the key
    assert remap(("10.0.0.9", 6379)) == ("10.0.0.9", 6379)
    assert address_remap({})(("h", 1)) == ("h", 1)


def test_remap_takes_ipv6_and_hostnames() -> None:
    remap = address_remap({"[fd00::1]:6379": "[::1]:7000", "redis-0.redis:6379": "lb:7001"})
    assert remap(("fd00::1", 6379)) == ("::1", 7000)
    assert remap(("redis-0.redis", 6379)) == ("lb", 7001)


@pytest.mark.parametrize(
    "bad",
    [
        {"10.0.0.1": "127.0.0.1:1"},
        {"10.0.0.1:1": "127.0.0.1"},
        {"h:x": "h:1"},
        {":1": "h:1"},
        # hosts that would rewrite the URL they are pasted into: path/query, user info,
        # another seed
        {"10.0.0.1:1": "h/5?db=3:6379"},
        {"10.0.0.1:1": "user:pw@h:6379"},
        {"10.0.0.1:1": "a,b:6379"},
    ],
)
def test_remap_refuses_an_entry_that_is_not_host_port(bad: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="host:port"):
        address_remap(bad)


def test_a_cluster_url_maps_its_seeds_and_hands_redis_py_the_remap() -> None:
    kwargs: dict[str, Any] = {"address_map": MAP, "socket_timeout": 5}
    url = _mapped("redis+cluster://u:p@10.0.0.1:6379,10.0.0.2:6379,10.0.0.3:6379/0", kwargs)
    assert url == "redis+cluster://u:p@127.0.0.1:27000,127.0.0.1:27001,10.0.0.3:6379/0"
    assert "address_map" not in kwargs
    assert kwargs["address_remap"](("10.0.0.2", 6379)) == ("127.0.0.1", 27001)
    # redis-py does not map a MOVED reply's address: reload the slot map on each instead
    assert kwargs["reinitialize_steps"] == 1
    assert kwargs["socket_timeout"] == 5


def test_the_caller_may_still_choose_reinitialize_steps() -> None:
    kwargs: dict[str, Any] = {"address_map": MAP, "reinitialize_steps": 3}
    _mapped("redis+cluster://10.0.0.1:6379", kwargs)
    assert kwargs["reinitialize_steps"] == 3


def test_a_standalone_url_is_rewritten_and_gets_no_cluster_arguments() -> None:
    kwargs: dict[str, Any] = {"address_map": MAP}
    assert _mapped("rediss://:pw@10.0.0.1:6379/2?x=1", kwargs) == (
        "rediss://:pw@127.0.0.1:27000/2?x=1"
    )
    assert kwargs == {}
    assert _mapped("redis://10.0.0.1/0", {"address_map": MAP}) == "redis://127.0.0.1:27000/0"
    assert _mapped("redis://10.0.0.7:6379/0", {"address_map": MAP}) == "redis://10.0.0.7:6379/0"
    assert _mapped("unix:///tmp/redis.sock", {"address_map": MAP}) == "unix:///tmp/redis.sock"
    client = connect("redis://10.0.0.2:6379/1", address_map=MAP)  # lazy: no connection yet
    try:
        pool = client.connection_pool.connection_kwargs
        assert (pool["host"], pool["port"], pool["db"]) == ("127.0.0.1", 27001, 1)
    finally:
        client.close()


def test_no_map_changes_nothing() -> None:
    kwargs: dict[str, Any] = {"address_map": {}}
    assert _mapped("redis+cluster://10.0.0.1:6379", kwargs) == "redis+cluster://10.0.0.1:6379"
    assert kwargs == {}


def test_a_sentinel_url_refuses_a_map() -> None:
    with pytest.raises(ValueError, match="sentinel"):
        _mapped("redis+sentinel://10.0.0.1:26379/mymaster", {"address_map": MAP})


def test_the_setting_reads_json_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QBATCH_REDIS_ADDRESS_MAP", '{"10.0.0.1:6379": "127.0.0.1:27000"}')
    settings = ConnectionSettings()
    assert settings.redis_address_map == {"10.0.0.1:6379": "127.0.0.1:27000"}
    assert settings.redis_kwargs()["address_map"] == {"10.0.0.1:6379": "127.0.0.1:27000"}
    monkeypatch.delenv("QBATCH_REDIS_ADDRESS_MAP")
    assert "address_map" not in ConnectionSettings().redis_kwargs()


def test_the_setting_refuses_a_bad_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QBATCH_REDIS_ADDRESS_MAP", '{"10.0.0.1": "127.0.0.1:27000"}')
    with pytest.raises(ValidationError, match="host:port"):
        ConnectionSettings()


def test_the_worker_reads_it_too(monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.cli import load_settings

    monkeypatch.setenv("QBATCH_REDIS_ADDRESS_MAP", '{"10.0.0.1:6379": "127.0.0.1:27000"}')
    settings = load_settings([])
    assert settings.redis_address_map == {"10.0.0.1:6379": "127.0.0.1:27000"}
    assert settings.redis_kwargs()["address_map"] == {"10.0.0.1:6379": "127.0.0.1:27000"}
