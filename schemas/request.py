"""The request envelope: what producers put on `qbatch.requests`.

The body is an OpenAI request body for the envelope's endpoint. Models are
strict (unknown fields rejected) because a silently ignored field, say a
misspelt `max_tokens`, is a bug the caller never sees.
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)
from pydantic_core import to_json

from schemas import json_schema, limits
from schemas.tool_loop import LoopState, ToolLoopOptions

RequestId = Annotated[str, Field(pattern=limits.ID_PATTERN, min_length=1, max_length=128)]


def _not_reserved(job_id: str) -> str:
    if job_id.endswith(limits.RESERVED_JOB_SUFFIXES):
        raise ValueError(
            f"may not end with {' or '.join(limits.RESERVED_JOB_SUFFIXES)} (those name a "
            "job's own Redis keys)"
        )
    return job_id


JobId = Annotated[RequestId, AfterValidator(_not_reserved)]
Endpoint = Literal["/v1/chat/completions", "/v1/completions"]
CHAT_ENDPOINT: Endpoint = "/v1/chat/completions"
COMPLETIONS_ENDPOINT: Endpoint = "/v1/completions"
Text = Annotated[str, Field(max_length=limits.MAX_TEXT_CHARS)]


_INT_BOUND = 10**limits.MAX_JSON_INT_DIGITS


def _finite_json(value: dict[str, Any]) -> dict[str, Any]:
    """Free-form JSON fields hold only what JSON can say. Python's parser (and pydantic's)
    accept `NaN` and `Infinity`, which no JSON reader need understand and which come back
    as null once the result is written, so a request's metadata would not be echoed as
    sent; an integer of thousands of digits Python's own `json` cannot read back; and a
    caller in Python can pass sets, bytes or objects. Rejected at the edge, naming where."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        where = path or "(value)"
        if isinstance(item, bool) or item is None or isinstance(item, str):
            continue
        if isinstance(item, float):
            if not math.isfinite(item):
                raise ValueError(f"{where}: {item} is not a JSON number")
        elif isinstance(item, int):
            if not -_INT_BOUND < item < _INT_BOUND:
                raise ValueError(
                    f"{where}: integer of more than {limits.MAX_JSON_INT_DIGITS} digits"
                )
        elif isinstance(item, dict):
            for k, v in item.items():
                if not isinstance(k, str):
                    raise ValueError(f"{where}: object keys must be strings, got {k!r}")
                stack.append((f"{path}.{k}" if path else k, v))
        elif isinstance(item, list | tuple):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(item))
        else:
            raise ValueError(f"{where}: a {type(item).__name__} is not JSON")
    return value


# A JSON object from the caller that qbatch passes along without a model of its own
# (metadata, tool parameter schemas, response schemas, chat-template arguments).
JsonObject = Annotated[dict[str, Any], AfterValidator(_finite_json)]


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# ---------------------------------------------------------------- messages


class TextPart(StrictModel):
    type: Literal["text"]
    text: Text


Content = Text | Annotated[list[TextPart], Field(min_length=1, max_length=256)]


def content_text(content: Content | None) -> str:
    """Flatten OpenAI content parts to the plain text a chat template expects."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content)


class FunctionCall(StrictModel):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    arguments: Annotated[str, Field(max_length=limits.MAX_TEXT_CHARS)]
    """JSON text, exactly as OpenAI sends it."""


class ToolCall(StrictModel):
    id: Annotated[str, Field(min_length=1, max_length=128)]
    type: Literal["function"] = "function"
    function: FunctionCall


class SystemMessage(StrictModel):
    role: Literal["system", "developer"]
    content: Content
    name: str | None = None


class UserMessage(StrictModel):
    role: Literal["user"]
    content: Content
    name: str | None = None


class AssistantMessage(StrictModel):
    role: Literal["assistant"]
    content: Content | None = None
    reasoning_content: Text | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=limits.MAX_TOOLS)] | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _says_something(self) -> AssistantMessage:
        if self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs content or tool_calls")
        return self


class ToolMessage(StrictModel):
    role: Literal["tool"]
    content: Content
    tool_call_id: Annotated[str, Field(min_length=1, max_length=128)]


Message = Annotated[
    SystemMessage | UserMessage | AssistantMessage | ToolMessage,
    Discriminator("role"),
]

# ---------------------------------------------------------------- tools


class FunctionDef(StrictModel):
    name: Annotated[str, Field(pattern=limits.TOOL_NAME_PATTERN)]
    description: Annotated[str, Field(max_length=8_192)] | None = None
    parameters: JsonObject | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _is_json_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        """Reject a broken schema at the edge, not when the model calls the tool."""
        if value is None:
            return value
        if len(to_json(value)) > limits.MAX_TOOL_SCHEMA_BYTES:
            raise ValueError(f"tool schema over {limits.MAX_TOOL_SCHEMA_BYTES} bytes")
        json_schema.check(value)
        if value.get("type", "object") != "object":
            raise ValueError("tool parameters must describe an object")
        return value


class Tool(StrictModel):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(StrictModel):
    name: Annotated[str, Field(pattern=limits.TOOL_NAME_PATTERN)]


class NamedToolChoice(StrictModel):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice

# ---------------------------------------------------------------- response_format


class TextFormat(StrictModel):
    type: Literal["text"]


class JsonObjectFormat(StrictModel):
    type: Literal["json_object"]


class JsonSchemaSpec(StrictModel):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    schema_: Annotated[JsonObject, Field(alias="schema")]
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @field_validator("schema_")
    @classmethod
    def _is_json_schema(cls, value: dict[str, Any]) -> dict[str, Any]:
        if len(to_json(value)) > limits.MAX_TOOL_SCHEMA_BYTES:
            raise ValueError(f"response schema over {limits.MAX_TOOL_SCHEMA_BYTES} bytes")
        json_schema.check(value)
        return value


class JsonSchemaFormat(StrictModel):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Discriminator("type")]

# ---------------------------------------------------------------- bodies

OutputTokens = Annotated[int, Field(ge=1, le=limits.MAX_OUTPUT_TOKENS)]
Stop = (
    Annotated[str, Field(min_length=1, max_length=limits.MAX_STOP_CHARS)]
    | Annotated[
        list[Annotated[str, Field(min_length=1, max_length=limits.MAX_STOP_CHARS)]],
        Field(max_length=limits.MAX_STOP_SEQUENCES),
    ]
)


class SamplingFields(StrictModel):
    """Fields both endpoints share; mapped onto engine sampling parameters."""

    model: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=100_000)] | None = None
    max_tokens: OutputTokens | None = None
    stop: Stop | None = None
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    n: Literal[1] | None = None
    """Only one choice per request: fan out with several request_ids instead."""
    user: Annotated[str, Field(max_length=256)] | None = None
    """Accepted for OpenAI compatibility; not used."""
    ignore_eos: bool | None = None
    """vLLM extension (as in vLLM's OpenAI server): keep generating past EOS up to max_tokens."""
    min_tokens: Annotated[int, Field(ge=0, le=limits.MAX_OUTPUT_TOKENS)] | None = None
    """vLLM extension: do not stop (EOS or stop strings) before this many tokens."""

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionBody(SamplingFields):
    messages: Annotated[list[Message], Field(min_length=1, max_length=limits.MAX_MESSAGES)]
    tools: Annotated[list[Tool], Field(max_length=limits.MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    max_completion_tokens: OutputTokens | None = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: JsonObject | None = None

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionBody:
        if (
            not self.tools
            and self.tool_choice is None
            and not any(isinstance(m, ToolMessage) for m in self.messages)
        ):
            return self  # the common case, kept cheap: nothing to cross-check
        names = [tool.function.name for tool in self.tools or ()]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        if (
            isinstance(self.tool_choice, NamedToolChoice)
            and self.tool_choice.function.name not in names
        ):
            raise ValueError(
                f"tool_choice names {self.tool_choice.function.name!r}, which is not in tools"
            )
        if self.tool_choice == "required" and not names:
            raise ValueError("tool_choice is 'required' but no tools are given")
        call_ids = {
            call.id
            for message in self.messages
            if isinstance(message, AssistantMessage)
            for call in message.tool_calls or ()
        }
        for index, message in enumerate(self.messages):
            if (
                isinstance(message, ToolMessage)
                and call_ids
                and message.tool_call_id not in call_ids
            ):
                raise ValueError(
                    f"messages[{index}].tool_call_id {message.tool_call_id!r} answers no "
                    "earlier assistant tool call"
                )
        return self

    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionBody(SamplingFields):
    prompt: (
        Annotated[str, Field(min_length=1, max_length=limits.MAX_TEXT_CHARS)]
        | Annotated[
            list[Annotated[int, Field(ge=0, lt=2**31)]],
            Field(min_length=1, max_length=limits.MAX_PROMPT_TOKEN_IDS),
        ]
    )
    echo: bool | None = None
    response_format: ResponseFormat | None = None

    def output_limit(self) -> int | None:
        return self.max_tokens


def _body_kind(value: Any) -> str:
    if isinstance(value, dict):
        return "completion" if "prompt" in value and "messages" not in value else "chat"
    if isinstance(value, CompletionBody):
        return "completion"
    return "chat"


Body = Annotated[
    Annotated[ChatCompletionBody, Tag("chat")] | Annotated[CompletionBody, Tag("completion")],
    Discriminator(_body_kind),
]

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
        if self.endpoint == COMPLETIONS_ENDPOINT and not isinstance(self.body, CompletionBody):
            raise ValueError("body: /v1/completions takes `prompt`, not `messages`")
        if self.endpoint == CHAT_ENDPOINT and not isinstance(self.body, ChatCompletionBody):
            raise ValueError("body: /v1/chat/completions takes `messages`, not `prompt`")
        if self.loop is not None and self.tool_loop is None:
            raise ValueError("loop: a continuation needs `tool_loop`")
        if self.tool_loop is not None and not self.is_chat:
            raise ValueError("tool_loop: only /v1/chat/completions requests can call tools")
        if self.loop is not None and self.tool_loop and self.loop.turn > self.tool_loop.max_turns:
            raise ValueError("loop.turn: beyond tool_loop.max_turns")
        return self

    @property
    def is_chat(self) -> bool:
        return isinstance(self.body, ChatCompletionBody)

    def deadline_passed(self, now: datetime) -> bool:
        return self.deadline is not None and now >= self.deadline
