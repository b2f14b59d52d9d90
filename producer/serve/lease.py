"""One `qbatch serve` per Redis prefix, enforced: a lease with an epoch.

Why: the batch runner steps every active batch, and the file store's sweeps remove
files; two servers on one prefix would step the same batch twice (two output files,
two bulk jobs) and race each other's state changes. Documenting "one server per
prefix" did not stop a rolling deploy from running two for a minute.

The lease is one Redis key holding a **token** `{epoch}:{holder}` with a TTL. A server
takes it at start (`Lease.acquire`: `SET NX`, the epoch from `INCR`, so each taking is
numbered), renews it every third of its TTL (`LeaseKeeper`), and gives it back when it
stops. **Every state change checks it**: the file store's scripts compare the key to
their token first, and the batch store watches it in its transactions. A server paused
past its TTL (a GC pause, SIGSTOP, a network split) whose lease another server took
then fails its next change with `LeaseLost` instead of overwriting the newer server's
state, and stops. A second server started beside a live one waits up to `wait_s` for
the lease (a rolling deploy: the old one stops and releases it), then refuses to start.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from schemas.keys import RedisKeys

log = logging.getLogger("qbatch.serve")

LEASE_LOST = "QBATCH_LEASE_LOST"
"""The error a fenced Lua script answers when the lease is not its server's."""

FENCE_LUA = f"""
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return redis.error_reply('{LEASE_LOST} another qbatch serve holds this prefix')
end
"""
"""The first lines of every fenced script: KEYS[1] the lease key, ARGV[1] the token."""

_RENEW = """
local held = redis.call('GET', KEYS[1])
if held == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
if held == false then
  -- expired while this server was paused, and nobody took it since: nothing was
  -- changed by another holder, so taking it back is safe
  return redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) and 1 or 0
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class LeaseLost(RuntimeError):
    """Another server holds this prefix's lease: this one may change nothing more."""


class LeaseHeld(RuntimeError):
    """The lease stayed another server's for as long as this one would wait."""


def lease_lost(exc: BaseException) -> bool:
    """Whether a Redis error is a fenced script's answer to a lost lease."""
    return isinstance(exc, redis.exceptions.ResponseError) and LEASE_LOST in str(exc)


@dataclass
class Lease:
    """This server's hold on its prefix (`acquire` it; see the module docstring)."""

    redis: Any
    keys: RedisKeys
    token: str
    ttl_s: float

    @property
    def key(self) -> str:
        return self.keys.serve_lease()

    @property
    def epoch(self) -> int:
        return int(self.token.split(":", 1)[0])

    @classmethod
    def acquire(
        cls,
        redis_client: Any,
        keys: RedisKeys,
        *,
        ttl_s: float = 30.0,
        wait_s: float = 45.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> Lease:
        """Take the lease, waiting up to `wait_s` while another server holds it
        (LeaseHeld after that, naming the holder's token)."""
        deadline = clock() + wait_s
        holder = uuid.uuid4().hex[:16]
        while True:
            epoch = int(redis_client.incr(keys.serve_lease_epoch()))
            token = f"{epoch}:{holder}"
            if redis_client.set(keys.serve_lease(), token, nx=True, px=int(ttl_s * 1000)):
                log.info("serve: lease %s taken on %s", token, keys.serve_lease())
                return cls(redis_client, keys, token, ttl_s)
            held = redis_client.get(keys.serve_lease())
            if clock() >= deadline:
                text = held.decode() if isinstance(held, bytes) else held
                raise LeaseHeld(
                    f"another qbatch serve holds this Redis prefix (lease {text!r} on "
                    f"{keys.serve_lease()}); one server per prefix. Stop it, or give this "
                    "one its own prefix (QBATCH_REDIS_PREFIX)"
                )
            sleep(min(1.0, ttl_s / 10))

    def renew(self) -> bool:
        """Extend the lease; False when another server holds it now."""
        return bool(self.redis.eval(_RENEW, 1, self.key, self.token, int(self.ttl_s * 1000)))

    def release(self) -> None:
        """Give the lease back (only if still this server's), so a successor need not
        wait out the TTL."""
        self.redis.eval(_RELEASE, 1, self.key, self.token)

    def held(self) -> bool:
        raw = self.redis.get(self.key)
        return (raw.decode() if isinstance(raw, bytes) else raw) == self.token

    def check_watched(self, pipe: Any) -> None:
        """Inside a WATCH transaction that watches `key`: LeaseLost unless the lease is
        this server's (the EXEC then fails if it changes before the writes land)."""
        raw = pipe.get(self.key)
        if (raw.decode() if isinstance(raw, bytes) else raw) != self.token:
            pipe.unwatch()
            raise LeaseLost(f"the lease on {self.key} is no longer {self.token}")


class LeaseKeeper:
    """Renews a lease every third of its TTL on a thread; calls `on_lost` once when the
    lease is found to be another server's (the server then stops). A renewal that
    fails on a Redis error is retried on the next tick: the lease outlives two."""

    def __init__(self, lease: Lease, on_lost: Callable[[], None]) -> None:
        self.lease = lease
        self.on_lost = on_lost
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        while not self._stop.wait(self.lease.ttl_s / 3):
            try:
                if self.lease.renew():
                    continue
            except redis.exceptions.RedisError:
                log.warning("serve: cannot renew the lease; trying again", exc_info=True)
                continue
            log.error("serve: lease %s lost to another server; stopping", self.lease.token)
            self.on_lost()
            return

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="qbatch-serve-lease", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop renewing and give the lease back."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            self.lease.release()
        except redis.exceptions.RedisError:
            log.warning("serve: cannot release the lease (it expires by itself)", exc_info=True)


__all__ = [
    "FENCE_LUA",
    "LEASE_LOST",
    "Lease",
    "LeaseHeld",
    "LeaseKeeper",
    "LeaseLost",
    "lease_lost",
]
