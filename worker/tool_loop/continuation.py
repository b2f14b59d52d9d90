"""A tool loop's next turn, built from a turn event and its calls' records. Pure.

The continuation is the same request (same `request_id`, job, options and deadline) with
the assistant message of the turn (its `tool_calls`, its text and reasoning) and one `tool`
message per call appended, and `loop` set: the next turn's number, the transcript so far
and the lane. A `tool_choice` that forced a call (`"required"` or a named function) becomes
`"auto"` for the continuation, as agent loops do, or every turn would call a tool again and
the loop could only end at its turn limit.

It is validated as any envelope; a continuation that would break the contract's limits
(too many messages, too large) becomes an *aborted* continuation instead: the envelope the
turn ran with, `loop.abort` set, so the worker answers the request `tool_loop_aborted` with
the transcript, and the one place results are written stays the worker.
"""

from __future__ import annotations

import hashlib
from typing import Any

from pydantic import ValidationError

from schemas import ChatCompletionBody, ContractError, ErrorCode, ErrorInfo, RequestEnvelope
from schemas.decode import encode_request
from schemas.limits import MAX_ENVELOPE_BYTES, MAX_TOOL_TURNS, MAX_TOOLS
from schemas.tool_events import ToolTurnEvent
from schemas.tool_loop import CallRecord, LoopState, TurnRecord
from worker.tool_loop.runner import PendingCall

ABORT_CONTENT_CHARS = 2_000
"""An aborted continuation keeps at most this much of each call's content in its transcript."""


class ContinuationError(ValueError):
    """The continuation would break the contract (the message says how)."""


def pending_calls(event: ToolTurnEvent) -> list[PendingCall]:
    env = event.envelope
    return [
        PendingCall(
            request_id=event.request_id,
            turn=event.turn,
            call_id=call.id,
            name=call.function.name,
            arguments=call.function.arguments,
            job_id=env.job_id,
            metadata=env.metadata,
        )
        for call in event.message.tool_calls or ()
    ]


def fingerprint(call: PendingCall) -> str:
    """Names one call of one turn: only the same id, name and arguments reuse a record."""
    digest = hashlib.sha256("\0".join((call.call_id, call.name, call.arguments)).encode())
    return digest.hexdigest()[:32]


def _turn(event: ToolTurnEvent, records: list[CallRecord]) -> TurnRecord:
    return TurnRecord(
        turn=event.turn, content=event.message.content, calls=records, usage=event.usage
    )


def continuation(event: ToolTurnEvent, records: list[CallRecord]) -> RequestEnvelope:
    """The next turn's envelope (raise ContinuationError)."""
    env = event.envelope
    if not isinstance(env.body, ChatCompletionBody):
        raise ContinuationError("a tool loop needs a chat request")
    body: dict[str, Any] = env.body.model_dump(mode="json", exclude_none=True, by_alias=True)
    message = event.message.model_dump(mode="json", exclude_none=True)
    body["messages"].append(message)
    body["messages"].extend(
        {"role": "tool", "tool_call_id": record.id, "content": record.content} for record in records
    )
    if body.get("tool_choice") not in (None, "auto", "none"):
        body["tool_choice"] = "auto"
    data = env.model_dump(mode="json", exclude_none=True, by_alias=True)
    data["body"] = body
    try:
        transcript = [*(env.loop.transcript if env.loop else ()), _turn(event, records)]
        data["loop"] = {
            "turn": event.turn + 1,
            "transcript": [t.model_dump(mode="json") for t in transcript],
            "lane": event.lane,
        }
        nxt = RequestEnvelope.model_validate(data)
    except ValidationError as exc:
        raise ContinuationError(ContractError.from_validation(exc).message) from None
    size = len(encode_request(nxt))
    if size > MAX_ENVELOPE_BYTES:
        raise ContinuationError(
            f"the continuation is {size} bytes, over the envelope limit {MAX_ENVELOPE_BYTES}"
        )
    return nxt


def aborted(event: ToolTurnEvent, records: list[CallRecord], reason: str) -> RequestEnvelope:
    """The turn's own envelope with `loop.abort`: the worker answers it, unrun. Never
    raises: the transcript keeps what the contract's limits allow (at most MAX_TOOLS
    calls, short contents, the last MAX_TOOL_TURNS turns), or none at all."""
    env = event.envelope
    abort = ErrorInfo(
        code=ErrorCode.tool_loop_aborted,
        message=f"the loop could not continue after turn {event.turn}: {reason}"[:4_000],
    )
    turn = min(max(event.turn + 1, 2), MAX_TOOL_TURNS)
    short = [
        r.model_copy(update={"content": r.content[:ABORT_CONTENT_CHARS]})
        for r in records[:MAX_TOOLS]
    ]
    try:
        kept = [*(env.loop.transcript if env.loop else ()), _turn(event, short)]
        loop = LoopState(turn=turn, transcript=kept[-MAX_TOOL_TURNS:], lane=event.lane, abort=abort)
    except Exception:  # a turn the records cannot describe: abort without a transcript
        loop = LoopState(turn=turn, transcript=[], lane=event.lane, abort=abort)
    return env.model_copy(update={"loop": loop})


__all__ = ["ContinuationError", "aborted", "continuation", "fingerprint", "pending_calls"]
