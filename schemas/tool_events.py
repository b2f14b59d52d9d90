"""The record on the tool-calls topic: one model turn of a tool loop that ended in calls.

The worker publishes it (key = request_id, so one loop's turns stay in one partition's
order) instead of writing a result; the tool executor consumes it, runs the calls and
publishes the continuation (`schemas.request.RequestEnvelope` with `loop` set) to the
requests topic. The event holds the envelope exactly as the turn ran, so the executor
needs nothing else to build the next turn.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, model_validator

from schemas.request import RequestEnvelope
from schemas.result import AssistantOutput
from schemas.tool_loop import Turn
from schemas.usage import Usage


class ToolTurnEvent(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    v: Literal[1] = 1
    request_id: str
    turn: Turn
    """The model turn that made these calls (1 for the request as submitted)."""
    lane: str
    """The lane the loop runs in (the first turn's), carried into the continuation."""
    envelope: RequestEnvelope
    message: AssistantOutput
    """The assistant message of this turn; `tool_calls` is never empty."""
    usage: Usage
    emitted_ms: int
    """When the worker published it (epoch ms): the executor's queue time starts here."""

    @model_validator(mode="after")
    def _one_request(self) -> ToolTurnEvent:
        # The record's key and the continuation are the envelope's id; an event naming
        # another id would answer (and sign) a request it does not carry.
        if self.request_id != self.envelope.request_id:
            raise ValueError("request_id must equal envelope.request_id")
        # Only a tool loop's turn makes an event; without `tool_loop` its continuation
        # could not be read back (the fuzz suite found one the executor would publish).
        if self.envelope.tool_loop is None:
            raise ValueError("envelope.tool_loop is required: the event is a tool loop's turn")
        if self.turn >= self.envelope.tool_loop.max_turns:  # the worker answers that turn
            raise ValueError("turn: a loop's last turn makes no event (tool_loop.max_turns)")
        return self


__all__ = ["ToolTurnEvent"]
