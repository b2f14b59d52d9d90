"""Typed OpenAI messages -> what a chat template reads, and the echo engine's "prompt". Pure.

Kept apart from `worker.rendering` (which decides what a request's prompt is) because
these are pure conversions every renderer and test shares.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from schemas.request import (
    AssistantMessage,
    ChatCompletionBody,
    Message,
    SystemMessage,
    ToolMessage,
    UserMessage,
    content_text,
)

__all__ = ["echo_text", "messages_to_template"]


def _arguments_for_template(arguments: str) -> Any:
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments
    return parsed if isinstance(parsed, dict) else arguments


def messages_to_template(messages: Iterable[Message]) -> list[dict[str, Any]]:
    """Typed OpenAI messages -> the plain dicts chat templates expect."""
    out: list[dict[str, Any]] = []
    for message in messages:
        if isinstance(message, SystemMessage):
            out.append({"role": "system", "content": content_text(message.content)})
        elif isinstance(message, UserMessage):
            out.append({"role": "user", "content": content_text(message.content)})
        elif isinstance(message, AssistantMessage):
            item: dict[str, Any] = {
                "role": "assistant",
                "content": content_text(message.content),
            }
            if message.reasoning_content is not None:
                item["reasoning_content"] = message.reasoning_content
            if message.tool_calls:
                item["tool_calls"] = [
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {
                            "name": call.function.name,
                            "arguments": _arguments_for_template(call.function.arguments),
                        },
                    }
                    for call in message.tool_calls
                ]
            out.append(item)
        elif isinstance(message, ToolMessage):
            out.append(
                {
                    "role": "tool",
                    "content": content_text(message.content),
                    "tool_call_id": message.tool_call_id,
                }
            )
    return out


def echo_text(body: ChatCompletionBody) -> str:
    """What the echo "model" answers: the trailing `tool` messages' contents when the
    conversation ends with tool results (a tool loop's continuation: a tool can script
    the next turn by returning a `<tool_call>` block), else the last user message."""
    results: list[str] = []
    for message in reversed(body.messages):
        if not isinstance(message, ToolMessage):
            break
        results.append(content_text(message.content))
    if results:
        return "\n".join(reversed(results))
    return _last_user_text(body)


def conversation_text(body: ChatCompletionBody) -> str:
    """A chat's messages as one text in order (role, then content), for an engine with no
    chat template that still needs the whole prompt (the echo's simulated prefix cache)."""
    return "\n".join(f"{m.role}: {content_text(m.content)}" for m in body.messages)


def _last_user_text(body: ChatCompletionBody) -> str:
    for message in reversed(body.messages):
        if isinstance(message, UserMessage):
            return content_text(message.content)
    return content_text(body.messages[-1].content)
