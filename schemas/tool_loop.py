"""The tool loop's part of the contract: the opt-in option, the state a continuation
carries, and the transcript a final result reports.

A request with `tool_loop` set is run as a loop: each model turn that ends in tool calls
(with turns left) goes to the tool-calls topic instead of a result; an executor runs the
calls and publishes a *continuation*, the same request (same `request_id`) with the
assistant message and one `tool` message per call appended and `loop` set. Only the last
turn writes a result, at the original request's key, with `tool_loop` (a `ToolLoopReport`)
in it. The models here are the loop's memory between processes, so they travel inside
envelopes and must stay small and strict.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from schemas import limits
from schemas.errors import ErrorInfo
from schemas.usage import Usage


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


Turn = Annotated[int, Field(ge=1, le=limits.MAX_TOOL_TURNS)]


class ToolLoopOptions(_Strict):
    """`tool_loop` of an envelope: run the model's tool calls and continue."""

    max_turns: Turn = Field(
        limits.DEFAULT_TOOL_TURNS,
        description="Model turns at most (each one after the first follows a round of "
        "tool calls); a last turn that still calls tools fails `tool_loop_max_turns`.",
    )


class ToolErrorKind(StrEnum):
    """Why a call did not run to a result (the model reads the same words)."""

    unknown_tool = "unknown_tool"
    invalid_arguments = "invalid_arguments"
    timeout = "timeout"
    exception = "exception"
    result_too_large = "result_too_large"
    permission_denied = "permission_denied"


class CallRecord(_Strict):
    """One executed (or refused) call: what the model asked and what it was told."""

    id: Annotated[str, Field(min_length=1, max_length=128)]
    name: Annotated[str, Field(max_length=64)]
    arguments: Annotated[str, Field(max_length=limits.MAX_TEXT_CHARS)]
    ok: bool
    content: Annotated[str, Field(max_length=limits.MAX_TEXT_CHARS)]
    """The `tool` message's content: the result, or a JSON error object."""
    error: ToolErrorKind | None = None
    duration_ms: Annotated[float, Field(ge=0)]
    reused: bool = False
    """Taken from the executor's record (a redelivered turn): the tool did not run again."""


class TurnRecord(_Strict):
    """One model turn that ended in tool calls, and the calls' outcomes."""

    turn: Turn
    content: Annotated[str, Field(max_length=limits.MAX_TEXT_CHARS)] | None = None
    """Text the model wrote beside its calls."""
    calls: Annotated[list[CallRecord], Field(max_length=limits.MAX_TOOLS)]
    usage: Usage


Transcript = Annotated[list[TurnRecord], Field(max_length=limits.MAX_TOOL_TURNS)]


class LoopState(_Strict):
    """`loop` of a continuation envelope, set by the executor (never by a caller)."""

    turn: Annotated[int, Field(ge=2, le=limits.MAX_TOOL_TURNS)]
    """The model turn this continuation runs."""
    transcript: Transcript
    lane: Annotated[str, Field(pattern=r"^[a-z][a-z0-9_-]{0,31}$")] | None = None
    """The lane the loop's first turn ran in (its engine priority class)."""
    abort: ErrorInfo | None = None
    """Set when the loop cannot go on (e.g. the continuation would break the envelope's
    limits): the worker answers the request with this error and the transcript, unrun."""
    sig: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")] | None = None
    """The executor's HMAC of the request id and the rest of this object
    (`schemas.loop_auth`): a worker runs no `loop` without a valid one."""


class ToolLoopReport(_Strict):
    """`tool_loop` of a final result."""

    turns: Annotated[int, Field(ge=0, le=limits.MAX_TOOL_TURNS)]
    """Model turns run (the last one included; 0 when the first never ran)."""
    transcript: Transcript
    usage: Usage
    """Summed over every turn (also what `response.usage` says)."""


__all__ = [
    "CallRecord",
    "LoopState",
    "ToolErrorKind",
    "ToolLoopOptions",
    "ToolLoopReport",
    "Transcript",
    "TurnRecord",
]
