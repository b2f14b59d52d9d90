"""The Redis sink: result keys, wake-up lists and job bookkeeping (the v1 contract), and
the dedupe store the worker asks before running a batch.

Results are written through `schemas.replies.ResultWriter`: one Lua call per chunk, in
which each request's result key, wake-up list and job counters and stream change
together or not at all, and only the first write of a request_id counts, so a redelivered
request that raced its twin cannot count twice in its job. The scripts check every key's
type before writing, so a key of the wrong type refuses one result instead of
half-writing it.

On a Redis Cluster (a `redis+cluster://` URL) the keys carry hash tags and a result is
written in two idempotent steps (its own keys, then its job's counters: see
`ResultWriter`); the admission then also asks whether a result found is counted in its
job yet, and runs the request again when it is not, so the second step happens.

Behind Redis Sentinel (a `redis+sentinel://` URL) Redis is one server, written as above;
its failover reaches the sink as connection errors (`MasterNotFoundError`, a demoted
master's READONLY turned into one), an outage like any other.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis

from schemas import RedisKeys, RequestEnvelope, ResultEnvelope
from schemas.redis_conn import connect, is_cluster, mget, reply_text
from schemas.replica_ack import ReplicaAck
from schemas.replies import ResultWriter, WriteReply, WriteStatus
from schemas.result import RESULT_HEAD_BYTES, result_head
from schemas.scripts import lua
from schemas.settings import ConnectionSettings
from worker.records import Reply
from worker.sinks.base import Admission, ReplySink, SinkRefused, SinkUnavailable

T = TypeVar("T")

_UNAVAILABLE: tuple[type[Exception], ...] = (
    redis.ConnectionError,
    redis.exceptions.BusyLoadingError,
    # The server answers but refuses every command for a while (ACL NOPERM until an
    # operator fixes the user, a read-only replica after a failover, OOM under maxmemory
    # until keys expire): as unavailable as a closed socket. A failed result could not
    # be written either, so answering the chunk as failed would help nobody.
    redis.exceptions.NoPermissionError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.OutOfMemoryError,
    # A Redis Cluster failing over: redis-py raises these by class, with their code
    # stripped from the text, so they were once taken for a refusal of the result itself
    # and answered `failed` (the chaos soak: 76 results failed and 67 lost in one master
    # failover). RedisClusterException (no node reachable, a slot not covered) is not even
    # a RedisError.
    redis.exceptions.ClusterError,  # ClusterDownError, MasterDownError
    redis.exceptions.TryAgainError,
    redis.exceptions.RedisClusterException,  # SlotNotCoveredError, "cannot be connected"
)
_DATA_CODES = frozenset({"WRONGTYPE", "BUSYKEY", "NOGROUP", "CROSSSLOT"})
"""Error codes that are about the command and its data: a retry of the same call gets the
same answer. Every other code names a state of the server that passes (BUSY: a script
past `busy-reply-threshold`; MISCONF: a failed RDB or AOF write; LOADING, NOREPLICAS,
MASTERDOWN, TRYAGAIN, CLUSTERDOWN, NOPERM, ...)."""
_CODE = re.compile(r"[A-Z][A-Z_]+")
_PIPELINE_ERROR = " of pipeline caused error: "
"""How redis-py's cluster pipeline wraps a command's error reply (`Command # 1 (MGET k)
of pipeline caused error: BUSY ...`): the code is after it (the CI chaos soak: a BUSY
read through `mget_nonatomic` was taken for a refusal and stopped a writer)."""
_ACL_IN_SCRIPT = "can't run this command"
"""A command inside a script refused by the ACL (plain ERR, not NOPERM): a permission
problem of the whole deployment, waited out like NOPERM until an operator fixes it."""


def not_now(exc: redis.exceptions.ResponseError) -> bool:
    """Whether an error reply says "not now" rather than "never for this call".

    Redis starts every error reply with a code. redis-py strips `ERR ` (the generic error:
    a bad argument, a script error, an unknown command) and the codes it maps to classes,
    and leaves any other code in the text. So a reply that still starts with a code names
    a state of the server unless the code is one of `_DATA_CODES`: a result written while
    Redis is BUSY or MISCONF waits like one written while it is down (the results lost in
    both cases were answered `failed` because only a list of known codes was waited out).
    Only a reply no retry of the same call can change refuses it.
    """
    text = str(exc)
    if text.startswith("Command # "):  # a cluster pipeline's: "... caused error: BUSY ..."
        text = text.partition(_PIPELINE_ERROR)[2] or text
    code = text.split(" ", 1)[0]
    if _CODE.fullmatch(code):
        return code not in _DATA_CODES
    return _ACL_IN_SCRIPT in text


def call(fn: Callable[[], T]) -> T:
    """Run one Redis call, mapping its errors onto the sink contract."""
    try:
        return fn()
    except redis.TimeoutError as exc:
        # a read that timed out on a connection the server took: the call may be what is
        # slow (worker.sinks.retrying.Stalled); a connect that timed out, or replicas slow
        # to acknowledge (ReplicasBehind), is an outage
        reading = str(exc).startswith("Timeout reading")
        raise SinkUnavailable(f"Redis: {type(exc).__name__}: {exc}", timed_out=reading) from exc
    except _UNAVAILABLE as exc:
        raise SinkUnavailable(f"Redis: {type(exc).__name__}: {exc}") from exc
    except redis.exceptions.NoScriptError as exc:
        # A master promoted by a failover has an empty script cache; the next try of the
        # Script loads it again. Never a refusal of the result.
        raise SinkUnavailable(f"Redis: {exc}") from exc
    except redis.exceptions.ResponseError as exc:
        if not_now(exc):
            raise SinkUnavailable(f"Redis: {exc}") from exc
        raise SinkRefused(f"Redis refused: {exc}") from exc
    except redis.RedisError as exc:  # anything else of the client's: treat as an outage
        raise SinkUnavailable(f"Redis: {type(exc).__name__}: {exc}") from exc
    except (OSError, ValueError) as exc:
        # redis-py's cluster client can close a socket under another thread while it
        # re-reads the cluster's layout after a failover; the reader then gets the raw
        # I/O error (the CI chaos soak: "ValueError: I/O operation on closed file" stopped
        # a worker). Each thread has its own cluster client now (RedisSink), and what
        # still slips through is an outage: retried, never a fault of the worker.
        if isinstance(exc, ValueError) and "closed file" not in str(exc):
            raise
        raise SinkUnavailable(f"Redis: {type(exc).__name__}: {exc}") from exc


_SECRET_PARAMS = ("password", "sentinel_password")
"""Query parameters that carry a password (`redis+sentinel://...?sentinel_password=`)."""


def _redacted(url: str) -> str:
    """The URL without its passwords (user info and query), for logs."""
    parts = urlsplit(url)
    if parts.password is not None:
        netloc = parts.netloc.rsplit("@", 1)[1]
        user = f"{parts.username}:***@" if parts.username else ":***@"
        parts = parts._replace(netloc=user + netloc)
    if parts.query:
        query = [
            (k, "***" if k.lower() in _SECRET_PARAMS else v)
            for k, v in parse_qsl(parts.query, keep_blank_values=True)
        ]
        parts = parts._replace(query=urlencode(query, safe="*"))
    return urlunsplit(parts)


class RedisSink(ReplySink):
    name = "redis"
    dedupes = True

    def __init__(
        self,
        client: Any,
        keys: RedisKeys,
        where: str = "",
        admission_client: Any = None,
        ack: ReplicaAck | None = None,
    ) -> None:
        self.where = where
        self._client = client
        self._admission_client = admission_client or client
        """The dispatcher's own client on a cluster (see `from_settings`)."""
        self._keys = keys
        self._writer = ResultWriter(client, keys, ack)
        """With `ack` (--redis-wait-replicas) a write returns once replicas hold it, so the
        offsets committed after it never pass a result that a failover could lose."""
        self._admission_script = client.register_script(lua("admission"))

    @classmethod
    def from_settings(cls, settings: ConnectionSettings) -> RedisSink:
        def new() -> Any:
            return connect(
                settings.redis_url,
                failover_wait_s=0,  # the sink's own outage handling pauses and retries
                socket_timeout=5,
                socket_connect_timeout=5,
                health_check_interval=15,
                **settings.redis_kwargs(),
            )

        client = new()
        # redis-py's cluster client is not safe to share between threads while it reloads
        # the cluster's layout (it closes sockets another thread is reading): the
        # dispatcher's admission gets a client of its own there.
        admission = new() if is_cluster(client) else client
        return cls(
            client, settings.keys, _redacted(settings.redis_url), admission, settings.replica_ack
        )

    @property
    def client(self) -> Any:
        return self._client

    def cancelled_jobs(self, job_ids: Sequence[str]) -> frozenset[str]:
        """One pipeline of EXISTS, one per job (each its own slot on a cluster)."""
        if not job_ids:
            return frozenset()

        def look() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for job in job_ids:
                pipe.exists(self._keys.job_cancel(job))
            return list(pipe.execute())

        hits = call(look)
        return frozenset(job for job, hit in zip(job_ids, hits, strict=True) if hit)

    def admission(self, envelopes: Sequence[RequestEnvelope]) -> Admission:
        """One round trip per micro-batch, whatever its size; at most `RESULT_HEAD_BYTES`
        of each stored result are read (`schemas/lua/result_head.lua`)."""
        if not envelopes:
            return Admission()
        jobs = sorted({env.job_id for env in envelopes if env.job_id})
        if is_cluster(self._client):
            return call(lambda: self._cluster_admission(envelopes, jobs))
        keys: list[str] = []
        args: list[str | int] = [len(envelopes)]
        for env in envelopes:
            keys += [self._keys.result(env.request_id), self._keys.job_counted(env.job_id or "-")]
            args += [env.request_id, env.job_id or ""]
        keys += [self._keys.job_cancel(job) for job in jobs]
        replies: list[Any] = call(lambda: self._admission_script(keys=keys, args=args))
        answered: dict[str, str] = {}
        for env, reply in zip(envelopes, replies, strict=False):
            if reply is not None and reply is not False:
                answered[env.request_id] = reply_text(reply)
        cancelled = frozenset(
            job for job, hit in zip(jobs, replies[len(envelopes) :], strict=True) if hit
        )
        return Admission(answered, cancelled)

    def _cluster_admission(
        self, envelopes: Sequence[RequestEnvelope], jobs: Sequence[str]
    ) -> Admission:
        """The admission script's answers from one pipeline (its keys span slots): a result
        key of another type counts as absent, as there; a request its job counted was
        answered in that job (as there); and a result of this request's job that the job
        has not counted yet (a crash between the two write steps) counts as unanswered, so
        the request runs again and its write finishes the count."""
        pipe = self._admission_client.pipeline(transaction=False)
        for env in envelopes:
            pipe.getrange(self._keys.result(env.request_id), 0, RESULT_HEAD_BYTES - 1)
            pipe.sismember(self._keys.job_counted(env.job_id or "-"), env.request_id)
        for job in jobs:
            pipe.type(self._keys.job_cancel(job))
        raw = pipe.execute(raise_on_error=False)
        answered: dict[str, str] = {}
        for i, env in enumerate(envelopes):
            head, counted = raw[2 * i], raw[2 * i + 1] in (True, 1)
            if counted and env.job_id:  # answered in its own job, whatever holds the key
                answered[env.request_id] = env.job_id
            elif isinstance(head, bytes | str) and head:  # GETRANGE of no key: empty
                job = result_head(head if isinstance(head, bytes) else head.encode())[0]
                if not (env.job_id and job == env.job_id):  # else: not counted yet, run
                    answered[env.request_id] = job
        types = raw[2 * len(envelopes) :]
        cancelled = frozenset(
            job for job, t in zip(jobs, types, strict=True) if reply_text(t) == "string"
        )
        return Admission(answered, cancelled)

    def stored(self, request_ids: Sequence[str]) -> dict[str, bytes]:
        if not request_ids:
            return {}
        keys = [self._keys.result(r) for r in request_ids]
        values: list[Any] = call(lambda: mget(self._client, keys))
        return {
            rid: value if isinstance(value, bytes) else str(value).encode()
            for rid, value in zip(request_ids, values, strict=True)
            if value is not None
        }

    def write(
        self, replies: Sequence[Reply], now_ms: int, *, job_bookkeeping: bool = True
    ) -> list[WriteReply]:
        with_results = [r for r in replies if r.result is not None]
        pairs = [(r.result, r.ttl_s) for r in with_results if r.result is not None]
        encoded = [r.encoded() for r in with_results]
        written = iter(
            call(
                lambda: self._writer.write(
                    pairs, now_ms, job_bookkeeping=job_bookkeeping, encoded=encoded
                )
            )
        )
        existed = WriteReply(WriteStatus.existed)
        return [next(written) if r.result is not None else existed for r in replies]

    def record_duplicate(self, result: ResultEnvelope, ttl_s: int, now_ms: int) -> WriteReply:
        return call(lambda: self._writer.record_duplicate(result, ttl_s, now_ms))

    def value_limit(self) -> int | None:
        """The largest value Redis takes in one command (`proto-max-bulk-len`); None when
        it cannot be read (an ACL without CONFIG, a managed Redis): 512 MB by default."""
        try:
            found = self._client.config_get("proto-max-bulk-len")
        except Exception:
            return None
        values = [v for k, v in found.items() if reply_text(k) == "proto-max-bulk-len"]
        try:
            return int(reply_text(values[0])) if values else None
        except ValueError:
            return None

    def ping(self) -> bool:
        return bool(call(self._client.ping))

    def close(self) -> None:
        self._client.close()
        if self._admission_client is not self._client:
            self._admission_client.close()


__all__ = ["RedisSink", "call"]
