"""The v1 wire contract: what is accepted, what is rejected and how the rejection reads."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import (
    BatchInputLine,
    ChatCompletion,
    ContractError,
    ErrorCode,
    RedisKeys,
    RequestEnvelope,
    ResultEnvelope,
    Status,
    Timings,
    decode_request,
    encode_request,
    limits,
    valid_id,
)
from schemas.export import JSON_DIR, MODELS, render

WEATHER_TOOL = {
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


def chat(**extra: Any) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": "hi"}]}
    body.update(extra.pop("body", {}))
    return {"request_id": "req-1", "body": body, **extra}


def reject(data: Any, key: bytes | None = None) -> ContractError:
    raw = data if isinstance(data, bytes) else json.dumps(data).encode()
    with pytest.raises(ContractError) as info:
        decode_request(raw, key)
    return info.value


# ---------------------------------------------------------------- acceptance


def test_minimal_chat_defaults() -> None:
    env = decode_request(json.dumps(chat()).encode())
    assert env.v == 1
    assert env.endpoint == "/v1/chat/completions"
    assert env.priority == 0
    assert env.result_ttl_s == 86_400
    assert env.is_chat


def test_full_chat_with_tool_loop_is_accepted() -> None:
    env = decode_request(
        json.dumps(
            chat(
                job_id="nightly-2026-12-02",
                custom_id="row 17 / a",
                priority=-5,
                deadline="2030-01-01T00:00:00Z",
                result_ttl_s=3600,
                metadata={"team": "search", "n": 3},
                submitted_at="2026-12-02T10:00:00+00:00",
                body={
                    "model": "Qwen3-14B",
                    "messages": [
                        {"role": "system", "content": "be brief"},
                        {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
                        {
                            "role": "assistant",
                            "content": None,
                            "tool_calls": [
                                {
                                    "id": "call_1",
                                    "type": "function",
                                    "function": {
                                        "name": "get_weather",
                                        "arguments": '{"city":"Oslo"}',
                                    },
                                }
                            ],
                        },
                        {"role": "tool", "tool_call_id": "call_1", "content": "-3C"},
                    ],
                    "tools": [WEATHER_TOOL],
                    "tool_choice": "auto",
                    "temperature": 0.2,
                    "top_p": 0.9,
                    "top_k": 20,
                    "max_completion_tokens": 128,
                    "stop": ["\n\n"],
                    "seed": 7,
                    "presence_penalty": 0.5,
                    "frequency_penalty": -0.5,
                    "response_format": {"type": "json_object"},
                    "chat_template_kwargs": {"enable_thinking": False},
                },
            )
        ).encode(),
        b"req-1",
    )
    assert env.job_id == "nightly-2026-12-02"
    assert env.deadline == datetime(2030, 1, 1, tzinfo=UTC)
    assert env.body.output_limit() == 128  # type: ignore[union-attr]


def test_completions_endpoint_takes_prompt_or_token_ids() -> None:
    text = decode_request(
        json.dumps(
            {"request_id": "c", "endpoint": "/v1/completions", "body": {"prompt": "Once"}}
        ).encode()
    )
    ids = decode_request(
        json.dumps(
            {"request_id": "c", "endpoint": "/v1/completions", "body": {"prompt": [1, 2, 3]}}
        ).encode()
    )
    assert not text.is_chat and not ids.is_chat


def test_json_schema_response_format_uses_the_schema_alias() -> None:
    env = RequestEnvelope.model_validate(
        chat(
            body={
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "answer", "schema": {"type": "object"}},
                }
            }
        )
    )
    wire = json.loads(encode_request(env))
    assert wire["body"]["response_format"]["json_schema"]["schema"] == {"type": "object"}


# ---------------------------------------------------------------- rejections

REJECTIONS: list[tuple[str, Any, str]] = [
    ("not JSON", b"{nope", "(envelope)"),
    ("not an object", b"[1, 2]", "(envelope)"),
    ("not UTF-8", b'{"request_id": "\xff"}', "(envelope)"),
    ("oversize", b'{"x": "' + b"a" * limits.MAX_ENVELOPE_BYTES + b'"}', "(envelope)"),
    ("missing request_id", {"body": chat()["body"]}, "request_id"),
    ("request_id bad characters", chat(request_id="a b/c"), "request_id"),
    ("request_id too long", chat(request_id="a" * 129), "request_id"),
    ("request_id wrong type", chat(request_id=12), "request_id"),
    ("unknown envelope field", chat(colour="red"), "colour"),
    ("unknown body field", chat(body={"max_token": 5}), "body.max_token"),
    ("negative max_tokens", chat(body={"max_tokens": -1}), "body.max_tokens"),
    ("huge max_tokens", chat(body={"max_tokens": limits.MAX_OUTPUT_TOKENS + 1}), "body.max_tokens"),
    ("max_tokens as text", chat(body={"max_tokens": "ten"}), "body.max_tokens"),
    ("temperature out of range", chat(body={"temperature": 3}), "body.temperature"),
    ("empty messages", {"request_id": "r", "body": {"messages": []}}, "body.messages"),
    (
        "bad role",
        {"request_id": "r", "body": {"messages": [{"role": "bot", "content": "x"}]}},
        "body.messages[0]",
    ),
    (
        "tool message without id",
        {
            "request_id": "r",
            "body": {
                "messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}]
            },
        },
        "body.messages[1].tool_call_id",
    ),
    (
        "bad tool schema",
        chat(
            body={
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {
                                "type": "object",
                                "properties": {"a": {"type": "nonsense"}},
                            },
                        },
                    }
                ]
            }
        ),
        "body.tools[0].function.parameters",
    ),
    (
        "bad tool name",
        chat(body={"tools": [{"type": "function", "function": {"name": "no spaces"}}]}),
        "body.tools[0].function.name",
    ),
    ("too many tools", chat(body={"tools": [WEATHER_TOOL] * (limits.MAX_TOOLS + 1)}), "body.tools"),
    ("n over the bound", chat(body={"n": 17}), "body.n"),
    ("stream: true", chat(body={"stream": True}), "body.stream"),
    ("top_logprobs without logprobs", chat(body={"top_logprobs": 2}), "body.top_logprobs"),
    ("n > 1 in a tool loop", chat(body={"n": 2}, tool_loop={}), "tool_loop"),
    ("unknown endpoint", chat(endpoint="/v1/rerank"), "endpoint"),
    ("a chat body on /v1/embeddings", chat(endpoint="/v1/embeddings"), "body"),
    ("metadata too big", chat(metadata={"blob": "x" * limits.MAX_METADATA_BYTES}), "metadata"),
    ("naive deadline", chat(deadline="2030-01-01T00:00:00"), "deadline"),
    ("schema version 2", chat(v=2), "v"),
    ("ttl zero", chat(result_ttl_s=0), "result_ttl_s"),
]


@pytest.mark.parametrize(("case", "data", "param"), REJECTIONS, ids=[c[0] for c in REJECTIONS])
def test_each_rejection_names_the_field(case: str, data: Any, param: str) -> None:
    error = reject(data)
    assert error.code is ErrorCode.invalid_request
    assert error.param == param, error.message
    assert error.message.startswith(param), error.message
    info = error.info()
    assert info.param == param and info.message == error.message


def test_prompt_on_chat_endpoint_is_refused() -> None:
    error = reject({"request_id": "r", "endpoint": "/v1/chat/completions", "body": {"prompt": "x"}})
    assert "messages" in error.message


def test_key_must_match_request_id() -> None:
    error = reject(chat(), key=b"other")
    assert error.param == "request_id"
    assert error.request_id == "req-1"


def test_request_id_is_recovered_for_a_failed_result() -> None:
    assert reject(chat(body={"max_tokens": -1})).request_id == "req-1"
    assert reject(b"{nope", key=b"from-key").request_id == "from-key"
    assert reject(chat(request_id="bad id!"), key=b"bad id!").request_id is None


@pytest.mark.parametrize(
    ("data", "param", "where"),
    [
        (chat(metadata={"team": float("inf"), "n": [1, 2]}), "metadata", "team: inf"),
        (chat(metadata={"a": [1, {"b": float("nan")}]}), "metadata", "a[1].b: nan"),
        (chat(body={"chat_template_kwargs": {"t": float("-inf")}}), "body.chat_template_kwargs", "t: -inf"),
        (
            chat(body={"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "maximum": float("inf")}}}]}),
            "body.tools[0].function.parameters",
            "maximum: inf",
        ),
        (
            chat(body={"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "number", "minimum": float("nan")}}}}),
            "body.response_format.json_schema.schema",
            "minimum: nan",
        ),
    ],
)  # fmt: skip
def test_nan_and_infinity_are_refused_in_free_form_json(data: Any, param: str, where: str) -> None:
    # json.dumps writes them as NaN / Infinity, which Python's and pydantic's parsers read
    # back; the result would then carry null in their place (found by test_fuzz: metadata
    # {"team": inf} did not survive encode -> decode).
    error = reject(data)
    assert error.param == param
    assert where in error.message


def test_param_keeps_a_field_named_like_its_union_tag() -> None:
    # response_format's branch tag is "json_schema" and so is the field inside it
    data = chat(body={"response_format": {"type": "json_schema", "json_schema": {"name": "", "schema": {}}}})  # fmt: skip
    assert reject(data).param == "body.response_format.json_schema.name"


def test_contract_error_survives_pickling() -> None:
    import pickle

    error = reject(chat(body={"max_tokens": 0}))
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.message, copy.param, copy.code, copy.request_id) == (
        error.message, error.param, error.code, error.request_id,
    )  # fmt: skip


# ---------------------------------------------------------------- properties

ids = st.from_regex(r"[A-Za-z0-9_.:-]{1,128}", fullmatch=True)
texts = st.text(min_size=1, max_size=200)
messages = st.lists(
    st.one_of(
        st.builds(lambda t: {"role": "user", "content": t}, texts),
        st.builds(lambda t: {"role": "system", "content": t}, texts),
        st.builds(lambda t: {"role": "assistant", "content": t}, texts),
    ),
    min_size=1,
    max_size=8,
)
bodies = st.fixed_dictionaries(
    {"messages": messages},
    optional={
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0.01, 1),
        "max_tokens": st.integers(1, limits.MAX_OUTPUT_TOKENS),
        "seed": st.integers(0, 2**32),
        "stop": st.lists(st.text(min_size=1, max_size=10), max_size=4),
    },
)
envelopes = st.fixed_dictionaries(
    {"request_id": ids, "body": bodies},
    optional={
        "job_id": ids,
        "custom_id": st.text(min_size=1, max_size=64),
        "priority": st.integers(-1000, 1000),
        "metadata": st.dictionaries(st.text(max_size=10), st.integers(), max_size=5),
    },
)


@given(envelopes)
@settings(max_examples=200, deadline=None)
def test_round_trip_is_lossless(data: dict[str, Any]) -> None:
    env = decode_request(json.dumps(data).encode(), data["request_id"].encode())
    again = decode_request(encode_request(env), env.request_id.encode())
    assert again == env


@given(envelopes, st.sampled_from(["max_tokens", "temperature", "top_p"]), st.integers(-50, -1))
@settings(max_examples=100, deadline=None)
def test_out_of_range_numbers_are_always_rejected(
    data: dict[str, Any], field: str, value: int
) -> None:
    data = {**data, "body": {**data["body"], field: value}}
    error = reject(data)
    assert error.param == f"body.{field}"


@given(st.binary(max_size=300))
@settings(max_examples=300, deadline=None)
def test_arbitrary_bytes_never_escape_as_another_exception(raw: bytes) -> None:
    try:
        decode_request(raw)
    except ContractError as error:
        assert error.message
        assert error.code is ErrorCode.invalid_request


@given(st.text(max_size=140))
def test_valid_id_matches_the_pattern(text: str) -> None:
    ok = valid_id(text) is not None
    assert ok == (
        0 < len(text) <= 128 and all(c.isascii() and (c.isalnum() or c in "_.:-") for c in text)
    )


# ---------------------------------------------------------------- results, keys, batch lines


def test_result_envelope_round_trip_and_error_shape() -> None:
    result = ResultEnvelope(
        request_id="r1",
        status=Status.succeeded,
        response=ChatCompletion.model_validate(
            {
                "id": "chatcmpl-r1",
                "created": 1,
                "model": "m",
                "choices": [{"index": 0, "message": {"content": "hi"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        ),
        timings=Timings.of(submitted=1000, dequeued=1010, dispatched=1060, finished=1200),
    )
    wire = json.loads(result.model_dump_json(exclude_none=True))
    assert wire["response"]["object"] == "chat.completion"
    assert wire["timings"] == {
        "submitted": 1000, "dequeued": 1010, "dispatched": 1060, "finished": 1200,
        "queue_ms": 10.0, "batch_wait_ms": 50.0, "inference_ms": 140.0,
    }  # fmt: skip
    assert ResultEnvelope.model_validate(wire) == result


def test_redis_keys_follow_the_contract() -> None:
    keys = RedisKeys("qb")
    assert keys.result("a") == "qb:result:a"
    assert keys.done("a") == "qb:done:a"
    assert keys.job("j") == "qb:job:j"
    assert keys.job_stream("j") == "qb:job:j:done"
    assert keys.job_cancel("j") == "qb:job:j:cancel"


def test_batch_input_line() -> None:
    line = BatchInputLine.model_validate(
        {"custom_id": "x", "method": "POST", "url": "/v1/chat/completions", "body": {}}
    )
    assert line.url == "/v1/chat/completions"


@pytest.mark.parametrize("name", sorted(MODELS))
def test_committed_json_schemas_are_current(name: str) -> None:
    """Fails when a model changes without `python -m schemas.export`."""
    assert (JSON_DIR / name).read_text() == render(MODELS[name])
