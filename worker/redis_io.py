"""The Redis side of the worker: admission look-ups and the once-only reply write.

A result is written by one Lua script per request so that the result key, the
wake-up list and the job's counters and stream change together or not at all,
and only the first write of a request_id counts: a redelivered request that
raced its twin cannot count twice in its job.

All keys of one request are assumed to live on one Redis node (no Cluster
hash tags are used); see deploy/README.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import redis

from schemas import RedisKeys, ResultEnvelope

WRITE_RESULT_LUA = """
-- KEYS: result, done, job hash, job stream
-- ARGV: result json, ttl, status, request_id, custom_id, now_ms, has_job
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2]) then return 0 end
redis.call('RPUSH', KEYS[2], '1')
redis.call('EXPIRE', KEYS[2], ARGV[2])
if ARGV[7] ~= '1' then return 1 end
local ttl = tonumber(ARGV[2])
redis.call('HINCRBY', KEYS[3], ARGV[3], 1)
redis.call('HSET', KEYS[3], 'updated_at', ARGV[6])
redis.call('XADD', KEYS[4], '*', 'request_id', ARGV[4], 'custom_id', ARGV[5], 'status', ARGV[3])
if redis.call('TTL', KEYS[3]) < ttl then redis.call('EXPIRE', KEYS[3], ttl) end
if redis.call('TTL', KEYS[4]) < ttl then redis.call('EXPIRE', KEYS[4], ttl) end
local h = redis.call('HMGET', KEYS[3], 'total', 'succeeded', 'failed', 'expired', 'cancelled', 'status')
local total = tonumber(h[1])
if total then
  local ok = tonumber(h[2]) or 0
  local cancelled = tonumber(h[5]) or 0
  local done = ok + (tonumber(h[3]) or 0) + (tonumber(h[4]) or 0) + cancelled
  if done >= total and (h[6] == 'running' or h[6] == 'cancelling') then
    local status = 'completed'
    if h[6] == 'cancelling' or cancelled > 0 then status = 'cancelled'
    elseif done > ok then status = 'completed_with_errors' end
    redis.call('HSET', KEYS[3], 'status', status)
  end
end
return 1
"""


@dataclass(frozen=True, slots=True)
class Admission:
    """What Redis says about a batch before it runs."""

    already_answered: frozenset[str]
    cancelled_jobs: frozenset[str]


class RedisReplies:
    """Thin adapter: every call is one pipelined round trip; errors propagate to the caller's retry."""

    def __init__(self, client: redis.Redis, keys: RedisKeys) -> None:
        self._client = client
        self._keys = keys
        self._script = client.register_script(WRITE_RESULT_LUA)

    @classmethod
    def from_url(cls, url: str, keys: RedisKeys, **kwargs: object) -> RedisReplies:
        client = redis.Redis.from_url(
            url, socket_timeout=5, socket_connect_timeout=5, health_check_interval=15,
            **kwargs,  # type: ignore[arg-type]
        )
        return cls(client, keys)

    def ping(self) -> bool:
        return bool(self._client.ping())

    def admission(self, request_ids: Sequence[str], job_ids: Iterable[str]) -> Admission:
        jobs = sorted(set(job_ids))
        pipe = self._client.pipeline(transaction=False)
        for rid in request_ids:
            pipe.exists(self._keys.result(rid))
        for job in jobs:
            pipe.exists(self._keys.job_cancel(job))
        answers = pipe.execute()
        answered = frozenset(
            rid for rid, hit in zip(request_ids, answers[: len(request_ids)], strict=True) if hit
        )
        cancelled = frozenset(
            job for job, hit in zip(jobs, answers[len(request_ids) :], strict=True) if hit
        )
        return Admission(answered, cancelled)

    def write(self, results: Sequence[tuple[ResultEnvelope, int]], now_ms: int) -> list[bool]:
        """Write (result, ttl_s) pairs once each; True where this call wrote it."""
        if not results:
            return []
        pipe = self._client.pipeline(transaction=False)
        for result, ttl_s in results:
            job = result.job_id or "-"
            self._script(
                keys=[
                    self._keys.result(result.request_id),
                    self._keys.done(result.request_id),
                    self._keys.job(job),
                    self._keys.job_stream(job),
                ],
                args=[
                    result.model_dump_json(exclude_none=True),
                    ttl_s,
                    result.status.value,
                    result.request_id,
                    result.custom_id or "",
                    now_ms,
                    "1" if result.job_id else "0",
                ],
                client=pipe,
            )
        return [bool(flag) for flag in pipe.execute()]

    def close(self) -> None:
        self._client.close()


__all__ = ["WRITE_RESULT_LUA", "Admission", "RedisReplies"]
