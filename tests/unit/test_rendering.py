"""Prompt rendering with the real Qwen3 tokenizer and chat template."""

from __future__ import annotations

import json
from typing import Any

import pytest

from schemas.errors import ContractError, ErrorCode
from schemas.request import RequestEnvelope
from worker.rendering import (
    PromptRenderer,
    load_generation_defaults,
    messages_to_template,
    sampling_from_body,
)

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def chat(messages: list[dict[str, Any]], **body: Any) -> RequestEnvelope:
    return RequestEnvelope.model_validate(
        {"request_id": "r-1", "body": {"messages": messages, **body}}
    )


def completion(prompt: Any, **body: Any) -> RequestEnvelope:
    return RequestEnvelope.model_validate(
        {"request_id": "r-2", "endpoint": "/v1/completions", "body": {"prompt": prompt, **body}}
    )


@pytest.fixture()
def renderer(qwen3_tokenizer: Any, qwen3_fixture_dir: Any) -> PromptRenderer:
    return PromptRenderer(
        qwen3_tokenizer,
        max_model_len=4096,
        served_names={"qwen3-14b", "Qwen/Qwen3-14B"},
        generation_defaults=load_generation_defaults(qwen3_fixture_dir),
    )


def test_plain_chat(renderer: PromptRenderer, qwen3_tokenizer: Any) -> None:
    out = renderer.render(
        chat([{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi!"}])
    )
    assert out.text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert out.token_ids == qwen3_tokenizer.encode(out.text, add_special_tokens=False)
    assert out.prompt_tokens == len(out.token_ids)
    # <|im_start|> is one special token, not a string of pieces
    assert out.token_ids[0] == qwen3_tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert out.reasoning_enabled is True
    assert out.tools is None
    assert out.sampling.max_tokens == 4096 - out.prompt_tokens


def test_content_parts_are_flattened(renderer: PromptRenderer) -> None:
    out = renderer.render(
        chat(
            [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                }
            ]
        )
    )
    assert "<|im_start|>user\nab<|im_end|>" in out.text


def test_tools_are_rendered_in_the_tools_block(renderer: PromptRenderer) -> None:
    out = renderer.render(
        chat(
            [{"role": "system", "content": "S."}, {"role": "user", "content": "Paris?"}],
            tools=[WEATHER_TOOL],
        )
    )
    head, _, rest = out.text.partition("<tools>\n")
    block, _, _ = rest.partition("\n</tools>")
    assert head.startswith("<|im_start|>system\nS.\n\n# Tools")
    assert json.loads(block) == WEATHER_TOOL
    assert out.tools is not None and [t.function.name for t in out.tools] == ["get_weather"]


def test_tool_choice_none_renders_without_tools(renderer: PromptRenderer) -> None:
    out = renderer.render(
        chat([{"role": "user", "content": "Paris?"}], tools=[WEATHER_TOOL], tool_choice="none")
    )
    assert "<tools>" not in out.text
    assert out.tools is None


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_required_and_named_tool_choice_render_the_tools(
    renderer: PromptRenderer, choice: Any
) -> None:
    out = renderer.render(
        chat([{"role": "user", "content": "Paris?"}], tools=[WEATHER_TOOL], tool_choice=choice)
    )
    assert "<tools>" in out.text and out.tools is not None


def test_enable_thinking_false(renderer: PromptRenderer) -> None:
    out = renderer.render(
        chat([{"role": "user", "content": "Hi"}], chat_template_kwargs={"enable_thinking": False})
    )
    assert out.text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert out.reasoning_enabled is False


def test_reserved_template_kwargs_are_rejected(renderer: PromptRenderer) -> None:
    with pytest.raises(ContractError) as info:
        renderer.render(
            chat([{"role": "user", "content": "Hi"}], chat_template_kwargs={"tokenize": True})
        )
    assert info.value.param == "body.chat_template_kwargs"


def test_multi_turn_tool_loop(renderer: PromptRenderer) -> None:
    out = renderer.render(
        chat(
            [
                {"role": "user", "content": "Weather in Zürich?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            # odd whitespace and non-ASCII: re-serialised like the model writes
                            "function": {"name": "get_weather", "arguments": '{"city":"Zürich"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "12 C, rain"},
            ],
            tools=[WEATHER_TOOL],
        )
    )
    assert (
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Zürich"}}\n'
        "</tool_call><|im_end|>\n"
    ) in out.text
    assert (
        "<|im_start|>user\n<tool_response>\n12 C, rain\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    ) in out.text
    assert out.text.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_assistant_reasoning_content_is_passed_to_the_template(renderer: PromptRenderer) -> None:
    out = renderer.render(
        chat(
            [
                {"role": "user", "content": "Q1"},
                {"role": "assistant", "content": "A1", "reasoning_content": "thinking hard"},
                {"role": "user", "content": "Q2"},
            ]
        )
    )
    # Qwen3 drops reasoning of turns before the last user query ...
    assert "thinking hard" not in out.text
    items = messages_to_template(
        chat(
            [
                {"role": "user", "content": "Q1"},
                {"role": "assistant", "content": "A1", "reasoning_content": "thinking hard"},
            ]
        ).body.messages  # type: ignore[union-attr]
    )
    # ... but the field reaches the template
    assert items[1] == {"role": "assistant", "content": "A1", "reasoning_content": "thinking hard"}


def test_non_object_arguments_are_passed_verbatim() -> None:
    items = messages_to_template(
        chat(
            [
                {"role": "user", "content": "x"},
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "not json"}}],
                },
            ]
        ).body.messages  # type: ignore[union-attr]
    )
    assert items[1]["tool_calls"][0]["function"]["arguments"] == "not json"
    assert items[1]["content"] == ""


def test_completion_prompt_text(renderer: PromptRenderer, qwen3_tokenizer: Any) -> None:
    out = renderer.render(completion("Once upon a time", max_tokens=16))
    assert out.text == "Once upon a time"
    assert (
        out.token_ids == qwen3_tokenizer("Once upon a time", add_special_tokens=False)["input_ids"]
    )
    assert out.reasoning_enabled is False and out.tools is None
    assert out.sampling.max_tokens == 16


def test_completion_prompt_token_ids(renderer: PromptRenderer, qwen3_tokenizer: Any) -> None:
    ids = qwen3_tokenizer.encode("Hello world", add_special_tokens=False)
    out = renderer.render(completion(ids))
    assert out.token_ids == ids
    assert out.text == "Hello world"


def test_completion_token_ids_out_of_vocab(renderer: PromptRenderer) -> None:
    with pytest.raises(ContractError) as info:
        renderer.render(completion([1, 10_000_000]))
    assert info.value.param == "body.prompt"
    assert "10000000" in info.value.message


def test_context_length_exceeded_by_max_tokens(qwen3_tokenizer: Any) -> None:
    r = PromptRenderer(qwen3_tokenizer, max_model_len=100, served_names={"m"})
    env = chat([{"role": "user", "content": "Hi"}], max_tokens=95)
    n = len(r.render(chat([{"role": "user", "content": "Hi"}])).token_ids or [])
    with pytest.raises(ContractError) as info:
        r.render(env)
    err = info.value
    assert err.code is ErrorCode.context_length_exceeded
    assert err.param == "body.max_tokens"
    assert str(n) in err.message and "95" in err.message and "100" in err.message
    assert str(n + 95) in err.message


def test_context_length_exceeded_by_max_completion_tokens(qwen3_tokenizer: Any) -> None:
    r = PromptRenderer(qwen3_tokenizer, max_model_len=20, served_names={"m"})
    with pytest.raises(ContractError) as info:
        r.render(chat([{"role": "user", "content": "Hi"}], max_completion_tokens=19))
    assert info.value.param == "body.max_completion_tokens"


def test_context_length_exceeded_by_prompt_alone(qwen3_tokenizer: Any) -> None:
    r = PromptRenderer(qwen3_tokenizer, max_model_len=10, served_names={"m"})
    with pytest.raises(ContractError) as info:
        r.render(chat([{"role": "user", "content": "word " * 50}]))
    assert info.value.code is ErrorCode.context_length_exceeded
    assert info.value.param == "body.messages"
    assert "10" in info.value.message
    with pytest.raises(ContractError) as info2:
        r.render(completion("word " * 50))
    assert info2.value.param == "body.prompt"


def test_exact_fit_is_allowed(qwen3_tokenizer: Any) -> None:
    r = PromptRenderer(qwen3_tokenizer, max_model_len=100, served_names={"m"})
    n = r.render(chat([{"role": "user", "content": "Hi"}])).prompt_tokens
    out = r.render(chat([{"role": "user", "content": "Hi"}], max_tokens=100 - n))
    assert out.sampling.max_tokens == 100 - n


def test_default_max_tokens_is_clamped_not_rejected(qwen3_tokenizer: Any) -> None:
    r = PromptRenderer(
        qwen3_tokenizer, max_model_len=100, served_names={"m"}, default_max_tokens=1000
    )
    out = r.render(chat([{"role": "user", "content": "Hi"}]))
    assert out.sampling.max_tokens == 100 - out.prompt_tokens
    r2 = PromptRenderer(
        qwen3_tokenizer, max_model_len=100, served_names={"m"}, default_max_tokens=7
    )
    assert r2.render(chat([{"role": "user", "content": "Hi"}])).sampling.max_tokens == 7


def test_unknown_model(renderer: PromptRenderer) -> None:
    with pytest.raises(ContractError) as info:
        renderer.render(chat([{"role": "user", "content": "Hi"}], model="gpt-4o"))
    assert info.value.code is ErrorCode.unknown_model
    assert info.value.param == "body.model"
    assert "gpt-4o" in info.value.message and "qwen3-14b" in info.value.message
    assert renderer.render(chat([{"role": "user", "content": "Hi"}], model="qwen3-14b"))


def test_generation_defaults_loaded(qwen3_fixture_dir: Any) -> None:
    assert load_generation_defaults(qwen3_fixture_dir) == {
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
    }


def test_sampling_defaults_apply_when_unset(renderer: PromptRenderer) -> None:
    s = renderer.render(chat([{"role": "user", "content": "Hi"}])).sampling
    assert (s.temperature, s.top_p, s.top_k) == (0.6, 0.95, 20)
    assert s.seed is None and s.stop == () and not s.json_object and s.json_schema is None


def test_sampling_mapping() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    env = chat(
        [{"role": "user", "content": "Hi"}],
        temperature=0.0,
        top_p=0.5,
        top_k=-1,
        seed=7,
        stop="END",
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    )
    s = sampling_from_body(env.body, 12, {"temperature": 0.6, "top_p": 0.95, "top_k": 20})
    assert s.max_tokens == 12
    assert (s.temperature, s.top_p, s.top_k, s.seed) == (0.0, 0.5, -1, 7)
    assert s.stop == ("END",)
    assert (s.presence_penalty, s.frequency_penalty) == (0.5, -0.25)
    assert s.json_schema == schema and s.json_object is False

    env2 = completion("x", stop=["a", "b"], response_format={"type": "json_object"})
    s2 = sampling_from_body(env2.body, 5, None)
    assert s2.stop == ("a", "b") and s2.json_object is True and s2.json_schema is None
    assert (s2.temperature, s2.top_p, s2.top_k) == (None, None, None)

    env3 = completion("x", response_format={"type": "text"})
    s3 = sampling_from_body(env3.body, 5, None)
    assert s3.json_schema is None and s3.json_object is False


def test_echo_renderer_without_tokenizer() -> None:
    r = PromptRenderer(None, max_model_len=50, served_names={"echo"})
    out = r.render(
        chat(
            [{"role": "system", "content": "sys"}, {"role": "user", "content": "one two  three"}],
            tools=[WEATHER_TOOL],
        )
    )
    assert out.text == "one two  three"
    assert out.token_ids is None
    assert out.prompt_tokens == 3
    assert out.sampling.max_tokens == 47
    assert out.reasoning_enabled is True  # no template: thinking follows enable_thinking
    assert out.tools is not None
    quiet = r.render(
        chat([{"role": "user", "content": "x"}], chat_template_kwargs={"enable_thinking": False})
    )
    assert quiet.reasoning_enabled is False
    c = r.render(completion("a b c d", max_tokens=4))
    assert (c.text, c.token_ids, c.prompt_tokens, c.sampling.max_tokens) == ("a b c d", None, 4, 4)
    ids = r.render(completion([5, 6, 7]))
    assert ids.token_ids == [5, 6, 7] and ids.prompt_tokens == 3
    with pytest.raises(ContractError) as info:
        r.render(completion("w " * 60))
    assert info.value.code is ErrorCode.context_length_exceeded
    with pytest.raises(ContractError):
        r.render(chat([{"role": "user", "content": "Hi"}], model="other"))


def test_engine_request(renderer: PromptRenderer) -> None:
    out = renderer.render(chat([{"role": "user", "content": "Hi"}]))
    req = out.engine_request("r-1", priority=3)
    assert (req.key, req.prompt, req.prompt_token_ids, req.sampling, req.priority) == (
        "r-1",
        out.text,
        out.token_ids,
        out.sampling,
        3,
    )
