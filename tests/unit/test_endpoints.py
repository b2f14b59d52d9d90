"""The endpoint table (`schemas.endpoints`) is the one list of endpoints: the type unions
name exactly its models, and the envelope, the client, `qbatch serve`'s routes and batch
checks and the worker's engine-task check all read it."""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from producer.envelopes import Request
from producer.serve import batches
from schemas import RequestEnvelope, ResultEnvelope
from schemas.endpoints import BY_PATH, ENDPOINTS, PATHS, Body, Task, path_for, spec_of
from schemas.errors import ContractError
from tests.serve_fixtures import offline_app
from worker.endpoints import HANDLERS
from worker.engines.base import Engine
from worker.rendering import PromptRenderer


def _members(union: Any) -> set[type]:
    """The classes of a union, through Annotated wrappers."""
    while typing.get_origin(union) is typing.Annotated:
        union = typing.get_args(union)[0]
    out = set()
    for arg in typing.get_args(union):
        while typing.get_origin(arg) is typing.Annotated:
            arg = typing.get_args(arg)[0]
        if arg is not type(None):
            out.add(arg)
    return out


def test_the_unions_name_exactly_the_tables_models() -> None:
    assert _members(Body) == {spec.body for spec in ENDPOINTS}
    response = ResultEnvelope.model_fields["response"].annotation
    assert _members(response) == {spec.response for spec in ENDPOINTS}
    assert len(PATHS) == len(ENDPOINTS) == len({s.body for s in ENDPOINTS})


@pytest.mark.parametrize("spec", ENDPOINTS, ids=lambda s: s.path)
def test_a_bare_body_names_its_endpoint_by_its_input_field(spec: Any) -> None:
    body = {
        spec.input_field: [{"role": "user", "content": "hi"}]
        if spec.input_field == "messages"
        else "hi"
    }
    assert path_for(body) == Request(body).envelope().endpoint == spec.path
    env = RequestEnvelope.model_validate({"request_id": "r", "endpoint": spec.path, "body": body})
    assert spec_of(env.body) is spec and isinstance(env.body, spec.body)


def test_the_envelope_refuses_an_endpoint_the_table_lacks_and_names_the_known_ones() -> None:
    with pytest.raises(ValidationError) as caught:
        RequestEnvelope.model_validate(
            {"request_id": "r", "endpoint": "/v1/rerank", "body": {"prompt": "x"}}
        )
    assert all(path in str(caught.value) for path in PATHS)
    schema = RequestEnvelope.model_json_schema()["properties"]["endpoint"]
    assert schema["enum"] == list(PATHS)


def test_serve_routes_and_batch_checks_come_from_the_table(tmp_path: Path) -> None:
    app = offline_app(tmp_path)
    posts = {r.path for r in app.routes if "POST" in getattr(r, "methods", ())}
    assert set(PATHS) <= posts
    assert batches.ENDPOINTS == PATHS


def test_an_endpoint_whose_task_the_engine_lacks_is_refused_naming_the_field() -> None:
    renderer = PromptRenderer(None, max_model_len=512, served_names={"m"}, tasks=())
    env = RequestEnvelope.model_validate(
        {"request_id": "r", "body": {"messages": [{"role": "user", "content": "hi"}]}}
    )
    with pytest.raises(ContractError) as caught:
        renderer.render(env)
    assert caught.value.param == "endpoint" and "generate" in caught.value.message
    assert Engine.supported_tasks == frozenset({Task.generate})
    assert {BY_PATH[p].task for p in PATHS} == set(Task)  # every task has an endpoint


def test_every_endpoint_has_one_worker_handler_and_the_renderer_has_no_branch() -> None:
    assert tuple(HANDLERS) == PATHS
    assert all(HANDLERS[spec.path].spec is spec for spec in ENDPOINTS)
    import inspect

    from worker import outputs, rendering

    for module in (rendering, outputs):
        source = inspect.getsource(module)
        for spec in ENDPOINTS:
            assert spec.body.__name__ not in source, (module.__name__, spec.body.__name__)
