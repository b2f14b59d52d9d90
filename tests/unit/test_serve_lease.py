"""One `qbatch serve` per Redis prefix (`producer.serve.lease`): taking, waiting for,
renewing and losing the lease, and every kind of state change refusing to run without
it (file records, batch records). fakeredis, an injected clock; the keeper's thread is
synchronised by events."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from producer.serve.batches import BatchStore
from producer.serve.lease import Lease, LeaseHeld, LeaseKeeper, LeaseLost
from schemas.keys import RedisKeys
from tests.storage_fixtures import fake_redis
from tests.unit.test_serve_batches import _record


class Ticks:
    """A clock that moves only when `sleep` is called."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_the_first_server_takes_the_lease_and_a_second_is_refused_after_waiting() -> None:
    redis, keys = fake_redis(), RedisKeys("p")
    first = Lease.acquire(redis, keys, ttl_s=30, wait_s=0)
    assert first.held() and first.epoch >= 1
    ticks = Ticks()
    with pytest.raises(LeaseHeld, match="one server per prefix") as caught:
        Lease.acquire(redis, keys, ttl_s=30, wait_s=5, clock=ticks, sleep=ticks.sleep)
    assert first.token in str(caught.value)
    assert ticks.now >= 5 and ticks.slept  # it waited, in steps
    other = Lease.acquire(redis, RedisKeys("q"), wait_s=0)  # another prefix: its own lease
    assert other.held()


def test_a_successor_takes_over_once_the_holder_releases() -> None:
    redis, keys = fake_redis(), RedisKeys("p")
    first = Lease.acquire(redis, keys, wait_s=0)
    ticks = Ticks()

    def release_on_third_wait(seconds: float) -> None:
        ticks.sleep(seconds)
        if len(ticks.slept) == 3:
            first.release()  # the old server stopped (a rolling deploy)

    second = Lease.acquire(redis, keys, wait_s=60, clock=ticks, sleep=release_on_third_wait)
    assert second.held() and not first.held()
    assert second.epoch > first.epoch
    assert not first.renew()  # the old one can never take it back while it is held
    first.release()  # and its release does not free the new holder's lease
    assert second.held()


def test_a_lease_that_expired_unclaimed_is_taken_back_by_renewal() -> None:
    redis, keys = fake_redis(), RedisKeys("p")
    lease = Lease.acquire(redis, keys, wait_s=0)
    redis.delete(keys.serve_lease())  # its TTL ran out while the server was paused
    assert lease.renew() and lease.held()


def test_writes_of_a_server_that_lost_its_lease_fail_and_change_nothing() -> None:
    redis, keys = fake_redis(), RedisKeys("p")
    old = Lease.acquire(redis, keys, wait_s=0)
    batches = BatchStore(redis, keys, old)
    first, second = _record(), _record()
    assert batches.create(first, max_active=5) is None
    redis.delete(keys.serve_lease())
    new = Lease.acquire(redis, keys, wait_s=0)  # another server took the prefix
    for write in (
        lambda: batches.create(second, max_active=5),
        lambda: batches.update(first.id, status="failed"),
        lambda: batches.transition(first.id, ("in_progress",), status="failed"),
        lambda: batches.finish(first),
    ):
        with pytest.raises(LeaseLost):
            write()
    stored = batches.load(first.id)
    assert stored is not None and stored.status == "in_progress"
    assert batches.load(second.id) is None and batches.active_ids() == [first.id]
    assert redis.ttl(keys.serve_batch(first.id)) == -1  # finish's EXPIRE did not land
    assert BatchStore(redis, keys, new).transition(first.id, ("in_progress",), status="failed")
    loaded = batches.load(first.id)
    assert loaded is not None and loaded.status == "failed"


def test_the_keeper_renews_and_reports_a_lost_lease_once() -> None:
    redis, keys = fake_redis(), RedisKeys("p")
    lease = Lease.acquire(redis, keys, ttl_s=0.06, wait_s=0)
    renewed = threading.Event()
    real_renew = lease.renew

    def renew() -> bool:
        ok = real_renew()
        renewed.set()
        return ok

    lease.renew = renew  # type: ignore[method-assign]
    lost: list[Any] = []
    gone = threading.Event()
    keeper = LeaseKeeper(lease, on_lost=lambda: (lost.append(1), gone.set()))
    keeper.start()
    assert renewed.wait(5) and not lost
    redis.set(keys.serve_lease(), "99:someone-else")
    assert gone.wait(5) and lost == [1]
    keeper.stop()
    assert redis.get(keys.serve_lease()) == b"99:someone-else"  # not released: not its own


def test_stopping_the_keeper_releases_the_lease() -> None:
    redis, keys = fake_redis(), RedisKeys("p")
    lease = Lease.acquire(redis, keys, ttl_s=30, wait_s=0)
    keeper = LeaseKeeper(lease, on_lost=lambda: None)
    keeper.start()
    keeper.stop()
    assert redis.get(keys.serve_lease()) is None
    assert Lease.acquire(redis, keys, wait_s=0).held()  # a successor need not wait
