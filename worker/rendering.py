"""Prompt rendering shared by every engine: request envelope -> prompt text, token ids, sampling.

What differs per endpoint (how a body becomes a prompt, how a context policy cuts it, its
own checks) is its handler's (`worker.endpoints`); the renderer holds what every endpoint
shares and dispatches by the envelope's `endpoint`, with no branch per endpoint.

Rendering happens in the service, before any GPU work, so that a request that cannot run
(unknown model, prompt plus output over the context) is rejected with a `ContractError` naming
the field at fault instead of failing inside the engine.

Chat requests (`worker.endpoints.chat`) are rendered with the model's own chat template
(`tokenizer.apply_chat_template`), exactly as vLLM's OpenAI server would:

* `system` and `developer` messages become `system`; content parts are flattened to text.
* assistant `tool_calls` become `{"id", "type": "function", "function": {"name", "arguments"}}`
  with `arguments` parsed from the OpenAI JSON string into a mapping (vLLM does the same).
  Qwen3's template writes a mapping with `tojson` and a string verbatim; the mapping keeps the
  format the model was trained on whatever whitespace the client used. Arguments that are not
  a JSON object are passed on as the original string.
* `reasoning_content` of assistant messages is passed through (Qwen3's template uses it).
* `tool_choice`: `"none"` renders without tools; `"auto"`, `"required"` and a named function
  render with all tools. A `"required"`/named choice also sets the sampling's JSON Schema
  (`worker.tool_loop.forced_calls`): on vLLM (structured outputs) the output is then a valid call.
  The parser (`worker.toolcalls`) reports whatever the model actually emitted.

A renderer with `tokenizer=None` (the echo engine) renders cheaply and deterministically: the
last user message for chat (or, when the conversation ends with `tool` messages, their
contents: the scripted tool-loop "model"), the prompt for completions, and counts
whitespace-split words as tokens. It runs at thousands of requests per second, so it avoids
any per-call heavy work.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from schemas.context import ContextPolicy, ContextReport, ContextStrategy
from schemas.endpoints import BY_PATH, Task
from schemas.errors import ContractError, ErrorCode
from schemas.request import RequestEnvelope
from schemas.result_size import DEFAULT_MAX_RESULT_BYTES, ResultSize
from worker import context_window as cw
from worker.endpoints import EndpointHandler, Prompt, RenderedPrompt, handler_for
from worker.engines.base import EmbeddingShape
from worker.sampling import GENERATION_DEFAULT_KEYS, load_generation_defaults, sampling_from_body
from worker.segment_tokens import SegmentEncoder
from worker.template_messages import messages_to_template
from worker.tool_loop.forced_calls import forced_schema

__all__ = [
    "DEFAULT_OUTPUT_RESERVE",
    "GENERATION_DEFAULT_KEYS",
    "PromptRenderer",
    "RenderedPrompt",
    "load_generation_defaults",
    "messages_to_template",
    "sampling_from_body",
]

DEFAULT_OUTPUT_RESERVE = 1_024
"""Output tokens a context policy leaves room for when neither the request (max_tokens) nor
the worker (default_max_tokens) sets a budget."""


class _TokenizerCodec:
    """A Hugging Face tokenizer as `context_window.Codec` (no special tokens added)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=False))


class PromptRenderer:
    """Renders envelopes for one served model. Thread-safe; build once, call many times."""

    def __init__(
        self,
        tokenizer: Any | None,
        *,
        max_model_len: int,
        served_names: set[str] | frozenset[str],
        default_max_tokens: int | None = None,
        generation_defaults: Mapping[str, Any] | None = None,
        modalities: Iterable[str] = ("text",),
        max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES,
        tasks: Iterable[Task] = (Task.generate,),
        embedding_shape: EmbeddingShape | None = None,
    ) -> None:
        """`modalities`: what the served model reads; media parts of another kind are
        refused before rendering (a multimodal engine passes e.g. ("text", "image")).
        `max_result_bytes`: a request whose result could be larger is refused
        (`result_too_large`, `schemas.result_size`). `tasks`: what the engine runs
        (`Engine.supported_tasks`); an endpoint that needs another is refused.
        `embedding_shape`: an embed engine's vectors (`Engine.embedding_shape`)."""
        if max_model_len < 1:
            raise ValueError("max_model_len must be positive")
        self.tokenizer = tokenizer
        self.prompt_encoder = SegmentEncoder(tokenizer) if tokenizer is not None else None
        """Rendered prompts' token ids, families' shared stretches cached (segment_tokens)."""
        self.max_model_len = max_model_len
        self.served_names = frozenset(served_names)
        self.default_max_tokens = default_max_tokens
        self.generation_defaults = {
            key: value
            for key, value in (generation_defaults or {}).items()
            if key in GENERATION_DEFAULT_KEYS and value is not None
        }
        template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
        # Thinking is only "enabled" for templates that know about <think> (Qwen3 and kin).
        self.template_thinks = isinstance(template, str) and "<think>" in template
        self._vocab_size = len(tokenizer) if tokenizer is not None else None
        self._think_end_id = _token_id(tokenizer, "</think>") if self.template_thinks else None
        self.modalities = frozenset(modalities)
        self.max_result_bytes = max_result_bytes
        self.tasks = frozenset(tasks)
        self.embedding_shape = embedding_shape

    # ------------------------------------------------------------------ public

    def render(self, envelope: RequestEnvelope) -> RenderedPrompt:
        body: Any = envelope.body  # past `prepare`, a generate endpoint's body
        task = BY_PATH[envelope.endpoint].task
        if task not in self.tasks:
            runs = ", ".join(sorted(self.tasks)) or "nothing"
            raise ContractError(
                f"{envelope.endpoint} needs an engine that runs {task}; this pool's runs {runs}",
                param="endpoint",
            )
        if body.model is not None and body.model not in self.served_names:
            served = ", ".join(sorted(self.served_names)) or "(none)"
            raise ContractError(
                f"model {body.model!r} is not served here; served: {served}",
                param="body.model",
                code=ErrorCode.unknown_model,
            )
        handler = handler_for(envelope.endpoint)
        prepared = handler.prepare(self, envelope, body)
        if prepared is not None:
            return prepared
        self._check_token_ids(handler, body)
        handler.check(self, body)
        explicit, max_param = handler.output_budget(body)
        prompt = handler.render(self, body)
        report = None
        if envelope.context is not None:
            body, prompt, report = self._fit(handler, envelope.context, body, prompt, explicit)
        text, token_ids, n_prompt, reasoning, tools = prompt
        max_tokens = self._max_tokens(n_prompt, explicit, handler.prompt_param, max_param)
        size = ResultSize(body.choices(), max_tokens, body.top_logprobs_k())
        if explicit is None:  # only the context's room: clamped to the result bound
            size = size.fitting(self.max_result_bytes)
            max_tokens = size.max_tokens
        result_bytes = size.check(self.max_result_bytes, max_param=max_param)
        sampling = sampling_from_body(body, max_tokens, self.generation_defaults)
        forced = handler.forced(body)
        if forced is not None and tools:
            for name in ("response_format", "structured_outputs"):
                if getattr(body, name) is not None:
                    raise ContractError(
                        "a forced tool_choice makes the output the call itself; it cannot be "
                        f"combined with {name}",
                        param=f"body.{name}",
                    )
            schema = forced_schema(forced, tools)
            sampling = replace(sampling, json_schema=schema, json_object=False)
            reasoning = False  # the output is the call's JSON from its first token
        return RenderedPrompt(
            text=text,
            token_ids=token_ids,
            sampling=sampling,
            reasoning_enabled=reasoning,
            tools=tools,
            prompt_tokens=n_prompt,
            forced=forced if tools else None,
            think_end_id=self._think_end_id if reasoning else None,
            cache_salt=body.cache_salt,
            context=report,
            conversation=handler.conversation(self, body),
            result_bytes=result_bytes,
        )

    # ------------------------------------------------------------------ internals

    def _window(self, policy: ContextPolicy, explicit: int | None) -> int:
        """Prompt tokens a policy may keep: the context minus the output budget, and no
        more than `max_prompt_tokens`. The budget is max_tokens, else the worker's default,
        else `DEFAULT_OUTPUT_RESERVE` (a quarter of a small context at most)."""
        if explicit is None:
            explicit = self.default_max_tokens or min(
                DEFAULT_OUTPUT_RESERVE, self.max_model_len // 4
            )
        window = self.max_model_len - explicit
        if policy.max_prompt_tokens is not None:
            window = min(window, policy.max_prompt_tokens)
        return window

    def _codec(self) -> cw.Codec:
        if self.tokenizer is None:
            return cw.WordCodec()
        return _TokenizerCodec(self.tokenizer)

    def _fit(
        self,
        handler: EndpointHandler,
        policy: ContextPolicy,
        body: Any,
        prompt: Prompt,
        explicit: int | None,
    ) -> tuple[Any, Prompt, ContextReport]:
        """Apply the request's context policy (see `worker.context_window`)."""
        strategy = policy.strategy
        before = handler.measure(self, body, prompt)
        window = self._window(policy, explicit)
        report = ContextReport(
            strategy=strategy,
            window=window,
            prompt_tokens_before=before,
            prompt_tokens_after=before,
        )
        if before <= window or window < 1:  # fits, or max_tokens alone is over the context
            return body, prompt, report
        if strategy is ContextStrategy.error:
            if policy.max_prompt_tokens is None:  # today's rule, checked by _max_tokens
                return body, prompt, report
            raise ContractError(
                f"the prompt is {before} tokens, over context.max_prompt_tokens "
                f"({policy.max_prompt_tokens}); set context.strategy to cut it",
                param=handler.prompt_param,
                code=ErrorCode.context_length_exceeded,
            )
        fitted, dropped, truncated = handler.fit(
            self, body, strategy, before, window, self._codec()
        )
        prompt = handler.render(self, fitted)
        return (
            fitted,
            prompt,
            report.model_copy(
                update={
                    "prompt_tokens_after": handler.measure(self, fitted, prompt),
                    "messages_dropped": len(dropped),
                    "dropped": dropped,
                    "truncated": truncated,
                }
            ),
        )

    def check_vocabulary(self, ids: Iterable[int], param: str) -> None:
        """Token ids a request names must be in the vocabulary (vLLM refuses them too):
        a ContractError naming `param` otherwise (no check without a tokenizer)."""
        if self._vocab_size is None:
            return
        bad = next((i for i in ids if i >= self._vocab_size), None)
        if bad is not None:
            raise ContractError(
                f"token id {bad} is out of the vocabulary (size {self._vocab_size})", param=param
            )

    def _check_token_ids(self, handler: EndpointHandler, body: Any) -> None:
        if self._vocab_size is None:
            return
        named = {
            "logit_bias": [int(k) for k in body.logit_bias or ()],
            "allowed_token_ids": body.allowed_token_ids or (),
            "stop_token_ids": body.stop_token_ids or (),
            "prompt": handler.prompt_token_ids(body),
        }
        for name, ids in named.items():
            self.check_vocabulary(ids, f"body.{name}")

    def _max_tokens(
        self, n_prompt: int, explicit: int | None, prompt_param: str, max_param: str
    ) -> int:
        limit = self.max_model_len
        if n_prompt >= limit:
            raise ContractError(
                f"the prompt is {n_prompt} tokens, which leaves no room for output in the "
                f"model's context of {limit} tokens (max_model_len)",
                param=prompt_param,
                code=ErrorCode.context_length_exceeded,
            )
        room = limit - n_prompt
        if explicit is not None:
            if explicit > room:
                raise ContractError(
                    f"the prompt is {n_prompt} tokens and {max_param.rsplit('.', 1)[-1]} is "
                    f"{explicit}: {n_prompt + explicit} > the model's context of {limit} tokens "
                    f"(max_model_len); at most {room} output tokens fit",
                    param=max_param,
                    code=ErrorCode.context_length_exceeded,
                )
            return explicit
        if self.default_max_tokens is not None:
            # A server default never rejects a request: it is clamped to what fits (vLLM).
            return max(1, min(self.default_max_tokens, room))
        return room


def _token_id(tokenizer: Any, token: str) -> int | None:
    """The id of a single-token string, or None when the vocabulary has no such token."""
    ids = tokenizer.encode(token, add_special_tokens=False)
    return int(ids[0]) if len(ids) == 1 else None
