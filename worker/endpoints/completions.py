"""`/v1/completions` on the worker.

The prompt is taken as given: a string (tokenised with vLLM's completions default, special
tokens on) or token ids (decoded for the text). Context policies cut the prompt's text or
ids (`worker.context_window.fit_text` / `fit_ids`); the response echoes the prompt when
asked and maps log-probabilities to completions' parallel lists.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from schemas.context import TRUNCATION_MARKER, ContextStrategy, Truncation
from schemas.endpoints import COMPLETIONS
from schemas.request import CompletionBody, RequestEnvelope
from schemas.result import Completion, CompletionChoice, ToolCallError
from worker import context_window as cw
from worker.endpoints.base import EndpointHandler, Prompt, RenderedPrompt
from worker.engines.base import EngineOutput
from worker.outputs import completion_logprobs, finish_reason, usage_of
from worker.toolcalls import IdFactory

if TYPE_CHECKING:
    from worker.rendering import PromptRenderer


class CompletionsHandler(EndpointHandler):
    spec = COMPLETIONS
    prompt_param = "body.prompt"

    def output_budget(self, body: CompletionBody) -> tuple[int | None, str]:
        return body.max_tokens, "body.max_tokens"

    def render(self, renderer: PromptRenderer, body: CompletionBody) -> Prompt:
        prompt = body.prompt_value()
        tokenizer = renderer.tokenizer
        if isinstance(prompt, str):
            if tokenizer is None:
                return Prompt(prompt, None, len(prompt.split()), False, None)
            # vLLM's completions default: special tokens on (Qwen3 has no BOS: no change).
            special = body.add_special_tokens is not False
            ids = list(tokenizer(prompt, add_special_tokens=special)["input_ids"])
            return Prompt(prompt, ids, len(ids), False, None)
        ids = list(prompt)
        if tokenizer is None:
            return Prompt(" ".join(map(str, ids)), ids, len(ids), False, None)
        text = tokenizer.decode(ids, skip_special_tokens=False)
        return Prompt(text, ids, len(ids), False, None)

    def fit(
        self,
        renderer: PromptRenderer,
        body: CompletionBody,
        strategy: ContextStrategy,
        before: int,
        window: int,
        codec: cw.Codec,
    ) -> tuple[CompletionBody, list[int], list[Truncation]]:
        value = body.prompt_value()
        if isinstance(value, str):

            def measure(text: str) -> int:
                trial = body.model_copy(update={"prompt": text})
                return self.render(renderer, trial).n_prompt

            text, removed = cw.fit_text(
                strategy, value, before - window, codec, measure, window, "body.prompt"
            )
            fitted = body.model_copy(update={"prompt": text})
        else:
            marker = codec.encode(TRUNCATION_MARKER.format(tokens=len(value)))
            ids, removed = cw.fit_ids(strategy, value, window, marker)
            fitted = body.model_copy(update={"prompt": ids})
        return fitted, [], [Truncation(message=None, tokens_removed=removed)]

    def prompt_token_ids(self, body: CompletionBody) -> Sequence[int]:
        prompt = body.prompt_value()
        return prompt if isinstance(prompt, list) else ()

    def build_response(
        self,
        envelope: RequestEnvelope,
        body: CompletionBody,
        rendered: RenderedPrompt,
        output: EngineOutput,
        *,
        model: str,
        created: int,
        fingerprint: str | None,
        id_factory: IdFactory | None,
    ) -> tuple[Completion, list[ToolCallError]]:
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
        completion = Completion(
            id=f"cmpl-{envelope.request_id}",
            created=created,
            model=model,
            choices=choices,
            usage=usage_of(output),
            system_fingerprint=fingerprint,
        )
        return completion, []


__all__ = ["CompletionsHandler"]
