"""Run one round of tool calls: look up, validate, check permission, run with a timeout.

Every call ends as a `schemas.tool_loop.CallRecord`, never an exception: an unknown tool,
arguments that do not parse or validate, a refused sensitive call, a timeout, an
exception in the tool and an oversize result each become a `tool` message whose content
is a JSON error object, so the model can recover (apologise, retry with other arguments).

A tool that raises `ToolError` tells the model its message; any other exception is the
tool's own fault: the model reads a generic message and the exception goes to the log
(`tool_exception`), never into the transcript stored with the result.

Calls run concurrently, each in a thread of its own, and the wait for each ends at its
own start + `timeout_s`. A Python thread cannot be killed: a timed-out synchronous tool
keeps its thread until it returns (its late result is dropped). Coroutine tools all run
on one event loop (a thread of its own, started at the first), cancelled at their timeout
by `asyncio.wait_for`: a client or pool an async tool keeps stays on the loop it was made
on. The clock is injected for the durations.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from schemas.tool_loop import CallRecord, ToolErrorKind
from worker.logs import log
from worker.tool_loop.registry import (
    InvalidArguments,
    ToolCallContext,
    ToolRegistry,
    parse_arguments,
    result_text,
)
from worker.tool_loop.spec import ToolError

Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class PendingCall:
    """One call of a turn, as the model made it."""

    request_id: str
    turn: int
    call_id: str
    name: str
    arguments: str
    job_id: str | None = None
    metadata: dict[str, Any] | None = None


ERROR_MESSAGE_CHARS = 2_000
"""An error's message is cut to this: a validator's message quotes the value it refused
(160,000 x U+200B once made a record too large for its own schema, and stopped every
executor)."""


INTERNAL_ERROR = "the tool failed with an internal error; the tool executor logged it"
"""What the model reads for an exception other than `ToolError`."""


def error_content(kind: ToolErrorKind, message: str) -> str:
    short = (
        message if len(message) <= ERROR_MESSAGE_CHARS else message[:ERROR_MESSAGE_CHARS] + "..."
    )
    return json.dumps({"error": {"type": kind.value, "message": short}}, ensure_ascii=False)


def _record(
    call: PendingCall,
    *,
    content: str,
    error: ToolErrorKind | None = None,
    duration_ms: float = 0.0,
) -> CallRecord:
    return CallRecord(
        id=call.call_id,
        name=call.name,
        arguments=call.arguments,
        ok=error is None,
        content=content,
        error=error,
        duration_ms=round(max(0.0, duration_ms), 3),
    )


def _failed(call: PendingCall, kind: ToolErrorKind, message: str, ms: float = 0.0) -> CallRecord:
    return _record(call, content=error_content(kind, message), error=kind, duration_ms=ms)


class _Running:
    """A call in its thread: its outcome once the thread finishes."""

    def __init__(self, fn: Callable[[], Any], timeout_s: float, clock: Clock) -> None:
        self.timeout_s = timeout_s
        self.value: Any = None
        self.error: BaseException | None = None
        self.started = clock()
        self.ended: float | None = None
        self._clock = clock
        self.thread = threading.Thread(
            target=self._run, args=(fn,), name="qbatch-tool-call", daemon=True
        )
        self.thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            value = fn()
            if inspect.isawaitable(value):
                coroutine = _bounded(value, self.timeout_s)
                value = asyncio.run_coroutine_threadsafe(coroutine, _event_loop()).result()
            self.value = value
        except BaseException as exc:  # reported to the model, never raised here
            self.error = exc
        finally:
            self.ended = self._clock()


async def _bounded(awaitable: Any, timeout_s: float) -> Any:
    return await asyncio.wait_for(awaitable, timeout_s)


_LOOP: asyncio.AbstractEventLoop | None = None
_LOOP_LOCK = threading.Lock()


def _event_loop() -> asyncio.AbstractEventLoop:
    """The one loop every coroutine tool runs on (started on first use, a daemon thread)."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None:
            loop = asyncio.new_event_loop()
            runner = threading.Thread(target=loop.run_forever, name="qbatch-async-tools")
            runner.daemon = True
            runner.start()
            _LOOP = loop
        return _LOOP


def run_calls(
    registry: ToolRegistry, calls: Sequence[PendingCall], *, clock: Clock = time.monotonic
) -> list[CallRecord]:
    """The records of `calls`, in order; the calls that pass their checks run concurrently."""
    records: list[CallRecord | None] = [None] * len(calls)
    running: list[tuple[int, PendingCall, _Running, int]] = []
    for index, call in enumerate(calls):
        spec = registry.get(call.name)
        if spec is None:
            known = ", ".join(registry.names) or "none"
            records[index] = _failed(
                call, ToolErrorKind.unknown_tool, f"no tool {call.name!r} here (tools: {known})"
            )
            continue
        try:
            arguments = parse_arguments(call.arguments)
            validated = spec.validate(arguments)
        except InvalidArguments as exc:
            records[index] = _failed(call, ToolErrorKind.invalid_arguments, str(exc))
            continue
        context = ToolCallContext(
            request_id=call.request_id,
            turn=call.turn,
            call_id=call.call_id,
            name=call.name,
            arguments=arguments,
            job_id=call.job_id,
            metadata=call.metadata,
        )
        if spec.sensitive:
            refusal = _permission(registry, context)
            if refusal is not None:
                records[index] = _failed(call, ToolErrorKind.permission_denied, refusal)
                continue

        def invoke(spec: Any = spec, validated: Any = validated, ctx: Any = context) -> Any:
            return spec.invoke(validated, ctx)

        running.append(
            (index, call, _Running(invoke, spec.timeout_s, clock), spec.max_result_bytes)
        )
    for index, call, run, max_bytes in running:
        run.thread.join(max(0.0, run.started + run.timeout_s - clock()))
        records[index] = _finished(call, run, max_bytes, clock)
    return [r for r in records if r is not None]


def _permission(registry: ToolRegistry, context: ToolCallContext) -> str | None:
    """None when approved, else the reason told to the model."""
    try:
        verdict = registry.permission(context)
    except Exception:  # a broken hook refuses; it never approves by accident
        log.exception("permission_hook_failed", tool=context.name, request_id=context.request_id)
        return "the permission check failed with an internal error; the tool executor logged it"
    if verdict is True:
        return None
    if isinstance(verdict, str) and verdict:
        return verdict
    return f"{context.name!r} is sensitive and the permission check refused this call"


def _finished(call: PendingCall, run: _Running, max_bytes: int, clock: Clock) -> CallRecord:
    if run.thread.is_alive() or isinstance(run.error, TimeoutError):
        return _failed(
            call,
            ToolErrorKind.timeout,
            f"{call.name} did not finish within {run.timeout_s:g} s",
            (clock() - run.started) * 1000,
        )
    ms = ((run.ended or clock()) - run.started) * 1000
    if isinstance(run.error, ToolError):
        return _failed(call, ToolErrorKind.exception, str(run.error), ms)
    if run.error is not None:
        log.error(
            "tool_exception",
            tool=call.name,
            request_id=call.request_id,
            turn=call.turn,
            call_id=call.call_id,
            exc_info=run.error,
        )
        return _failed(call, ToolErrorKind.exception, INTERNAL_ERROR, ms)
    try:
        content = result_text(run.value)
    except Exception as exc:  # a return value JSON cannot hold
        return _failed(call, ToolErrorKind.exception, f"unserialisable result: {exc}", ms)
    size = len(content.encode("utf-8"))
    if size > max_bytes:
        return _failed(
            call,
            ToolErrorKind.result_too_large,
            f"the result is {size} bytes, over this tool's max_result_bytes {max_bytes}",
            ms,
        )
    return _record(call, content=content, duration_ms=ms)


__all__ = ["PendingCall", "error_content", "run_calls"]
