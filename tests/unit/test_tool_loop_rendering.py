"""A tool loop's continuation through the real Qwen3 chat template, forced tool calls, and
call ids that stay the same when a turn runs again."""

from __future__ import annotations

import json
from typing import Any

import pytest

from schemas import ContractError, RequestEnvelope, WorkerInfo
from schemas.result import AssistantOutput
from schemas.tool_events import ToolTurnEvent
from schemas.tool_loop import CallRecord
from schemas.usage import Usage
from worker.endpoints import build_response
from worker.engines.base import EngineOutput
from worker.records import Finished, Inbound, Running
from worker.rendering import PromptRenderer
from worker.results import finished_result
from worker.tool_loop.continuation import continuation
from worker.tool_loop.forced_calls import ForcedCall, as_blocks

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


@pytest.fixture()
def renderer(qwen3_tokenizer: Any) -> PromptRenderer:
    return PromptRenderer(qwen3_tokenizer, max_model_len=4096, served_names={"qwen3-14b"})


def envelope(**body: Any) -> RequestEnvelope:
    return RequestEnvelope.model_validate(
        {
            "request_id": "loop-1",
            "tool_loop": {"max_turns": 3},
            "body": {
                "messages": [{"role": "user", "content": "Weather in Paris?"}],
                "tools": [WEATHER, TIME],
                **body,
            },
        }
    )


def test_a_continuation_renders_the_call_and_its_result_the_way_qwen3_expects(
    renderer: PromptRenderer,
) -> None:
    call = {
        "id": "call_a",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    event = ToolTurnEvent(
        request_id="loop-1",
        turn=1,
        lane="interactive",
        envelope=envelope(),
        message=AssistantOutput(content=None, tool_calls=[call]),  # type: ignore[list-item]
        usage=Usage(prompt_tokens=10, completion_tokens=4, total_tokens=14),
        emitted_ms=0,
    )
    record = CallRecord(
        id="call_a", name="get_weather", arguments='{"city": "Paris"}', ok=True,
        content='{"temp": 21}', duration_ms=1.0,
    )  # fmt: skip
    nxt = continuation(event, [record])
    text = renderer.render(nxt).text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
        "\n</tool_call><|im_end|>\n"
    ) in text
    assert '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>\n' in text
    assert text.endswith("<|im_start|>assistant\n")


def test_a_named_tool_choice_constrains_the_output_to_its_arguments(
    renderer: PromptRenderer,
) -> None:
    env = envelope(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    rendered = renderer.render(env)
    assert rendered.sampling.json_schema == WEATHER["function"]["parameters"]  # type: ignore[index]
    assert rendered.reasoning_enabled is False
    output = EngineOutput("k", '{"city": "Oslo"}', 10, 5, "stop")
    response, errors = build_response(env, rendered, output, model="m", created=0)
    (call,) = response.choices[0].message.tool_calls  # type: ignore[union-attr]
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Oslo"},
    )
    assert response.choices[0].finish_reason == "tool_calls"  # type: ignore[union-attr]
    assert errors == []


def test_required_allows_any_offered_tool_and_reports_what_is_not_a_call(
    renderer: PromptRenderer,
) -> None:
    env = envelope(tool_choice="required")
    rendered = renderer.render(env)
    schema = rendered.sampling.json_schema
    assert schema is not None and schema["type"] == "array" and schema["minItems"] == 1
    names = [item["properties"]["name"]["const"] for item in schema["items"]["anyOf"]]
    assert names == ["get_weather", "get_time"]
    two = '[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]'
    response, errors = build_response(
        env, rendered, EngineOutput("k", two, 1, 1, "stop"), model="m", created=0
    )
    calls = response.choices[0].message.tool_calls  # type: ignore[union-attr]
    assert [c.function.name for c in calls or ()] == ["get_time", "get_weather"] and not errors
    # an engine without guided decoding may emit anything: reported, never dropped
    response, errors = build_response(
        env, rendered, EngineOutput("k", "hello", 1, 1, "stop"), model="m", created=0
    )
    assert response.choices[0].message.tool_calls is None  # type: ignore[union-attr]
    assert len(errors) == 1 and "hello" in errors[0].raw
    # arguments that break the tool's schema are refused by the parser
    _, errors = build_response(
        env, rendered, EngineOutput("k", '[{"name": "get_weather", "arguments": {"town": 1}}]', 1, 1, "stop"),
        model="m", created=0,
    )  # fmt: skip
    assert len(errors) == 1 and errors[0].name == "get_weather"


def test_a_forced_choice_and_a_response_format_are_refused_together(
    renderer: PromptRenderer,
) -> None:
    env = envelope(tool_choice="required", response_format={"type": "json_object"})
    with pytest.raises(ContractError) as caught:
        renderer.render(env)
    assert caught.value.param == "body.response_format"


def test_as_blocks_keeps_bad_output_as_a_block() -> None:
    assert as_blocks("[]", ForcedCall(None)) == "<tool_call>[]</tool_call>"
    assert as_blocks("{not json", ForcedCall("f")) == "<tool_call>{not json</tool_call>"
    assert (
        as_blocks('{"a": 1}', ForcedCall("f"))
        == '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    )


def test_a_turn_run_twice_names_its_calls_the_same(renderer: PromptRenderer) -> None:
    """A worker that re-runs a redelivered turn must emit the same call ids, or the
    executor would not find its records and would run the tools again."""
    env = envelope()
    rendered = renderer.render(env)
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'

    def once() -> list[str]:
        inbound = Inbound(tp=None, offset=0, record=None, envelope=env, dequeued_ms=0)  # type: ignore[arg-type]
        item = Finished(Running(inbound, rendered, 0), EngineOutput("k", text, 5, 5, "stop"), 1)
        result = finished_result(item, model="m", worker=WorkerInfo(id="w"))
        calls = result.response.choices[0].message.tool_calls  # type: ignore[union-attr]
        return [c.id for c in calls or ()]

    first, second = once(), once()
    assert first == second and first[0].startswith("call_")
    other = env.model_copy(update={"request_id": "loop-2"})
    inbound = Inbound(tp=None, offset=0, record=None, envelope=other, dequeued_ms=0)  # type: ignore[arg-type]
    item = Finished(Running(inbound, rendered, 0), EngineOutput("k", text, 5, 5, "stop"), 1)
    result = finished_result(item, model="m", worker=WorkerInfo(id="w"))
    assert result.response.choices[0].message.tool_calls[0].id != first[0]  # type: ignore[union-attr,index]
