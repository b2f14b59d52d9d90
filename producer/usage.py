"""Per-tenant usage: requests and prompt / completion / reasoning tokens by model and day.

Kept in Redis, one hash per tenant and UTC day (`RedisKeys.serve_usage`), fields
`{kind}:{model}` (kinds below hold no `:`, so the first `:` ends the kind and the model
may be any name). Written by `qbatch serve` (each sync answer, each batch result when
the batch is collected) and by `qbatch bulk run` / `collect` (tenant `cli`, or
`--tenant`); read by `qbatch usage` and exported by the server's `/metrics`.

Once per result: a result is added with one Lua script that first SADDs its request_id
to the day's `counted` set (`RedisKeys.serve_usage_counted`) and adds nothing when it
was already there. A finalize redone after a restart, a `bulk collect` run twice, or a
worker's redelivered record (one result per request_id, `request_id` is the same)
therefore count once. The day is the result's own `timings.finished` (not the time it is
seen), so a redo on another day finds the same set. The counted set lives `COUNTED_TTL_S`
(longer than the longest batch window), the usage hash `USAGE_TTL_S`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from schemas import RedisKeys, ResultEnvelope
from schemas.redis_conn import reply_text

KINDS = ("requests", "prompt_tokens", "completion_tokens", "reasoning_tokens")
CLI_TENANT = "cli"
"""The tenant of usage recorded by `qbatch bulk` without `--tenant`."""
USAGE_TTL_S = 400 * 86_400
COUNTED_TTL_S = 9 * 86_400
UNKNOWN_MODEL = "unknown"

RECORD_SCRIPT = """
if redis.call('SADD', KEYS[2], ARGV[1]) == 0 then return 0 end
redis.call('EXPIRE', KEYS[2], ARGV[3])
for i = 4, #ARGV, 2 do redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('EXPIRE', KEYS[1], ARGV[2])
return 1
"""


def day_of(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%d")


def result_day(result: ResultEnvelope, now: float | None = None) -> str:
    """The UTC day a result finished (`timings.finished`, epoch ms or s), else today."""
    finished = result.timings.finished
    if finished is None:
        return day_of(time.time() if now is None else now)
    return day_of(finished / 1000 if finished > 10**11 else finished)


def counts_as_usage(result: ResultEnvelope) -> bool:
    """A result a worker made (answered, failed, expired, cancelled by a worker) counts;
    one the producer wrote for a line refused before it was sent (a bad line) does not."""
    return result.response is not None or result.worker is not None


def result_usage(result: ResultEnvelope) -> tuple[str, dict[str, int]]:
    """(model, {kind: count}) of one result: one request, and its tokens when it has any."""
    response = result.response
    model = (
        response.model
        if response is not None
        else (result.worker.model if result.worker and result.worker.model else None)
    ) or UNKNOWN_MODEL
    counts = dict.fromkeys(KINDS, 0)
    counts["requests"] = 1
    if response is not None:
        usage = response.usage
        counts["prompt_tokens"] = usage.prompt_tokens
        counts["completion_tokens"] = usage.completion_tokens
        details = usage.completion_tokens_details
        counts["reasoning_tokens"] = details.reasoning_tokens if details else 0
    return model, counts


@dataclass(frozen=True, slots=True)
class UsageRow:
    tenant: str
    day: str
    model: str
    counts: dict[str, int]


def parse_hash(tenant: str, day: str, fields: dict[Any, Any]) -> list[UsageRow]:
    """A usage hash as rows, one per model (unknown kinds are ignored), sorted by model."""
    by_model: dict[str, dict[str, int]] = {}
    for raw_field, raw_value in fields.items():
        name = reply_text(raw_field)
        kind, _, model = name.partition(":")
        if kind not in KINDS or not model:
            continue
        by_model.setdefault(model, dict.fromkeys(KINDS, 0))[kind] += int(raw_value)
    return [UsageRow(tenant, day, m, by_model[m]) for m in sorted(by_model)]


def last_days(days: int, now: float | None = None) -> list[str]:
    """The last `days` UTC days, newest first."""
    today = datetime.fromtimestamp(time.time() if now is None else now, UTC).date()
    return [(today - timedelta(days=i)).isoformat() for i in range(days)]


class UsageStore:
    """Record and read usage (see the module docstring)."""

    def __init__(self, redis_client: Any, keys: RedisKeys) -> None:
        self.redis = redis_client
        self.keys = keys
        self._script = redis_client.register_script(RECORD_SCRIPT)

    def record(self, tenant: str, result: ResultEnvelope) -> tuple[str, dict[str, int]] | None:
        """Add one result's usage to its tenant's day, once: returns (model, counts) when
        it was added now, None when this request_id was counted before (or never ran)."""
        if not counts_as_usage(result):
            return None
        model, counts = result_usage(result)
        day = result_day(result)
        args: list[Any] = [result.request_id, USAGE_TTL_S, COUNTED_TTL_S]
        for kind, value in counts.items():
            if value:
                args += [f"{kind}:{model}", value]
        keys = [self.keys.serve_usage(tenant, day), self.keys.serve_usage_counted(tenant, day)]
        return (model, counts) if int(self._script(keys=keys, args=args)) == 1 else None

    def tenants(self) -> list[str]:
        """Every tenant with usage recorded (SCAN over the usage keys)."""
        found: set[str] = set()
        for raw in self.redis.scan_iter(match=self.keys.serve_usage_scan(), count=1000):
            parsed = self.keys.serve_usage_of(raw.decode() if isinstance(raw, bytes) else raw)
            if parsed is not None:
                found.add(parsed[0])
        return sorted(found)

    def rows(self, tenants: Iterable[str], days: list[str]) -> list[UsageRow]:
        """Usage rows of `tenants` on `days`, in that order."""
        pairs = [(t, d) for t in tenants for d in days]
        pipe = self.redis.pipeline(transaction=False)
        for tenant, day in pairs:
            pipe.hgetall(self.keys.serve_usage(tenant, day))
        out: list[UsageRow] = []
        for (tenant, day), fields in zip(pairs, pipe.execute(), strict=True):
            out += parse_hash(tenant, day, fields or {})
        return out


__all__ = [
    "CLI_TENANT",
    "KINDS",
    "UsageRow",
    "UsageStore",
    "counts_as_usage",
    "last_days",
    "parse_hash",
    "result_day",
    "result_usage",
]
