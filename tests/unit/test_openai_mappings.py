"""What the supported OpenAI/vLLM fields do: rendering, sampling, engines and responses."""

from __future__ import annotations

import sys
import types
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest

from schemas import ContractError, validate_envelope
from schemas.request import RequestEnvelope
from schemas.result import ChatCompletion, Completion
from worker.endpoints import build_response
from worker.engines.base import EngineOutput, EngineSample, SamplingSpec, TokenLogprob
from worker.engines.echo import echo_output
from worker.outputs import MIN_LOGPROB
from worker.rendering import PromptRenderer

TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}},
    },
}
CALL = '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>'
ECHO = PromptRenderer(None, max_model_len=4096, served_names={"m"})


def chat(*messages: dict[str, Any], **body: Any) -> RequestEnvelope:
    msgs = list(messages) or [{"role": "user", "content": "hello there world"}]
    return validate_envelope({"request_id": "r-1", "body": {"messages": msgs, **body}})


def completion(prompt: Any = "one two three four five", **body: Any) -> RequestEnvelope:
    return validate_envelope(
        {"request_id": "r-2", "endpoint": "/v1/completions", "body": {"prompt": prompt, **body}}
    )


def run_echo(env: RequestEnvelope, renderer: PromptRenderer = ECHO) -> Any:
    """Render, answer with the echo engine, build the response: the worker's path."""
    rendered = renderer.render(env)
    output = echo_output(rendered.engine_request("k"))
    return build_response(env, rendered, output, model="m", created=1)


@pytest.fixture(scope="module")
def qwen3(qwen3_tokenizer: Any) -> PromptRenderer:
    return PromptRenderer(qwen3_tokenizer, max_model_len=4096, served_names={"m"})


# ---------------------------------------------------------------- rendering


def test_reasoning_effort_renders_qwen3_thinking_switch(qwen3: PromptRenderer) -> None:
    off = qwen3.render(chat(reasoning_effort="none"))
    assert off.text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert off.reasoning_enabled is False and off.think_end_id is None
    on = qwen3.render(chat(reasoning_effort="high"))
    assert on.text.endswith("<|im_start|>assistant\n") and on.reasoning_enabled is True
    assert on.think_end_id is not None
    assert on.text == qwen3.render(chat()).text  # high is Qwen3's default: thinking on


def test_continue_final_message_prefills_the_answer(qwen3: PromptRenderer) -> None:
    env = chat(
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "The colour is"},
        continue_final_message=True,
        add_generation_prompt=False,
    )
    text = qwen3.render(env).text
    assert text.endswith("The colour is") and not text.endswith("<|im_end|>\n")


def test_add_generation_prompt_false_leaves_the_header_out(qwen3: PromptRenderer) -> None:
    text = qwen3.render(chat(add_generation_prompt=False)).text
    assert text.endswith("<|im_end|>\n") and "<|im_start|>assistant" not in text


def test_add_special_tokens_reaches_the_tokenizer(
    qwen3: PromptRenderer, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[object] = []
    encode = qwen3.tokenizer.encode

    def spy(text: str, **kwargs: Any) -> Any:
        seen.append(kwargs.get("add_special_tokens"))
        return encode(text, **kwargs)

    monkeypatch.setattr(qwen3.tokenizer, "encode", spy)
    plain = qwen3.render(chat())
    special = qwen3.render(chat(add_special_tokens=True))
    # The flag reaches encode (chat's default: off, as vLLM's). Qwen3's tokenizer adds no
    # BOS, so the ids themselves agree; a tokenizer with one would differ here.
    assert seen == [False, True]
    assert special.token_ids == plain.token_ids and plain.token_ids


@pytest.mark.parametrize(
    ("part", "kind"),
    [
        ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "image"),
        ({"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}, "audio"),
        ({"type": "file", "file": {"file_id": "file-abc"}}, "file"),
    ],
)
def test_media_parts_are_refused_by_a_text_only_model(part: dict[str, Any], kind: str) -> None:
    env = chat(
        {"role": "system", "content": "Describe."},
        {"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]},
    )
    with pytest.raises(ContractError) as info:
        ECHO.render(env)
    assert info.value.param == "body.messages[1].content[1]"
    assert "text-only" in info.value.message and kind in info.value.message
    # The code path is ready for a multimodal engine: it declares what it reads.
    reads = PromptRenderer(None, max_model_len=4096, served_names={"m"}, modalities=("text", kind))
    assert reads.render(env).text == "What is this?"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logit_bias": {"151669": 1}}, "body.logit_bias"),
        ({"allowed_token_ids": [1, 10**6]}, "body.allowed_token_ids"),
        ({"stop_token_ids": [200_000]}, "body.stop_token_ids"),
    ],
)
def test_token_ids_must_be_in_the_vocabulary(
    qwen3: PromptRenderer, fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(ContractError) as info:
        qwen3.render(chat(**fields))
    assert info.value.param == param and "vocabulary" in info.value.message
    qwen3.render(chat(logit_bias={"151668": -100}))  # the last id is inside


def test_every_sampling_field_reaches_the_spec() -> None:
    env = chat(
        n=3,
        logprobs=True,
        top_logprobs=4,
        min_p=0.05,
        repetition_penalty=1.1,
        logit_bias={"11": 5, "12": -100},
        stop_token_ids=[7],
        include_stop_str_in_output=True,
        allowed_token_ids=[1, 2, 3],
        bad_words=["darn"],
        structured_outputs={"choice": ["yes", "no"]},
        cache_salt="tenant-a",
        min_tokens=2,
        ignore_eos=True,
        max_tokens=9,
    )
    rendered = ECHO.render(env)
    assert rendered.sampling == SamplingSpec(
        max_tokens=9,
        ignore_eos=True,
        min_tokens=2,
        choice=("yes", "no"),
        n=3,
        logprobs=4,
        min_p=0.05,
        repetition_penalty=1.1,
        logit_bias=((11, 5.0), (12, -100.0)),
        stop_token_ids=(7,),
        include_stop_str_in_output=True,
        allowed_token_ids=(1, 2, 3),
        bad_words=("darn",),
    )
    assert rendered.engine_request("k").cache_salt == "tenant-a"


def test_logprobs_zero_means_the_chosen_token_only() -> None:
    assert ECHO.render(chat(logprobs=True)).sampling.logprobs == 0
    assert ECHO.render(chat(logprobs=False, top_logprobs=0)).sampling.logprobs is None
    assert ECHO.render(completion(logprobs=0)).sampling.logprobs == 0


# ---------------------------------------------------------------- responses


def test_n_choices_each_with_index_finish_and_usage() -> None:
    resp, errors = run_echo(chat(n=3, max_tokens=2))
    assert isinstance(resp, ChatCompletion) and errors == []
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert {c.finish_reason for c in resp.choices} == {"length"}
    assert resp.usage.prompt_tokens == 3 and resp.usage.completion_tokens == 6


def test_n_choices_report_their_own_tool_call_errors() -> None:
    env = chat(n=2, tools=[TOOL])
    rendered = ECHO.render(env)
    good = EngineSample(CALL, 5, "stop")
    bad = EngineSample('<tool_call>{"name": "nope", "arguments": {}}</tool_call>', 5, "stop")
    output = EngineOutput.of_samples("k", [good, bad], prompt_tokens=4)
    resp, errors = build_response(env, rendered, output, model="m", created=1)
    assert resp.choices[0].finish_reason == "tool_calls"
    assert resp.choices[1].finish_reason == "stop" and resp.choices[1].message.tool_calls is None
    assert [e.choice for e in errors] == [1] and "nope" in errors[0].raw
    assert resp.usage.completion_tokens == 10


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    two = CALL + "\n" + CALL.replace("UTC", "CET")
    resp, errors = run_echo(chat({"role": "user", "content": two}, tools=[TOOL]))
    assert len(resp.choices[0].message.tool_calls) == 2 and errors == []
    env = chat({"role": "user", "content": two}, tools=[TOOL], parallel_tool_calls=False)
    resp, errors = run_echo(env)
    calls = resp.choices[0].message.tool_calls
    assert len(calls) == 1 and '"UTC"' in calls[0].function.arguments
    assert len(errors) == 1 and "parallel_tool_calls is false" in errors[0].reason
    assert "CET" in errors[0].raw


def test_include_reasoning_false_hides_the_text_but_counts_the_tokens() -> None:
    said = {"role": "user", "content": "<think>one two three</think>four"}
    shown, _ = run_echo(chat(said))
    hidden, _ = run_echo(chat(said, include_reasoning=False))
    assert shown.choices[0].message.reasoning_content == "one two three"
    assert hidden.choices[0].message.reasoning_content is None
    assert hidden.choices[0].message.content == "four"
    details = hidden.usage.completion_tokens_details
    assert details is not None and details.reasoning_tokens == 3


def test_reasoning_tokens_count_up_to_the_think_end_id(qwen3: PromptRenderer) -> None:
    env = chat()
    rendered = qwen3.render(env)
    end = rendered.think_end_id
    assert end == qwen3.tokenizer.convert_tokens_to_ids("</think>")
    ids = [100, 101, 102, end, 271, 9707]
    closed = EngineSample("<think>abc</think>\n\nHi", len(ids), "stop", token_ids=ids)
    open_ = EngineSample("<think>abc def", 4, "length", token_ids=[100, 101, 102, 103])
    output = EngineOutput.of_samples("k", [closed, open_], prompt_tokens=9, cached_tokens=8)
    resp, _ = build_response(env, rendered, output, model="m", created=1)
    assert resp.usage.completion_tokens_details.reasoning_tokens == 4 + 4
    assert resp.usage.prompt_tokens_details.cached_tokens == 8
    off = qwen3.render(chat(reasoning_effort="none"))
    resp, _ = build_response(chat(reasoning_effort="none"), off, output, model="m", created=1)
    assert resp.usage.completion_tokens_details.reasoning_tokens == 0


def test_chat_logprobs_shape() -> None:
    resp, _ = run_echo(chat(logprobs=True, top_logprobs=2))
    content = resp.choices[0].logprobs.content
    assert [t.token for t in content] == ["hello", " there", " world"]
    assert [t.logprob for t in content] == [0.0, -0.25, -0.5]
    assert content[1].bytes == list(b" there")
    assert [(a.token, a.logprob) for a in content[1].top_logprobs] == [
        (" there", -0.25),
        (" there~1", -1.25),
    ]
    none, _ = run_echo(chat(logprobs=True))
    assert none.choices[0].logprobs.content[0].top_logprobs == []
    plain, _ = run_echo(chat())
    assert plain.choices[0].logprobs is None
    ChatCompletion.model_validate_json(resp.model_dump_json())


def test_completion_logprobs_shape() -> None:
    resp, _ = run_echo(completion("a b c", logprobs=2))
    assert isinstance(resp, Completion)
    lp = resp.choices[0].logprobs
    assert lp.tokens == ["a", " b", " c"]
    assert lp.token_logprobs == [0.0, -0.25, -0.5]
    assert lp.text_offset == [0, 1, 3]
    assert lp.top_logprobs[1] == {" b": -0.25, " b~1": -1.25}
    Completion.model_validate_json(resp.model_dump_json())


def test_completion_logprobs_always_hold_the_sampled_token() -> None:
    sample = EngineSample(
        " x",
        1,
        "stop",
        logprobs=[TokenLogprob(5, " x", -3.0, top=((6, " y", -0.1), (7, " z", -0.2)))],
    )
    env = completion(logprobs=2)
    output = EngineOutput.of_samples("k", [sample], prompt_tokens=1)
    resp, _ = build_response(env, ECHO.render(env), output, model="m", created=1)
    assert resp.choices[0].logprobs.top_logprobs == [{" y": -0.1, " z": -0.2, " x": -3.0}]


def test_infinite_logprobs_are_clamped_like_vllm() -> None:
    sample = EngineSample(
        "x", 1, "stop", logprobs=[TokenLogprob(1, "x", float("-inf"), ((1, "x", float("-inf")),))]
    )
    env = chat(logprobs=True, top_logprobs=1)
    output = EngineOutput.of_samples("k", [sample], prompt_tokens=1)
    resp, _ = build_response(env, ECHO.render(env), output, model="m", created=1)
    token = resp.choices[0].logprobs.content[0]
    assert token.logprob == MIN_LOGPROB and token.top_logprobs[0].logprob == MIN_LOGPROB
    assert "Infinity" not in resp.model_dump_json()


def test_return_tokens_as_token_ids() -> None:
    resp, _ = run_echo(chat(logprobs=True, top_logprobs=1, return_tokens_as_token_ids=True))
    assert [t.token for t in resp.choices[0].logprobs.content] == [
        "token_id:0",
        "token_id:1",
        "token_id:2",
    ]
    resp, _ = run_echo(completion("a b", logprobs=1, return_tokens_as_token_ids=True))
    assert resp.choices[0].logprobs.tokens == ["token_id:0", "token_id:1"]


def test_echo_puts_the_prompt_before_the_completion() -> None:
    env = completion("Say", echo=True)
    output = EngineOutput("k", " hi", 1, 1, "stop")
    resp, _ = build_response(env, ECHO.render(env), output, model="m", created=1)
    assert resp.choices[0].text == "Say hi"


def test_fingerprint_is_passed_to_both_endpoints() -> None:
    for env in (chat(), completion()):
        rendered = ECHO.render(env)
        output = echo_output(rendered.engine_request("k"))
        resp, _ = build_response(env, rendered, output, model="m", created=1, fingerprint="fp_1")
        assert resp.system_fingerprint == "fp_1"


# ---------------------------------------------------------------- vLLM's mapping


class _Params:
    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs


@pytest.fixture()
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    """Just enough of vllm's namespace for `sampling_params` (the GPU smoke test runs the
    real one): SamplingParams and StructuredOutputsParams record their arguments."""
    vllm = types.ModuleType("vllm")
    vllm.SamplingParams = _Params  # type: ignore[attr-defined]
    sp = types.ModuleType("vllm.sampling_params")
    sp.RequestOutputKind = SimpleNamespace(FINAL_ONLY="final")  # type: ignore[attr-defined]
    sp.StructuredOutputsParams = _Params  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", sp)


def test_vllm_sampling_params_carry_every_field(fake_vllm: None) -> None:
    from worker.engines.vllm_engine import sampling_params

    spec = SamplingSpec(
        max_tokens=9,
        temperature=0.5,
        n=3,
        logprobs=5,
        min_p=0.1,
        repetition_penalty=1.2,
        logit_bias=((11, 5.0),),
        stop_token_ids=(7,),
        include_stop_str_in_output=True,
        allowed_token_ids=(1, 2),
        bad_words=("darn",),
        choice=("yes", "no"),
    )
    kwargs = sampling_params(spec).kwargs
    assert {k: v for k, v in kwargs.items() if k != "structured_outputs"} == {
        "max_tokens": 9,
        "ignore_eos": False,
        "min_tokens": 0,
        "output_kind": "final",
        "stop": None,
        "seed": None,
        "temperature": 0.5,
        "n": 3,
        "logprobs": 5,
        "min_p": 0.1,
        "repetition_penalty": 1.2,
        "logit_bias": {11: 5.0},
        "stop_token_ids": [7],
        "include_stop_str_in_output": True,
        "allowed_token_ids": [1, 2],
        "bad_words": ["darn"],
    }
    assert kwargs["structured_outputs"].kwargs == {"choice": ["yes", "no"]}
    plain = sampling_params(SamplingSpec(max_tokens=4)).kwargs
    assert "n" not in plain and "logprobs" not in plain and "structured_outputs" not in plain
    assert sampling_params(replace(spec, logprobs=0)).kwargs["logprobs"] == 0


def _logprob(value: float, decoded: str | None) -> Any:
    return SimpleNamespace(logprob=value, decoded_token=decoded)


def test_vllm_outputs_become_samples_with_logprobs() -> None:
    from worker.engines.vllm_engine import _to_output

    def completion_output(index: int, ids: list[int], finish: str) -> Any:
        positions = [{i: _logprob(-0.5, f"t{i}"), 99: _logprob(-0.1, None)} for i in ids]
        return SimpleNamespace(
            index=index,
            text=f"text{index}",
            token_ids=ids,
            finish_reason=finish,
            logprobs=positions,
        )

    result = SimpleNamespace(
        prompt_token_ids=[1, 2, 3, 4],
        num_cached_tokens=2,
        outputs=[completion_output(1, [5, 6], "length"), completion_output(0, [7], "stop")],
    )
    output = _to_output("k", result, k=1, decode=lambda tid: f"<{tid}>")
    samples = output.samples()
    assert [s.text for s in samples] == ["text0", "text1"]  # by index, not arrival
    assert [s.finish for s in samples] == ["stop", "length"]
    assert output.prompt_tokens == 4 and output.cached_tokens == 2
    assert output.total_completion_tokens == 3
    first = samples[0].logprobs[0]
    assert (first.token_id, first.token, first.logprob) == (7, "t7", -0.5)
    assert first.top == ((99, "<99>", -0.1),)  # best first; an empty decode is filled in
    assert _to_output("k", result).samples()[0].logprobs is None  # not asked: not built
