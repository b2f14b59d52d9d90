"""The loop's pure logic: the worker's route/finalize and the executor's continuation."""

from __future__ import annotations

from typing import Any

import pytest

from schemas import ChatCompletion, ErrorCode, ErrorInfo, RequestEnvelope, ResultEnvelope, Status
from schemas.keys import RedisKeys
from schemas.result import AssistantOutput, ChatChoice
from schemas.tool_events import ToolTurnEvent
from schemas.tool_loop import CallRecord
from schemas.usage import Usage
from worker.tool_loop.continuation import (
    ContinuationError,
    aborted,
    continuation,
    fingerprint,
    pending_calls,
)
from worker.tool_loop.routing import event_too_large, finalize, route, turn_of
from worker.tool_loop.runner import PendingCall

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}


def envelope(max_turns: int | None = 3, **extra: Any) -> RequestEnvelope:
    data: dict[str, Any] = {
        "request_id": "r1",
        "job_id": "j1",
        "metadata": {"team": "t"},
        "body": {
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [TOOL],
            **extra.pop("body", {}),
        },
        **extra,
    }
    if max_turns is not None:
        data["tool_loop"] = {"max_turns": max_turns}
    return RequestEnvelope.model_validate(data)


def usage(n: int) -> Usage:
    return Usage(prompt_tokens=n, completion_tokens=n, total_tokens=2 * n)


def result(env: RequestEnvelope, *, calls: bool, n: int = 1) -> ResultEnvelope:
    message = AssistantOutput(
        content=None if calls else "done",
        tool_calls=[CALL] if calls else None,  # type: ignore[list-item]
    )
    response = ChatCompletion(
        id="x",
        created=0,
        model="m",
        choices=[ChatChoice(message=message, finish_reason="tool_calls" if calls else "stop")],
        usage=usage(n),
    )
    return ResultEnvelope.for_request(env, Status.succeeded, response=response)


def record(content: str = '{"ok": true}') -> CallRecord:
    return CallRecord(
        id="call_1", name="f", arguments='{"a": 1}', ok=True, content=content, duration_ms=2.0
    )


def event_for(env: RequestEnvelope) -> ToolTurnEvent:
    routed = route(env, result(env, calls=True), lane="bulk", now_ms=7)
    assert isinstance(routed, ToolTurnEvent)
    return routed


def test_a_plain_request_passes_through() -> None:
    env = envelope(max_turns=None)
    res = result(env, calls=True)
    assert route(env, res, lane="bulk", now_ms=0) is res
    assert finalize(env, res) is res


def test_a_turn_with_calls_and_turns_left_becomes_an_event() -> None:
    env = envelope()
    event = event_for(env)
    assert (event.request_id, event.turn, event.lane, event.emitted_ms) == ("r1", 1, "bulk", 7)
    assert event.message.tool_calls and event.message.tool_calls[0].id == "call_1"
    assert event.envelope is env


def test_the_loop_walks_its_turns_and_sums_usage_into_the_final_result() -> None:
    env = envelope(body={"tool_choice": "required"})
    first = event_for(env)
    (pending,) = pending_calls(first)
    assert (pending.request_id, pending.turn, pending.call_id, pending.job_id) == (
        "r1",
        1,
        "call_1",
        "j1",
    )
    second_env = continuation(first, [record()])
    assert turn_of(second_env) == 2 and second_env.request_id == "r1"
    assert second_env.loop is not None and second_env.loop.lane == "bulk"
    body = second_env.body.model_dump(exclude_none=True)  # type: ignore[union-attr]
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "tool"]
    assert body["messages"][2]["tool_call_id"] == "call_1"
    assert body["tool_choice"] == "auto"  # a forced choice is not forced again
    second = route(second_env, result(second_env, calls=True, n=10), lane="interactive", now_ms=0)
    assert isinstance(second, ToolTurnEvent) and second.lane == "bulk"  # the first turn's lane
    third_env = continuation(second, [record()])
    assert third_env.loop is not None and [t.turn for t in third_env.loop.transcript] == [1, 2]
    final = route(third_env, result(third_env, calls=False, n=100), lane="bulk", now_ms=0)
    assert isinstance(final, ResultEnvelope) and final.ok
    assert final.tool_loop is not None and final.tool_loop.turns == 3
    assert final.tool_loop.usage == usage(111) == final.response.usage  # type: ignore[union-attr]
    assert [t.calls[0].content for t in final.tool_loop.transcript] == ['{"ok": true}'] * 2


def test_the_last_turn_that_still_calls_fails_with_the_transcript() -> None:
    env = envelope(max_turns=2)
    nxt = continuation(event_for(env), [record()])
    final = route(nxt, result(nxt, calls=True), lane="bulk", now_ms=0)
    assert isinstance(final, ResultEnvelope) and final.status is Status.failed
    assert final.error is not None and final.error.code is ErrorCode.tool_loop_max_turns
    assert final.error.param == "tool_loop.max_turns"
    assert final.tool_loop is not None and final.tool_loop.turns == 2
    assert final.response is not None  # the calls it did not run are visible


def test_a_failed_turn_ends_the_loop_with_what_was_done() -> None:
    env = continuation(event_for(envelope()), [record()])
    error = ErrorInfo(code=ErrorCode.internal_error, message="engine down")
    failed = ResultEnvelope.for_request(env, Status.failed, error=error)
    final = route(env, failed, lane="bulk", now_ms=0)
    assert isinstance(final, ResultEnvelope) and final.status is Status.failed
    assert final.tool_loop is not None and final.tool_loop.turns == 1  # turn 2 never ran
    assert final.tool_loop.usage == usage(1)


def test_an_event_too_large_for_the_topic_aborts() -> None:
    env = envelope()
    final = event_too_large(env, result(env, calls=True), 2_000_000, 1_000_000)
    assert final.error is not None and final.error.code is ErrorCode.tool_loop_aborted
    assert "2000000" in final.error.message


def test_a_continuation_over_the_limits_is_an_aborted_envelope_instead() -> None:
    env = envelope()
    event = event_for(env)
    huge = record(content="x" * 900_000)
    with pytest.raises(ContinuationError, match="over the envelope limit"):
        continuation(event, [huge])  # the content twice: a message and the transcript
    stop = aborted(event, [huge], "too large")
    assert stop.loop is not None and stop.loop.abort is not None
    assert stop.loop.abort.code is ErrorCode.tool_loop_aborted
    assert len(stop.loop.transcript[0].calls[0].content) == 2_000  # trimmed
    assert stop.body == env.body  # the turn's own envelope, unchanged otherwise


def test_a_caller_cannot_send_loop_state() -> None:
    with pytest.raises(ValueError):
        envelope(max_turns=None, loop={"turn": 2, "transcript": []})


def test_fingerprints_change_with_any_part_of_the_call() -> None:
    base = PendingCall("r", 1, "c", "f", "{}")
    prints = {
        fingerprint(base),
        fingerprint(PendingCall("r", 1, "c2", "f", "{}")),
        fingerprint(PendingCall("r", 1, "c", "g", "{}")),
        fingerprint(PendingCall("r", 1, "c", "f", '{"a": 1}')),
    }
    assert len(prints) == 4
    assert fingerprint(PendingCall("other", 9, "c", "f", "{}")) == fingerprint(
        base
    )  # key has those


# ---------------------------------------------------------------- issue 40: one event, no stop


def test_a_turn_of_129_calls_is_aborted_not_a_crash() -> None:
    """TurnRecord holds at most MAX_TOOLS (128) calls: built outside any `try`, a 129-call
    turn stopped every executor, on every restart. The worker now runs at most 128 (the
    rest are tool_call_errors), and the executor aborts such an event whatever its calls."""
    from schemas.limits import MAX_TOOLS

    event = event_for(envelope())
    records = [record() for _ in range(MAX_TOOLS + 1)]
    with pytest.raises(ContinuationError):
        continuation(event, records)
    env = aborted(event, records, "too many calls")
    assert env.loop is not None and env.loop.abort is not None
    assert len(env.loop.transcript[-1].calls) == MAX_TOOLS


def test_aborting_a_forged_sixteen_turn_loop_never_raises() -> None:
    from schemas.limits import MAX_TOOL_TURNS
    from schemas.tool_loop import LoopState

    transcript = [
        {"turn": t, "content": None, "calls": [], "usage": usage(1).model_dump()}
        for t in range(1, MAX_TOOL_TURNS + 1)
    ]
    loop = LoopState.model_validate({"turn": MAX_TOOL_TURNS, "transcript": transcript})
    forged = envelope(max_turns=MAX_TOOL_TURNS).model_copy(update={"loop": loop})
    event = event_for(envelope()).model_copy(update={"turn": MAX_TOOL_TURNS, "envelope": forged})
    with pytest.raises(ContinuationError):
        continuation(event, [record()])
    out = aborted(event, [record()], "x")
    assert out.loop is not None and out.loop.turn == MAX_TOOL_TURNS
    assert len(out.loop.transcript) <= MAX_TOOL_TURNS and out.loop.abort is not None


def test_an_error_message_quoting_a_huge_argument_is_cut() -> None:
    """A validator's message quotes the value: 160,000 x U+200B made the call's record too
    large for its own schema (900,000 characters)."""
    from schemas.tool_loop import ToolErrorKind
    from worker.tool_loop.runner import ERROR_MESSAGE_CHARS, error_content

    content = error_content(ToolErrorKind.invalid_arguments, "bad: " + "\u200b" * 160_000)
    assert len(content) < ERROR_MESSAGE_CHARS + 200
    CallRecord(id="c", name="f", arguments="{}", ok=False, content=content, duration_ms=0)


def test_usage_sums_are_held_at_the_bound() -> None:
    from schemas.usage import TOKEN_BOUND

    big = Usage(prompt_tokens=TOKEN_BOUND, completion_tokens=TOKEN_BOUND, total_tokens=TOKEN_BOUND)
    assert big.plus(big).total_tokens == TOKEN_BOUND


def test_the_worker_runs_at_most_128_calls_a_turn() -> None:
    from schemas.limits import MAX_TOOLS
    from schemas.request import Tool
    from worker.toolcalls import parse_output

    text = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>' * (MAX_TOOLS + 2)
    parsed = parse_output(text, tools=[Tool.model_validate(TOOL)], reasoning_enabled=False)
    assert len(parsed.tool_calls) == MAX_TOOLS and len(parsed.errors) == 2
    assert "at most 128" in parsed.errors[0].reason


def test_a_loop_is_run_only_with_the_executors_signature() -> None:
    """Any producer could set `loop` (a forged transcript, a continuation's priority)."""
    from schemas.decode import decode_request, encode_request
    from schemas.loop_auth import LoopSigner

    signer, other = LoopSigner(b"k" * 32), LoopSigner(b"x" * 32)
    nxt = continuation(event_for(envelope()), [record()])
    signed = signer.sign(nxt)
    wire = decode_request(encode_request(signed), signed.request_id.encode())  # a round trip
    assert signer.valid(wire) and not other.valid(wire)
    assert not signer.valid(nxt)  # unsigned
    assert signer.valid(envelope())  # no loop: nothing to check
    moved = wire.model_copy(update={"request_id": "r2"})
    assert not signer.valid(moved)  # a signed loop is its request's only
    bumped = wire.model_copy(
        update={"loop": wire.loop.model_copy(update={"lane": "interactive"})}  # type: ignore[union-attr]
    )
    assert not signer.valid(bumped)


def test_the_chaos_tests_ledger_key_is_the_executors() -> None:
    """tests/tool_fixtures.py rebuilds a call's ledger key from the permission hook's
    context; if it drifted from the executor's, the kill -9 test's count of recorded calls
    run again could never be above 0."""
    from schemas.request import Tool
    from tests.tool_fixtures import call_block, ledger_key, registry
    from worker.tool_loop.ledger import CallLedger
    from worker.tool_loop.registry import parse_arguments
    from worker.tool_loop.spec import ToolCallContext
    from worker.toolcalls import parse_output

    tools = [Tool.model_validate(t) for t in registry.openai_tools("step")]
    text = call_block("step", n=1, until=2, tag="Lé 7")
    parsed = parse_output(text, tools=tools, reasoning_enabled=False)
    (call,) = parsed.tool_calls
    pending = PendingCall("req-1", 2, call.id, call.function.name, call.function.arguments)
    context = ToolCallContext(
        request_id="req-1",
        turn=2,
        call_id=call.id,
        name=call.function.name,
        arguments=parse_arguments(call.function.arguments),
    )

    class Settings:
        keys = RedisKeys("pfx")

    ledger = CallLedger(None, Settings())  # type: ignore[arg-type]
    assert ledger_key(context, "pfx") == ledger.key(pending)
