"""The route table (issue 17, part 3): one definition in `schemas.routes`, used by the
client (topic by body.model), `qbatch bulk` (unknown model = bad line) and `qbatch serve`
(400 model_not_found before queuing, /v1/models)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from producer.bulk import Defaults, scan_lines
from producer.client import QBatchClient, Request
from producer.serve.batches import validate_input
from producer.serve.errors import openai_code
from schemas import ContractError, ErrorCode, RequestEnvelope
from schemas.routes import RoutesError, RouteTable, load_routes, parse_routes
from schemas.settings import BULK, ConnectionSettings
from worker.tool_loop.answers import continuation_topic

TABLE = {
    "qwen3-8b": {"topic": "q.qwen", "bulk_topic": "q.qwen.bulk"},
    "qwen": {"topic": "q.qwen", "bulk_topic": "q.qwen.bulk"},
    "llama": {"topic": "q.llama"},
}


class Sent:
    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []

    def send(self, topic: str, key: bytes, value: bytes) -> Any:
        self.sent.append((topic, key))
        return self

    is_done = True

    def get(self, timeout: float | None = None) -> None:
        return None

    def flush(self, timeout: float | None = None) -> None:
        return None


def body(model: str | None) -> dict[str, Any]:
    data: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]}
    if model is not None:
        data["model"] = model
    return data


def routed_client(producer: Sent, routes: RouteTable | None) -> QBatchClient:
    settings = ConnectionSettings(topic="q.default", bulk_topic="q.default.bulk", routes=routes)
    return QBatchClient(settings, producer=producer, redis_client=object())


def test_a_table_routes_names_and_aliases_and_falls_back_to_topic_for_bulk() -> None:
    table = parse_routes(TABLE)
    assert table.models == ["qwen3-8b", "qwen", "llama"]
    assert table.route("qwen").topic_for(bulk=True) == "q.qwen.bulk"
    assert table.route("llama").topic_for(bulk=True) == "q.llama"  # no bulk_topic: topic
    assert table.route("qwen3-8b").topic_for(bulk=False) == "q.qwen"


@pytest.mark.parametrize("model", ["gpt-4o", None, ""])
def test_an_unknown_or_missing_model_is_a_contract_error_naming_body_model(
    model: str | None,
) -> None:
    with pytest.raises(ContractError) as info:
        parse_routes(TABLE).route(model)
    assert info.value.param == "body.model" and info.value.code is ErrorCode.unknown_model
    assert info.value.message.startswith("body.model: ") and "llama" in info.value.message


@pytest.mark.parametrize(
    "data", [{}, {"m": {}}, {"m": {"topic": ""}}, {"m": {"topic": "t", "x": 1}}, ["m"]]
)
def test_a_bad_table_is_refused(data: object) -> None:
    with pytest.raises(RoutesError):
        parse_routes(data)


def test_tables_load_from_yaml_json_and_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "r.yaml").write_text("llama:\n  topic: q.llama\n")
    (tmp_path / "r.json").write_text(json.dumps(TABLE))
    (tmp_path / "bad.yaml").write_text("llama: [\n")
    assert load_routes(tmp_path / "r.yaml").models == ["llama"]
    assert load_routes(tmp_path / "r.json").route("qwen").bulk_topic == "q.qwen.bulk"
    with pytest.raises(RoutesError, match="not valid YAML"):
        load_routes(tmp_path / "bad.yaml")
    with pytest.raises(RoutesError, match="missing"):
        load_routes(tmp_path / "missing.json")
    monkeypatch.setenv("QBATCH_ROUTES", json.dumps(TABLE))
    assert ConnectionSettings().routes == parse_routes(TABLE)
    monkeypatch.delenv("QBATCH_ROUTES")
    assert ConnectionSettings().routes is None


def test_the_client_publishes_to_the_models_pool() -> None:
    producer = Sent()
    qb = routed_client(producer, parse_routes(TABLE))
    qb.submit(body("qwen"), request_id="r1")
    qb.submit(body("llama"), request_id="r2", lane=BULK)
    qb.submit(body("qwen3-8b"), request_id="r3", lane=BULK)
    assert [t for t, _ in producer.sent] == ["q.qwen", "q.llama", "q.qwen.bulk"]


def test_an_unknown_model_is_refused_before_anything_is_published() -> None:
    producer = Sent()
    qb = routed_client(producer, parse_routes(TABLE))
    with pytest.raises(ContractError) as info:
        qb.submit(body("gpt-4o"))
    assert info.value.param == "body.model" and "'gpt-4o'" in info.value.message
    with pytest.raises(ContractError, match=r"^\[1\] body.model"):
        qb.submit_many([Request(body("llama")), Request(body("nope"))])
    assert producer.sent == []


def test_without_a_table_every_model_goes_to_the_one_topic() -> None:
    producer = Sent()
    qb = routed_client(producer, None)
    qb.submit(body("anything"), request_id="r1")
    qb.submit(body(None), request_id="r2", lane=BULK)
    assert [t for t, _ in producer.sent] == ["q.default", "q.default.bulk"]


def line(custom_id: str, model: str) -> str:
    return json.dumps(
        {
            "custom_id": custom_id,
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": body(model),
        }
    )


def test_bulk_lines_naming_an_unknown_model_are_bad_lines() -> None:
    texts = [line("a", "llama"), line("b", "gpt-4o"), line("c", "qwen")]
    routed = Defaults(priority=3).routed(parse_routes(TABLE))
    scan = scan_lines(texts, "job1", defaults=routed)
    assert [(bad.line, bad.error and bad.error.param) for bad in scan.bad] == [(2, "body.model")]
    assert scan.lines[0].envelope is not None and scan.lines[0].envelope.priority == 3
    assert scan_lines(texts, "job1", defaults=Defaults(priority=3)).bad == []


def test_a_batch_naming_an_unknown_model_fails_validation_with_model_not_found() -> None:
    texts = [line("a", "llama"), line("b", "gpt-4o")]
    _scan, errors = validate_input(
        texts, "batch_x", "/v1/chat/completions", Defaults(routes=parse_routes(TABLE))
    )
    assert [(e["code"], e["line"], e["param"]) for e in errors] == [
        ("model_not_found", 2, "body.model")
    ]
    assert openai_code(ErrorCode.unknown_model) == "model_not_found"
    assert openai_code(ErrorCode.invalid_request) == "invalid_request"


@pytest.mark.parametrize(
    ("model", "routed", "topic"),
    [
        ("qwen", True, "q.qwen"),  # the pool serving the model, its interactive topic
        ("llama", True, "q.llama"),
        ("nobody", True, "q.default"),  # unknown: the default pool answers unknown_model
        (None, True, "q.default"),
        ("qwen", False, "q.default"),  # one pool: the interactive topic, as before
    ],
)
def test_a_tool_loops_next_turn_goes_to_its_models_pool(
    model: str | None, routed: bool, topic: str
) -> None:
    """The tool executor publishes a continuation where its model is served (before the
    fix every continuation went to the default topic, where another pool's workers answer
    `unknown_model`); its lane (engine priority) travels in `loop.lane`, not the topic."""
    settings = ConnectionSettings(
        topic="q.default",
        bulk_topic="q.default.bulk",
        routes=parse_routes(TABLE) if routed else None,
    )
    envelope = RequestEnvelope.model_validate({"request_id": "r1", "body": body(model)})
    assert continuation_topic(settings, envelope) == topic
