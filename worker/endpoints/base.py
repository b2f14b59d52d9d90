"""What an endpoint's worker-side handler does, and the prompt types it shares with the
renderer.

`worker.rendering.PromptRenderer` owns what every endpoint shares (the served model, the
context window, output budgets, result bounds, sampling, context policies); a handler
(`worker.endpoints.chat`, `worker.endpoints.completions`) owns what differs: how its body
becomes a prompt, how a context policy cuts it, which checks it needs, and how the engine's
output becomes its response. One handler per row of `schemas.endpoints`.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from schemas.context import ContextReport, ContextStrategy, Truncation
from schemas.endpoints import EndpointSpec, Response
from schemas.request import ChatCompletionBody, RequestEnvelope, Tool
from schemas.result import ToolCallError
from worker import context_window as cw
from worker.engines.base import EmbedSpec, EngineOutput, EngineRequest, SamplingSpec
from worker.tool_loop.forced_calls import ForcedCall
from worker.toolcalls import IdFactory

if TYPE_CHECKING:
    from pydantic import BaseModel

    from worker.rendering import PromptRenderer


class Prompt(NamedTuple):
    """A body rendered: its text, token ids (None without a tokenizer), length, whether the
    model may open `<think>`, and the tools rendered into it."""

    text: str
    token_ids: list[int] | None
    n_prompt: int
    reasoning: bool
    tools: list[Tool] | None


@dataclass(frozen=True, slots=True)
class RenderedPrompt:
    """A request ready for an engine."""

    text: str
    token_ids: list[int] | None
    """Prompt token ids, or None when there is no tokenizer (echo)."""
    sampling: SamplingSpec
    reasoning_enabled: bool
    """The prompt leaves the model free to open `<think>` (Qwen3 chat, thinking not disabled)."""
    tools: list[Tool] | None
    """The tools rendered into the prompt (None when none were, e.g. `tool_choice: "none"`)."""
    prompt_tokens: int
    """Length of the prompt in tokens (whitespace-split words without a tokenizer)."""
    forced: ForcedCall | None = None
    """A forced tool choice: the output is JSON (see `worker.tool_loop.forced_calls`)."""
    think_end_id: int | None = None
    """The `</think>` token id when reasoning is enabled (counts reasoning tokens)."""
    cache_salt: str | None = None
    context: ContextReport | None = None
    """What the request's context policy did (None: it set none)."""
    conversation: ChatCompletionBody | None = None
    """Without a tokenizer (echo), the chat body (`text` is only the echoed part), for the
    echo engine's simulated prefix cache; a reference, so it costs nothing unused."""
    result_bytes: int = 0
    """How large its result can get (`schemas.result_size`), within max_result_bytes."""
    embed: EmbedSpec | None = None
    """An embed request's inputs (`/v1/embeddings`); None for generation."""

    def engine_request(
        self, key: str, priority: int = 0, *, first_lane: bool = False
    ) -> EngineRequest:
        return EngineRequest(
            key=key,
            prompt=self.text,
            prompt_token_ids=self.token_ids,
            sampling=self.sampling,
            priority=priority,
            cache_salt=self.cache_salt,
            conversation=self.conversation,
            first_lane=first_lane,
            embed=self.embed,
        )


class EndpointHandler(abc.ABC):
    """One endpoint on the worker: its body to a prompt, the engine's output to its response.

    `body` arguments are the endpoint's own body model (`spec.body`)."""

    spec: EndpointSpec
    prompt_param: str
    """The field a prompt-length error names (`body.messages`, `body.prompt`)."""

    def prepare(
        self, renderer: PromptRenderer, envelope: RequestEnvelope, body: Any
    ) -> RenderedPrompt | None:
        """The request ready for its engine, for an endpoint that does not generate
        (`/v1/embeddings` renders no prompt and samples nothing); None: the renderer's
        generation path, through the hooks below."""
        return None

    @abc.abstractmethod
    def output_budget(self, body: Any) -> tuple[int | None, str]:
        """The output tokens the request asks for (None: not set) and the field naming it."""

    def check(self, renderer: PromptRenderer, body: Any) -> None:  # noqa: B027 (optional)
        """Refuse what this endpoint's body asks and the served model cannot do."""

    @abc.abstractmethod
    def render(self, renderer: PromptRenderer, body: Any) -> Prompt:
        """The body as the served model's prompt."""

    def measure(self, renderer: PromptRenderer, body: Any, prompt: Prompt) -> int:
        """The prompt's length as a context policy counts it."""
        return prompt.n_prompt

    @abc.abstractmethod
    def fit(
        self,
        renderer: PromptRenderer,
        body: Any,
        strategy: ContextStrategy,
        before: int,
        window: int,
        codec: cw.Codec,
    ) -> tuple[BaseModel, list[int], list[Truncation]]:
        """The body cut to `window` tokens by `strategy`: the new body, the indexes of the
        messages dropped and the truncations made."""

    def prompt_token_ids(self, body: Any) -> Sequence[int]:
        """Token ids the body gives as its prompt (checked against the vocabulary)."""
        return ()

    def forced(self, body: Any) -> ForcedCall | None:
        """A forced tool call (the output is then constrained JSON), if the body forces one."""
        return None

    def conversation(self, renderer: PromptRenderer, body: Any) -> ChatCompletionBody | None:
        """What the echo engine's prefix-cache simulation reads (chat, without a tokenizer)."""
        return None

    @abc.abstractmethod
    def build_response(
        self,
        envelope: RequestEnvelope,
        body: Any,
        rendered: RenderedPrompt,
        output: EngineOutput,
        *,
        model: str,
        created: int,
        fingerprint: str | None,
        id_factory: IdFactory | None,
    ) -> tuple[Response, list[ToolCallError]]:
        """The endpoint's response to one finished request, and its tool-call errors."""


__all__ = ["EndpointHandler", "Prompt", "RenderedPrompt"]
