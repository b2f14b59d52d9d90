"""What the executor publishes for one turn event, as pure functions: the continuation,
or the aborted envelope that still answers the request when the event cannot be carried on
(malformed, a transcript over its bounds), and the topic it goes to."""

from __future__ import annotations

import json

from schemas import ConnectionSettings, ContractError, ErrorCode, ErrorInfo, RequestEnvelope
from schemas.decode import encode_request
from schemas.limits import MAX_ENVELOPE_BYTES
from schemas.tool_events import ToolTurnEvent
from schemas.tool_loop import CallRecord, LoopState
from worker.tool_loop.continuation import ContinuationError, aborted, continuation


def malformed_answer(value: bytes | None, reason: str) -> RequestEnvelope | None:
    """A malformed event whose envelope still validates: that envelope, aborted, so the
    worker answers its request `tool_loop_aborted` instead of leaving it unanswered."""
    try:
        data = json.loads(value or b"")
        env = RequestEnvelope.model_validate(data["envelope"])
    except (ValueError, KeyError, TypeError):
        return None
    if env.tool_loop is None:
        return None
    turn = min(max(2, (env.loop.turn + 1) if env.loop else 2), env.tool_loop.max_turns)
    loop = LoopState(
        turn=max(turn, 2),
        transcript=env.loop.transcript if env.loop else [],
        lane=env.loop.lane if env.loop else None,
        abort=ErrorInfo(
            code=ErrorCode.tool_loop_aborted,
            message=f"the tool executor got a malformed turn event ({reason[:300]})",
        ),
    )
    return env.model_copy(update={"loop": loop})


def abort_reason(exc: Exception) -> str:
    return (
        str(exc)
        if isinstance(exc, ContinuationError)
        else f"the executor could not build it ({type(exc).__name__})"
    )


def next_envelope(
    event: ToolTurnEvent, records: list[CallRecord]
) -> tuple[RequestEnvelope, Exception | None]:
    """The continuation of `event` once its calls ran (`records`), and None; or, when it
    cannot be built (ContinuationError, or anything else one event can cause), the aborted
    envelope that still answers the request, and why. Never raises for one event: a
    forged 16-turn transcript once stopped every executor here."""
    try:
        return continuation(event, records), None
    except Exception as exc:
        env = aborted(event, records, abort_reason(exc))
        if len(encode_request(env)) > MAX_ENVELOPE_BYTES:
            assert env.loop is not None
            env = env.model_copy(update={"loop": env.loop.model_copy(update={"transcript": []})})
        return env, exc


def continuation_topic(settings: ConnectionSettings, env: RequestEnvelope) -> str:
    """Where a loop's next turn goes: the requests topic of the pool serving its model
    (the route table's interactive `topic`: the turn keeps its first turn's engine
    priority through `loop.lane`), else the interactive topic. A model the table does not
    know goes there too, and the worker answers it `unknown_model`: visible, not lost."""
    if settings.routes is None:
        return settings.topic
    try:
        return settings.routes.route(env.body.model).topic
    except ContractError:
        return settings.topic


__all__ = ["abort_reason", "continuation_topic", "malformed_answer", "next_envelope"]
