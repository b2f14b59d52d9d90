"""Token counts, on their own so that both requests (a tool loop's transcript so far) and
results can hold them without importing each other."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Usage(BaseModel):
    """OpenAI's `usage` object."""

    model_config = ConfigDict(extra="forbid")

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    def plus(self, other: Usage) -> Usage:
        return Usage(
            prompt_tokens=self.prompt_tokens + other.prompt_tokens,
            completion_tokens=self.completion_tokens + other.completion_tokens,
            total_tokens=self.total_tokens + other.total_tokens,
        )


ZERO_USAGE = Usage(prompt_tokens=0, completion_tokens=0, total_tokens=0)
