"""Build OpenAI response objects from engine outputs. Pure.

What every endpoint's response builder (`worker.endpoints`) shares: finish reasons,
log-probabilities in the OpenAI shapes (chat's `logprobs.content`, completions' parallel
lists), and usage counted the way OpenAI bills it: the prompt once, every choice's
completion tokens, the reasoning tokens among them and the prompt tokens the prefix cache
served.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from schemas.result import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    FinishReason,
    TopLogprob,
    Usage,
)
from schemas.usage import CompletionTokensDetails, PromptTokensDetails
from worker.engines.base import EngineOutput, EngineSample, TokenLogprob
from worker.toolcalls import ParsedOutput

__all__ = [
    "chat_logprobs",
    "completion_logprobs",
    "finish_reason",
    "reasoning_tokens",
    "usage_of",
]

MIN_LOGPROB = -9999.0
"""JSON has no -inf: a token the model deems impossible is reported at this (as vLLM)."""


def finish_reason(sample: EngineSample, *, has_tool_calls: bool = False) -> FinishReason:
    """tool_calls > length > abort > stop."""
    if has_tool_calls:
        return "tool_calls"
    if sample.finish == "length":
        return "length"
    if sample.finish == "abort":
        return "abort"
    return "stop"


def reasoning_tokens(sample: EngineSample, parsed: ParsedOutput, think_end_id: int | None) -> int:
    """Completion tokens spent thinking: up to and including `</think>`, all of them when the
    thinking was never closed; without token ids (echo) the words of the reasoning."""
    if parsed.reasoning_content is None:
        return 0
    if sample.token_ids is not None and think_end_id is not None:
        try:
            return sample.token_ids.index(think_end_id) + 1
        except ValueError:
            return len(sample.token_ids)
    return len(parsed.reasoning_content.split())


_NO_CACHED = PromptTokensDetails(cached_tokens=0)
_NO_REASONING = CompletionTokensDetails(reasoning_tokens=0)
"""The common details, shared (they are frozen): most results have neither."""


def usage_of(output: EngineOutput, *, reasoning: int = 0) -> Usage:
    completion = output.total_completion_tokens
    cached = output.cached_tokens or 0
    return Usage(
        prompt_tokens=output.prompt_tokens,
        completion_tokens=completion,
        total_tokens=output.prompt_tokens + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached) if cached else _NO_CACHED,
        completion_tokens_details=(
            CompletionTokensDetails(reasoning_tokens=reasoning) if reasoning else _NO_REASONING
        ),
    )


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) and logprob > MIN_LOGPROB else MIN_LOGPROB


def _token_text(token_id: int, text: str, as_ids: bool) -> str:
    return f"token_id:{token_id}" if as_ids else text


def chat_logprobs(
    logprobs: Sequence[TokenLogprob], k: int, *, as_ids: bool = False
) -> ChatLogprobs:
    """OpenAI's chat `logprobs`: every generated token, with its `k` likeliest alternatives."""
    content = []
    for item in logprobs:
        token = _token_text(item.token_id, item.token, as_ids)
        content.append(
            ChatTokenLogprob(
                token=token,
                logprob=_finite(item.logprob),
                bytes=list(token.encode("utf-8")),
                top_logprobs=[
                    TopLogprob(
                        token=(alt := _token_text(tid, text, as_ids)),
                        logprob=_finite(lp),
                        bytes=list(alt.encode("utf-8")),
                    )
                    for tid, text, lp in item.top[:k]
                ],
            )
        )
    return ChatLogprobs(content=content)


def completion_logprobs(
    logprobs: Sequence[TokenLogprob], k: int, *, as_ids: bool = False
) -> CompletionLogprobs:
    """The legacy completions shape: the sampled token is always in `top_logprobs`, so an
    entry holds up to k + 1 tokens (as OpenAI documents)."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = 0
    for item in logprobs:
        token = _token_text(item.token_id, item.token, as_ids)
        tokens.append(token)
        token_logprobs.append(_finite(item.logprob))
        entry = {_token_text(tid, text, as_ids): _finite(lp) for tid, text, lp in item.top[:k]}
        entry.setdefault(token, _finite(item.logprob))
        top.append(entry)
        offsets.append(offset)
        offset += len(item.token)
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top, text_offset=offsets
    )
