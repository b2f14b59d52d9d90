"""Records on Kafka -> vLLM (Qwen3-14B architecture, dummy weights) -> results in Redis.

Run on the GPU machine with the stack up (deploy/gpu/README.md):
    python3 -m pytest tests/gpu -q
The weights are random, so the text is noise: these tests check the plumbing, the
rendering (tools in the prompt, thinking on and off) and that the parser runs on
real engine output, not what the model says.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import pytest

from tests.gpu.harness import create_topics, start_pipeline

REPO = Path(__file__).resolve().parents[2]
MODEL_DIR = REPO / "tests" / "fixtures" / "qwen3-14b"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def pipeline() -> Iterator[dict[str, Any]]:
    from worker.config import WorkerSettings
    from worker.engines.vllm_engine import VllmEngine

    run = f"gpu-{uuid.uuid4().hex[:6]}"
    settings = WorkerSettings(
        engine="vllm",
        model=str(MODEL_DIR),
        served_model_name="Qwen3-14B",
        load_format="dummy",
        dtype="bfloat16",
        max_model_len=4096,
        gpu_memory_utilization=float(os.environ.get("QBATCH_GPU_MEMORY_UTILIZATION", "0.9")),
        topic=f"{run}.requests",
        bulk_topic=f"{run}.requests.bulk",
        dlq_topic=f"{run}.dlq",
        group=f"{run}-w",
        prefix=run,
        metrics_port=0,
        tool_calls_topic=f"{run}.tool-calls",
        # forced calls as compact JSON: random weights would otherwise wander in the
        # whitespace the grammar allows and run out of tokens before the call closes
        engine_args={
            "structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True}
        },
        # every test through qbatch's lane scheduler (vLLM's own behind the step cap)
        interactive_step_tokens=256,
    )
    create_topics(
        settings,
        [(settings.topic, 4), (settings.bulk_topic, 4), (settings.dlq_topic, 1),
         (settings.tool_calls_topic, 4)],
    )  # fmt: skip
    executor = _executor(settings, run)
    engine = VllmEngine.from_settings(settings)
    engine.start()
    pipe = start_pipeline(settings, engine)
    executor_thread = threading.Thread(target=executor.run, daemon=True)
    executor_thread.start()
    send, worker, producer, r = pipe.send, pipe.worker, pipe.producer, pipe.redis

    yield {
        "send": send,
        "engine": engine,
        "worker": worker,
        "executor": executor,
        "producer": producer,
        "redis": r,
        "settings": settings,
        "run": run,
    }
    executor.request_stop()
    executor_thread.join(timeout=30)
    pipe.stop()


def _executor(settings: Any, run: str) -> Any:
    """`qbatch tools serve` in a thread, with one weather tool."""
    from producer.tools import ToolRegistry
    from worker.tool_loop.executor import ExecutorSettings, ToolExecutor

    registry = ToolRegistry()

    @registry.tool
    def get_weather(city: Literal["Oslo", "Paris"]) -> dict[str, Any]:
        """Current weather for a city."""
        return {"city": city, "temp_c": 21}

    executor_settings = ExecutorSettings(
        kafka_bootstrap=settings.kafka_bootstrap,
        redis_url=settings.redis_url,
        topic=settings.topic,
        dlq_topic=settings.dlq_topic,
        tool_calls_topic=settings.tool_calls_topic,
        prefix=run,
        tools_group=f"{run}-tools",
        tools_metrics_port=0,
    )
    return ToolExecutor(executor_settings, registry)


def test_plain_chat_round_trip(pipeline: dict[str, Any]) -> None:
    res = pipeline["send"](
        {
            "request_id": "plain",
            "body": {
                "messages": [{"role": "user", "content": "Hello!"}],
                "max_tokens": 24,
                "ignore_eos": True,
            },
        }
    )
    assert res["status"] == "succeeded", res
    assert res["response"]["model"] == "Qwen3-14B"
    assert res["response"]["usage"]["completion_tokens"] == 24
    assert res["response"]["choices"][0]["finish_reason"] in {"length", "tool_calls"}
    assert res["worker"]["engine"] == "vllm/continuous"
    assert res["timings"]["inference_ms"] > 0
    # the scheduler stats of this engine (its own stat-logger store) and its KV capacity
    stats = pipeline["engine"].stats()
    assert stats.kv_cache_tokens is not None and stats.kv_cache_tokens > 0, stats
    assert stats.kv_cache_usage is not None and stats.running is not None, stats


def test_tool_request_renders_tools_and_parses_output(pipeline: dict[str, Any]) -> None:
    from schemas import RequestEnvelope
    from worker.rendering import PromptRenderer

    envelope = {
        "request_id": "tools",
        "body": {"messages": [{"role": "user", "content": "Weather in Oslo?"}],
                 "tools": TOOLS, "max_tokens": 48, "ignore_eos": True},
    }  # fmt: skip
    engine = pipeline["engine"]
    renderer = PromptRenderer(
        engine.tokenizer, max_model_len=engine.max_model_len, served_names={"Qwen3-14B"}
    )
    rendered = renderer.render(RequestEnvelope.model_validate(envelope))
    assert "<tools>" in rendered.text and '"get_weather"' in rendered.text
    res = pipeline["send"](envelope)
    assert res["status"] == "succeeded", res
    message = res["response"]["choices"][0]["message"]
    # random weights: whatever came out was either content, valid calls or reported errors
    assert message.get("content") or message.get("tool_calls") or res["tool_call_errors"]


@pytest.mark.parametrize("thinking", [True, False])
def test_enable_thinking_both_ways(pipeline: dict[str, Any], thinking: bool) -> None:
    from schemas import RequestEnvelope
    from worker.rendering import PromptRenderer

    envelope = {
        "request_id": f"think-{thinking}",
        "body": {"messages": [{"role": "user", "content": "Why is the sky blue?"}],
                 "max_tokens": 32, "ignore_eos": True,
                 "chat_template_kwargs": {"enable_thinking": thinking}},
    }  # fmt: skip
    engine = pipeline["engine"]
    renderer = PromptRenderer(
        engine.tokenizer, max_model_len=engine.max_model_len, served_names={"Qwen3-14B"}
    )
    rendered = renderer.render(RequestEnvelope.model_validate(envelope))
    assert rendered.text.endswith("<think>\n\n</think>\n\n") is (not thinking)
    assert rendered.reasoning_enabled is thinking
    res = pipeline["send"](envelope)
    assert res["status"] == "succeeded", res
    if not thinking:
        assert res["response"]["choices"][0]["message"].get("reasoning_content") is None


def test_prompt_over_the_context_is_refused_before_the_gpu(pipeline: dict[str, Any]) -> None:
    started = time.perf_counter()
    res = pipeline["send"](
        {
            "request_id": "too-long",
            "endpoint": "/v1/completions",
            "body": {"prompt": list(range(1000, 1000 + 4000)), "max_tokens": 500},
        }
    )
    assert res["status"] == "failed"
    assert res["error"]["code"] == "context_length_exceeded"
    assert res["timings"].get("dispatched") is None  # never reached the engine
    assert time.perf_counter() - started < 5


def test_response_format_json_schema_constrains_the_output(pipeline: dict[str, Any]) -> None:
    """Structured outputs reach vLLM's grammar backend (xgrammar in the kit).

    Random weights pick among the tokens the grammar allows, and JSON allows any amount of
    whitespace, so the answer may run out of tokens before it closes; but every character it
    did produce must be on the schema's path. Without the constraint, random weights
    produce arbitrary tokens that almost never open with "{".
    """
    import jsonschema

    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    res = pipeline["send"](
        {
            "request_id": "structured",
            "body": {
                "messages": [{"role": "user", "content": "Is water wet? Answer in JSON."}],
                "max_tokens": 96,
                "temperature": 0,
                "chat_template_kwargs": {"enable_thinking": False},
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "verdict", "schema": schema},
                },
            },
        }
    )
    assert res["status"] == "succeeded", res
    choice = res["response"]["choices"][0]
    text = choice["message"]["content"] or ""
    if choice["finish_reason"] == "stop":
        jsonschema.validate(json.loads(text), schema)
    else:
        assert choice["finish_reason"] == "length"
        assert text.strip() == "" or text.lstrip().startswith("{"), text[:200]


def test_a_forced_tool_call_loops_to_the_final_turn(pipeline: dict[str, Any]) -> None:
    """Two turns on the real engine: turn 1 is forced to call get_weather (structured
    outputs make the random-weight model emit valid arguments), the executor runs it, and
    turn 2 (tool_choice back to auto) renders the call and its result and answers."""
    weather = pipeline["executor"].registry.openai_tools("get_weather")[0]
    res = pipeline["send"](
        {
            "request_id": "loop",
            "tool_loop": {"max_turns": 2},
            "body": {
                "messages": [{"role": "user", "content": "Weather in Oslo?"}],
                "tools": [weather],
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                "max_tokens": 48,
                "temperature": 0,
            },
        }
    )
    assert res["status"] == "succeeded", res
    loop = res["tool_loop"]
    assert loop["turns"] == 2, loop
    (turn,) = loop["transcript"]
    (call,) = turn["calls"]
    assert call["name"] == "get_weather" and call["ok"], call
    city = json.loads(call["arguments"])["city"]
    assert city in {"Oslo", "Paris"} and json.loads(call["content"]) == {"city": city, "temp_c": 21}
    usage = res["response"]["usage"]
    first = turn["usage"]
    # summed over both turns; turn 2's prompt is turn 1's plus the call and its result
    assert usage["prompt_tokens"] > 2 * first["prompt_tokens"], (usage, first)
    assert usage["completion_tokens"] > first["completion_tokens"], (usage, first)
    assert res["response"]["choices"][0]["finish_reason"] in {"stop", "length"}


def test_n_logprobs_and_logit_bias_on_vllm(pipeline: dict[str, Any]) -> None:
    """`n: 3`, `logprobs` with `top_logprobs: 5` and `logit_bias` through vLLM itself.

    A +100 bias outweighs any logit random weights produce, so every sampled token is the
    biased one; the logprobs are vLLM's raw ones (before the bias), five alternatives each,
    best first.
    """
    tokenizer = pipeline["engine"].tokenizer
    (blue,) = tokenizer.encode(" blue", add_special_tokens=False)
    res = pipeline["send"](
        {
            "request_id": "n3-logprobs-bias",
            "body": {
                "messages": [{"role": "user", "content": "Name a colour."}],
                "n": 3,
                "logprobs": True,
                "top_logprobs": 5,
                "logit_bias": {str(blue): 100},
                "temperature": 1.0,
                "max_tokens": 8,
                "ignore_eos": True,
                "reasoning_effort": "none",
            },
        }
    )
    assert res["status"] == "succeeded", res
    response = res["response"]
    assert response["system_fingerprint"].startswith("fp_")
    assert [c["index"] for c in response["choices"]] == [0, 1, 2]
    assert response["usage"]["completion_tokens"] == 24
    assert response["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0
    for choice in response["choices"]:
        assert choice["message"]["content"] == " blue" * 8, choice
        content = choice["logprobs"]["content"]
        assert [t["token"] for t in content] == [" blue"] * 8
        for token in content:
            top = [alt["logprob"] for alt in token["top_logprobs"]]
            assert len(top) == 5 and top == sorted(top, reverse=True) and top[0] <= 0
            assert token["logprob"] <= top[0] and token["bytes"] == list(b" blue")


def test_completions_logprobs_and_cached_tokens_on_vllm(pipeline: dict[str, Any]) -> None:
    """Completions `logprobs: 5` with n = 2, and vLLM's prefix cache counted on a repeat."""
    prompt = "The history of the city begins " + "long ago and far away, " * 60
    body = {"prompt": prompt, "n": 2, "logprobs": 5, "max_tokens": 6, "ignore_eos": True}
    first = pipeline["send"](
        {"request_id": "cmpl-lp-1", "endpoint": "/v1/completions", "body": body}
    )
    again = pipeline["send"](
        {"request_id": "cmpl-lp-2", "endpoint": "/v1/completions", "body": body}
    )
    for res in (first, again):
        assert res["status"] == "succeeded", res
        assert [c["index"] for c in res["response"]["choices"]] == [0, 1]
        for choice in res["response"]["choices"]:
            lp = choice["logprobs"]
            assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 6
            assert all(5 <= len(top) <= 6 for top in lp["top_logprobs"])
            assert lp["text_offset"] == sorted(lp["text_offset"])
    prompt_tokens = again["response"]["usage"]["prompt_tokens"]
    cached = again["response"]["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert prompt_tokens > 256 and 0 < cached <= prompt_tokens, again["response"]["usage"]


def test_context_policies_fit_long_prompts_on_vllm(pipeline: dict[str, Any]) -> None:
    """A 60-turn conversation with tool calls (~6K tokens) and a ~9K-token document in a 4K
    context: sliding_window and truncate_middle make them fit, measured with the engine's
    own tokenizer, and vLLM accepts the result (it would refuse an over-long prompt)."""
    turns: list[dict[str, Any]] = [{"role": "system", "content": "Answer briefly."}]
    for n in range(60):
        turns.append({"role": "user", "content": f"Question {n}: " + "how is the weather " * 12})
        turns.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": f"c{n}",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    }
                ],
            }
        )
        turns.append({"role": "tool", "tool_call_id": f"c{n}", "content": '{"temp_c": 21}'})
        turns.append({"role": "assistant", "content": "It is 21 degrees. " * 8})
    turns.append({"role": "user", "content": "And tomorrow?"})
    slide = pipeline["send"]({
        "request_id": "ctx-slide",
        "body": {"messages": turns, "tools": TOOLS, "max_tokens": 64, "ignore_eos": True},
        "context": {"strategy": "sliding_window", "max_prompt_tokens": 2048},
    })  # fmt: skip
    assert slide["status"] == "succeeded", slide
    report = slide["context"]
    assert report["prompt_tokens_before"] > 4096 >= 2048 >= report["prompt_tokens_after"]
    assert report["messages_dropped"] > 0 and report["messages_dropped"] % 4 == 0
    assert slide["response"]["usage"]["prompt_tokens"] == report["prompt_tokens_after"]
    assert slide["response"]["usage"]["completion_tokens"] == 64

    document = " ".join(f"Clause {i} sets out the terms of delivery." for i in range(1000))
    cut = pipeline["send"]({
        "request_id": "ctx-cut",
        "body": {"messages": [{"role": "user", "content": "Summarise:\n" + document}],
                 "max_tokens": 256, "ignore_eos": True},
        "context": {"strategy": "truncate_middle"},
    })  # fmt: skip
    assert cut["status"] == "succeeded", cut
    report = cut["context"]
    assert report["window"] == 4096 - 256
    assert report["prompt_tokens_before"] > 4096
    assert cut["response"]["usage"]["prompt_tokens"] == report["prompt_tokens_after"] <= 3840
    assert report["truncated"][0]["tokens_removed"] >= report["prompt_tokens_before"] - 3840


def test_interactive_next_to_bulk_through_the_step_cap(pipeline: dict[str, Any]) -> None:
    """The lane scheduler is vLLM's scheduler here; bulk lines and an interactive request
    running together all finish (the cap shapes steps, it never drops work)."""
    engine, settings, r = pipeline["engine"], pipeline["settings"], pipeline["redis"]
    assert engine.step_tokens == 256
    assert engine._kwargs["scheduler_cls"].endswith("vllm_lane_scheduler.LaneScheduler")
    bulk = [f"bulk-{uuid.uuid4().hex[:6]}-{i}" for i in range(24)]
    for rid in bulk:
        envelope = {
            "request_id": rid,
            "endpoint": "/v1/completions",
            "body": {"prompt": "word " * 1500, "max_tokens": 48, "ignore_eos": True},
        }
        pipeline["producer"].send(
            settings.bulk_topic, key=rid.encode(), value=json.dumps(envelope).encode()
        )
    pipeline["producer"].flush()
    result = pipeline["send"](
        {
            "request_id": f"i-{uuid.uuid4().hex[:6]}",
            "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16},
        }
    )
    assert result["status"] == "succeeded"
    for rid in bulk:
        assert r.blpop([f"{pipeline['run']}:done:{rid}"], timeout=300) is not None
        done = json.loads(r.get(f"{pipeline['run']}:result:{rid}"))
        assert done["status"] == "succeeded"
        assert done["response"]["usage"]["completion_tokens"] == 48
