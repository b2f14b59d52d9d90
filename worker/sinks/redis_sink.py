"""The Redis sink: result keys, wake-up lists and job bookkeeping (the v1 contract), and
the dedupe store the worker asks before running a batch.

Results are written through `schemas.replies.ResultWriter`: one Lua call per chunk, in
which each request's result key, wake-up list and job counters and stream change
together or not at all, and only the first write of a request_id counts, so a redelivered
request that raced its twin cannot count twice in its job. The scripts check every key's
type before writing, so a key of the wrong type refuses one result instead of
half-writing it.

All keys of one request are assumed to live on one Redis node (no Cluster hash tags are
used); see deploy/README.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis

from schemas import RedisKeys, RequestEnvelope, ResultEnvelope
from schemas.replies import ResultWriter, WriteReply, WriteStatus
from schemas.scripts import lua
from schemas.settings import ConnectionSettings
from worker.records import Reply
from worker.sinks.base import Admission, ReplySink, SinkRefused, SinkUnavailable

T = TypeVar("T")

_UNAVAILABLE: tuple[type[Exception], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.exceptions.BusyLoadingError,
    # The server answers but refuses every command for a while (ACL NOPERM until an
    # operator fixes the user, a read-only replica after a failover, OOM under maxmemory
    # until keys expire): as unavailable as a closed socket. A failed result could not
    # be written either, so answering the chunk as failed would help nobody.
    redis.exceptions.NoPermissionError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.OutOfMemoryError,
)
_TRANSIENT_REPLIES = ("TRYAGAIN", "CLUSTERDOWN", "MASTERDOWN", "LOADING", "NOPERM")
_ACL_IN_SCRIPT = "can't run this command"
"""A command inside a script refused by the ACL (plain ERR, not NOPERM): a permission
problem of the whole deployment, waited out like NOPERM until an operator fixes it."""


def call(fn: Callable[[], T]) -> T:
    """Run one Redis call, mapping its errors onto the sink contract."""
    try:
        return fn()
    except _UNAVAILABLE as exc:
        raise SinkUnavailable(f"Redis: {type(exc).__name__}: {exc}") from exc
    except redis.exceptions.ResponseError as exc:
        if str(exc).startswith(_TRANSIENT_REPLIES) or _ACL_IN_SCRIPT in str(exc):
            raise SinkUnavailable(f"Redis: {exc}") from exc
        raise SinkRefused(f"Redis refused: {exc}") from exc
    except redis.RedisError as exc:  # anything else of the client's: treat as an outage
        raise SinkUnavailable(f"Redis: {type(exc).__name__}: {exc}") from exc


def _redacted(url: str) -> str:
    """The URL without its password."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit(parts._replace(netloc=user + netloc))


class RedisSink(ReplySink):
    name = "redis"
    dedupes = True

    def __init__(self, client: redis.Redis, keys: RedisKeys, where: str = "") -> None:
        self.where = where
        self._client = client
        self._keys = keys
        self._writer = ResultWriter(client, keys)
        self._admission_script = client.register_script(lua("admission"))

    @classmethod
    def from_settings(cls, settings: ConnectionSettings) -> RedisSink:
        client = redis.Redis.from_url(
            settings.redis_url,
            socket_timeout=5,
            socket_connect_timeout=5,
            health_check_interval=15,
            **settings.redis_kwargs(),
        )
        return cls(client, settings.keys, _redacted(settings.redis_url))

    @property
    def client(self) -> redis.Redis:
        return self._client

    def admission(self, envelopes: Sequence[RequestEnvelope]) -> Admission:
        """One round trip per micro-batch, whatever its size."""
        request_ids = [env.request_id for env in envelopes]
        jobs = sorted({env.job_id for env in envelopes if env.job_id})
        keys = [self._keys.result(rid) for rid in request_ids]
        keys += [self._keys.job_cancel(job) for job in jobs]
        if not keys:
            return Admission()
        replies: list[Any] = call(
            lambda: self._admission_script(keys=keys, args=[len(request_ids)])
        )
        answered: dict[str, str] = {}
        for rid, reply in zip(request_ids, replies, strict=False):
            if reply is not None and reply is not False:
                answered[rid] = reply.decode() if isinstance(reply, bytes) else str(reply)
        cancelled = frozenset(
            job for job, hit in zip(jobs, replies[len(request_ids) :], strict=True) if hit
        )
        return Admission(answered, cancelled)

    def stored(self, request_ids: Sequence[str]) -> dict[str, bytes]:
        if not request_ids:
            return {}
        keys = [self._keys.result(r) for r in request_ids]
        values: list[Any] = call(lambda: list(self._client.mget(keys)))  # type: ignore[arg-type]
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

    def ping(self) -> bool:
        return bool(call(self._client.ping))

    def close(self) -> None:
        self._client.close()


__all__ = ["RedisSink", "call"]
