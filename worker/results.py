"""Finished engine work -> result envelopes. Pure: no I/O, no clock (times are passed in).

Every outcome goes through `schemas.ResultEnvelope.for_request`, so a success, an engine
error, a rejected record and an expired or cancelled request all echo the same request
fields and move the same job.
"""

from __future__ import annotations

from schemas import (
    ErrorCode,
    ErrorInfo,
    RequestEnvelope,
    ResultEnvelope,
    Status,
    Timings,
    WorkerInfo,
)
from schemas.ref import RequestRef
from worker.endpoints import build_response
from worker.records import Finished
from worker.tool_loop.routing import turn_of
from worker.toolcalls import turn_call_ids


def submitted_ms(envelope: RequestEnvelope | None) -> int | None:
    if envelope is None or envelope.submitted_at is None:
        return None
    return int(envelope.submitted_at.timestamp() * 1000)


def finished_result(
    item: Finished, *, model: str, worker: WorkerInfo, fingerprint: str | None = None
) -> ResultEnvelope:
    """The result of a request the engine ran (succeeded, or failed in the engine)."""
    run, output = item.running, item.output
    env = run.inbound.envelope
    timings = Timings.of(
        submitted=submitted_ms(env),
        dequeued=run.inbound.dequeued_ms,
        dispatched=run.dispatched_ms,
        admitted=run.admitted_ms,
        engine_submitted=run.engine_submitted_ms,
        scheduled=output.scheduled_ms,
        first_token=output.first_token_ms,
        finished=item.finished_ms,
    )
    worker = run.worker or worker
    if output.finish == "error":
        return ResultEnvelope.failure(
            env,
            ErrorCode.engine_error,
            output.error or "engine error",
            timings=timings,
            worker=worker,
        )
    try:
        ids = turn_call_ids(env.request_id, turn_of(env)) if env.tool_loop is not None else None
        response, tool_errors = build_response(
            env,
            run.rendered,
            output,
            model=model,
            created=item.finished_ms // 1000,
            id_factory=ids,
            fingerprint=fingerprint,
        )
    except Exception as exc:  # a parser defect must cost one request, not the writer
        return ResultEnvelope.failure(
            env,
            ErrorCode.internal_error,
            f"building the response: {type(exc).__name__}: {exc}",
            timings=timings,
            worker=worker,
        )
    return ResultEnvelope.for_request(
        env,
        Status.succeeded,
        response=response,
        tool_call_errors=tool_errors,
        timings=timings,
        worker=worker,
        context=run.rendered.context,
    )


def refused_result(
    ref: RequestEnvelope | RequestRef,
    error: ErrorInfo,
    *,
    status: Status = Status.failed,
    dequeued_ms: int | None,
    finished_ms: int,
    worker: WorkerInfo,
) -> ResultEnvelope:
    """The result of a request that never reached the engine."""
    return ResultEnvelope.for_request(
        ref,
        status,
        error=error,
        timings=Timings.of(
            submitted=submitted_ms(ref) if isinstance(ref, RequestEnvelope) else None,
            dequeued=dequeued_ms,
            dispatched=None,
            finished=finished_ms,
        ),
        worker=worker,
    )


def duplicate_result(result: ResultEnvelope) -> ResultEnvelope:
    """What a request gets whose request_id already holds another job's result."""
    return result.model_copy(
        update={
            "status": Status.failed,
            "response": None,
            "tool_call_errors": [],
            "error": ErrorInfo(
                code=ErrorCode.duplicate_request_id,
                message=(
                    f"request_id {result.request_id!r} already has a result from another "
                    "job; request ids are global, use a fresh one"
                ),
                param="request_id",
            ),
        }
    )


__all__ = ["duplicate_result", "finished_result", "refused_result", "submitted_ms"]
