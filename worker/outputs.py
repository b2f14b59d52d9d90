"""Build OpenAI response objects from engine outputs. Pure.

The service calls `build_response` once per finished request. For each of the request's `n`
choices it parses chat output (reasoning, tool calls), maps log-probabilities onto the
OpenAI shapes (chat's `logprobs.content`, completions' parallel lists), and counts usage
the way OpenAI bills it: the prompt once, every choice's completion tokens, the reasoning
tokens among them and the prompt tokens the prefix cache served.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from schemas.request import ChatCompletionBody, CompletionBody, RequestEnvelope
from schemas.result import (
    AssistantOutput,
    ChatChoice,
    ChatCompletion,
    ChatLogprobs,
    ChatTokenLogprob,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    FinishReason,
    ToolCallError,
    TopLogprob,
    Usage,
)
from schemas.usage import CompletionTokensDetails, PromptTokensDetails
from worker.engines.base import EngineOutput, EngineSample, TokenLogprob
from worker.rendering import RenderedPrompt
from worker.tool_loop.forced_calls import as_blocks
from worker.toolcalls import IdFactory, ParsedOutput, parse_output

__all__ = [
    "build_response",
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


def _build_completion(
    envelope: RequestEnvelope,
    body: CompletionBody,
    rendered: RenderedPrompt,
    output: EngineOutput,
    *,
    model: str,
    created: int,
    fingerprint: str | None,
) -> Completion:
    prefix = rendered.text if body.echo else ""
    k = body.top_logprobs_k()
    as_ids = bool(body.return_tokens_as_token_ids)
    choices = [
        CompletionChoice(
            index=index,
            text=prefix + sample.text,
            finish_reason=finish_reason(sample),
            logprobs=(
                completion_logprobs(sample.logprobs or [], k, as_ids=as_ids)
                if k is not None
                else None
            ),
        )
        for index, sample in enumerate(output.samples())
    ]
    return Completion(
        id=f"cmpl-{envelope.request_id}",
        created=created,
        model=model,
        choices=choices,
        usage=usage_of(output),
        system_fingerprint=fingerprint,
    )


def _build_chat(
    envelope: RequestEnvelope,
    body: ChatCompletionBody,
    rendered: RenderedPrompt,
    output: EngineOutput,
    *,
    model: str,
    created: int,
    fingerprint: str | None,
    id_factory: IdFactory | None,
) -> tuple[ChatCompletion, list[ToolCallError]]:
    k = body.top_logprobs_k()
    as_ids = bool(body.return_tokens_as_token_ids)
    single_call = body.parallel_tool_calls is False
    show_reasoning = body.include_reasoning is not False
    choices: list[ChatChoice] = []
    errors: list[ToolCallError] = []
    reasoning = 0
    for index, sample in enumerate(output.samples()):
        text = sample.text
        if rendered.forced is not None:
            text = as_blocks(text, rendered.forced)
        parsed = parse_output(
            text,
            tools=rendered.tools,
            reasoning_enabled=rendered.reasoning_enabled,
            id_factory=id_factory,
            single_call=single_call,
        )
        if parsed.reasoning_content is not None:
            reasoning += reasoning_tokens(sample, parsed, rendered.think_end_id)
        calls = list(parsed.tool_calls) or None
        message = AssistantOutput(
            content=parsed.content,
            reasoning_content=parsed.reasoning_content if show_reasoning else None,
            tool_calls=calls,
        )
        finish = finish_reason(sample, has_tool_calls=calls is not None)
        if k is None:
            choices.append(ChatChoice(index=index, message=message, finish_reason=finish))
        else:
            logprobs = chat_logprobs(sample.logprobs or [], k, as_ids=as_ids)
            choices.append(
                ChatChoice(index=index, message=message, finish_reason=finish, logprobs=logprobs)
            )
        if parsed.errors:
            errors.extend(e.model_copy(update={"choice": index}) for e in parsed.errors)
    response = ChatCompletion(
        id=f"chatcmpl-{envelope.request_id}",
        created=created,
        model=model,
        choices=choices,
        usage=usage_of(output, reasoning=reasoning),
        system_fingerprint=fingerprint,
    )
    return response, errors


def build_response(
    envelope: RequestEnvelope,
    rendered: RenderedPrompt,
    output: EngineOutput,
    *,
    model: str,
    created: int,
    id_factory: IdFactory | None = None,
    fingerprint: str | None = None,
) -> tuple[ChatCompletion | Completion, list[ToolCallError]]:
    """The response for one finished request, and its tool-call errors (chat only).

    Raises ValueError for an output with finish="error": such a request gets a failed result
    carrying `output.error`, not a response.
    """
    body = envelope.body
    if output.finish == "error":
        raise ValueError(
            f"request {output.key} failed in the engine ({output.error}); it has no response"
        )
    if isinstance(body, CompletionBody):
        completion = _build_completion(
            envelope, body, rendered, output, model=model, created=created, fingerprint=fingerprint
        )
        return completion, []
    return _build_chat(
        envelope,
        body,
        rendered,
        output,
        model=model,
        created=created,
        fingerprint=fingerprint,
        id_factory=id_factory,
    )
