"""The context policy's part of the contract: what a request asks when its prompt is longer
than the model's window, and what its result reports was done.

"Longer is not better": a live dialogue keeps a short sliding window, a summary a few
thousand tokens. Without a policy a prompt over the context fails (`context_length_exceeded`),
as before; with one the worker cuts it by rule, measured with the served model's own
tokenizer and chat template, so callers need not count tokens themselves.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from schemas import limits


class ContextStrategy(StrEnum):
    error = "error"
    """Refuse a prompt over the window (`context_length_exceeded`); the default."""
    sliding_window = "sliding_window"
    """Chat: drop the oldest turns whole until the prompt fits. System messages, the latest
    user message and what follows it are kept; a turn is a user message and the replies
    after it, so an assistant's tool calls stay with their tool results."""
    truncate_middle = "truncate_middle"
    """Cut the longest message (or a completions prompt) in the middle, by tokens, with a
    visible marker saying how many tokens were cut."""
    truncate_head = "truncate_head"
    """As truncate_middle, but cut the message's beginning and keep its end."""


TRUNCATION_MARKER = "\n[... {tokens} tokens cut by qbatch context policy ...]\n"
"""Put where a truncation cut text out; `{tokens}` is the number of tokens removed."""

PromptTokens = Annotated[int, Field(ge=1, le=limits.MAX_PROMPT_TOKEN_IDS)]


class ContextPolicy(BaseModel):
    """`context` of an envelope: how to fit a prompt into the model's window."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    strategy: ContextStrategy = Field(
        ContextStrategy.error,
        description="error (default) | sliding_window (chat) | truncate_middle | truncate_head",
    )
    max_prompt_tokens: PromptTokens | None = Field(
        None,
        description="The window, in prompt tokens; never more than the model's context "
        "minus max_tokens (the worker's default output budget when max_tokens is unset).",
    )


class Truncation(BaseModel):
    model_config = ConfigDict(extra="forbid")

    message: int | None = None
    """Index in `body.messages` of the message cut (None: a completions prompt or an
    embeddings input, which `input` names)."""
    input: int | None = None
    """Index in `body.input` of the embeddings input cut."""
    tokens_removed: int


class ContextReport(BaseModel):
    """What the worker did to fit the prompt: in the result of every request that set a
    `context` policy other than a plain `error` without a window."""

    model_config = ConfigDict(extra="forbid")

    strategy: ContextStrategy
    window: int
    """The prompt-token budget that applied (max_prompt_tokens, context minus output)."""
    prompt_tokens_before: int
    prompt_tokens_after: int
    messages_dropped: int = 0
    dropped: list[int] = Field(default_factory=list)
    """Indexes in `body.messages` of the messages dropped, oldest first."""
    truncated: list[Truncation] = Field(default_factory=list)


__all__ = [
    "TRUNCATION_MARKER",
    "ContextPolicy",
    "ContextReport",
    "ContextStrategy",
    "Truncation",
]
