"""Waiting for one result on `redis.asyncio`: a sync request of `qbatch serve` waits on
the event loop and holds a pooled connection while its BLPOP blocks, never a thread.

Why: a request waits up to its client's timeout (an hour at most). On threads, the
server's ceiling was its pool (256 slots, `--max-sync-inflight`); on the event loop it
is Redis's connection limit (one connection per waiting request, from a pool of
`max_waiting`). The wait reads the result key, then blocks on the request's wake-up
list (the worker pushes a token after writing the result) for at most `poll_s`, and
reads again; a Redis error (a failover) is retried until the deadline.
"""

from __future__ import annotations

import logging
from typing import Any

import anyio
import redis

from schemas.keys import RedisKeys
from schemas.redis_async import connect_async

log = logging.getLogger("qbatch.serve")

RETRY_S = 0.2


class ResultWaiter:
    """Waits for results under `keys` on an async client (`connect_async`)."""

    def __init__(self, client: Any, keys: RedisKeys, poll_s: float = 5.0) -> None:
        self.redis = client
        self.keys = keys
        self.poll_s = poll_s

    @classmethod
    def connect(cls, url: str, keys: RedisKeys, max_waiting: int, **kwargs: Any) -> ResultWaiter:
        """A waiter with a pool of `max_waiting` connections (+ a few for the reads)."""
        return cls(connect_async(url, max_connections=max_waiting + 8, **kwargs), keys)

    async def wait_raw(self, request_id: str, timeout: float) -> bytes | None:
        """The result's JSON as stored, or None when `timeout` passes first. A Redis
        error past the deadline is raised."""
        deadline = anyio.current_time() + timeout
        while True:
            try:
                raw = await self.redis.get(self.keys.result(request_id))
                if raw is not None:
                    return raw.encode() if isinstance(raw, str) else bytes(raw)
                left = deadline - anyio.current_time()
                if left <= 0:
                    return None
                await self.redis.blpop(
                    [self.keys.done(request_id)], timeout=max(0.01, min(self.poll_s, left))
                )
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                if anyio.current_time() >= deadline:
                    raise
                log.warning("serve: Redis unreachable while waiting for %s; retrying", request_id)
                await anyio.sleep(RETRY_S)

    async def aclose(self) -> None:
        await self.redis.aclose()


__all__ = ["ResultWaiter"]
