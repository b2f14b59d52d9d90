"""Build OpenAI response objects from engine outputs. Pure.

The service calls `build_response` once per finished request; it parses chat output (reasoning,
tool calls) and returns the response with the tool-call blocks that did not parse or validate.
"""

from __future__ import annotations

from schemas.request import CompletionBody, RequestEnvelope
from schemas.result import (
    AssistantOutput,
    ChatChoice,
    ChatCompletion,
    Completion,
    CompletionChoice,
    FinishReason,
    ToolCallError,
    Usage,
)
from worker.engines.base import EngineOutput
from worker.forced_calls import as_blocks
from worker.rendering import RenderedPrompt
from worker.toolcalls import IdFactory, ParsedOutput, parse_output

__all__ = [
    "build_chat_completion",
    "build_completion",
    "build_response",
    "finish_reason",
    "usage_of",
]


def finish_reason(output: EngineOutput, *, has_tool_calls: bool = False) -> FinishReason:
    """tool_calls > length > abort > stop."""
    if output.finish == "error":
        raise ValueError(
            f"request {output.key} failed in the engine ({output.error}); it has no response"
        )
    if has_tool_calls:
        return "tool_calls"
    if output.finish == "length":
        return "length"
    if output.finish == "abort":
        return "abort"
    return "stop"


def usage_of(output: EngineOutput) -> Usage:
    return Usage(
        prompt_tokens=output.prompt_tokens,
        completion_tokens=output.completion_tokens,
        total_tokens=output.prompt_tokens + output.completion_tokens,
    )


def build_chat_completion(
    request_id: str, output: EngineOutput, parsed: ParsedOutput, model: str, created: int
) -> ChatCompletion:
    return ChatCompletion(
        id=f"chatcmpl-{request_id}",
        created=created,
        model=model,
        choices=[
            ChatChoice(
                index=0,
                message=AssistantOutput(
                    content=parsed.content,
                    reasoning_content=parsed.reasoning_content,
                    tool_calls=list(parsed.tool_calls) or None,
                ),
                finish_reason=finish_reason(output, has_tool_calls=bool(parsed.tool_calls)),
            )
        ],
        usage=usage_of(output),
    )


def build_completion(
    request_id: str, output: EngineOutput, model: str, created: int, *, prefix: str = ""
) -> Completion:
    """`prefix` is the prompt text when the request asked for `echo`."""
    return Completion(
        id=f"cmpl-{request_id}",
        created=created,
        model=model,
        choices=[
            CompletionChoice(
                index=0, text=prefix + output.text, finish_reason=finish_reason(output)
            )
        ],
        usage=usage_of(output),
    )


def build_response(
    envelope: RequestEnvelope,
    rendered: RenderedPrompt,
    output: EngineOutput,
    *,
    model: str,
    created: int,
    id_factory: IdFactory | None = None,
) -> tuple[ChatCompletion | Completion, list[ToolCallError]]:
    """The response for one finished request, and its tool-call errors (chat only).

    Raises ValueError for an output with finish="error": such a request gets a failed result
    carrying `output.error`, not a response.
    """
    if isinstance(envelope.body, CompletionBody):
        prefix = rendered.text if envelope.body.echo else ""
        return build_completion(envelope.request_id, output, model, created, prefix=prefix), []
    text = output.text
    if rendered.forced is not None:
        text = as_blocks(text, rendered.forced)
    parsed = parse_output(
        text,
        tools=rendered.tools,
        reasoning_enabled=rendered.reasoning_enabled,
        id_factory=id_factory,
    )
    return (
        build_chat_completion(envelope.request_id, output, parsed, model, created),
        list(parsed.errors),
    )
