"""`/v1/embeddings`: the body's bounds, the wire encodings, the worker's preparation of a
request (tokens, context policy, Matryoshka, result bound) and the engines' vectors."""

from __future__ import annotations

import base64
import math
import struct
from typing import Any

import pytest
from pydantic import ValidationError

from producer.bulk import Defaults, parse_line
from schemas import ContractError, RequestEnvelope, ResultEnvelope, Status
from schemas.embeddings import (
    MAX_EMBED_INPUTS,
    EmbeddingBody,
    decode_vector,
    embedding_result_bytes,
    encode_vector,
)
from schemas.errors import ErrorCode
from schemas.result import read_stored
from worker.embedding import echo_vector, normalized, shortened
from worker.endpoints import build_response
from worker.endpoints.embeddings import MAX_EMBED_REQUEST_TOKENS
from worker.engines.base import EmbeddingShape, EngineOutput
from worker.engines.echo import EchoEngine
from worker.rendering import PromptRenderer


def envelope(body: dict[str, Any], **options: Any) -> RequestEnvelope:
    return RequestEnvelope.model_validate(
        {"request_id": "r1", "endpoint": "/v1/embeddings", "body": body, **options}
    )


def echo_renderer(
    size: int = 16, *, max_model_len: int = 100, max_result_bytes: int = 16 << 20
) -> tuple[EchoEngine, PromptRenderer]:
    engine = EchoEngine(task="embed", embed_size=size)
    renderer = PromptRenderer(
        None,
        max_model_len=max_model_len,
        served_names={"echo"},
        tasks=engine.supported_tasks,
        embedding_shape=engine.embedding_shape,
        max_result_bytes=max_result_bytes,
    )
    return engine, renderer


def run(engine: EchoEngine, renderer: PromptRenderer, env: RequestEnvelope) -> Any:
    rendered = renderer.render(env)
    outputs: list[EngineOutput] = []
    engine.submit([rendered.engine_request("k")], outputs.append)
    response, errors = build_response(env, rendered, outputs[0], model="echo", created=7)
    assert errors == []
    return rendered, response


def norm(vector: list[float]) -> float:
    return math.sqrt(math.fsum(x * x for x in vector))


# ---------------------------------------------------------------- the body


@pytest.mark.parametrize(
    ("value", "count"),
    [("one text", 1), (["a", "b"], 2), ([1, 2, 3], 1), ([[1, 2], [3]], 2)],
)
def test_every_input_form_of_openai_is_taken(value: Any, count: int) -> None:
    assert len(EmbeddingBody(input=value).inputs()) == count


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "body.input"),
        ({"input": []}, "body.input"),
        ({"input": [[]]}, "body.input"),
        ({"input": ["a", 1]}, "body.input"),
        ({"input": [-1]}, "body.input"),
        ({"input": ["x"] * (MAX_EMBED_INPUTS + 1)}, "body.input"),
        ({"input": "x", "dimensions": 0}, "body.dimensions"),
        ({"input": "x", "dimensions": True}, "body.dimensions"),
        ({"input": "x", "dimensions": "8"}, "body.dimensions"),
        ({"input": "x", "dimensions": 10**6}, "body.dimensions"),
        ({"input": "x", "encoding_format": "int8"}, "body.encoding_format"),
        ({"input": "x", "user": "u" * 257}, "body.user"),
        ({"input": "x", "n": 2}, "body.n"),
        ({"input": 5}, "body.input"),
    ],
)
def test_bad_bodies_are_refused_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ContractError) as caught:
        from schemas import validate_envelope

        validate_envelope({"request_id": "r", "endpoint": "/v1/embeddings", "body": body})
    assert (caught.value.param or "").startswith(param), caught.value


def test_a_chat_body_on_the_embeddings_endpoint_names_the_input_it_lacks() -> None:
    with pytest.raises(ValidationError, match="takes `input`"):
        envelope({"messages": [{"role": "user", "content": "hi"}]})


def test_sliding_window_is_refused_for_embeddings() -> None:
    with pytest.raises(ValidationError, match="/v1/embeddings takes truncate_middle"):
        envelope({"input": "x"}, context={"strategy": "sliding_window"})


# ---------------------------------------------------------------- the wire


def test_base64_is_openais_little_endian_float32() -> None:
    vector = [0.5, -0.25, 1e-3]
    text = encode_vector(vector, "base64")
    assert isinstance(text, str)
    assert struct.unpack("<3f", base64.b64decode(text)) == pytest.approx(vector)
    assert decode_vector(text) == pytest.approx(vector)
    assert encode_vector(vector, "float") == vector
    # the bound is an upper bound of what the encodings take
    for fmt in ("float", "base64"):
        size = len(str(encode_vector([-1.2345678901234567e-05] * 512, fmt)))  # type: ignore[arg-type]
        assert size < embedding_result_bytes(1, 512, fmt)  # type: ignore[arg-type]


def test_a_stored_result_is_read_for_its_usage_without_its_vectors() -> None:
    engine, renderer = echo_renderer(8)
    env = envelope({"input": ["a b", "c"], "encoding_format": "float"})
    _, response = run(engine, renderer, env)
    raw = (
        ResultEnvelope.for_request(env, Status.succeeded, response=response)
        .model_dump_json(exclude_none=True)
        .encode()
    )
    light, span = read_stored(raw)
    assert span is not None and light.response is not None
    assert light.response.data == [] and light.response.usage.prompt_tokens == 3  # type: ignore[union-attr]
    assert raw[span[0] : span[1]] == response.model_dump_json(exclude_none=True).encode()


# ---------------------------------------------------------------- the worker


def test_echo_vectors_are_unit_deterministic_and_shortened() -> None:
    engine, renderer = echo_renderer(16)
    rendered, response = run(engine, renderer, envelope({"input": ["x y", "z", "x y"]}))
    vectors = [item.embedding for item in response.data]
    assert [len(v) for v in vectors] == [16, 16, 16]
    assert all(abs(norm(v) - 1) < 1e-9 for v in vectors)
    assert vectors[0] == vectors[2] != vectors[1]
    assert response.usage.prompt_tokens == response.usage.total_tokens == 5
    assert response.id == "embd-r1" and [d.index for d in response.data] == [0, 1, 2]
    _, short = run(engine, renderer, envelope({"input": "x y", "dimensions": 4}))
    assert short.data[0].embedding == pytest.approx(shortened(vectors[0], 4))
    assert rendered.sampling.n == 1 and rendered.embed is not None


def test_vector_helpers() -> None:
    assert normalized([3.0, 4.0]) == [0.6, 0.8]
    assert normalized([0.0, 0.0]) == [0.0, 0.0]
    assert shortened([3.0, 4.0, 12.0], 2) == [0.6, 0.8]
    assert echo_vector("a", 40) == echo_vector("a", 40) != echo_vector("b", 40)
    assert echo_vector([1, 2], 8) != echo_vector([2, 1], 8)


@pytest.mark.parametrize(
    ("shape", "dims", "problem"),
    [
        (EmbeddingShape(64), 32, "not Matryoshka-trained"),
        (EmbeddingShape(64, True), 65, "over the served model's 64"),
        (EmbeddingShape(64, True), 64, None),
        (EmbeddingShape(64, True, (32, 64)), 16, "takes dimensions 32, 64"),
        (EmbeddingShape(64, True, (32, 64)), 32, None),
    ],
)
def test_which_dimensions_a_model_takes(
    shape: EmbeddingShape, dims: int, problem: str | None
) -> None:
    found = shape.dimensions_problem(dims)
    assert (found is None) if problem is None else (problem in (found or ""))


def test_the_config_keys_vllm_reads_decide_matryoshka() -> None:
    class Config:
        matryoshka_dimensions = [128, 256]

    assert EmbeddingShape.of_config(Config(), 1024) == EmbeddingShape(1024, True, (128, 256))
    assert EmbeddingShape.of_config(object(), 1024) == EmbeddingShape(1024)


def test_inputs_over_the_context_are_refused_or_cut_by_the_policy() -> None:
    _, renderer = echo_renderer(8, max_model_len=10)
    long_input = " ".join(f"w{i}" for i in range(25))
    with pytest.raises(ContractError) as caught:
        renderer.render(envelope({"input": long_input}))
    assert caught.value.param == "body.input"
    assert caught.value.code is ErrorCode.context_length_exceeded
    with pytest.raises(ContractError) as caught:
        renderer.render(envelope({"input": ["ok", "ok", long_input]}))
    assert caught.value.param == "body.input[2]"

    env = envelope({"input": ["ok", long_input]}, context={"strategy": "truncate_middle"})
    rendered = renderer.render(env)
    assert rendered.embed is not None and rendered.embed.inputs[1] == (
        "w0 w1 w2 w3 w4 w20 w21 w22 w23 w24"
    )
    report = rendered.context
    assert report is not None and report.window == 10
    assert (report.prompt_tokens_before, report.prompt_tokens_after) == (26, 11)
    [cut] = report.truncated
    assert (cut.input, cut.message, cut.tokens_removed) == (1, None, 15)

    env = envelope(
        {"input": long_input}, context={"strategy": "truncate_head", "max_prompt_tokens": 3}
    )
    rendered = renderer.render(env)
    assert rendered.embed is not None and rendered.embed.inputs == ("w22 w23 w24",)


def test_a_request_whose_vectors_could_pass_the_result_bound_is_refused() -> None:
    _, renderer = echo_renderer(4096, max_result_bytes=1 << 20)
    texts = ["x"] * 20
    with pytest.raises(ContractError) as caught:
        renderer.render(envelope({"input": texts}))  # floats: ~2 MB
    assert caught.value.code is ErrorCode.result_too_large
    assert caught.value.param == "body.input" and "base64" in caught.value.message
    renderer.render(envelope({"input": texts, "encoding_format": "base64"}))  # ~0.4 MB


def test_the_tokens_of_one_request_are_bounded() -> None:
    _, renderer = echo_renderer(4, max_model_len=200_000)
    words = " ".join(["w"] * 160_000)
    with pytest.raises(ContractError) as caught:
        renderer.render(envelope({"input": [words, words]}))
    assert (
        caught.value.param == "body.input" and str(MAX_EMBED_REQUEST_TOKENS) in caught.value.message
    )


def test_with_a_tokenizer_inputs_are_token_ids_and_ids_are_checked(qwen3_tokenizer: Any) -> None:
    renderer = PromptRenderer(
        qwen3_tokenizer,
        max_model_len=64,
        served_names={"m"},
        tasks=("embed",),  # type: ignore[arg-type]
        embedding_shape=EmbeddingShape(64),
    )
    rendered = renderer.render(envelope({"input": ["hello world", "hi"]}))
    assert rendered.embed is not None
    assert rendered.embed.inputs[0] == qwen3_tokenizer("hello world")["input_ids"]
    assert rendered.prompt_tokens == len(rendered.embed.inputs[0]) + len(rendered.embed.inputs[1])
    rendered = renderer.render(envelope({"input": [[1, 2], [3]]}))
    assert rendered.embed is not None and rendered.embed.inputs == ([1, 2], [3])
    with pytest.raises(ContractError) as caught:
        renderer.render(envelope({"input": [[1], [10**7]]}))
    assert caught.value.param == "body.input[1]" and "vocabulary" in caught.value.message
    with pytest.raises(ContractError) as caught:
        renderer.render(envelope({"input": "x", "dimensions": 8}))
    assert caught.value.param == "body.dimensions"


def test_a_generate_pool_refuses_embeddings_and_an_embed_pool_refuses_chat() -> None:
    generate = PromptRenderer(None, max_model_len=100, served_names={"m"})
    with pytest.raises(ContractError) as caught:
        generate.render(envelope({"input": "x"}))
    assert caught.value.param == "endpoint" and "embed" in caught.value.message
    _, embed = echo_renderer()
    chat = RequestEnvelope.model_validate(
        {"request_id": "r", "body": {"messages": [{"role": "user", "content": "hi"}]}}
    )
    with pytest.raises(ContractError) as caught:
        embed.render(chat)
    assert caught.value.param == "endpoint"


def test_an_engine_answer_with_the_wrong_number_of_vectors_is_an_error() -> None:
    _, renderer = echo_renderer(4)
    env = envelope({"input": ["a", "b"]})
    rendered = renderer.render(env)
    wrong = EngineOutput("k", "", 2, 0, "stop", embeddings=[[1.0, 0.0, 0.0, 0.0]])
    with pytest.raises(ValueError, match="1 vectors for 2 inputs"):
        build_response(env, rendered, wrong, model="echo", created=1)


# ---------------------------------------------------------------- bulk


def test_bulk_lines_default_to_base64_unless_they_chose() -> None:
    defaults = Defaults(embeddings_base64=True)

    def line(body: dict[str, Any]) -> Any:
        import json

        text = json.dumps(
            {"custom_id": "c", "method": "POST", "url": "/v1/embeddings", "body": body}
        )
        parsed = parse_line(text, 1, None, "job", defaults=defaults.routed(None))
        assert parsed.envelope is not None, parsed.error
        return parsed.envelope.body.encoding_format

    assert line({"input": "x"}) == "base64"
    assert line({"input": "x", "encoding_format": "float"}) == "float"
    plain = parse_line(
        '{"custom_id": "c", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}',
        1,
        None,
        "job",
    )
    assert plain.envelope is not None and plain.envelope.body.encoding_format is None


# ---------------------------------------------------------------- the engines


def _settings(**kw: Any) -> Any:
    from worker.config import WorkerSettings

    return WorkerSettings(engine="vllm", task="embed", model="/models/Qwen3-Embedding-8B", **kw)


def test_the_vllm_embedder_loads_the_pooling_runner_without_the_step_cap() -> None:
    from worker.engines import engine_class
    from worker.engines.vllm_embed import VllmEmbedder, embed_kwargs

    kwargs = embed_kwargs(_settings(interactive_step_tokens=256, tensor_parallel_size=2))
    assert (kwargs["runner"], kwargs["convert"]) == ("pooling", "embed")
    assert "scheduler_cls" not in kwargs and kwargs["tensor_parallel_size"] == 2
    assert embed_kwargs(_settings(engine_args={"convert": "none"}))["convert"] == "none"
    assert engine_class("vllm", "embed") is VllmEmbedder
    assert VllmEmbedder.supported_tasks == frozenset({"embed"})


class _Pooled:
    def __init__(self, ids: list[int], vector: list[float]) -> None:
        self.prompt_token_ids = ids
        self.outputs = type("Out", (), {"data": vector})()


def _embed_request(key: str, *inputs: list[int], dims: int | None = None) -> Any:
    from worker.engines.base import EmbedSpec, EngineRequest, SamplingSpec

    spec = EmbedSpec(inputs=tuple(inputs), dimensions=dims)
    return EngineRequest(key, "", None, SamplingSpec(max_tokens=1), embed=spec)


def test_the_vllm_embedder_answers_each_request_once_in_input_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import asyncio

    from worker.engines.vllm_embed import VllmEmbedder

    class FakeLLM:
        def __init__(self) -> None:
            self.ids: list[str] = []

        async def encode(self, prompt: Any, params: Any, request_id: str, priority: int = 0) -> Any:
            self.ids.append(request_id)
            ids = prompt["prompt_token_ids"]
            if ids == [666]:
                raise RuntimeError("engine fault")
            if ids == [777]:
                await asyncio.sleep(10)
            yield _Pooled(ids, [float(ids[0]), 0.0])

    engine = VllmEmbedder({"model": "m"})
    engine._llm = FakeLLM()
    # no vLLM here: the spec stands in for its PoolingParams
    monkeypatch.setattr("worker.engines.vllm_embed._pooling_params", lambda spec: spec)
    outputs: list[EngineOutput] = []

    async def scenario() -> None:
        await engine._generate(_embed_request("a", [3, 4], [5]), outputs.append)
        await engine._generate(_embed_request("b", [1], [666]), outputs.append)
        task = asyncio.ensure_future(engine._generate(_embed_request("c", [777]), outputs.append))
        await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())
    by_key = {o.key: o for o in outputs}
    assert len(outputs) == 3
    assert by_key["a"].embeddings == [[3.0, 0.0], [5.0, 0.0]] and by_key["a"].prompt_tokens == 3
    assert by_key["b"].finish == "error" and "engine fault" in (by_key["b"].error or "")
    assert by_key["c"].finish == "abort"
    assert engine._llm.ids[:2] == ["a#0", "a#1"]


def test_the_vllm_embedders_static_batch_splits_one_embed_call_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from worker.engines.vllm_embed import VllmEmbedder

    calls: list[int] = []

    class FakeLLM:
        def embed(self, prompts: list[Any], pooling_params: Any, use_tqdm: bool) -> list[Any]:
            calls.append(len(prompts))
            return [_Pooled(p["prompt_token_ids"], [1.0] * 2) for p in prompts]

    engine = VllmEmbedder({"model": "m"}, mode="static")
    engine._llm = FakeLLM()
    monkeypatch.setattr("worker.engines.vllm_embed._pooling_params", lambda spec: spec)
    outputs: list[EngineOutput] = []
    batch = [_embed_request("a", [1, 2], [3]), _embed_request("b", [4])]
    engine._run_static_batch(batch, outputs.append)
    assert calls == [3]  # one call for the whole micro-batch
    assert [(o.key, len(o.embeddings or []), o.prompt_tokens) for o in outputs] == [
        ("a", 2, 3),
        ("b", 1, 1),
    ]


def test_a_transformers_vector_does_not_depend_on_its_batch_mates(tiny_qwen3_dir: Any) -> None:
    import threading

    from worker.engines.transformers_embed import TransformersEmbedder

    engine = TransformersEmbedder(str(tiny_qwen3_dir), max_model_len=64)
    engine.start()
    try:

        def run(*requests: Any) -> dict[str, EngineOutput]:
            done: dict[str, EngineOutput] = {}
            event = threading.Event()

            def collect(output: EngineOutput) -> None:
                done[output.key] = output
                if len(done) == len(requests):
                    event.set()

            engine.submit(list(requests), collect)
            assert event.wait(60)
            return done

        alone = run(_embed_request("a", [10, 11, 12]))["a"]
        mixed = run(
            _embed_request("long", list(range(100, 150))),
            _embed_request("a", [10, 11, 12]),
            _embed_request("over", list(range(100, 200))),
            _embed_request("short", [7], dims=8),
        )
        assert alone.embeddings is not None and mixed["a"].embeddings is not None
        diff = max(
            abs(x - y) for x, y in zip(alone.embeddings[0], mixed["a"].embeddings[0], strict=True)
        )
        assert diff < 1e-5
        assert mixed["over"].finish == "error" and "max_model_len" in (mixed["over"].error or "")
        assert len((mixed["short"].embeddings or [[]])[0]) == 8
    finally:
        engine.close()


# ---------------------------------------------------------------- found in review


@pytest.mark.parametrize(
    ("value", "param"),
    [
        (["a", ""], "body.input[1]"),
        (["a", [1]], "body.input[1]"),
        ([[1, 2], []], "body.input[1]"),
        ([[1, 2], [3, -1]], "body.input[1][1]"),
        ([1, "a"], "body.input[1]"),
        ([[1], [2.5]], "body.input[1][0]"),
    ],
)
def test_the_input_at_fault_is_named_not_the_whole_union(value: Any, param: str) -> None:
    from schemas import validate_envelope

    with pytest.raises(ContractError) as caught:
        validate_envelope(
            {"request_id": "r", "endpoint": "/v1/embeddings", "body": {"input": value}}
        )
    assert caught.value.param == param, caught.value


def test_an_input_of_no_tokens_is_refused_naming_it() -> None:
    _, renderer = echo_renderer()
    with pytest.raises(ContractError) as caught:
        renderer.render(envelope({"input": ["fine", "   "]}))
    assert caught.value.param == "body.input[1]" and "no tokens" in caught.value.message


def test_a_vector_that_is_not_finite_fails_the_request_instead_of_writing_null() -> None:
    _, renderer = echo_renderer(2)
    env = envelope({"input": "x"})
    rendered = renderer.render(env)
    bad = EngineOutput("k", "", 1, 0, "stop", embeddings=[[float("nan"), 0.0]])
    with pytest.raises(ValueError, match="not finite"):
        build_response(env, rendered, bad, model="echo", created=1)


def test_the_size_bound_covers_a_result_with_the_largest_envelope() -> None:
    engine, renderer = echo_renderer(1024, max_result_bytes=16 << 20)
    env = envelope(
        {"input": [f"text {i}" for i in range(17)], "encoding_format": "base64"},
        metadata={"blob": "x" * 16_000},
        custom_id="c" * 512,
    )
    rendered, response = run(engine, renderer, env)
    result = ResultEnvelope.for_request(env, Status.succeeded, response=response)
    assert len(result.model_dump_json(exclude_none=True)) < rendered.result_bytes


def test_one_failing_input_stops_the_requests_other_inputs_in_vllm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import asyncio

    from worker.engines.vllm_embed import VllmEmbedder

    cancelled: list[str] = []

    class FakeLLM:
        async def encode(self, prompt: Any, params: Any, request_id: str, priority: int = 0) -> Any:
            if prompt["prompt_token_ids"] == [666]:
                raise RuntimeError("refused")
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled.append(request_id)
                raise
            yield _Pooled([1], [1.0])

    engine = VllmEmbedder({"model": "m"})
    engine._llm = FakeLLM()
    monkeypatch.setattr("worker.engines.vllm_embed._pooling_params", lambda spec: spec)
    outputs: list[EngineOutput] = []
    asyncio.run(engine._generate(_embed_request("a", [1], [666], [2]), outputs.append))
    [output] = outputs
    assert output.finish == "error" and "refused" in (output.error or "")
    assert sorted(cancelled) == ["a#0", "a#2"]


def test_in_static_mode_a_bad_request_fails_only_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.engines.vllm_embed import VllmEmbedder

    class FakeLLM:
        def embed(self, prompts: list[Any], pooling_params: Any, use_tqdm: bool) -> list[Any]:
            if any(p["prompt_token_ids"] == [666] for p in prompts):
                raise ValueError("prompt refused")
            return [_Pooled(p["prompt_token_ids"], [1.0]) for p in prompts]

    engine = VllmEmbedder({"model": "m"}, mode="static")
    engine._llm = FakeLLM()
    monkeypatch.setattr("worker.engines.vllm_embed._pooling_params", lambda spec: spec)
    outputs: list[EngineOutput] = []
    batch = [_embed_request("a", [1]), _embed_request("bad", [666]), _embed_request("c", [2])]
    engine._run_static_batch(batch, outputs.append)
    assert {o.key: o.finish for o in outputs} == {"a": "stop", "bad": "error", "c": "stop"}
