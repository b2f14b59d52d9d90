"""No batch stops `qbatch serve` twice: the worker's strike rule (`worker.supervision`),
for the batch runner.

The runner already takes a batch step that raises as that batch's problem (logged, tried
again next tick). What it cannot catch is the process dying under a step (killed for
memory, a crash in a library): every restart resumes that batch and dies again. So the
runner marks the batch it is stepping (one Redis key, cleared after the step); a server
that starts and finds a mark gives that batch a strike; a batch with two strikes is not
stepped again but failed (`internal_error`), its job cancelled. Strikes live 7 days.
"""

from __future__ import annotations

from typing import Any

from schemas.keys import RedisKeys
from schemas.redis_conn import reply_text

QUARANTINE_AFTER = 2
STRIKES_TTL_S = 7 * 86_400
QUARANTINED = (
    "the server stopped twice while handling this batch (see its logs); it is not run again"
)


class BatchStrikes:
    def __init__(self, redis_client: Any, keys: RedisKeys) -> None:
        self.redis = redis_client
        self._current = keys.serve_runner_current()
        self._strikes = keys.serve_runner_strikes()

    def recover(self) -> str | None:
        """At start: the batch a dead process was stepping (given a strike now), if any."""
        found = self.redis.get(self._current)
        if found is None:
            return None
        batch_id = reply_text(found)
        self.redis.hincrby(self._strikes, batch_id, 1)
        self.redis.expire(self._strikes, STRIKES_TTL_S)
        self.redis.delete(self._current)
        return batch_id

    def quarantined(self, batch_id: str) -> bool:
        return int(self.redis.hget(self._strikes, batch_id) or 0) >= QUARANTINE_AFTER

    def mark(self, batch_id: str) -> None:
        self.redis.set(self._current, batch_id)

    def clear(self) -> None:
        self.redis.delete(self._current)


__all__ = ["QUARANTINED", "BatchStrikes"]
