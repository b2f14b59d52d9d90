"""OpenAI chat messages, content parts and tool definitions.

Content parts are modelled for every kind OpenAI sends (text, `image_url`, `input_audio`,
`file`, and `refusal` in assistant messages), so a body with an image is a well-formed
request. Whether the *served model* can read an image is the worker's question, not the
wire format's: `worker.rendering` refuses media parts naming the part and saying the model
is text-only, and a multimodal engine can take them later without a contract change.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Discriminator, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError, to_json

from schemas import json_schema, limits
from schemas.common import JsonObject, StrictModel, Text

# ---------------------------------------------------------------- content parts


class TextPart(StrictModel):
    type: Literal["text"]
    text: Text


class ImageUrl(StrictModel):
    url: Text
    detail: Literal["auto", "low", "high"] | None = None


class ImageUrlPart(StrictModel):
    type: Literal["image_url"]
    image_url: ImageUrl


class InputAudio(StrictModel):
    data: Text
    format: Annotated[str, Field(max_length=16)]


class InputAudioPart(StrictModel):
    type: Literal["input_audio"]
    input_audio: InputAudio


class FileRef(StrictModel):
    file_data: Text | None = None
    file_id: Annotated[str, Field(max_length=256)] | None = None
    filename: Annotated[str, Field(max_length=256)] | None = None


class FilePart(StrictModel):
    type: Literal["file"]
    file: FileRef


class RefusalPart(StrictModel):
    type: Literal["refusal"]
    refusal: Text


MediaPart = ImageUrlPart | InputAudioPart | FilePart
"""Parts only a multimodal model can read."""

_MAX_PARTS = 256
TextParts = Annotated[list[TextPart], Field(min_length=1, max_length=_MAX_PARTS)]
Content = Text | TextParts
UserContent = (
    Text
    | Annotated[
        list[Annotated[TextPart | MediaPart, Discriminator("type")]],
        Field(min_length=1, max_length=_MAX_PARTS),
    ]
)
AssistantContent = (
    Text
    | Annotated[
        list[Annotated[TextPart | RefusalPart, Discriminator("type")]],
        Field(min_length=1, max_length=_MAX_PARTS),
    ]
)
AnyContent = Content | UserContent | AssistantContent


def content_text(content: AnyContent | None) -> str:
    """Flatten OpenAI content parts to the plain text a chat template expects (media parts
    have none; the renderer refuses them before this for a text-only model)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(
        part.text
        if isinstance(part, TextPart)
        else part.refusal
        if isinstance(part, RefusalPart)
        else ""
        for part in content
    )


def media_parts(content: AnyContent | None) -> list[tuple[int, MediaPart]]:
    """The (index, part) of every media part of `content`."""
    if content is None or isinstance(content, str):
        return []
    return [
        (index, part)
        for index, part in enumerate(content)
        if isinstance(part, ImageUrlPart | InputAudioPart | FilePart)
    ]


# ---------------------------------------------------------------- messages


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
    content: UserContent
    name: str | None = None


def _refuse(why: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported_field", "not supported: {why}", {"why": why})


class AssistantMessage(StrictModel):
    role: Literal["assistant"]
    content: AssistantContent | None = None
    reasoning_content: Text | None = None
    refusal: Text | None = None
    """Accepted (OpenAI SDKs echo it back); the chat template does not render it."""
    tool_calls: Annotated[list[ToolCall], Field(max_length=limits.MAX_TOOLS)] | None = None
    name: str | None = None
    audio: Any = None
    function_call: Any = None

    _REFUSED: ClassVar[dict[str, str]] = {
        "audio": "the served model reads and answers text only",
        "function_call": "deprecated by OpenAI; send `tool_calls`",
    }

    @field_validator(*_REFUSED)
    @classmethod
    def _refused(cls, value: Any, info: ValidationInfo) -> None:
        if value is not None:
            raise _refuse(cls._REFUSED[str(info.field_name)])
        return None

    @model_validator(mode="after")
    def _says_something(self) -> AssistantMessage:
        if self.content is None and not self.tool_calls and self.refusal is None:
            raise ValueError("an assistant message needs content or tool_calls")
        return self


class ToolMessage(StrictModel):
    role: Literal["tool"]
    content: Content
    tool_call_id: Annotated[str, Field(min_length=1, max_length=128)]


class FunctionMessage(StrictModel):
    """OpenAI's deprecated `function` role: modelled only to refuse it with a reason."""

    role: Literal["function"]
    content: Any = None
    name: Any = None

    @model_validator(mode="after")
    def _deprecated(self) -> FunctionMessage:
        raise _refuse("the `function` role is deprecated by OpenAI; send a `tool` message")


Message = Annotated[
    SystemMessage | UserMessage | AssistantMessage | ToolMessage | FunctionMessage,
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
