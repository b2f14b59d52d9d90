"""The OpenAI request bodies an envelope carries: chat completions and completions.

Every field OpenAI's API or vLLM's OpenAI-compatible server accepts has the decision
`schemas.openai_fields.RULES` records for it: supported fields are typed and bounded,
ignored ones are typed (so a wrong type is still an error) and change nothing, refused
ones pass only at null or their harmless default and otherwise fail naming the field and
why. Unknown fields are rejected, as everywhere in the contract.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    ConfigDict,
    Discriminator,
    Field,
    field_validator,
    model_validator,
)
from pydantic_core import to_json

from schemas import json_schema, limits
from schemas.common import JsonObject, StrictModel, Text, field_error
from schemas.messages import (
    AssistantMessage,
    Message,
    NamedToolChoice,
    TextPart,
    Tool,
    ToolChoice,
    ToolMessage,
)
from schemas.openai_fields import REASONING_EFFORT_THINKS, refused_reason, refused_schema

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


class _Prediction(StrictModel):
    type: Literal["content"]
    content: Text | Annotated[list[TextPart], Field(min_length=1, max_length=256)]


# ---------------------------------------------------------------- sampling extensions

TokenId = Annotated[int, Field(ge=0, lt=limits.TOKEN_ID_BOUND)]
TokenIds = Annotated[list[TokenId], Field(min_length=1, max_length=limits.MAX_ALLOWED_TOKEN_IDS)]
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]
TopLogprobs = Annotated[int, Field(ge=0, le=limits.MAX_TOP_LOGPROBS)]
Word = Annotated[str, Field(min_length=1, max_length=limits.MAX_STOP_CHARS)]


def _logit_bias(value: dict[str, float]) -> dict[str, float]:
    if len(value) > limits.MAX_LOGIT_BIAS:
        raise ValueError(f"at most {limits.MAX_LOGIT_BIAS} token ids")
    for key in value:
        if not (key.isascii() and key.isdigit()) or int(key) >= limits.TOKEN_ID_BOUND:
            raise ValueError(f"key {key[:40]!r} is not a token id (a decimal integer string)")
    return value


class StructuredOutputs(StrictModel):
    """vLLM's `structured_outputs`, the constraints qbatch can offer with bounded cost."""

    json_: JsonObject | None = Field(None, alias="json")
    choice: Annotated[list[Word], Field(min_length=1, max_length=256)] | None = None
    json_object: bool | None = None
    regex: Any = None
    grammar: Any = None
    structural_tag: Any = None

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @field_validator("regex", "grammar", "structural_tag")
    @classmethod
    def _unbounded(cls, value: Any) -> None:
        if value is not None:
            raise ValueError(
                "not supported: compiling a caller's grammar on the GPU worker has no time "
                "bound; use json or choice"
            )
        return None

    @field_validator("json_")
    @classmethod
    def _is_json_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            if len(to_json(value)) > limits.MAX_TOOL_SCHEMA_BYTES:
                raise ValueError(f"schema over {limits.MAX_TOOL_SCHEMA_BYTES} bytes")
            json_schema.check(value)
        return value

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [self.json_ is not None, self.choice is not None, bool(self.json_object)]
        if sum(given) != 1:
            raise ValueError("give exactly one of json, choice, json_object")
        return self


# ---------------------------------------------------------------- bodies

OutputTokens = Annotated[int, Field(ge=1, le=limits.MAX_OUTPUT_TOKENS)]
Stop = (
    Annotated[str, Field(min_length=1, max_length=limits.MAX_STOP_CHARS)]
    | Annotated[
        list[Annotated[str, Field(min_length=1, max_length=limits.MAX_STOP_CHARS)]],
        Field(max_length=limits.MAX_STOP_SEQUENCES),
    ]
)
ShortText = Annotated[str, Field(max_length=256)]


class SamplingFields(StrictModel):
    """Fields both endpoints share (decisions: `schemas.openai_fields`).

    Refused fields are not declared: they arrive as extras (pydantic keeps unknown keys
    aside at no cost when there are none), and `_check_extras`, run first by each body's
    model validator, lets a refused field through at null or its harmless default, fails
    it naming the field and why, and fails any other unknown key as before. Declared, the
    25 refused fields cost every request ~1.6 us of validation for keys nobody sends.
    The JSON Schema still lists them (`refused_schema`) and still forbids other keys.
    """

    model_config = ConfigDict(
        extra="allow",
        frozen=True,
        json_schema_extra=lambda schema, cls: refused_schema(
            schema, getattr(cls, "ENDPOINT", "chat")
        ),
    )

    model: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=100_000)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    max_tokens: OutputTokens | None = None
    stop: Stop | None = None
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=2.0)] | None = None
    n: Annotated[int, Field(ge=1, le=limits.MAX_CHOICES)] | None = None
    logit_bias: Annotated[dict[str, Bias], Field(max_length=limits.MAX_LOGIT_BIAS)] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    ignore_eos: bool | None = None
    min_tokens: Annotated[int, Field(ge=0, le=limits.MAX_OUTPUT_TOKENS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=limits.MAX_STOP_TOKEN_IDS)] | None = (
        None
    )
    include_stop_str_in_output: bool | None = None
    allowed_token_ids: TokenIds | None = None
    bad_words: Annotated[list[Word], Field(max_length=limits.MAX_BAD_WORDS)] | None = None
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    add_special_tokens: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    # accepted and ignored
    user: ShortText | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    request_id: ShortText | None = None

    ENDPOINT: ClassVar[Literal["chat", "completions"]] = "chat"

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        return None if value is None else _logit_bias(value)

    def _check_extras(self) -> None:
        extra = self.__pydantic_extra__
        if not extra:
            return
        for name in list(extra):
            why = refused_reason(self.ENDPOINT, name, extra[name])
            if why == "":  # a refused field at null or its default: as if absent
                del extra[name]
                self.__pydantic_fields_set__.discard(name)
            elif why is None:
                raise field_error(name, "Extra inputs are not permitted")
            else:
                raise field_error(name, f"not supported: {why}")

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def choices(self) -> int:
        return self.n or 1

    def _check_shared(self) -> None:
        if self.structured_outputs is not None and self.response_format is not None:
            raise field_error("structured_outputs", "give it or response_format, not both")


class ChatCompletionBody(SamplingFields):
    messages: Annotated[list[Message], Field(min_length=1, max_length=limits.MAX_MESSAGES)]
    tools: Annotated[list[Tool], Field(max_length=limits.MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: OutputTokens | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = (
        None
    )
    include_reasoning: bool | None = None
    chat_template_kwargs: JsonObject | None = None
    documents: Annotated[list[dict[str, Text]], Field(max_length=256)] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    # accepted and ignored
    safety_identifier: ShortText | None = None
    store: bool | None = None
    metadata: (
        Annotated[
            dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
            Field(max_length=16),
        ]
        | None
    ) = None
    prompt_cache_key: ShortText | None = None
    prompt_cache_retention: Literal["in-memory", "in_memory", "24h"] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    prediction: _Prediction | None = None

    ENDPOINT: ClassVar[Literal["chat", "completions"]] = "chat"

    _CROSS_CHECKED: ClassVar[frozenset[str]] = frozenset(
        {
            "top_logprobs",
            "structured_outputs",
            "reasoning_effort",
            "continue_final_message",
            "tools",
            "tool_choice",
        }
    )

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionBody:
        self._check_extras()
        if self.model_fields_set.isdisjoint(self._CROSS_CHECKED) and ToolMessage not in map(
            type, self.messages
        ):
            return self  # the common case, kept cheap: nothing to cross-check
        if self.top_logprobs and not self.logprobs:
            raise field_error("top_logprobs", "needs logprobs: true")
        if self.structured_outputs is not None:
            self._check_shared()
        if self.reasoning_effort is not None and self.chat_template_kwargs:
            said = self.chat_template_kwargs.get("enable_thinking")
            if isinstance(said, bool) and said != REASONING_EFFORT_THINKS[self.reasoning_effort]:
                raise field_error(
                    "reasoning_effort",
                    f"{self.reasoning_effort!r} contradicts "
                    f"chat_template_kwargs.enable_thinking {str(said).lower()}",
                )
        if self.continue_final_message:
            if self.add_generation_prompt is not False:
                raise field_error("continue_final_message", "needs add_generation_prompt: false")
            if not isinstance(self.messages[-1], AssistantMessage):
                raise field_error(
                    "continue_final_message", "the last message must be the assistant's"
                )
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

    def top_logprobs_k(self) -> int | None:
        """Alternatives per token when logprobs were asked for (0: the chosen token only)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def thinking(self) -> bool | None:
        """Whether the request turns Qwen3 thinking on or off; None: it leaves it alone."""
        said = (self.chat_template_kwargs or {}).get("enable_thinking")
        if isinstance(said, bool):
            return said
        if self.reasoning_effort is not None:
            return REASONING_EFFORT_THINKS[self.reasoning_effort]
        return None


PromptText = Annotated[str, Field(min_length=1, max_length=limits.MAX_TEXT_CHARS)]
PromptIds = Annotated[list[TokenId], Field(min_length=1, max_length=limits.MAX_PROMPT_TOKEN_IDS)]


class CompletionBody(SamplingFields):
    prompt: PromptText | PromptIds | list[PromptText] | list[PromptIds]
    echo: bool | None = None
    logprobs: Annotated[int, Field(strict=True, ge=0, le=limits.MAX_TOP_LOGPROBS)] | None = Field(
        None, description="k alternatives per token (an integer: `true` is chat's spelling)"
    )
    best_of: Annotated[int, Field(ge=1, le=limits.MAX_CHOICES)] | None = None

    ENDPOINT: ClassVar[Literal["chat", "completions"]] = "completions"

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: Any) -> str | list[int]:
        """OpenAI also takes a list of prompts (one choice each); qbatch runs one prompt per
        request, so that each has its own result, retries and deadline. A one-item list is
        that item."""
        if isinstance(value, list) and not value:
            raise ValueError("a prompt is needed")
        if isinstance(value, list) and isinstance(value[0], str | list):
            if len(value) != 1:
                raise ValueError(
                    f"{len(value)} prompts in one request: qbatch runs one prompt per request "
                    "(send one request each; `n` asks several choices of one prompt)"
                )
            return value[0]
        return value

    @model_validator(mode="after")
    def _consistent(self) -> CompletionBody:
        self._check_extras()
        self._check_shared()
        if self.best_of is not None and self.best_of != self.choices():
            raise field_error(
                "best_of",
                f"{self.best_of} != n {self.choices()}: vLLM V1 does not rank candidates; "
                "ask n with logprobs and choose",
            )
        if self.echo and self.logprobs is not None:
            raise field_error(
                "logprobs", "not with echo (the prompt's log-probabilities are not returned)"
            )
        return self

    def output_limit(self) -> int | None:
        return self.max_tokens

    def top_logprobs_k(self) -> int | None:
        return self.logprobs

    def prompt_value(self) -> str | list[int]:
        """The one prompt (the validator unwrapped one-item lists)."""
        return self.prompt  # type: ignore[return-value]
