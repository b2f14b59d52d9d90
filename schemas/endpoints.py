"""The endpoints qbatch serves, in one table: each one's path, body model, response model,
the engine task it needs and the body field that holds its input.

Everything that once listed the endpoints reads this table instead: the envelope's
`endpoint` field and its body check (`schemas.request`), the body union's discriminator,
`qbatch serve`'s routes and its batch `url`/`endpoint` checks, the client's guess of a
bare body's endpoint, and the worker, which refuses at start an engine that cannot run
a task the table needs (`Engine.supported_tasks`, as vLLM's `supported_tasks`). A new
endpoint is a body model, a response model and a row here (the two unions below name
the models for type checkers; `tests/unit/test_endpoints.py` holds them to the table).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, Discriminator, Tag

from schemas.bodies import ChatCompletionBody, CompletionBody
from schemas.embeddings import EmbeddingBody, EmbeddingList
from schemas.result import ChatCompletion, Completion


class Task(StrEnum):
    """What an engine does for a request (vLLM's task names)."""

    generate = "generate"
    embed = "embed"


@dataclass(frozen=True, slots=True)
class EndpointSpec:
    path: str
    body: type[BaseModel]
    response: type[BaseModel]
    task: Task
    input_field: str
    """The body's field that holds the input: a bare body with it names this endpoint
    (the first row wins when a body holds several)."""
    tools: bool = False
    """Its requests may offer tools, force calls and run tool loops."""


CHAT = EndpointSpec(
    "/v1/chat/completions", ChatCompletionBody, ChatCompletion, Task.generate, "messages", True
)
COMPLETIONS = EndpointSpec("/v1/completions", CompletionBody, Completion, Task.generate, "prompt")
EMBEDDINGS = EndpointSpec("/v1/embeddings", EmbeddingBody, EmbeddingList, Task.embed, "input")

ENDPOINTS: tuple[EndpointSpec, ...] = (CHAT, COMPLETIONS, EMBEDDINGS)
"""Every endpoint, the default (chat) first."""
BY_PATH: dict[str, EndpointSpec] = {spec.path: spec for spec in ENDPOINTS}
PATHS: tuple[str, ...] = tuple(BY_PATH)


def spec_of(body: BaseModel) -> EndpointSpec:
    """The endpoint a validated body belongs to."""
    for spec in ENDPOINTS:
        if isinstance(body, spec.body):
            return spec
    raise TypeError(f"{type(body).__name__} is no endpoint's body")


def path_for(body: Mapping[str, Any]) -> str:
    """The endpoint a bare body names by its input field (`prompt` and no `messages`:
    completions); the default when it names none, so validation says what is missing."""
    for spec in ENDPOINTS:
        if spec.input_field in body:
            return spec.path
    return ENDPOINTS[0].path


def _body_tag(value: Any) -> str:
    if isinstance(value, Mapping):
        return path_for(value)
    if isinstance(value, BaseModel):
        return spec_of(value).path
    return ENDPOINTS[0].path


Body = Annotated[
    Annotated[ChatCompletionBody, Tag(CHAT.path)]
    | Annotated[CompletionBody, Tag(COMPLETIONS.path)]
    | Annotated[EmbeddingBody, Tag(EMBEDDINGS.path)],
    Discriminator(_body_tag),
]
"""A request body: the union of the table's body models, told apart by their input field."""

Response = ChatCompletion | Completion | EmbeddingList
"""A result's response: the union of the table's response models."""


__all__ = [
    "BY_PATH",
    "CHAT",
    "COMPLETIONS",
    "EMBEDDINGS",
    "ENDPOINTS",
    "PATHS",
    "Body",
    "EndpointSpec",
    "Response",
    "Task",
    "path_for",
    "spec_of",
]
