"""How large a request's result can get, known before it runs (issue 40).

A result's size is set by what the request asks for, not by its own size: an 8 KB chat
request with `n` 16, `max_tokens` 2,000 and `top_logprobs` 20 comes back as ~46 MB of JSON
(1,449 bytes per generated token), which Redis must hold, a worker must build and
`qbatch serve` must send. So every edge that takes a request (the worker when it renders
it, `qbatch serve` when it is posted) bounds this estimate by `max_result_bytes`, and the
worker's writer refuses a result that still comes out larger (`result_too_large`): never a
write that Redis resets, retried for ever.

The estimate is an upper bound for ordinary output, not a worst case for any token: text
costs `TEXT_BYTES_PER_TOKEN` (about 4 characters a token, some escaped), and each log-
probability entry (the chosen token, and each of `top_logprobs` alternatives, with its
`bytes` list) `LOGPROB_BYTES_PER_ENTRY`, measured on Qwen3 output (1,449 bytes per token
for 21 entries). Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas import limits
from schemas.errors import ContractError, ErrorCode
from schemas.request import ChatCompletionBody, RequestEnvelope

TEXT_BYTES_PER_TOKEN = 8
LOGPROB_BYTES_PER_ENTRY = 70
RESULT_OVERHEAD_BYTES = limits.RESULT_OVERHEAD_BYTES
DEFAULT_MAX_RESULT_BYTES = 16 * 1024 * 1024
"""16 MiB: far under Redis' 512 MB value limit, and a few such results held at once by a
worker or `qbatch serve` stay inside their memory."""


@dataclass(frozen=True, slots=True)
class ResultSize:
    """What sets a request's result size."""

    choices: int
    max_tokens: int
    top_logprobs: int | None
    """Alternatives per token with logprobs (0: the chosen token only); None: no logprobs."""

    @property
    def per_token(self) -> int:
        entries = 0 if self.top_logprobs is None else 1 + self.top_logprobs
        return TEXT_BYTES_PER_TOKEN + entries * LOGPROB_BYTES_PER_ENTRY

    @property
    def bytes(self) -> int:
        return RESULT_OVERHEAD_BYTES + self.choices * self.max_tokens * self.per_token

    def fitting(self, limit: int) -> ResultSize:
        """These choices and logprobs with the output budget cut to what `limit` allows
        (at least one token): for a request that set no max_tokens, whose budget is only
        what the context leaves (a default is clamped, never refused, as vLLM does)."""
        room = max(0, limit - RESULT_OVERHEAD_BYTES) // (self.choices * self.per_token)
        return ResultSize(self.choices, max(1, min(self.max_tokens, room)), self.top_logprobs)

    def check(self, limit: int, *, max_param: str = "body.max_tokens") -> int:
        """The estimate, or a `result_too_large` ContractError naming the field that makes
        it large (top_logprobs / logprobs, else n, else the output budget)."""
        estimate = self.bytes
        if estimate <= limit:
            return estimate
        if self.top_logprobs is not None:
            param = "body.top_logprobs" if self.top_logprobs else "body.logprobs"
        elif self.choices > 1:
            param = "body.n"
        else:
            param = max_param
        raise ContractError(
            f"the result could be {estimate:,} bytes ({self.choices} choice(s) x "
            f"{self.max_tokens:,} tokens x {self.per_token} bytes a token), over the "
            f"{limit:,} bytes results may have (max_result_bytes): lower max_tokens, n or "
            "top_logprobs",
            param=param,
            code=ErrorCode.result_too_large,
        )


def check_asked(envelope: RequestEnvelope, limit: int) -> None:
    """At an edge that does not know the model's context (`qbatch serve`, a bulk file):
    a request that sets its output budget is held to `limit` there and then; one that
    does not is checked by the worker, against what its context leaves."""
    body = envelope.body
    explicit = body.output_limit()
    if explicit is None:
        return
    chat_max = isinstance(body, ChatCompletionBody) and body.max_completion_tokens
    max_param = "body.max_completion_tokens" if chat_max else "body.max_tokens"
    ResultSize(body.choices(), explicit, body.top_logprobs_k()).check(limit, max_param=max_param)


__all__ = [
    "DEFAULT_MAX_RESULT_BYTES",
    "LOGPROB_BYTES_PER_ENTRY",
    "RESULT_OVERHEAD_BYTES",
    "TEXT_BYTES_PER_TOKEN",
    "ResultSize",
    "check_asked",
]
