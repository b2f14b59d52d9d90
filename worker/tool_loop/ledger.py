"""The executor's memory of calls, in Redis: one SET NX string per call
(`{prefix}:toolcall:{request_id}:{turn}:{fingerprint}`), so a redelivered turn reuses
what was recorded instead of running its tools again, and when two executors race on one
turn the first record wins."""

from __future__ import annotations

from typing import Any

import redis
from pydantic import ValidationError

from schemas import ConnectionSettings
from schemas.redis_conn import mget
from schemas.tool_loop import CallRecord
from worker.logs import log
from worker.tool_loop.continuation import fingerprint
from worker.tool_loop.runner import PendingCall


class CallLedger:
    """The executor's memory of calls, in Redis: one SET NX string per call."""

    def __init__(self, client: redis.Redis, settings: ConnectionSettings) -> None:
        self._client = client
        self._keys = settings.keys

    def key(self, call: PendingCall) -> str:
        return self._keys.tool_call(call.request_id, call.turn, fingerprint(call))

    def lookup(self, keys: list[str]) -> dict[str, CallRecord]:
        if not keys:
            return {}
        values: list[Any] = mget(self._client, keys)
        found: dict[str, CallRecord] = {}
        for key, value in zip(keys, values, strict=True):
            if value is None:
                continue
            try:
                found[key] = CallRecord.model_validate_json(value)
            except ValidationError:
                log.warning("tool_record_unreadable", key=key)  # run it again
        return found

    def cancelled_jobs(self, job_ids: list[str]) -> frozenset[str]:
        """Which of these jobs are cancelled (one pipeline of EXISTS)."""
        if not job_ids:
            return frozenset()
        pipe = self._client.pipeline(transaction=False)
        for job in job_ids:
            pipe.exists(self._keys.job_cancel(job))
        hits = pipe.execute()
        return frozenset(job for job, hit in zip(job_ids, hits, strict=True) if hit)

    def record(self, items: list[tuple[str, CallRecord, int]]) -> dict[str, CallRecord]:
        """SET NX each (key, record, ttl_s); where another executor was first, its record."""
        if not items:
            return {}
        pipe = self._client.pipeline(transaction=False)
        for key, record, ttl in items:
            pipe.set(key, record.model_dump_json(exclude_none=True), nx=True, ex=ttl)
        created = pipe.execute()
        lost = [key for (key, _, _), ok in zip(items, created, strict=True) if not ok]
        winners = self.lookup(lost)
        out = {key: record for key, record, _ in items}
        for key in lost:
            if key in winners:
                out[key] = winners[key].model_copy(update={"reused": True})
        return out


__all__ = ["CallLedger"]
