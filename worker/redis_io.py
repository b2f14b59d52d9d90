"""The Redis side of the worker: admission look-ups and the once-only reply write.

Results are written through `schemas.replies.ResultWriter`: one Lua call per chunk,
in which each request's result key, wake-up list and job counters and stream change
together or not at all, and only the first write of a request_id counts, so a
redelivered request that raced its twin cannot count twice in its job.

All keys of one request are assumed to live on one Redis node (no Cluster
hash tags are used); see deploy/README.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import redis

from schemas import RedisKeys, ResultEnvelope
from schemas.replies import ResultWriter

EXISTS_EACH_LUA = """
-- One 0/1 per key: plain EXISTS with many keys only returns a count.
local out = {}
for i, key in ipairs(KEYS) do out[i] = redis.call('EXISTS', key) end
return out
"""


@dataclass(frozen=True, slots=True)
class Admission:
    """What Redis says about a batch before it runs."""

    already_answered: frozenset[str]
    cancelled_jobs: frozenset[str]


class RedisReplies:
    """Thin adapter: one round trip per call; errors propagate to the caller's retry loop."""

    def __init__(self, client: redis.Redis, keys: RedisKeys) -> None:
        self._client = client
        self._keys = keys
        self._writer = ResultWriter(client, keys)
        self._exists_script = client.register_script(EXISTS_EACH_LUA)

    @classmethod
    def from_url(cls, url: str, keys: RedisKeys, **kwargs: object) -> RedisReplies:
        client = redis.Redis.from_url(
            url,
            socket_timeout=5,
            socket_connect_timeout=5,
            health_check_interval=15,
            **kwargs,
        )
        return cls(client, keys)

    def ping(self) -> bool:
        return bool(self._client.ping())

    def admission(self, request_ids: Sequence[str], job_ids: Iterable[str]) -> Admission:
        """One round trip per micro-batch, whatever its size."""
        jobs = sorted(set(job_ids))
        keys = [self._keys.result(rid) for rid in request_ids]
        keys += [self._keys.job_cancel(job) for job in jobs]
        if not keys:
            return Admission(frozenset(), frozenset())
        hits = self._exists_script(keys=keys)
        answered = frozenset(rid for rid, hit in zip(request_ids, hits, strict=False) if hit)
        cancelled = frozenset(
            job for job, hit in zip(jobs, hits[len(request_ids) :], strict=True) if hit
        )
        return Admission(answered, cancelled)

    def write(self, results: Sequence[tuple[ResultEnvelope, int]], now_ms: int) -> list[bool]:
        """Write (result, ttl_s) pairs once each; True where this call wrote it."""
        return self._writer.write(results, now_ms)

    def close(self) -> None:
        self._client.close()


__all__ = ["EXISTS_EACH_LUA", "Admission", "RedisReplies"]
