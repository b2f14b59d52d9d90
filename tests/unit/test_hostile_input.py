"""Records built to break the decoder: each becomes a ContractError naming where, with as
much of the request recovered as is valid (so its failed result reaches its job)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from schemas import ContractError, decode_request, validate_envelope
from schemas.decode import recover_ref
from schemas.ref import RequestRef

HUGE = "9" * 5_000


def envelope(**extra: Any) -> dict[str, Any]:
    env: dict[str, Any] = {
        "request_id": "r1",
        "job_id": "job-1",
        "custom_id": "row-1",
        "metadata": {"team": "a"},
        "result_ttl_s": 600,
        "body": {"messages": [{"role": "user", "content": "hi"}]},
    }
    env.update(extra)
    return env


def raw(env: dict[str, Any], **swap: str) -> bytes:
    """JSON text of `env`, with literal text substituted for placeholders."""
    text = json.dumps(env)
    for name, literal in swap.items():
        text = text.replace(f'"<{name}>"', literal)
    return text.encode()


def rejected(data: bytes, key: bytes | None = b"r1") -> ContractError:
    with pytest.raises(ContractError) as info:
        decode_request(data, key)
    return info.value


@pytest.mark.parametrize(
    "where",
    [
        {"metadata": {"n": "<n>"}},
        {"priority": "<n>"},
        {"result_ttl_s": "<n>"},
        {"body": {"messages": [{"role": "user", "content": "hi"}], "seed": "<n>"}},
        {"body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "<n>"}},
        {"body": {"prompt": ["<n>"]}, "endpoint": "/v1/completions"},
    ],
)
def test_a_5000_digit_integer_anywhere_is_a_contract_error(where: dict[str, Any]) -> None:
    error = rejected(raw(envelope(**where), n=HUGE))
    assert error.request_id == "r1"
    assert error.param  # names a field, or "(envelope)"


def test_an_integer_too_long_for_json_readers_is_refused_in_metadata() -> None:
    error = rejected(raw(envelope(metadata={"n": "<n>"}), n="1" * 1_500))
    assert error.param == "metadata" and "1000 digits" in error.message


def test_deep_nesting_is_a_contract_error() -> None:
    deep = "[" * 100_000 + "]" * 100_000
    error = rejected(raw(envelope(metadata={"n": "<n>"}), n=deep))
    assert error.request_id == "r1"


@pytest.mark.parametrize(
    "parameters",
    [
        {"type": "object", "properties": {"a": {"type": "string", "pattern": "a{99999999999}"}}},
        {"type": "object", "patternProperties": {"a{99999999999}": {}}},
        {"type": "object", "properties": {"a": {"$ref": "#/" + "a/" * 3000}}},
    ],
)
def test_pathological_tool_schemas_are_refused_naming_the_tool(parameters: dict[str, Any]) -> None:
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}],
    }
    error = rejected(raw(envelope(body=body)))
    assert error.param is not None and error.param.startswith("body.tools[0]")


def test_a_pathological_response_schema_is_refused_naming_it() -> None:
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(?<"}},
        },
    }
    error = rejected(raw(envelope(body=body)))
    assert error.param == "body.response_format.json_schema.schema"


def test_a_rejected_envelope_keeps_its_job() -> None:
    """Only the body is wrong: the failed result must still reach job-1."""
    error = rejected(raw(envelope(body={"messages": [], "max_tokens": 0})))
    assert error.ref == RequestRef(
        request_id="r1", job_id="job-1", custom_id="row-1", metadata={"team": "a"}, result_ttl_s=600
    )


def test_a_key_mismatch_keeps_the_whole_reference() -> None:
    error = rejected(raw(envelope()), key=b"another-key")
    assert error.param == "request_id"
    assert error.ref is not None and error.ref.job_id == "job-1" and error.ref.result_ttl_s == 600


def test_recovery_keeps_only_valid_fields() -> None:
    ref = recover_ref(
        {
            "request_id": "r1",
            "job_id": "vic:cancel",  # reserved: not a job to count in
            "custom_id": "",
            "metadata": {"x": float("nan")},
            "result_ttl_s": -5,
        },
        None,
    )
    assert ref == RequestRef(request_id="r1")


def test_recovery_falls_back_to_the_record_key() -> None:
    assert recover_ref([1, 2], b"from-key") == RequestRef(request_id="from-key")
    assert recover_ref({"request_id": "bad id!"}, b"\xff") is None


def test_validate_envelope_raises_only_contract_errors_for_odd_python_values() -> None:
    """The producer validates dicts built in Python: values JSON cannot even hold."""
    for odd in (object(), {1, 2}, b"bytes", 10**5000):
        with pytest.raises(ContractError):
            validate_envelope(envelope(metadata={"x": odd}))


@pytest.mark.parametrize(
    "swap",
    [
        {"chat_template_kwargs": {"x": "<S>"}},
        {"chat_template_kwargs": {"<S>": 1}},
        {"chat_template_kwargs": {"nested": [{"deep": "<S>"}]}},
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "n", "schema": {"description": "<S>"}},
            }
        },
    ],
    ids=["value", "key", "nested", "response_schema"],
)
def test_a_lone_surrogate_in_free_form_json_is_refused(swap: dict[str, Any]) -> None:
    """`"\\ud800"` is valid JSON text but no UTF-8 writer can encode it: accepted, it made
    the worker fail to write the request's result (or its next tool-loop turn), and
    `qbatch serve` fail to publish a batch line it had accepted."""
    env = envelope()
    env["body"].update(swap)
    text = json.dumps(env).replace('"<S>"', '"a\\ud800b"')
    error = rejected(text.encode())
    assert error.param is not None and error.param.startswith("body.")
    assert "surrogate" in error.message or "unicode" in error.message


@pytest.mark.parametrize("count", [-5, 2**40 + 1, int("9" * 30)])
def test_a_continuations_usage_figures_are_bounded(count: int) -> None:
    """A continuation carries its transcript's usage, which the final result sums: a
    negative or enormous figure (one past what a 64-bit JSON reader holds made the whole
    job's collect fail) is refused where it enters."""
    usage = {"prompt_tokens": count, "completion_tokens": 0, "total_tokens": 0}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    env = envelope(
        tool_loop={"max_turns": 4},
        loop={"turn": 2, "transcript": [{"turn": 1, "calls": [], "usage": usage}]},
    )
    env["body"]["tools"] = tools
    error = rejected(raw(env))
    assert error.param == "loop.transcript[0].usage.prompt_tokens"
