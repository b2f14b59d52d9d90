"""The transformers engine on a tiny RANDOM-weight Qwen3 (CPU). Output text is noise."""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from schemas.request import RequestEnvelope
from worker.engines.base import EngineOutput, EngineRequest, SamplingSpec
from worker.rendering import PromptRenderer

pytestmark = [
    pytest.mark.cpu_model,
    pytest.mark.skipif(
        importlib.util.find_spec("torch") is None,
        reason="torch is not installed (pip install -e '.[cpu]')",
    ),
]


class Collector:
    def __init__(self, expected: int) -> None:
        self.outputs: dict[str, EngineOutput] = {}
        self.calls = 0
        self.expected = expected
        self.done = threading.Event()
        self.lock = threading.Lock()

    def __call__(self, output: EngineOutput) -> None:
        with self.lock:
            self.calls += 1
            self.outputs[output.key] = output
            if self.calls >= self.expected:
                self.done.set()

    def wait(self, timeout: float = 120) -> dict[str, EngineOutput]:
        assert self.done.wait(timeout), f"only {self.calls}/{self.expected} outputs arrived"
        return self.outputs


@pytest.fixture(scope="module")
def engine(tiny_qwen3_dir: Path) -> Iterator[Any]:
    from worker.engines.transformers_engine import TransformersEngine

    eng = TransformersEngine(str(tiny_qwen3_dir), served_name="tiny-qwen3")
    eng.start()
    yield eng
    eng.close()


def run(engine: Any, requests: list[EngineRequest]) -> dict[str, EngineOutput]:
    collector = Collector(len(requests))
    engine.submit(requests, collector)
    outputs = collector.wait()
    assert collector.calls == len(requests)  # exactly one on_done each
    return outputs


def greedy(key: str, prompt: str, max_tokens: int, **kw: Any) -> EngineRequest:
    return EngineRequest(
        key=key,
        prompt=prompt,
        prompt_token_ids=None,
        sampling=SamplingSpec(max_tokens=max_tokens, temperature=0.0, **kw),
    )


def test_engine_properties(engine: Any) -> None:
    assert engine.name == "transformers" and engine.mode == "static"
    assert engine.model_name == "tiny-qwen3"
    assert engine.max_model_len == 2048
    assert engine.tokenizer.padding_side == "left"
    assert "<think>" in engine.tokenizer.chat_template


def test_batch_of_chat_requests_with_different_max_tokens(engine: Any) -> None:
    renderer = PromptRenderer(
        engine.tokenizer, max_model_len=engine.max_model_len, served_names={engine.model_name}
    )
    limits = {"a": 1, "b": 5, "c": 17}
    requests = []
    for i, (key, limit) in enumerate(limits.items()):
        env = RequestEnvelope.model_validate(
            {
                "request_id": key,
                "body": {
                    "messages": [{"role": "user", "content": "Hello " * (i * 5 + 1)}],
                    "max_tokens": limit,
                    "temperature": 0.0,
                    "chat_template_kwargs": {"enable_thinking": False},
                },
            }
        )
        requests.append(renderer.render(env).engine_request(key))
    outputs = run(engine, requests)
    assert set(outputs) == set(limits)
    for key, limit in limits.items():
        o = outputs[key]
        assert o.finish in {"stop", "length"}, o.error
        assert 1 <= o.completion_tokens <= limit
        assert o.prompt_tokens == len(requests[list(limits).index(key)].prompt_token_ids or [])
        if o.finish == "length":
            assert o.completion_tokens == limit
        assert "<|im_end|>" not in o.text and "<|endoftext|>" not in o.text
    # a random model practically never emits EOS within one token
    assert outputs["a"].finish == "length"


def test_left_padding_does_not_change_greedy_output(engine: Any) -> None:
    alone = run(engine, [greedy("x", "The quick brown fox", 8)])["x"]
    batched = run(
        engine,
        [
            greedy(
                "long", "A far longer prompt so that the other row gets plenty of left padding", 3
            ),
            greedy("x", "The quick brown fox", 8),
        ],
    )["x"]
    assert batched.text == alone.text
    assert batched.completion_tokens == alone.completion_tokens == 8


def test_seeded_sampling_is_reproducible(engine: Any) -> None:
    def sampled() -> str:
        req = EngineRequest(
            key="s",
            prompt="Once",
            prompt_token_ids=None,
            sampling=SamplingSpec(max_tokens=10, temperature=1.0, seed=42),
        )
        return run(engine, [req])["s"].text

    assert sampled() == sampled()


def test_stop_string_cuts_text(engine: Any) -> None:
    base = run(engine, [greedy("b", "The quick brown fox", 12)])["b"]
    tokens = engine.tokenizer.encode(base.text, add_special_tokens=False)
    stop = engine.tokenizer.decode(tokens[4:6])
    assert stop.strip(), "need a visible stop string"
    cut = run(engine, [greedy("b", "The quick brown fox", 12, stop=(stop,))])["b"]
    assert cut.finish == "stop"
    assert cut.text == base.text[: base.text.find(stop)]
    assert cut.completion_tokens <= 6


def test_too_long_request_errors_alone(engine: Any) -> None:
    outputs = run(engine, [greedy("ok", "Hi", 2), greedy("big", "Hi", engine.max_model_len)])
    assert outputs["ok"].finish == "length"
    assert outputs["big"].finish == "error" and "max_model_len" in (outputs["big"].error or "")


def test_generate_error_fails_the_batch_and_engine_survives(
    engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("simulated OOM")

    monkeypatch.setattr(engine._model, "generate", boom)
    outputs = run(
        engine,
        [
            greedy("e1", "Hi", 3),
            greedy("e2", "Yo", 4),
            EngineRequest(
                key="e3",
                prompt="Hey",
                prompt_token_ids=None,
                sampling=SamplingSpec(max_tokens=2, temperature=0.8),
            ),
        ],
    )
    assert {k: o.finish for k, o in outputs.items()} == {
        "e1": "error",
        "e2": "error",
        "e3": "error",
    }
    assert all("simulated OOM" in (o.error or "") for o in outputs.values())
    monkeypatch.undo()
    after = run(engine, [greedy("ok", "Hi", 2)])["ok"]
    assert after.finish == "length" and after.completion_tokens == 2


def test_on_done_exception_does_not_kill_the_thread(engine: Any) -> None:
    def bad(_: EngineOutput) -> None:
        raise ValueError("callback bug")

    engine.submit([greedy("z", "Hi", 1)], bad)
    assert run(engine, [greedy("ok", "Hi", 1)])["ok"].finish == "length"


def test_submit_after_close_answers_every_request(tiny_qwen3_dir: Path) -> None:
    from worker.engines.transformers_engine import TransformersEngine

    eng = TransformersEngine(str(tiny_qwen3_dir))
    pending = Collector(1)
    eng.submit([greedy("n", "Hi", 1)], pending)  # not started
    assert pending.wait()["n"].finish == "error"
    eng.start()
    eng.close()
    closed = Collector(2)
    eng.submit([greedy("c1", "Hi", 1), greedy("c2", "Hi", 1)], closed)
    assert {o.finish for o in closed.wait().values()} == {"error"}


def test_a_tool_loop_continuation_runs_through_the_real_template(engine: Any) -> None:
    """Turn 2 of a loop on the CPU engine: the assistant's call and the tool's result are
    rendered by Qwen3's own template, generated, and the turn becomes the final result."""
    from schemas import ResultEnvelope, Status
    from schemas.result import AssistantOutput
    from schemas.tool_events import ToolTurnEvent
    from schemas.tool_loop import CallRecord
    from schemas.usage import Usage
    from worker.endpoints import build_response
    from worker.tool_loop.continuation import continuation
    from worker.tool_loop.routing import route

    tool = {
        "type": "function",
        "function": {"name": "get_weather", "parameters": {"type": "object"}},
    }
    first = RequestEnvelope.model_validate(
        {
            "request_id": "loop",
            "tool_loop": {"max_turns": 2},
            "body": {
                "messages": [{"role": "user", "content": "Weather in Oslo?"}],
                "tools": [tool],
                "max_tokens": 6,
                "temperature": 0.0,
                "chat_template_kwargs": {"enable_thinking": False},
            },
        }
    )
    call = {"id": "call_0", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    event = ToolTurnEvent(
        request_id="loop", turn=1, lane="interactive", envelope=first,
        message=AssistantOutput(tool_calls=[call]),  # type: ignore[list-item]
        usage=Usage(prompt_tokens=20, completion_tokens=9, total_tokens=29), emitted_ms=0,
    )  # fmt: skip
    record = CallRecord(
        id="call_0", name="get_weather", arguments='{"city": "Oslo"}', ok=True,
        content='{"temp_c": 21}', duration_ms=1.0,
    )  # fmt: skip
    second = continuation(event, [record])
    renderer = PromptRenderer(
        engine.tokenizer, max_model_len=engine.max_model_len, served_names={engine.model_name}
    )
    rendered = renderer.render(second)
    assert '{"name": "get_weather", "arguments": {"city": "Oslo"}}' in rendered.text
    assert '<tool_response>\n{"temp_c": 21}\n</tool_response>' in rendered.text
    output = run(engine, [rendered.engine_request("k")])["k"]
    assert output.prompt_tokens == len(rendered.engine_request("k").prompt_token_ids or [])
    response, _ = build_response(second, rendered, output, model=engine.model_name, created=0)
    final = route(
        second,
        ResultEnvelope.for_request(second, Status.succeeded, response=response),
        lane="interactive",
        now_ms=0,
    )
    assert isinstance(final, ResultEnvelope) and final.tool_loop is not None
    assert final.tool_loop.turns == 2 and final.tool_loop.transcript[0].calls == [record]
    assert final.response is not None
    assert final.response.usage.prompt_tokens == 20 + output.prompt_tokens


# ---------------------------------------------------------------- OpenAI parameters (issue 16)


def test_n_choices_and_logprobs_from_the_raw_logits(engine: Any) -> None:
    """n rows per request; each token's logprob is the log-softmax of the model's own
    logits at that step, so greedy choices carry the top-1 alternative as their token."""
    (out,) = run(engine, [greedy("n3", "Count: one two", 6, n=3, logprobs=4)]).values()
    samples = out.samples()
    assert len(samples) == 3 and out.finish != "error"
    assert len({s.text for s in samples}) == 1  # greedy: three identical choices
    for sample in samples:
        assert sample.logprobs is not None and sample.token_ids is not None
        assert len(sample.logprobs) == sample.completion_tokens == len(sample.token_ids)
        for item, token_id in zip(sample.logprobs, sample.token_ids, strict=True):
            assert item.token_id == token_id and len(item.top) == 4
            assert item.top[0][0] == token_id  # greedy picked the likeliest token
            assert abs(item.top[0][2] - item.logprob) < 1e-5
            assert [t[2] for t in item.top] == sorted((t[2] for t in item.top), reverse=True)
            assert item.logprob <= 0.0
    assert out.total_completion_tokens == sum(s.completion_tokens for s in samples)


def test_logit_bias_and_allowed_token_ids_steer_greedy_decoding(engine: Any) -> None:
    tok = engine.tokenizer
    target = tok.encode(" banana", add_special_tokens=False)[0]
    outs = run(
        engine,
        [
            greedy("bias", "Hello", 4, logit_bias=((target, 100.0),), ignore_eos=True),
            greedy("allowed", "Hello", 4, allowed_token_ids=(target,), ignore_eos=True),
        ],
    )
    for key in ("bias", "allowed"):
        assert outs[key].token_ids == [target] * 4, key


def test_stop_token_ids_and_bad_words(engine: Any) -> None:
    tok = engine.tokenizer
    free = run(engine, [greedy("free", "Hello there", 8, ignore_eos=True)])["free"]
    assert free.token_ids is not None and len(free.token_ids) == 8
    stop_at = free.token_ids[2]
    cut = run(engine, [greedy("cut", "Hello there", 8, ignore_eos=True, stop_token_ids=(stop_at,))])
    first = free.token_ids.index(stop_at)
    assert cut["cut"].token_ids == free.token_ids[: first + 1] and cut["cut"].finish == "stop"
    word = tok.decode([free.token_ids[0]]).strip()
    if word:  # a banned first token must not be generated first
        banned = run(engine, [greedy("bad", "Hello there", 3, ignore_eos=True, bad_words=(word,))])
        assert banned["bad"].token_ids is not None
        assert banned["bad"].token_ids[0] not in {
            ids[0] for ids in (tok.encode(v, add_special_tokens=False) for v in (word, " " + word))
        }


def test_include_stop_str_in_output_keeps_the_stop_string(engine: Any) -> None:
    free = run(engine, [greedy("f", "Once upon", 10, ignore_eos=True)])["f"]
    stop = free.text[3:6]
    assert stop.strip(), "the noise text is long enough to cut"
    outs = run(
        engine,
        [
            greedy("drop", "Once upon", 10, ignore_eos=True, stop=(stop,)),
            greedy(
                "keep",
                "Once upon",
                10,
                ignore_eos=True,
                stop=(stop,),
                include_stop_str_in_output=True,
            ),
        ],
    )
    at = free.text.find(stop)
    assert outs["drop"].text == free.text[:at]
    assert outs["keep"].text == free.text[: at + len(stop)]


def test_min_p_and_repetition_penalty_run_and_change_only_their_group(engine: Any) -> None:
    plain = greedy("plain", "a a a a", 6, ignore_eos=True)
    penalised = greedy("rep", "a a a a", 6, ignore_eos=True, repetition_penalty=2.0)
    sampled = EngineRequest(
        key="minp",
        prompt="a a a a",
        prompt_token_ids=None,
        sampling=SamplingSpec(max_tokens=6, temperature=1.0, min_p=0.999, seed=1, ignore_eos=True),
    )
    outs = run(engine, [plain, penalised, sampled])
    assert all(o.finish != "error" for o in outs.values())
    # min_p near 1 keeps only the likeliest token: sampling becomes greedy.
    assert outs["minp"].token_ids == outs["plain"].token_ids
    assert outs["rep"].token_ids != outs["plain"].token_ids
