"""`/v1/embeddings` on the worker.

Every input is tokenised as vLLM's embeddings endpoint does (the tokenizer's special
tokens on: Qwen3-Embedding's tokenizer appends its end-of-text token); without a tokenizer
(echo) an input's words are its tokens. Each input must fit the model's context, or the
request's context policy cuts it (truncate_head keeps its end, truncate_middle its two
ends; no marker is put in the cut, since a marker would move the vector), reported per
input as chat reports its messages. The request stays one engine request, whose output
holds one vector per input; the response sends them as floats or base64.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from schemas.context import ContextPolicy, ContextReport, ContextStrategy, Truncation
from schemas.embeddings import (
    Embedding,
    EmbeddingBody,
    EmbeddingList,
    EmbeddingUsage,
    embedding_result_bytes,
    encode_vector,
)
from schemas.endpoints import EMBEDDINGS
from schemas.errors import ContractError, ErrorCode
from schemas.request import RequestEnvelope
from schemas.result import ToolCallError
from worker import context_window as cw
from worker.endpoints.base import EndpointHandler, Prompt, RenderedPrompt
from worker.engines.base import EmbedSpec, EngineOutput, SamplingSpec
from worker.toolcalls import IdFactory

if TYPE_CHECKING:
    from pydantic import BaseModel

    from worker.rendering import PromptRenderer

MAX_EMBED_REQUEST_TOKENS = 300_000
"""Tokens of all of one request's inputs together (OpenAI's bound per request)."""
_NO_SAMPLING = SamplingSpec(max_tokens=1)
"""An embed request samples nothing; its spec is a placeholder the engines ignore."""


class EmbeddingsHandler(EndpointHandler):
    spec = EMBEDDINGS
    prompt_param = "body.input"

    def prepare(
        self, renderer: PromptRenderer, envelope: RequestEnvelope, body: EmbeddingBody
    ) -> RenderedPrompt:
        shape = renderer.embedding_shape
        if shape is None:  # the renderer's task check refuses this first; kept for safety
            raise ContractError("this pool does not embed", param="endpoint")
        if body.dimensions is not None:
            problem = shape.dimensions_problem(body.dimensions)
            if problem is not None:
                raise ContractError(problem, param="body.dimensions")
        items = body.inputs()
        param = _input_param(len(items))
        counted = [self._tokens(renderer, item, param(i)) for i, item in enumerate(items)]
        counted, report = self._fit(renderer, envelope.context, counted, param)
        total = sum(n for _, n in counted)
        if total > MAX_EMBED_REQUEST_TOKENS:
            raise ContractError(
                f"the inputs are {total} tokens together, over {MAX_EMBED_REQUEST_TOKENS} for "
                "one request; send them in several",
                param="body.input",
                code=ErrorCode.context_length_exceeded,
            )
        dims = body.dimensions or shape.size
        size = embedding_result_bytes(len(items), dims, body.wire_format())
        if size > renderer.max_result_bytes:
            raise ContractError(
                f"{len(items)} vectors of {dims} dimensions as {body.wire_format()} can take "
                f"{size} bytes, over the worker's result bound of {renderer.max_result_bytes}; "
                "send fewer inputs a request, or ask encoding_format base64",
                param="body.input",
                code=ErrorCode.result_too_large,
            )
        inputs = tuple(item for item, _ in counted)
        return RenderedPrompt(
            text=inputs[0] if isinstance(inputs[0], str) else "",
            token_ids=None,
            sampling=_NO_SAMPLING,
            reasoning_enabled=False,
            tools=None,
            prompt_tokens=total,
            context=report,
            result_bytes=size,
            embed=EmbedSpec(inputs=inputs, dimensions=body.dimensions),
        )

    def _tokens(
        self, renderer: PromptRenderer, item: str | list[int], param: str
    ) -> tuple[Any, int]:
        """(what the engine takes for the input, its length in tokens)."""
        tokenizer = renderer.tokenizer
        if isinstance(item, list):
            renderer.check_vocabulary(item, param)
            return item, len(item)
        if tokenizer is None:
            n = len(item.split())
            value: Any = item
        else:
            value = list(tokenizer(item, add_special_tokens=True)["input_ids"])
            n = len(value)
        if n == 0:  # vLLM refuses an empty prompt: say so here, naming the input
            raise ContractError("the input is no tokens once tokenised", param=param)
        return value, n

    def _fit(
        self,
        renderer: PromptRenderer,
        policy: ContextPolicy | None,
        counted: list[tuple[Any, int]],
        param: Callable[[int], str],
    ) -> tuple[list[tuple[Any, int]], ContextReport | None]:
        """Each input within the window, cut by the policy where it allows."""
        window = renderer.max_model_len
        if policy is not None and policy.max_prompt_tokens is not None:
            window = min(window, policy.max_prompt_tokens)
        before = sum(n for _, n in counted)
        report = (
            ContextReport(
                strategy=policy.strategy,
                window=window,
                prompt_tokens_before=before,
                prompt_tokens_after=before,
            )
            if policy is not None
            else None
        )
        over = [i for i, (_, n) in enumerate(counted) if n > window]
        if not over:
            return counted, report
        strategy = policy.strategy if policy is not None else ContextStrategy.error
        if strategy is ContextStrategy.error:
            index = over[0]
            raise ContractError(
                f"input {index} is {counted[index][1]} tokens, over the window of {window} "
                "(the model's context, or context.max_prompt_tokens); set context.strategy "
                "truncate_head or truncate_middle to cut it",
                param=param(index),
                code=ErrorCode.context_length_exceeded,
            )
        fitted = list(counted)
        truncated = []
        for index in over:
            item, n = counted[index]
            units = item if isinstance(item, list) else item.split()
            head, tail = cw.cut_ids(units, n - window, strategy)
            kept = [*head, *tail]
            fitted[index] = (kept if isinstance(item, list) else " ".join(kept), len(kept))
            truncated.append(Truncation(input=index, tokens_removed=n - len(kept)))
        assert report is not None  # over the window without a policy raised above
        after = sum(n for _, n in fitted)
        return fitted, report.model_copy(
            update={"prompt_tokens_after": after, "truncated": truncated}
        )

    # The generation path's hooks: never reached, since `prepare` renders every request.

    def output_budget(self, body: EmbeddingBody) -> tuple[int | None, str]:
        return None, "body.input"

    def render(self, renderer: PromptRenderer, body: EmbeddingBody) -> Prompt:
        raise NotImplementedError("embeddings are prepared, not rendered")

    def fit(
        self,
        renderer: PromptRenderer,
        body: EmbeddingBody,
        strategy: ContextStrategy,
        before: int,
        window: int,
        codec: cw.Codec,
    ) -> tuple[BaseModel, list[int], list[Truncation]]:
        raise NotImplementedError("embeddings are prepared, not rendered")

    def build_response(
        self,
        envelope: RequestEnvelope,
        body: EmbeddingBody,
        rendered: RenderedPrompt,
        output: EngineOutput,
        *,
        model: str,
        created: int,
        fingerprint: str | None,
        id_factory: IdFactory | None,
    ) -> tuple[EmbeddingList, list[ToolCallError]]:
        vectors = output.embeddings
        expected = len(rendered.embed.inputs) if rendered.embed is not None else 0
        if vectors is None or len(vectors) != expected:
            raise ValueError(
                f"request {output.key}: the engine gave {len(vectors or ())} vectors for "
                f"{expected} inputs"
            )
        if not all(math.isfinite(x) for vector in vectors for x in vector):
            # JSON has no NaN (pydantic writes null): a result no reader could parse back
            raise ValueError(f"request {output.key}: the engine gave a vector that is not finite")
        fmt = body.wire_format()
        data = [
            Embedding(index=index, embedding=encode_vector(vector, fmt))
            for index, vector in enumerate(vectors)
        ]
        usage = EmbeddingUsage(
            prompt_tokens=output.prompt_tokens, total_tokens=output.prompt_tokens
        )
        response = EmbeddingList(
            data=data, model=model, usage=usage, id=f"embd-{envelope.request_id}", created=created
        )
        return response, []


def _input_param(n_inputs: int) -> Callable[[int], str]:
    """How an error names input i: `body.input` when it is the only one."""
    if n_inputs == 1:
        return lambda _index: "body.input"
    return lambda index: f"body.input[{index}]"


__all__ = ["MAX_EMBED_REQUEST_TOKENS", "EmbeddingsHandler"]
