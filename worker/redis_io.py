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

WRITE_RESULTS_LUA = """
-- Writes many results in one call. KEYS: per result (result, done, job hash, job stream).
-- ARGV[1] = now_ms; then per result: json, ttl, status, request_id, custom_id, has_job.
-- Returns one 1 (written now) or 0 (already existed) per result.
local out = {}
local now = ARGV[1]
for i = 0, (#KEYS / 4) - 1 do
  local k, a = i * 4, 1 + i * 6
  local rkey, dkey, jkey, skey = KEYS[k + 1], KEYS[k + 2], KEYS[k + 3], KEYS[k + 4]
  local ttl = tonumber(ARGV[a + 2])
  local status = ARGV[a + 3]
  if not redis.call('SET', rkey, ARGV[a + 1], 'NX', 'EX', ttl) then
    out[#out + 1] = 0
  else
    out[#out + 1] = 1
    redis.call('RPUSH', dkey, '1')
    redis.call('EXPIRE', dkey, ttl)
    if ARGV[a + 6] == '1' then
      redis.call('HINCRBY', jkey, status, 1)
      redis.call('HSET', jkey, 'updated_at', now)
      redis.call('XADD', skey, '*', 'request_id', ARGV[a + 4], 'custom_id', ARGV[a + 5],
                 'status', status)
      if redis.call('TTL', jkey) < ttl then redis.call('EXPIRE', jkey, ttl) end
      if redis.call('TTL', skey) < ttl then redis.call('EXPIRE', skey, ttl) end
      local h = redis.call('HMGET', jkey, 'total', 'succeeded', 'failed', 'expired',
                           'cancelled', 'status')
      local total = tonumber(h[1])
      if total then
        local ok = tonumber(h[2]) or 0
        local cancelled = tonumber(h[5]) or 0
        local done = ok + (tonumber(h[3]) or 0) + (tonumber(h[4]) or 0) + cancelled
        if done >= total and (h[6] == 'running' or h[6] == 'cancelling') then
          local final = 'completed'
          if h[6] == 'cancelling' or cancelled > 0 then final = 'cancelled'
          elseif done > ok then final = 'completed_with_errors' end
          redis.call('HSET', jkey, 'status', final)
        end
      end
    end
  end
end
return out
"""

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
        self._write_script = client.register_script(WRITE_RESULTS_LUA)
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
        """Write (result, ttl_s) pairs once each; True where this call wrote it.

        One script call for the whole chunk: packing one command with many
        arguments costs far less client CPU than one command per result.
        """
        if not results:
            return []
        keys: list[str] = []
        args: list[str | int] = [now_ms]
        for result, ttl_s in results:
            job = result.job_id or "-"
            rid = result.request_id
            keys += [
                self._keys.result(rid),
                self._keys.done(rid),
                self._keys.job(job),
                self._keys.job_stream(job),
            ]
            args += [
                result.model_dump_json(exclude_none=True),
                ttl_s,
                result.status.value,
                rid,
                result.custom_id or "",
                "1" if result.job_id else "0",
            ]
        return [bool(flag) for flag in self._write_script(keys=keys, args=args)]

    def close(self) -> None:
        self._client.close()


__all__ = ["EXISTS_EACH_LUA", "WRITE_RESULTS_LUA", "Admission", "RedisReplies"]
