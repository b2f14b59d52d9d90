"""The worker's side of a tool loop, pure: a finished turn becomes a result or a turn event.

A request opts in with `tool_loop`. When its turn succeeded with tool calls and turns are
left, `route` returns a `ToolTurnEvent` for the tool-calls topic instead of a result
(nothing is written to the reply key yet); every other outcome of a loop request, on any
turn, is its final result, and `finalize` adds the loop's report to it: the transcript
the continuation carried, the number of turns, and usage summed over all of them (also
in `response.usage`, so cost accounting reads one place). A last allowed turn that still
calls tools fails `tool_loop_max_turns`, keeping its response so the caller sees the
calls it did not get to run.
"""

from __future__ import annotations

from collections.abc import Iterable

from schemas import ChatCompletion, ErrorCode, ErrorInfo, RequestEnvelope, ResultEnvelope, Status
from schemas.tool_events import ToolTurnEvent
from schemas.tool_loop import ToolLoopReport
from schemas.usage import ZERO_USAGE, Usage

__all__ = ["event_too_large", "finalize", "route", "turn_of"]


def turn_of(envelope: RequestEnvelope) -> int:
    """The model turn an envelope runs: 1 as submitted, `loop.turn` for a continuation."""
    return envelope.loop.turn if envelope.loop is not None else 1


def route(
    envelope: RequestEnvelope, result: ResultEnvelope, *, lane: str, now_ms: int
) -> ResultEnvelope | ToolTurnEvent:
    """What becomes of one finished turn (a plain request's result passes through)."""
    if envelope.tool_loop is None:
        return result
    response = result.response
    if not (result.ok and isinstance(response, ChatCompletion) and response.choices):
        return finalize(envelope, result)
    choice = response.choices[0]
    if choice.finish_reason != "tool_calls" or not choice.message.tool_calls:
        return finalize(envelope, result)
    turn = turn_of(envelope)
    if turn >= envelope.tool_loop.max_turns:
        message = (
            f"turn {turn} of at most {envelope.tool_loop.max_turns} still called tools; the "
            "response holds the calls that were not run"
        )
        failed = _failed(result, ErrorCode.tool_loop_max_turns, message, "tool_loop.max_turns")
        return finalize(envelope, failed)
    return ToolTurnEvent(
        request_id=envelope.request_id,
        turn=turn,
        lane=envelope.loop.lane if envelope.loop and envelope.loop.lane else lane,
        envelope=envelope,
        message=choice.message,
        usage=response.usage,
        emitted_ms=now_ms,
    )


def finalize(envelope: RequestEnvelope, result: ResultEnvelope) -> ResultEnvelope:
    """A loop request's final result: the report added, usage summed (identity otherwise)."""
    if envelope.tool_loop is None:
        return result
    transcript = list(envelope.loop.transcript) if envelope.loop is not None else []
    earlier = _sum(turn.usage for turn in transcript)
    update: dict[str, object] = {}
    response = result.response
    if response is not None:
        assert isinstance(response.usage, Usage), "a tool loop is chat's (schemas.request)"
        total = earlier.plus(response.usage)
        update["response"] = response.model_copy(update={"usage": total})
    else:
        total = earlier
    turns = turn_of(envelope) if result.response is not None else len(transcript)
    update["tool_loop"] = ToolLoopReport(turns=turns, transcript=transcript, usage=total)
    return result.model_copy(update=update)


def event_too_large(
    envelope: RequestEnvelope, result: ResultEnvelope, size: int, limit: int
) -> ResultEnvelope:
    """The turn's event cannot go on the topic: the loop ends here, failed, with its report."""
    message = (
        f"turn {turn_of(envelope)}'s tool-call event is {size} bytes, over the tool-calls "
        f"topic's {limit}; the response holds the calls not run"
    )
    return finalize(envelope, _failed(result, ErrorCode.tool_loop_aborted, message))


def _failed(
    result: ResultEnvelope, code: ErrorCode, message: str, param: str | None = None
) -> ResultEnvelope:
    error = ErrorInfo(code=code, message=message, param=param)
    return result.model_copy(update={"status": Status.failed, "error": error})


def _sum(usages: Iterable[Usage]) -> Usage:
    total = ZERO_USAGE
    for usage in usages:
        total = total.plus(usage)
    return total
