"""How a result is written to Redis: atomically, once, with its job bookkeeping.

This is part of the contract, not of the worker: the producer answers the lines it
refuses itself (bad lines of a bulk file, lines of a cancelled job it never sent)
through the very same script, so counters, the job stream and the final status move
exactly as if a worker had answered. The Redis client is injected; the scripts are in
`schemas/lua/` (see `schemas.scripts`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from schemas.keys import RedisKeys
from schemas.result import ResultEnvelope
from schemas.scripts import lua


class WriteStatus(StrEnum):
    written = "written"
    """Written now: result key, wake-up push and (in a job) its counters and stream entry."""
    existed = "existed"
    """A result was already there: a redelivery, nothing changed."""
    other_job = "other_job"
    """A result of another job was already there: record the duplicate for this job."""
    wrong_type = "wrong_type"
    """One of its keys holds another Redis type; nothing was written (`detail` says which)."""


@dataclass(frozen=True, slots=True)
class WriteReply:
    status: WriteStatus
    detail: str = ""

    @property
    def fresh(self) -> bool:
        return self.status is WriteStatus.written


_CODES = {1: WriteStatus.written, 0: WriteStatus.existed, 3: WriteStatus.other_job}


def _reply(raw: Any) -> WriteReply:
    if isinstance(raw, int):
        return WriteReply(_CODES[raw])
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    if text.startswith("wrongtype "):
        role, _, kind = text[len("wrongtype ") :].partition(" ")
        return WriteReply(WriteStatus.wrong_type, f"its {role} key holds a Redis {kind}")
    raise ValueError(f"unexpected reply from the result script: {text!r}")


class ResultWriter:
    """Writes result envelopes once each (see `schemas/lua/write_results.lua`)."""

    def __init__(self, client: Any, keys: RedisKeys) -> None:
        self._keys = keys
        self._write_script = client.register_script(lua("write_results"))
        self._duplicate_script = client.register_script(lua("record_duplicate"))

    def write(
        self,
        results: Sequence[tuple[ResultEnvelope, int]],
        now_ms: int,
        *,
        job_bookkeeping: bool = True,
        encoded: Sequence[bytes] | None = None,
    ) -> list[WriteReply]:
        """Write (result, ttl_s) pairs once each; one reply per pair, in order.

        One script call for the whole chunk: packing one command with many arguments costs
        far less client CPU than one command per result. `job_bookkeeping=False` writes the
        results without touching their jobs' keys (for a job whose keys are broken).
        `encoded`: the results' JSON when the caller has it already (one per result).
        """
        if not results:
            return []
        keys: list[str] = []
        args: list[str | int | bytes] = [now_ms]
        for i, (result, ttl_s) in enumerate(results):
            job = (result.job_id if job_bookkeeping else None) or ""
            rid = result.request_id
            keys += [
                self._keys.result(rid),
                self._keys.done(rid),
                self._keys.job(job or "-"),
                self._keys.job_stream(job or "-"),
            ]
            args += [
                encoded[i] if encoded is not None else result.model_dump_json(exclude_none=True),
                ttl_s,
                result.status.value,
                rid,
                result.custom_id or "",
                job,
            ]
        return [_reply(raw) for raw in self._write_script(keys=keys, args=args)]

    def record_duplicate(self, result: ResultEnvelope, ttl_s: int, now_ms: int) -> WriteReply:
        """Count `result` (a failed `duplicate_request_id` result) in its job, once; the
        result travels inline in the job's stream entry."""
        if not result.job_id:
            return WriteReply(WriteStatus.existed)
        raw = self._duplicate_script(
            keys=[self._keys.job(result.job_id), self._keys.job_stream(result.job_id)],
            args=[
                result.request_id,
                result.custom_id or "",
                result.model_dump_json(exclude_none=True),
                now_ms,
                ttl_s,
            ],
        )
        return WriteReply(WriteStatus.written) if raw == 1 else _reply(raw)
