"""Token counts, on their own so that both requests (a tool loop's transcript so far) and
results can hold them without importing each other."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

# A token count: never negative, and far under what a 64-bit JSON reader holds even summed
# over a long tool loop (a continuation carries its transcript's usage from the caller's
# side of the wire, so its figures are validated like any input).
TOKEN_BOUND = 2**40
TokenCount = Annotated[int, Field(ge=0, le=TOKEN_BOUND)]


class PromptTokensDetails(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    cached_tokens: TokenCount = 0
    """Prompt tokens served from the prefix cache (0 on engines without one)."""


class CompletionTokensDetails(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    reasoning_tokens: TokenCount = 0
    """Completion tokens spent in `<think>` (up to and including `</think>`)."""


class Usage(BaseModel):
    """OpenAI's `usage` object. With `n` > 1 the prompt counts once and the completion
    tokens of every choice add up, as OpenAI bills them."""

    model_config = ConfigDict(extra="forbid")

    prompt_tokens: TokenCount
    completion_tokens: TokenCount
    total_tokens: TokenCount
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None

    def plus(self, other: Usage) -> Usage:
        def cached(usage: Usage) -> int:
            details = usage.prompt_tokens_details
            return details.cached_tokens if details else 0

        def reasoning(usage: Usage) -> int:
            details = usage.completion_tokens_details
            return details.reasoning_tokens if details else 0

        detailed = any(
            u.prompt_tokens_details or u.completion_tokens_details for u in (self, other)
        )
        return Usage(
            prompt_tokens=_add(self.prompt_tokens, other.prompt_tokens),
            completion_tokens=_add(self.completion_tokens, other.completion_tokens),
            total_tokens=_add(self.total_tokens, other.total_tokens),
            prompt_tokens_details=(
                PromptTokensDetails(cached_tokens=_add(cached(self), cached(other)))
                if detailed
                else None
            ),
            completion_tokens_details=(
                CompletionTokensDetails(reasoning_tokens=_add(reasoning(self), reasoning(other)))
                if detailed
                else None
            ),
        )


def _add(a: int, b: int) -> int:
    """A sum held at TOKEN_BOUND: two counts at the bound (a forged transcript's) summed
    once broke the worker thread that added them."""
    return min(a + b, TOKEN_BOUND)


ZERO_USAGE = Usage(prompt_tokens=0, completion_tokens=0, total_tokens=0)
