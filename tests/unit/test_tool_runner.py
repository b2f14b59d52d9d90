"""One round of tool calls: every bad case becomes a `tool` message the model can read,
calls run concurrently, and each waits no longer than its own timeout."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from producer.tools import ToolCallContext, ToolRegistry
from schemas.tool_loop import ToolErrorKind
from worker.tool_loop import ToolError
from worker.tool_loop.runner import INTERNAL_ERROR, PendingCall, error_content, run_calls


def call(name: str, arguments: str = "{}", call_id: str | None = None) -> PendingCall:
    return PendingCall("req", 1, call_id or f"call_{name}", name, arguments)


def build() -> tuple[ToolRegistry, list[str]]:
    ran: list[str] = []

    def permission(ctx: ToolCallContext) -> bool | str:
        if ctx.arguments.get("amount", 0) > 100:
            return "over 100 needs a human"
        return ctx.arguments.get("amount", 0) != 13  # 13: a plain refusal

    registry = ToolRegistry(permission=permission)

    @registry.tool
    def echo(text: str) -> dict[str, str]:
        ran.append(f"echo:{text}")
        return {"text": text}

    @registry.tool(timeout_s=0.3)
    def sleepy(seconds: float) -> str:
        time.sleep(seconds)
        ran.append("sleepy")
        return "woke"

    @registry.tool(timeout_s=0.3)
    async def asleep(seconds: float) -> str:
        await asyncio.sleep(seconds)
        return "woke"

    @registry.tool
    def boom() -> str:
        raise RuntimeError("the tool broke")

    @registry.tool(max_result_bytes=10)
    def big() -> str:
        return "é" * 6  # 12 bytes in UTF-8, 6 characters

    @registry.tool
    def odd() -> object:
        return object()

    @registry.tool(sensitive=True)
    def pay(amount: int) -> str:
        ran.append(f"pay:{amount}")
        return "paid"

    return registry, ran


def errors_of(records: list) -> list[ToolErrorKind | None]:  # type: ignore[type-arg]
    return [r.error for r in records]


def test_each_bad_case_is_a_json_error_message_and_good_calls_still_run() -> None:
    registry, ran = build()
    records = run_calls(
        registry,
        [
            call("echo", '{"text": "hi"}'),
            call("nope"),
            call("echo", '{"text": 3}', "c_bad"),
            call("echo", "not json", "c_json"),
            call("boom"),
            call("big"),
            call("odd"),
            call("pay", '{"amount": 50}'),
            call("pay", '{"amount": 500}', "c_500"),
            call("pay", '{"amount": 13}', "c_13"),
        ],
    )
    assert errors_of(records) == [
        None,
        ToolErrorKind.unknown_tool,
        ToolErrorKind.invalid_arguments,
        ToolErrorKind.invalid_arguments,
        ToolErrorKind.exception,
        ToolErrorKind.result_too_large,
        ToolErrorKind.exception,
        None,
        ToolErrorKind.permission_denied,
        ToolErrorKind.permission_denied,
    ]
    assert json.loads(records[0].content) == {"text": "hi"} and records[0].ok
    for record in records[1:7] + records[8:]:
        body = json.loads(record.content)["error"]
        assert body["type"] == record.error.value and body["message"]  # type: ignore[union-attr]
    assert "echo" in records[1].content and "pay" in records[1].content  # lists the tools
    # an exception's text is the tool's internals: logged, never told (nor stored)
    assert "the tool broke" not in records[4].content and "RuntimeError" not in records[4].content
    assert json.loads(records[4].content)["error"]["message"] == INTERNAL_ERROR
    assert "12 bytes" in records[5].content
    assert "over 100 needs a human" in records[8].content
    assert "refused" in records[9].content
    assert sorted(ran) == ["echo:hi", "pay:50"]  # nothing that failed a check ran
    assert [r.id for r in records][:3] == ["call_echo", "call_nope", "c_bad"]


def test_the_default_hook_refuses_sensitive_calls_and_says_why() -> None:
    registry = ToolRegistry()

    @registry.tool(sensitive=True)
    def delete(path: str) -> str:
        raise AssertionError("must not run")

    (record,) = run_calls(registry, [call("delete", '{"path": "/"}')])
    assert record.error is ToolErrorKind.permission_denied
    assert "sensitive" in json.loads(record.content)["error"]["message"]


def test_a_broken_hook_refuses() -> None:
    def hook(ctx: ToolCallContext) -> bool:
        raise KeyError("policy store down")

    registry = ToolRegistry(permission=hook)

    @registry.tool(sensitive=True)
    def pay(amount: int) -> str:
        raise AssertionError("must not run")

    (record,) = run_calls(registry, [call("pay", '{"amount": 1}')])
    assert record.error is ToolErrorKind.permission_denied
    assert "permission check failed" in record.content
    assert "policy store down" not in record.content


def test_calls_run_concurrently_and_time_out_on_their_own_clock() -> None:
    registry, _ = build()
    started = time.monotonic()
    records = run_calls(
        registry,
        [
            call("sleepy", '{"seconds": 5}', "s1"),
            call("sleepy", '{"seconds": 5}', "s2"),
            call("asleep", '{"seconds": 5}', "a1"),
            call("sleepy", '{"seconds": 0.05}', "s3"),
        ],
    )
    elapsed = time.monotonic() - started
    assert errors_of(records) == [ToolErrorKind.timeout] * 3 + [None]
    assert "0.3 s" in records[0].content
    assert elapsed < 2.0, elapsed  # three 0.3 s timeouts waited side by side, not 5 s each
    assert all(r.duration_ms >= 250 for r in records[:3])
    assert records[3].content == "woke"


def test_durations_come_from_the_injected_clock() -> None:
    registry, _ = build()
    ticks = iter(range(0, 1000, 1))
    lock = threading.Lock()

    def clock() -> float:
        with lock:
            return float(next(ticks))

    (record,) = run_calls(registry, [call("echo", '{"text": "x"}')], clock=clock)
    assert record.duration_ms > 0 and record.duration_ms % 1000 == 0


def test_error_content_is_json() -> None:
    assert json.loads(error_content(ToolErrorKind.timeout, "slow ü")) == {
        "error": {"type": "timeout", "message": "slow ü"}
    }


def test_a_tool_error_is_told_to_the_model_in_the_tools_words() -> None:
    registry = ToolRegistry()

    @registry.tool
    def book(day: str) -> str:
        raise ToolError(f"no room free on {day}; try another day")

    (record,) = run_calls(registry, [call("book", '{"day": "Monday"}')])
    assert record.error is ToolErrorKind.exception
    assert (
        json.loads(record.content)["error"]["message"] == "no room free on Monday; try another day"
    )


def test_a_first_parameter_typed_context_is_injected_and_not_in_the_schema() -> None:
    registry = ToolRegistry()
    seen: list[ToolCallContext] = []

    @registry.tool
    def charge(ctx: ToolCallContext, amount: int) -> str:
        """Charge the card.

        Args:
            amount: In cents, at most 10,000.
        """
        seen.append(ctx)
        return ctx.idempotency_key

    (spec,) = registry.openai_tools("charge")
    assert spec["function"]["description"] == "Charge the card."
    assert spec["function"]["parameters"]["properties"] == {
        "amount": {"type": "integer", "description": "In cents, at most 10,000."}
    }
    assert spec["function"]["parameters"]["required"] == ["amount"]
    (record,) = run_calls(
        registry, [PendingCall("req-9", 2, "call_x", "charge", '{"amount": 5}', job_id="j")]
    )
    assert record.ok and record.content == "req-9:2:call_x"
    assert seen[0].job_id == "j" and seen[0].arguments == {"amount": 5}
    # the model cannot pass the context itself
    (forged,) = run_calls(registry, [call("charge", '{"amount": 5, "ctx": {}}')])
    assert forged.error is ToolErrorKind.invalid_arguments


def test_only_the_first_parameter_may_take_the_context() -> None:
    registry = ToolRegistry()
    with pytest.raises(TypeError, match="first parameter"):

        @registry.tool
        def late(amount: int, ctx: ToolCallContext) -> str:
            return ""


def test_docstring_styles_all_describe_parameters() -> None:
    registry = ToolRegistry()

    @registry.tool
    def numpy_style(x: int) -> int:
        """Double it.

        Parameters
        ----------
        x : int
            The number.
        """
        return 2 * x

    @registry.tool
    def sphinx_style(x: int) -> int:
        """Triple it.

        :param x: The number.
        """
        return 3 * x

    for name, text in (("numpy_style", "Double it."), ("sphinx_style", "Triple it.")):
        (spec,) = registry.openai_tools(name)
        assert spec["function"]["description"] == text
        assert spec["function"]["parameters"]["properties"]["x"]["description"] == "The number."


def test_coroutine_tools_share_one_event_loop() -> None:
    registry = ToolRegistry()
    loops: list[int] = []

    @registry.tool
    async def where() -> str:
        loops.append(id(asyncio.get_running_loop()))
        await asyncio.sleep(0)
        return "here"

    for turn in range(3):
        records = run_calls(registry, [call("where", call_id=f"c{turn}{i}") for i in range(4)])
        assert all(r.ok for r in records)
    assert len(loops) == 12 and len(set(loops)) == 1
