"""How a result is written to Redis: atomically, once, with its job bookkeeping.

This is part of the contract, not of the worker: the producer answers the lines it
refuses itself (bad lines of a bulk file, lines of a cancelled job it never sent)
through the very same script, so counters, the job stream and the final status move
exactly as if a worker had answered. The Redis client is injected; the scripts are in
`schemas/lua/` (see `schemas.scripts`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from schemas.keys import RedisKeys
from schemas.redis_conn import eval_many, reply_text, waiting_out_failover
from schemas.replica_ack import ReplicaAck, eval_acked
from schemas.result import ResultEnvelope, Status
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
    text = reply_text(raw)
    if text.startswith("wrongtype "):
        role, _, kind = text[len("wrongtype ") :].partition(" ")
        return WriteReply(WriteStatus.wrong_type, f"its {role} key holds a Redis {kind}")
    raise ValueError(f"unexpected reply from the result script: {text!r}")


class ResultWriter:
    """Writes result envelopes once each (see `schemas/lua/write_results.lua`)."""

    def __init__(self, client: Any, keys: RedisKeys, ack: ReplicaAck | None = None) -> None:
        self._client = client
        self._keys = keys
        self._ack = ack or ReplicaAck()
        """Replicas that must hold a write before it returns (`schemas.replica_ack`)."""
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
        if self._keys.cluster:
            return self._write_cluster(results, now_ms, job_bookkeeping, encoded)
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
                self._keys.job_counted(job or "-"),
            ]
            args += [
                encoded[i] if encoded is not None else result.model_dump_json(exclude_none=True),
                ttl_s,
                result.status.value,
                rid,
                result.custom_id or "",
                job,
            ]
        if self._ack.enabled:
            return [_reply(raw) for raw in self._acked(lua("write_results"), keys, args)]
        return [_reply(raw) for raw in self._write_script(keys=keys, args=args)]

    def _acked(self, body: str, keys: list[str], args: list[Any]) -> Any:
        """One script call, returned once the replicas have it (raises as a call would)."""
        (raw,) = eval_acked(self._client, self._keys, self._ack, [(body, keys, args)])
        if isinstance(raw, Exception):
            raise raw
        return raw

    def _eval_many(self, body: str, calls: list[tuple[list[str], list[Any]]]) -> list[Any]:
        if self._ack.enabled:
            return eval_acked(self._client, self._keys, self._ack, [(body, k, a) for k, a in calls])
        return eval_many(self._client, body, calls)

    def _write_cluster(
        self,
        results: Sequence[tuple[ResultEnvelope, int]],
        now_ms: int,
        job_bookkeeping: bool,
        encoded: Sequence[bytes] | None,
    ) -> list[WriteReply]:
        """On a Redis Cluster a result's keys and its job's keys live in different slots,
        so one script cannot change both. Three pipelined round trips instead: the job
        keys' types (a job with a broken key refuses its results before any is written,
        as the single script does); each result's own keys, once (`write_result_cluster`);
        then each job counts the results written now or found from before
        (`count_results`, idempotent through the job's counted set). Readers see a result
        before its job entry, and a crash between the two is mended on redelivery: the
        admission treats a result not yet counted in its job as unanswered."""
        jobs = sorted({r.job_id for r, _ in results if r.job_id and job_bookkeeping})
        broken = self._broken_jobs(jobs)
        replies: list[WriteReply | None] = [None] * len(results)
        calls, where = [], []
        for i, (result, ttl_s) in enumerate(results):
            job = (result.job_id if job_bookkeeping else None) or ""
            if job in broken:
                replies[i] = WriteReply(WriteStatus.wrong_type, broken[job])
                continue
            rid = result.request_id
            data = encoded[i] if encoded is not None else result.model_dump_json(exclude_none=True)
            calls.append(([self._keys.result(rid), self._keys.done(rid)], [data, ttl_s, job]))
            where.append(i)
        counts: dict[str, list[tuple[ResultEnvelope, str, int]]] = {}
        written = self._eval_many(lua("write_result_cluster"), calls)
        for i, raw in zip(where, written, strict=True):
            if isinstance(raw, Exception):
                raise raw
            result, ttl_s = results[i]
            if isinstance(raw, list):
                code, status = int(raw[0]), reply_text(raw[1])
                replies[i] = WriteReply(_CODES[code])
                job = (result.job_id if job_bookkeeping else None) or ""
                if job and code == 0 and not status:
                    status = self._legacy_status(result.request_id)
                if job and code in (0, 1):
                    counts.setdefault(job, []).append(
                        (result, result.status.value if code == 1 else status, ttl_s)
                    )
            else:
                replies[i] = _reply(raw)
        self._count(counts, now_ms)
        return [r if r is not None else WriteReply(WriteStatus.existed) for r in replies]

    def _legacy_status(self, request_id: str) -> str:
        """The status of a result stored before its fields were ordered for `result_head`
        (the script cannot see it in the first bytes): read here, never in a script, so
        Redis does not decode a result of any size (gone one result TTL after upgrading)."""
        raw = self._client.get(self._keys.result(request_id))
        try:
            status = json.loads(raw).get("status") if raw is not None else None
        except (ValueError, AttributeError):
            status = None
        return str(status) if status in Status.__members__ else Status.failed.value

    def _broken_jobs(self, jobs: Sequence[str]) -> dict[str, str]:
        """job_id -> why, for the jobs whose hash, stream or counted set has another type."""
        if not jobs:
            return {}
        want = (
            ("job", "hash", self._keys.job),
            ("stream", "stream", self._keys.job_stream),
            ("counted", "set", self._keys.job_counted),
        )

        def read() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for job in jobs:
                for _role, _type, key in want:
                    pipe.type(key(job))
            return list(pipe.execute())

        # a pipeline bypasses the client's own failover wait: a producer-side write must
        # not fail here on a master dying mid-read (the chaos soak's cancelled submit did)
        types = iter(reply_text(t) for t in waiting_out_failover(self._client, read))
        broken = {}
        for job in jobs:
            for role, kind, _key in want:
                found = next(types)
                if found not in ("none", kind) and job not in broken:
                    broken[job] = f"its {role} key holds a Redis {found}"
        return broken

    def _count(self, counts: dict[str, list[tuple[ResultEnvelope, str, int]]], now_ms: int) -> None:
        calls = []
        for job, items in counts.items():
            args: list[Any] = [now_ms, max(ttl for _, _, ttl in items)]
            for result, status, _ttl in items:
                args += [result.request_id, result.custom_id or "", status]
            keys = [self._keys.job(job), self._keys.job_stream(job), self._keys.job_counted(job)]
            calls.append((keys, args))
        for raw in self._eval_many(lua("count_results"), calls):
            if isinstance(raw, Exception):
                raise raw

    def record_duplicate(self, result: ResultEnvelope, ttl_s: int, now_ms: int) -> WriteReply:
        """Count `result` (a failed `duplicate_request_id` result) in its job, once; the
        result travels inline in the job's stream entry."""
        if not result.job_id:
            return WriteReply(WriteStatus.existed)
        keys = [
            self._keys.job(result.job_id),
            self._keys.job_stream(result.job_id),
            self._keys.job_counted(result.job_id),
        ]
        args: list[Any] = [
            result.request_id,
            result.custom_id or "",
            result.model_dump_json(exclude_none=True),
            now_ms,
            ttl_s,
        ]
        if self._ack.enabled:
            raw = self._acked(lua("record_duplicate"), keys, args)
        else:
            raw = self._duplicate_script(keys=keys, args=args)
        return WriteReply(WriteStatus.written) if raw == 1 else _reply(raw)
