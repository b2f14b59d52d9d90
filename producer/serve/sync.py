"""`POST /v1/chat/completions` and `/v1/completions` of `qbatch serve`: one request through
the queue, answered like OpenAI's endpoint. No web framework here (unit-testable).

The request is published on a thread (a Kafka acknowledgement: milliseconds, on a
small pool of its own) and then waits for its result on the event loop
(`producer.serve.result_wait`): a waiting request holds a Redis connection, not a
thread, so `--max-sync-inflight` is bounded by Redis's connections, not a thread pool.

The request goes on the **interactive** lane (ahead of every bulk job) with `deadline` =
now + the client's own timeout: the `openai` SDK sends that timeout in the
`X-Stainless-Timeout` header (default 600 s), so a request whose caller has given up is
answered `expired` by the worker instead of using a GPU for nobody. The server waits on
the result key (the client's BLPOP wake-up), then answers the ChatCompletion/Completion
object, or the result's error with the status `qbatch bulk` output lines use
(`producer.batch_output.status_code`: 400 for a bad request or unknown model, 408 for a
deadline, 500 for an engine error, ...).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from datetime import timedelta
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import redis
from kafka.errors import KafkaError

from producer.batch_output import error_body, status_code
from producer.client import PublishError, QBatchClient, now_utc
from producer.serve.errors import ApiError, openai_code, openai_param
from producer.serve.result_wait import ResultWaiter
from schemas import ContractError, ResultEnvelope, Status
from schemas.result import read_stored
from schemas.result_size import DEFAULT_MAX_RESULT_BYTES

T = TypeVar("T")
TIMEOUT_HEADER = "x-stainless-timeout"
GRACE_S = 2.0
"""Waited past the deadline, so a request that expired unstarted gets its `expired`
result (a 408) rather than a bare timeout."""


def request_timeout(headers: Mapping[str, str], default: float, maximum: float) -> float:
    """The caller's timeout in seconds (`X-Stainless-Timeout`, else `default`), capped."""
    raw = headers.get(TIMEOUT_HEADER)
    try:
        value = float(raw) if raw is not None else default
    except ValueError:
        value = default
    if not math.isfinite(value) or value <= 0:
        value = default
    return min(value, maximum)


class SyncSlots:
    """Admission of sync requests: at most `limit` wait at once, and a tenant at most
    `per_tenant` of them (one tenant's burst of slow requests cannot take every slot
    from the others); one past either is answered 429 at once (the `openai` SDK backs
    off and retries a 429 by itself). The wait itself holds no thread
    (`producer.serve.result_wait`); publishing does, briefly, on `submits`, a pool of
    its own so a slow Kafka never takes the threads `/v1/files` and `/healthz` run on.
    Used from the event loop only (no lock: nothing awaits between check and count).
    """

    def __init__(self, limit: int, per_tenant: int | None = None, submit_threads: int = 32) -> None:
        self.limit = limit
        self.per_tenant = min(per_tenant, limit) if per_tenant and per_tenant > 0 else limit
        self.submits = anyio.CapacityLimiter(submit_threads)
        self.by_tenant: Counter[str] = Counter()
        """Requests in flight, per tenant (a tenant leaves it at none)."""

    @property
    def in_flight(self) -> int:
        return self.by_tenant.total()

    def take(self, tenant: str) -> None:
        if self.in_flight >= self.limit:
            raise ApiError(
                429,
                f"the server has {self.limit} chat/completions requests in flight (its "
                "limit, --max-sync-inflight); retry shortly",
                code="rate_limit_exceeded",
            )
        if self.by_tenant[tenant] >= self.per_tenant:
            raise ApiError(
                429,
                f"this key's tenant has {self.per_tenant} chat/completions requests in flight "
                "(the limit per tenant, --max-sync-inflight-per-tenant); retry shortly",
                code="rate_limit_exceeded",
            )
        self.by_tenant[tenant] += 1

    def give(self, tenant: str) -> None:
        self.by_tenant[tenant] -= 1
        if self.by_tenant[tenant] <= 0:
            del self.by_tenant[tenant]

    async def run(self, tenant: str, work: Callable[[], Awaitable[T]]) -> T:
        """`work()`, past `take(tenant)` (made only once admitted)."""
        self.take(tenant)
        try:
            return await work()
        finally:
            self.give(tenant)


async def run_sync(
    client: QBatchClient,
    waiter: ResultWaiter,
    submits: anyio.CapacityLimiter,
    body: Any,
    endpoint: str,
    timeout: float,
    tenant: str,
    on_result: Callable[[str, ResultEnvelope], None] | None = None,
    max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES,
) -> tuple[int, bytes]:
    """Submit one body (on a thread of `submits`), wait for its result (`waiter`, on the
    event loop): (HTTP status, JSON body bytes). ApiError for what is refused before it
    is queued (stream, a body the contract refuses, a result that could pass
    `max_result_bytes`, no Kafka).

    A succeeded result's response goes out as the bytes Redis holds (`response_span`):
    parsing a result of megabytes costs ~60x its size, and one request for `n` 16 x
    `top_logprobs` 20 OOM-killed the server that way. Only the small rest is parsed, for
    usage (`light_result`)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_request")
    if body.get("stream"):
        raise ApiError(
            400,
            "stream: true is not supported by qbatch serve (answers come whole from the "
            "queue); leave stream out or set it to false",
            code="unsupported_parameter",
            param="stream",
        )
    deadline = now_utc() + timedelta(seconds=timeout)

    def submit() -> str:
        return client.submit(
            body,
            endpoint=endpoint,
            lane=None,
            deadline=deadline,
            metadata={"tenant": tenant},
            max_result_bytes=max_result_bytes,
        )

    try:
        rid = await anyio.to_thread.run_sync(submit, limiter=submits)
        raw = await waiter.wait_raw(rid, timeout + GRACE_S)
    except ContractError as exc:
        raise ApiError(
            400, exc.message, code=openai_code(exc.code), param=openai_param(exc.param)
        ) from None
    except (PublishError, KafkaError, redis.exceptions.RedisError) as exc:
        raise ApiError(
            503, f"the queue is unavailable ({type(exc).__name__})", code="queue_unavailable"
        ) from None
    if raw is None:
        raise ApiError(504, f"no answer within {timeout:g} s", code="timeout")
    result, span = read_stored(raw)
    if on_result is not None:
        on_result(tenant, result)  # usage (producer.serve.metrics.UsageRecorder)
    if span is not None:
        return 200, raw[span[0] : span[1]]
    if result.status is Status.succeeded and result.response is not None:  # an older layout
        return 200, result.response.model_dump_json().encode()
    return status_code(result), json.dumps(error_body(result)).encode()


__all__ = ["GRACE_S", "TIMEOUT_HEADER", "SyncSlots", "request_timeout", "run_sync"]
