"""The request envelope: what producers put on `qbatch.requests`.

The body is an OpenAI request body for the envelope's endpoint. Models are
strict (unknown fields rejected) because a silently ignored field, say a
misspelt `max_tokens`, is a bug the caller never sees.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    AwareDatetime,
    Field,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import to_json

from schemas import limits
from schemas.bodies import (
    ChatCompletionBody,
    CompletionBody,
    JsonObjectFormat,
    JsonSchemaFormat,
    JsonSchemaSpec,
    ResponseFormat,
    SamplingFields,
    StructuredOutputs,
    TextFormat,
)
from schemas.common import JsonObject, StrictModel, Text, field_error
from schemas.context import ContextPolicy, ContextStrategy
from schemas.endpoints import BY_PATH, CHAT, COMPLETIONS, PATHS, Body, spec_of
from schemas.messages import (
    AssistantMessage,
    Content,
    FunctionCall,
    FunctionDef,
    ImageUrlPart,
    Message,
    NamedFunction,
    NamedToolChoice,
    SystemMessage,
    TextPart,
    Tool,
    ToolCall,
    ToolChoice,
    ToolMessage,
    UserMessage,
    content_text,
    media_parts,
)
from schemas.tool_loop import LoopState, ToolLoopOptions

__all__ = [
    "CHAT_ENDPOINT",
    "COMPLETIONS_ENDPOINT",
    "OPTION_NAMES",
    "AssistantMessage",
    "Body",
    "ChatCompletionBody",
    "CompletionBody",
    "Content",
    "Endpoint",
    "FunctionCall",
    "FunctionDef",
    "ImageUrlPart",
    "JobId",
    "JsonObject",
    "JsonObjectFormat",
    "JsonSchemaFormat",
    "JsonSchemaSpec",
    "Message",
    "NamedFunction",
    "NamedToolChoice",
    "RequestEnvelope",
    "RequestId",
    "RequestOptions",
    "ResponseFormat",
    "SamplingFields",
    "StrictModel",
    "StructuredOutputs",
    "SystemMessage",
    "Text",
    "TextFormat",
    "TextPart",
    "Tool",
    "ToolCall",
    "ToolChoice",
    "ToolMessage",
    "UserMessage",
    "content_text",
    "media_parts",
]

RequestId = Annotated[str, Field(pattern=limits.ID_PATTERN, min_length=1, max_length=128)]


def _not_reserved(job_id: str) -> str:
    if job_id.endswith(limits.RESERVED_JOB_SUFFIXES):
        raise ValueError(
            f"may not end with {' or '.join(limits.RESERVED_JOB_SUFFIXES)} (those name a "
            "job's own Redis keys)"
        )
    return job_id


JobId = Annotated[RequestId, AfterValidator(_not_reserved)]


def _known_endpoint(path: str) -> str:
    if path not in BY_PATH:
        # the value is cut: a record may carry a megabyte here, and the message travels
        raise ValueError(f"unknown endpoint {path[:100]!r}; qbatch serves {', '.join(PATHS)}")
    return path


Endpoint = Annotated[
    str, AfterValidator(_known_endpoint), WithJsonSchema({"type": "string", "enum": list(PATHS)})
]
"""One of `schemas.endpoints.PATHS` (the endpoint table)."""
CHAT_ENDPOINT = CHAT.path
COMPLETIONS_ENDPOINT = COMPLETIONS.path
# ---------------------------------------------------------------- envelope


class RequestOptions(StrictModel):
    """The per-request options of an envelope, defined once.

    `RequestEnvelope` inherits them; the client (`submit(**options)`, `Request`), the
    bulk defaults and the CLI flags are all built from these fields and their
    descriptions, so an option cannot mean one thing in one place and another elsewhere.
    """

    job_id: JobId | None = Field(
        None, description="Bulk-job membership: the result moves the job's counters."
    )
    custom_id: Annotated[str, Field(min_length=1, max_length=limits.MAX_CUSTOM_ID_CHARS)] | None = (
        Field(None, description="The caller's own id, echoed in the result (OpenAI Batch's).")
    )
    priority: Annotated[int, Field(gt=-limits.PRIORITY_BOUND, lt=limits.PRIORITY_BOUND)] = Field(
        0, description="Lower runs earlier (vLLM's convention); default 0."
    )
    deadline: AwareDatetime | None = Field(
        None, description="RFC 3339 time with an offset; not started by then: expired."
    )
    result_ttl_s: Annotated[int, Field(ge=1, le=limits.MAX_RESULT_TTL_S)] = Field(
        limits.DEFAULT_RESULT_TTL_S, description="Seconds the result is kept; default 86400."
    )
    metadata: JsonObject | None = Field(
        None, description="A small JSON object (<= 16 KiB) echoed in the result."
    )
    tool_loop: ToolLoopOptions | None = Field(
        None,
        description="Run the model's tool calls through the tool executor and continue to "
        'the final answer, e.g. {"max_turns": 4}; chat requests with tools only.',
    )
    context: ContextPolicy | None = Field(
        None,
        description="What to do with a prompt longer than the window, e.g. "
        '{"strategy": "sliding_window", "max_prompt_tokens": 2048}; default: refuse it.',
    )

    @field_validator("metadata")
    @classmethod
    def _small_metadata(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and len(to_json(value)) > limits.MAX_METADATA_BYTES:
            raise ValueError(f"metadata over {limits.MAX_METADATA_BYTES} bytes of JSON")
        return value


OPTION_NAMES = tuple(RequestOptions.model_fields)


class RequestEnvelope(RequestOptions):
    """One request on the requests topic (the record key is `request_id`)."""

    v: Literal[1] = 1
    request_id: RequestId
    endpoint: Endpoint = CHAT_ENDPOINT
    body: Body
    submitted_at: AwareDatetime | None = None
    loop: LoopState | None = None
    """Set by the tool executor on a tool loop's continuation (turn 2 onwards)."""

    @model_validator(mode="after")
    def _body_matches_endpoint(self) -> RequestEnvelope:
        expected = BY_PATH[self.endpoint]
        if not isinstance(self.body, expected.body):
            raise field_error(
                "body",
                f"{self.endpoint} takes `{expected.input_field}`, not "
                f"`{spec_of(self.body).input_field}`",
            )
        if self.loop is not None and self.tool_loop is None:
            raise ValueError("loop: a continuation needs `tool_loop`")
        if self.tool_loop is not None and not BY_PATH[self.endpoint].tools:
            raise ValueError("tool_loop: only /v1/chat/completions requests can call tools")
        if self.tool_loop is not None and self.body.choices() > 1:
            raise field_error("tool_loop", "a loop follows one conversation; body.n must be 1")
        if (
            self.context is not None
            and self.context.strategy is ContextStrategy.sliding_window
            and not self.is_chat
        ):
            raise field_error(
                "context.strategy",
                f"sliding_window drops chat turns; {self.endpoint} takes truncate_middle or "
                "truncate_head",
            )
        if self.loop is not None and self.tool_loop and self.loop.turn > self.tool_loop.max_turns:
            raise ValueError("loop.turn: beyond tool_loop.max_turns")
        return self

    @property
    def is_chat(self) -> bool:
        return isinstance(self.body, ChatCompletionBody)

    def deadline_passed(self, now: datetime) -> bool:
        return self.deadline is not None and now >= self.deadline
