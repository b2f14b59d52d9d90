"""How a result is written to Redis: atomically, once, with its job bookkeeping.

This is part of the contract, not of the worker: the producer answers the lines it
refuses itself (bad lines of a bulk file, lines of a cancelled job it never sent)
through the very same script, so counters, the job stream and the job's final
status move exactly as if a worker had answered. The Redis client is injected.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from schemas.keys import RedisKeys
from schemas.result import ResultEnvelope

FINALIZE_JOB_LUA = """
-- finalize(job): once every request of a running (or cancelling) job is answered, set
-- its final status; returns the status. Shared by the result writer and the producer.
local function finalize(job)
  local h = redis.call('HMGET', job, 'total', 'succeeded', 'failed', 'expired',
                      'cancelled', 'status')
  local total = tonumber(h[1])
  if not total then return h[6] end
  local ok = tonumber(h[2]) or 0
  local cancelled = tonumber(h[5]) or 0
  local done = ok + (tonumber(h[3]) or 0) + (tonumber(h[4]) or 0) + cancelled
  if done >= total and (h[6] == 'running' or h[6] == 'cancelling') then
    local status = 'completed'
    if h[6] == 'cancelling' or cancelled > 0 then status = 'cancelled'
    elseif done > ok then status = 'completed_with_errors' end
    redis.call('HSET', job, 'status', status)
    return status
  end
  return h[6]
end
"""

WRITE_RESULTS_LUA = (
    FINALIZE_JOB_LUA
    + """
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
      finalize(jkey)
    end
  end
end
return out
"""
)


class ResultWriter:
    """Writes result envelopes once each (see WRITE_RESULTS_LUA)."""

    def __init__(self, client: Any, keys: RedisKeys) -> None:
        self._keys = keys
        self._write_script = client.register_script(WRITE_RESULTS_LUA)

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
