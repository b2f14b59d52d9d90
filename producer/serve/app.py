"""`qbatch serve`: the OpenAI Files, Batches, Chat Completions, Completions and Models API
in front of the queue. The FastAPI app factory; routes stay thin and call `storage`,
`batches`, `runner` and `sync`, which hold the logic.

Every route but `/healthz` needs `Authorization: Bearer KEY` (`auth.KeyRing`); a key
sees only its tenant's files and batches, and another tenant's id is a 404 exactly like
an id that does not exist. Every error is OpenAI's `{"error": {message, type, param,
code}}`.
"""

from __future__ import annotations

import hmac
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Annotated, Any

import redis
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from producer.client import QBatchClient
from producer.jobs import JobStore
from producer.serve.auth import KeyRing
from producer.serve.batch_request import new_batch_record
from producer.serve.batches import (
    FINAL,
    MAX_BATCH_LINES,
    MAX_KEPT_BATCHES,
    MAX_WINDOW_HOURS,
    RECORD_TTL_S,
    BatchRecord,
    BatchStatus,
    BatchStore,
    batch_object,
)
from producer.serve.bodies import BATCH_BODY_BYTES, SYNC_BODY_BYTES, json_body
from producer.serve.errors import ApiError, not_found
from producer.serve.files_api import StorageQuota, page_of, register_files
from producer.serve.lease import Lease, LeaseKeeper, LeaseLost
from producer.serve.metrics import UsageRecorder
from producer.serve.page import PAGE_BATCHES, register_page
from producer.serve.result_wait import ResultWaiter
from producer.serve.runner import COLLECT_MARGIN_S, BatchRunner
from producer.serve.sessions import Sessions
from producer.serve.storage import FileStore
from producer.serve.sync import SyncSlots, request_timeout, run_sync
from producer.serve.tenant import Tenant, tenant_of
from producer.serve.upkeep import Upkeep, storage_jobs
from producer.usage import UsageStore
from schemas.endpoints import ENDPOINTS
from schemas.errors import loc_to_param
from schemas.result_size import DEFAULT_MAX_RESULT_BYTES

log = logging.getLogger("qbatch.serve")


@dataclass(frozen=True)
class ServeConfig:
    """The server's limits and defaults (flags / QBATCH_SERVE_*; see `producer.cli_serve`)."""

    max_upload_bytes: int = 200 * 1024 * 1024
    max_concurrent_batches: int = 16
    max_storage_bytes: int | None = None
    """What one tenant's stored files may hold (None: no limit); a tenant's
    `max_storage_bytes` in the keys file overrides it."""
    sync_timeout_s: float = 600.0
    """A sync request's deadline when the client sends no `X-Stainless-Timeout`."""
    max_sync_timeout_s: float = 3_600.0
    max_sync_inflight: int = 4096
    max_sync_inflight_per_tenant: int | None = None
    """One tenant's share of `max_sync_inflight` (None: all of it)."""
    max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES
    """A request (sync, or a batch line) whose result could be larger is refused as it is
    posted (`schemas.result_size`; the workers hold results to their own limit too)."""
    max_batch_lines: int = MAX_BATCH_LINES
    """Request lines a batch's input may hold (OpenAI's 50,000)."""
    reindex: bool = False
    """Import an older release's store again at start (`--reindex`; else once per
    prefix: `producer.serve.legacy_import`)."""
    models: tuple[str, ...] = ()
    metrics_token: str | None = None
    """When set, `/metrics` needs `Authorization: Bearer` this token: its series name every
    tenant and its volumes (QBATCH_SERVE_METRICS_TOKEN; not a flag, it is a secret)."""
    started: int = field(default_factory=lambda: int(time.time()))


@dataclass
class ServeState:
    """Everything the routes use, built once (`build_state`)."""

    config: ServeConfig
    keyring: KeyRing
    storage: FileStore
    client: QBatchClient
    batches: BatchStore
    jobs: JobStore
    runner: BatchRunner
    usage: UsageRecorder
    upkeep: Upkeep
    lease: Lease


def build_state(
    config: ServeConfig, keyring: KeyRing, storage: FileStore, client: QBatchClient, lease: Lease
) -> ServeState:
    """The server's parts, every state change under `lease` (taken by the caller: one
    server per Redis prefix, `producer.serve.lease`)."""
    # A job hash must outlive the longest window (168 h) and the finalize after it.
    jobs = JobStore.of(client, job_ttl_s=MAX_WINDOW_HOURS * 3_600 + COLLECT_MARGIN_S)
    batches = BatchStore(client.redis, client.keys, lease)
    runner = BatchRunner(
        client,
        batches,
        jobs,
        storage,
        max_batch_lines=config.max_batch_lines,
        max_result_bytes=config.max_result_bytes,
        priority_range=lambda tenant: keyring.limits_for(tenant).priority_range,
    )
    usage = UsageRecorder(UsageStore(client.redis, client.keys))
    runner.on_result = usage
    upkeep = Upkeep(storage_jobs(storage, reindex_force=config.reindex))
    return ServeState(config, keyring, storage, client, batches, jobs, runner, usage, upkeep, lease)


def _stop_server() -> None:
    """The lease went to another server: stop as on SIGTERM (uvicorn drains requests, the
    lifespan stops the runner); every write fails with LeaseLost meanwhile."""
    os.kill(os.getpid(), signal.SIGTERM)


def _json_error(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers or None)


def create_app(state: ServeState, *, run_batches: bool = True) -> FastAPI:
    """The ASGI app. `run_batches`: start the batch runner with the app (and resume every
    batch not in a final state) and the storage's upkeep (`producer.serve.upkeep`)."""

    keeper = LeaseKeeper(state.lease, on_lost=_stop_server)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        keeper.start()
        if run_batches:
            state.upkeep.start()
            state.runner.start()
        try:
            yield
        finally:
            state.upkeep.stop(timeout=5)  # first: no sweep starts while the runner stops
            state.runner.stop()
            keeper.stop()  # last: gives the prefix to a successor once nothing here writes
            state.client.close(timeout=5)
            for w in waiters:
                await w.aclose()

    app = FastAPI(title="qbatch serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.serve = state
    cfg = state.config
    slots = SyncSlots(cfg.max_sync_inflight, cfg.max_sync_inflight_per_tenant)
    waiters: list[ResultWaiter] = []

    def waiter() -> ResultWaiter:
        """Made on first use, on the event loop it then serves (an async client's pool
        belongs to one loop)."""
        if not waiters:
            settings = state.client.settings
            waiters.append(
                ResultWaiter.connect(
                    settings.redis_url,
                    state.client.keys,
                    cfg.max_sync_inflight,
                    **settings.redis_kwargs(),
                )
            )
        return waiters[0]

    quota = StorageQuota(state.storage, state.keyring, cfg.max_storage_bytes)

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return _json_error(exc)

    @app.exception_handler(LeaseLost)
    async def _lease_lost(_request: Request, _exc: LeaseLost) -> JSONResponse:
        return _json_error(
            ApiError(
                503,
                "this server is stopping: another qbatch serve took over its Redis prefix; retry",
                code="server_stopping",
            )
        )

    @app.exception_handler(redis.exceptions.RedisError)
    async def _redis_down(_request: Request, exc: redis.exceptions.RedisError) -> JSONResponse:
        """Files' and batches' records live in Redis: while it is down, BUSY or LOADING,
        a retryable 503 (the SDK retries it), not a 500."""
        log.warning("serve: Redis unavailable: %s: %s", type(exc).__name__, exc)
        return _json_error(
            ApiError(
                503, f"the queue is unavailable ({type(exc).__name__})", code="queue_unavailable"
            )
        )

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = tuple(x for x in first.get("loc", ()) if x not in ("query", "path", "body"))
        param = loc_to_param(loc) or None
        message = f"{param}: {first.get('msg', 'invalid')}" if param else "invalid request"
        return _json_error(ApiError(400, message, code="invalid_request", param=param))

    @app.exception_handler(HTTPException)
    async def _http(_request: Request, exc: HTTPException) -> JSONResponse:
        return _json_error(ApiError(exc.status_code, str(exc.detail), code=None))

    @app.exception_handler(Exception)
    async def _internal(_request: Request, exc: Exception) -> JSONResponse:
        log.error("serve: internal error: %s", type(exc).__name__, exc_info=exc)
        return _json_error(ApiError(500, "internal error", code="internal_error"))

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:  # on the event loop: answered with every thread busy
        return {"ok": True}

    @app.get("/metrics")
    def metrics(request: Request) -> Response:
        """Prometheus exposition. Scrapers hold no tenant key: open, or behind its own
        token (`metrics_token`), since the series name every tenant."""
        if cfg.metrics_token is not None:
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode(), cfg.metrics_token.encode()
            ):
                raise ApiError(401, "/metrics needs the metrics token", code="invalid_api_key")
        return Response(state.usage.exposition(), media_type=CONTENT_TYPE_LATEST)

    register_files(app, state.storage, quota, cfg.max_upload_bytes)

    # ------------------------------------------------------------ batches

    @app.post("/v1/batches")
    async def create_batch(request: Request, tenant: Tenant) -> dict[str, Any]:
        body = await json_body(request, BATCH_BODY_BYTES)
        # off the event loop: reads the input file's metadata from storage
        record = await run_in_threadpool(new_batch_record, state.storage, tenant, body)
        await quota.room(tenant, None)
        max_active = (
            state.keyring.limits_for(tenant).max_concurrent_batches or cfg.max_concurrent_batches
        )
        refused = await run_in_threadpool(state.batches.create, record, max_active)
        if refused == "active":
            raise ApiError(
                429,
                f"this key's tenant already has {max_active} batches in progress (the limit); "
                "wait for one to finish",
                code="batch_limit_reached",
            )
        if refused is not None:
            raise ApiError(
                429,
                f"this key's tenant holds {MAX_KEPT_BATCHES:,} batch records (the limit; "
                f"finished ones expire after {RECORD_TTL_S // 86_400} days)",
                code="batch_limit_reached",
            )
        state.runner.wake()
        return batch_object(record, None)

    def own_batch(batch_id: str, tenant: str) -> BatchRecord:
        record = state.batches.get(batch_id, tenant)
        if record is None:
            raise not_found("Batch", batch_id)
        return record

    def present(record: BatchRecord) -> dict[str, Any]:
        view = None if record.final_counts is not None else state.jobs.view(record.id)
        return batch_object(record, view)

    @app.get("/v1/batches/{batch_id}")
    def retrieve_batch(batch_id: str, tenant: Tenant) -> dict[str, Any]:
        return present(own_batch(batch_id, tenant))

    @app.get("/v1/batches")
    def list_batches(
        tenant: Tenant,
        after: str | None = None,
        limit: Annotated[int, Query(ge=1, le=100)] = 20,
    ) -> dict[str, Any]:
        records, more = state.batches.list(tenant, after=after, limit=limit)
        return page_of([present(r) for r in records], more)

    def newest_batches(tenant: str) -> list[dict[str, Any]]:
        records, _more = state.batches.list(tenant, after=None, limit=PAGE_BATCHES)
        return [present(r) for r in records]

    sessions = Sessions(state.client.redis, state.client.keys)
    register_page(app, tenant_of, state.keyring, newest_batches, sessions)  # GET /: page

    @app.post("/v1/batches/{batch_id}/cancel")
    def cancel_batch(batch_id: str, tenant: Tenant) -> dict[str, Any]:
        record = own_batch(batch_id, tenant)
        if record.status in FINAL or record.status == BatchStatus.finalizing:
            raise ApiError(
                409,
                f"batch {batch_id} is {record.status}: it can no longer be cancelled",
                code="batch_not_cancellable",
            )
        state.batches.transition(
            batch_id,
            (BatchStatus.validating, BatchStatus.in_progress),
            status=BatchStatus.cancelling,
            cancelling_at=int(time.time()),
        )
        state.jobs.cancel(batch_id)  # workers answer the job's unstarted lines `cancelled`
        state.runner.wake()
        return present(own_batch(batch_id, tenant))

    # ------------------------------------------------------------ sync + models

    async def sync(request: Request, tenant: str, endpoint: str) -> Response:
        body = await json_body(request, SYNC_BODY_BYTES)
        timeout = request_timeout(request.headers, cfg.sync_timeout_s, cfg.max_sync_timeout_s)
        status, payload = await slots.run(
            tenant,
            lambda: run_sync(
                state.client,
                waiter(),
                slots.submits,
                body,
                endpoint,
                timeout,
                tenant,
                state.usage,
                cfg.max_result_bytes,
            ),
        )
        return Response(payload, status_code=status, media_type="application/json")

    def sync_route(path: str) -> Callable[..., Awaitable[Response]]:
        async def handle(request: Request, tenant: Tenant) -> Response:
            return await sync(request, tenant, path)

        handle.__name__ = "sync_" + path.strip("/").replace("/", "_")
        return handle

    for spec in ENDPOINTS:  # one synchronous route per endpoint of the table
        app.post(spec.path, name=spec.path)(sync_route(spec.path))

    def model_object(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": cfg.started, "owned_by": "qbatch"}

    routes = state.client.routes
    served = tuple(routes.models) if routes is not None else cfg.models  # the table rules
    if not served:
        log.warning(
            "serve: /v1/models lists nothing: give --models (the names your workers serve) "
            "or a route table"
        )

    @app.get("/v1/models")
    def list_models(tenant: Tenant) -> dict[str, Any]:
        return {"object": "list", "data": [model_object(m) for m in served]}

    @app.get("/v1/models/{model:path}")
    def retrieve_model(model: str, tenant: Tenant) -> dict[str, Any]:
        if model not in served:
            raise not_found("Model", model)
        return model_object(model)

    return app


__all__ = ["ServeConfig", "ServeState", "build_state", "create_app"]
