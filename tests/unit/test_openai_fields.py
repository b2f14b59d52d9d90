"""Every OpenAI/vLLM body field: declared, decided once, documented, and refused by name."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from schemas import ContractError, validate_envelope
from schemas.bodies import ChatCompletionBody, CompletionBody, SamplingFields
from schemas.openai_fields import NOTHING, RULES, markdown_table, refused_names, rule_for

README = Path(__file__).resolve().parents[2] / "schemas" / "README.md"
BEGIN, END = "<!-- openai-fields:begin -->", "<!-- openai-fields:end -->"

BODIES: dict[str, type[SamplingFields]] = {
    "chat": ChatCompletionBody,
    "completions": CompletionBody,
}


def declared(model: type[SamplingFields]) -> set[str]:
    """The body's fields: its declared ones, and the refused ones it words errors for."""
    fields = {field.alias or name for name, field in model.model_fields.items()}
    return fields | refused_names(model.ENDPOINT)


def envelope(endpoint: str, **fields: Any) -> dict[str, Any]:
    if endpoint == "chat":
        body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]}
        return {"request_id": "r-1", "body": {**body, **fields}}
    return {
        "request_id": "r-1",
        "endpoint": "/v1/completions",
        "body": {"prompt": "hi", **fields},
    }


def rejected(data: dict[str, Any]) -> ContractError:
    with pytest.raises(ContractError) as info:
        validate_envelope(data)
    return info.value


# ---------------------------------------------------------------- table <-> models <-> docs


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_every_declared_field_has_exactly_one_rule(endpoint: str) -> None:
    fields = declared(BODIES[endpoint])
    ruled = [rule.name for rule in RULES if rule.applies_to(endpoint)]  # type: ignore[arg-type]
    assert sorted(ruled) == sorted(set(ruled)), "a field is decided twice"
    assert fields - set(ruled) == set(), "declared fields without a decision"
    assert set(ruled) - fields == set(), "decisions for fields the body does not declare"


def test_rules_are_unique_per_endpoint_and_documented() -> None:
    keys = [(rule.where, rule.name) for rule in RULES]
    assert len(keys) == len(set(keys))
    for rule in RULES:
        assert rule.note and not rule.note.endswith("."), rule.name
        if rule.accepted is not NOTHING:
            assert rule.decision == "refused", f"{rule.name}: only refused fields accept a default"


def test_readme_table_is_the_generated_one() -> None:
    text = README.read_text(encoding="utf-8")
    assert BEGIN in text and END in text, "schemas/README.md lost its table markers"
    table = text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n") + "\n"
    assert table == markdown_table(), "regenerate it: python -m schemas.openai_fields"


def test_rule_for_finds_both_endpoint_rules() -> None:
    assert rule_for("chat", "stream").where == "both"
    assert rule_for("completions", "echo").decision == "supported"
    assert rule_for("chat", "echo").decision == "refused"
    with pytest.raises(KeyError):
        rule_for("completions", "messages")


# ---------------------------------------------------------------- refused fields

REFUSED = [
    (endpoint, rule)
    for rule in RULES
    if rule.decision == "refused"
    for endpoint in ("chat", "completions")
    if rule.applies_to(endpoint)  # type: ignore[arg-type]
]


def _not_accepted(rule: Any) -> Any:
    if isinstance(rule.accepted, bool):
        return not rule.accepted
    if rule.accepted is NOTHING:
        return {"anything": 1}
    return "something else"


@pytest.mark.parametrize(("endpoint", "rule"), REFUSED, ids=[f"{e}-{r.name}" for e, r in REFUSED])
def test_refused_field_is_named_with_its_reason(endpoint: str, rule: Any) -> None:
    error = rejected(envelope(endpoint, **{rule.name: _not_accepted(rule)}))
    assert error.param == f"body.{rule.name}"
    assert rule.note in error.message
    assert "Extra inputs" not in error.message


@pytest.mark.parametrize(("endpoint", "rule"), REFUSED, ids=[f"{e}-{r.name}" for e, r in REFUSED])
def test_refused_field_passes_at_null_and_its_default(endpoint: str, rule: Any) -> None:
    validate_envelope(envelope(endpoint, **{rule.name: None}))
    if rule.accepted is not NOTHING:
        env = validate_envelope(envelope(endpoint, **{rule.name: rule.accepted}))
        assert rule.name not in env.body.model_dump(), "an accepted default is as if absent"
        assert rule.name not in env.body.model_fields_set


def test_accepted_default_is_exact_not_truthy() -> None:
    """`stream: 0` is not `stream: false`; `length_penalty: 1` (int) is not 1.0 either."""
    assert rejected(envelope("chat", stream=0)).param == "body.stream"
    assert rejected(envelope("chat", length_penalty=1)).param == "body.length_penalty"
    assert rejected(envelope("chat", modalities=["text", "audio"])).param == "body.modalities"


def test_body_priority_points_to_the_envelope() -> None:
    error = rejected(envelope("chat", priority=-5))
    assert error.param == "body.priority" and "envelope's `priority`" in error.message
    assert validate_envelope({**envelope("chat"), "priority": -5}).priority == -5


def test_unknown_fields_are_still_rejected() -> None:
    error = rejected(envelope("chat", temprature=0.5))
    assert error.param == "body.temprature"
    assert error.message == "body.temprature: Extra inputs are not permitted"
    assert rejected(envelope("completions", messages=[])).param == "body.messages"
    assert rejected(envelope("completions", suffix="x")).param == "body.suffix"
    assert rejected(envelope("chat", suffix="x")).param == "body.suffix"  # not a chat field


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_json_schema_lists_refused_fields_and_forbids_others(endpoint: str) -> None:
    schema = BODIES[endpoint].model_json_schema()
    assert schema["additionalProperties"] is False
    for name in refused_names(endpoint):  # type: ignore[arg-type]
        assert schema["properties"][name]["description"].startswith("Refused")


# ---------------------------------------------------------------- ignored fields

IGNORED_VALUES: dict[str, Any] = {
    "user": "user-1234",
    "safety_identifier": "hash-1",
    "store": True,
    "metadata": {"team": "search"},
    "service_tier": "flex",
    "prompt_cache_key": "k-1",
    "prompt_cache_retention": "24h",
    "verbosity": "low",
    "prediction": {"type": "content", "content": "the predicted answer"},
    "request_id": "their-own-id",
}


def test_every_ignored_field_has_a_sample_value() -> None:
    assert {r.name for r in RULES if r.decision == "ignored"} == set(IGNORED_VALUES)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_ignored_fields_change_nothing(endpoint: str) -> None:
    from worker.rendering import PromptRenderer

    fields = {
        name: value
        for name, value in IGNORED_VALUES.items()
        if any(r.name == name and r.applies_to(endpoint) for r in RULES)  # type: ignore[arg-type]
    }
    renderer = PromptRenderer(None, max_model_len=4096, served_names={"m"})
    plain = renderer.render(validate_envelope(envelope(endpoint)))
    tagged = renderer.render(validate_envelope(envelope(endpoint, **fields)))
    assert (tagged.text, tagged.sampling) == (plain.text, plain.sampling)


@pytest.mark.parametrize(
    ("name", "bad"),
    [
        ("store", "maybe"),
        ("service_tier", "fastest"),
        ("metadata", {"k": 1}),
        ("verbosity", "loud"),
        ("prediction", {"type": "diff"}),
    ],
)
def test_ignored_fields_are_still_type_checked(name: str, bad: Any) -> None:
    assert rejected(envelope("chat", **{name: bad})).param.startswith(f"body.{name}")


# ---------------------------------------------------------------- supported fields' bounds


@pytest.mark.parametrize(
    ("endpoint", "fields", "param"),
    [
        ("chat", {"n": 0}, "body.n"),
        ("chat", {"n": 17}, "body.n"),
        ("chat", {"logprobs": True, "top_logprobs": 21}, "body.top_logprobs"),
        ("chat", {"top_logprobs": 3}, "body.top_logprobs"),
        ("completions", {"logprobs": 21}, "body.logprobs"),
        ("completions", {"logprobs": True}, "body.logprobs"),
        ("completions", {"echo": True, "logprobs": 1}, "body.logprobs"),
        ("completions", {"best_of": 3, "n": 2}, "body.best_of"),
        ("completions", {"prompt": ["a", "b"]}, "body.prompt"),
        ("chat", {"logit_bias": {"abc": 1}}, "body.logit_bias"),
        ("chat", {"logit_bias": {"5": 101}}, "body.logit_bias.5"),
        ("chat", {"logit_bias": {str(i): 1 for i in range(1025)}}, "body.logit_bias"),
        ("chat", {"min_p": 1.5}, "body.min_p"),
        ("chat", {"repetition_penalty": 0}, "body.repetition_penalty"),
        ("chat", {"stop_token_ids": [-1]}, "body.stop_token_ids[0]"),
        ("chat", {"allowed_token_ids": []}, "body.allowed_token_ids"),
        ("chat", {"bad_words": [""]}, "body.bad_words[0]"),
        ("chat", {"reasoning_effort": "extreme"}, "body.reasoning_effort"),
        ("chat", {"structured_outputs": {"regex": "a+"}}, "body.structured_outputs.regex"),
        ("chat", {"structured_outputs": {"json": {}, "choice": ["a"]}}, "body.structured_outputs"),
        (
            "chat",
            {"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}},
            "body.structured_outputs",
        ),
        ("chat", {"continue_final_message": True}, "body.continue_final_message"),
        (
            "chat",
            {"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}},
            "body.reasoning_effort",
        ),
    ],
)
def test_supported_field_bounds(endpoint: str, fields: dict[str, Any], param: str) -> None:
    assert rejected(envelope(endpoint, **fields)).param == param


def test_one_item_prompt_list_is_that_prompt() -> None:
    assert validate_envelope(envelope("completions", prompt=["Say"])).body.prompt == "Say"
    body = validate_envelope(envelope("completions", prompt=[[1, 2, 3]])).body
    assert body.prompt == [1, 2, 3]


@pytest.mark.parametrize(
    ("effort", "thinks"),
    [("none", False), ("minimal", False), ("low", True), ("medium", True), ("high", True)],
)
def test_reasoning_effort_maps_to_enable_thinking(effort: str, thinks: bool) -> None:
    body = validate_envelope(envelope("chat", reasoning_effort=effort)).body
    assert isinstance(body, ChatCompletionBody) and body.thinking() is thinks
    agreeing = {"reasoning_effort": effort, "chat_template_kwargs": {"enable_thinking": thinks}}
    assert validate_envelope(envelope("chat", **agreeing)).body.thinking() is thinks


def test_a_whole_openai_sdk_body_runs_unchanged() -> None:
    """What `openai.chat.completions.create(...)` sends with its defaults spelled out."""
    body = {
        "model": "qwen3-14b",
        "messages": [
            {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "user", "content": "Classify: great product!", "name": "alice"},
        ],
        "stream": False,
        "n": 1,
        "logprobs": True,
        "top_logprobs": 5,
        "logit_bias": {"9707": 5},
        "parallel_tool_calls": False,
        "store": False,
        "service_tier": "auto",
        "metadata": {"job": "nightly"},
        "reasoning_effort": "none",
        "modalities": ["text"],
        "user": "u-1",
        "seed": 7,
    }
    env = validate_envelope({"request_id": "sdk-1", "body": body})
    assert env.body.top_logprobs_k() == 5 and env.body.thinking() is False
    assert json.loads(env.model_dump_json())["body"]["logit_bias"] == {"9707": 5.0}


def test_table_names_every_decision_word() -> None:
    table = markdown_table()
    rows = [line for line in table.splitlines()[2:]]
    assert len(rows) == len(RULES)
    assert all(re.match(r"^\| `[a-z_]+` \| (both|chat|completions) \| ", row) for row in rows)
