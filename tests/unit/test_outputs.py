"""Response building: finish reasons, usage, ids, the service entry point."""

from __future__ import annotations

import json
from typing import Any

import pytest

from schemas.request import RequestEnvelope
from schemas.result import ChatCompletion, Completion
from worker.endpoints import build_response
from worker.engines.base import EngineFinish, EngineOutput
from worker.rendering import PromptRenderer
from worker.toolcalls import seeded_id_factory

TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}},
    },
}


def out(text: str = "hi", finish: EngineFinish = "stop", p: int = 7, c: int = 3) -> EngineOutput:
    return EngineOutput(key="r-1", text=text, prompt_tokens=p, completion_tokens=c, finish=finish)


def chat(**body: Any) -> RequestEnvelope:
    return RequestEnvelope.model_validate(
        {"request_id": "r-1", "body": {"messages": [{"role": "user", "content": "x"}], **body}}
    )


def completion(**body: Any) -> RequestEnvelope:
    return RequestEnvelope.model_validate(
        {"request_id": "r-2", "endpoint": "/v1/completions", "body": {"prompt": "Say", **body}}
    )


ECHO = PromptRenderer(None, max_model_len=4096, served_names={"qwen3", "m"})


def respond(env: RequestEnvelope, output: EngineOutput, **kw: Any) -> Any:
    return build_response(env, ECHO.render(env), output, model="qwen3", created=123, **kw)


@pytest.mark.parametrize(
    ("finish", "calls", "expected"),
    [
        ("stop", False, "stop"),
        ("length", False, "length"),
        ("abort", False, "abort"),
        ("stop", True, "tool_calls"),
        ("length", True, "tool_calls"),
    ],
)
def test_chat_finish_reasons(finish: EngineFinish, calls: bool, expected: str) -> None:
    text = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>' if calls else "hi"
    resp, _ = respond(chat(tools=[TOOL]), out(text, finish))
    assert resp.choices[0].finish_reason == expected
    assert (resp.choices[0].message.tool_calls is not None) is calls


def test_chat_ids_usage_and_message() -> None:
    env = RequestEnvelope.model_validate(
        {"request_id": "r-9", "body": {"messages": [{"role": "user", "content": "x"}]}}
    )
    resp, _ = build_response(
        env,
        ECHO.render(env),
        out("<think>2+2</think>4", p=10, c=5),
        model="qwen3",
        created=1_700_000_000,
        fingerprint="fp_x",
    )
    assert resp.id == "chatcmpl-r-9" and resp.object == "chat.completion"
    assert resp.model == "qwen3" and resp.created == 1_700_000_000
    assert resp.system_fingerprint == "fp_x"
    assert resp.usage.model_dump() == {
        "prompt_tokens": 10,
        "completion_tokens": 5,
        "total_tokens": 15,
        "prompt_tokens_details": {"cached_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 1},
    }
    msg = resp.choices[0].message
    assert (msg.role, msg.content, msg.reasoning_content, msg.tool_calls) == (
        "assistant",
        "4",
        "2+2",
        None,
    )
    ChatCompletion.model_validate_json(resp.model_dump_json())


def test_completion() -> None:
    resp, _ = respond(completion(), out(" world", "length", p=1, c=16))
    assert resp.id == "cmpl-r-2" and resp.object == "text_completion"
    assert resp.choices[0].text == " world" and resp.choices[0].finish_reason == "length"
    assert resp.usage.total_tokens == 17


def test_error_output_has_no_response() -> None:
    failed = EngineOutput(
        key="r-1", text="", prompt_tokens=0, completion_tokens=0, finish="error", error="boom"
    )
    with pytest.raises(ValueError, match="boom"):
        respond(completion(), failed)


def test_build_response_chat_parses_tools_and_reasoning(qwen3_tokenizer: Any) -> None:
    renderer = PromptRenderer(qwen3_tokenizer, max_model_len=4096, served_names={"qwen3"})
    env = chat(tools=[TOOL])
    rendered = renderer.render(env)
    text = (
        "<think>\nneed the time\n</think>\n\n"
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_date", "arguments": {}}\n</tool_call>'
    )
    resp, errors = build_response(
        env, rendered, out(text, c=40), model="qwen3", created=9, id_factory=seeded_id_factory(3)
    )
    assert isinstance(resp, ChatCompletion)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning_content == "need the time"
    assert choice.message.content is None
    assert choice.message.tool_calls is not None
    (tc,) = choice.message.tool_calls
    assert tc.id == seeded_id_factory(3)()
    assert json.loads(tc.function.arguments) == {"tz": "UTC"}
    assert [(e.index, e.name) for e in errors] == [(1, "get_date")]


def test_build_response_tool_choice_none_reports_calls_as_errors() -> None:
    renderer = PromptRenderer(None, max_model_len=100, served_names={"m"})
    env = chat(tools=[TOOL], tool_choice="none")
    text = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    resp, errors = build_response(env, renderer.render(env), out(text), model="m", created=0)
    assert isinstance(resp, ChatCompletion)
    assert resp.choices[0].finish_reason == "stop"
    assert [e.reason for e in errors] == ["no tools were offered"]


def test_build_response_completion_and_echo() -> None:
    renderer = PromptRenderer(None, max_model_len=100, served_names={"m"})
    env = completion(max_tokens=3)
    resp, errors = build_response(env, renderer.render(env), out(" it"), model="m", created=0)
    assert isinstance(resp, Completion) and errors == []
    assert resp.choices[0].text == " it" and resp.id == "cmpl-r-2"
    env2 = completion(echo=True)
    resp2, _ = build_response(env2, renderer.render(env2), out(" it"), model="m", created=0)
    assert isinstance(resp2, Completion) and resp2.choices[0].text == "Say it"


def test_completion_text_is_not_parsed() -> None:
    renderer = PromptRenderer(None, max_model_len=100, served_names={"m"})
    env = completion()
    text = "<think>x</think><tool_call>{}</tool_call>"
    resp, errors = build_response(env, renderer.render(env), out(text), model="m", created=0)
    assert isinstance(resp, Completion) and resp.choices[0].text == text and errors == []
