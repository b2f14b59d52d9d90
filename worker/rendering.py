"""Prompt rendering shared by every engine: request envelope -> prompt text, token ids, sampling.

Rendering happens in the service, before any GPU work, so that a request that cannot run
(unknown model, prompt plus output over the context) is rejected with a `ContractError` naming
the field at fault instead of failing inside the engine.

Chat requests are rendered with the model's own chat template
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
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from schemas.context import (
    TRUNCATION_MARKER,
    ContextPolicy,
    ContextReport,
    ContextStrategy,
    Truncation,
)
from schemas.endpoints import BY_PATH, Task
from schemas.errors import ContractError, ErrorCode
from schemas.request import (
    ChatCompletionBody,
    CompletionBody,
    Message,
    RequestEnvelope,
    Tool,
    content_text,
    media_parts,
)
from schemas.result_size import DEFAULT_MAX_RESULT_BYTES, ResultSize
from worker import context_window as cw
from worker.engines.base import EngineRequest, SamplingSpec
from worker.sampling import GENERATION_DEFAULT_KEYS, load_generation_defaults, sampling_from_body
from worker.template_messages import echo_text, messages_to_template
from worker.tool_loop.forced_calls import ForcedCall, forced_call, forced_schema

__all__ = [
    "DEFAULT_OUTPUT_RESERVE",
    "GENERATION_DEFAULT_KEYS",
    "PromptRenderer",
    "RenderedPrompt",
    "load_generation_defaults",
    "messages_to_template",
    "sampling_from_body",
]

# Keyword names apply_chat_template owns; a request may not override them.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


DEFAULT_OUTPUT_RESERVE = 1_024
"""Output tokens a context policy leaves room for when neither the request (max_tokens) nor
the worker (default_max_tokens) sets a budget."""


class _Prompt(NamedTuple):
    text: str
    token_ids: list[int] | None
    n_prompt: int
    reasoning: bool
    tools: list[Tool] | None


class _TokenizerCodec:
    """A Hugging Face tokenizer as `context_window.Codec` (no special tokens added)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=False))


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

    def engine_request(self, key: str, priority: int = 0) -> EngineRequest:
        return EngineRequest(
            key=key,
            prompt=self.text,
            prompt_token_ids=self.token_ids,
            sampling=self.sampling,
            priority=priority,
            cache_salt=self.cache_salt,
            conversation=self.conversation,
        )


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
    ) -> None:
        """`modalities`: what the served model reads; media parts of another kind are
        refused before rendering (a multimodal engine passes e.g. ("text", "image")).
        `max_result_bytes`: a request whose result could be larger is refused
        (`result_too_large`, `schemas.result_size`). `tasks`: what the engine runs
        (`Engine.supported_tasks`); an endpoint that needs another is refused."""
        if max_model_len < 1:
            raise ValueError("max_model_len must be positive")
        self.tokenizer = tokenizer
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
        self._template_thinks = isinstance(template, str) and "<think>" in template
        self._vocab_size = len(tokenizer) if tokenizer is not None else None
        self._think_end_id = _token_id(tokenizer, "</think>") if self._template_thinks else None
        self.modalities = frozenset(modalities)
        self.max_result_bytes = max_result_bytes
        self.tasks = frozenset(tasks)

    # ------------------------------------------------------------------ public

    def render(self, envelope: RequestEnvelope) -> RenderedPrompt:
        body = envelope.body
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
        self._check_token_ids(body)
        if isinstance(body, ChatCompletionBody):
            self._check_media(body)
            prompt_param = "body.messages"
            explicit = body.max_completion_tokens or body.max_tokens
            max_param = (
                "body.max_completion_tokens" if body.max_completion_tokens else "body.max_tokens"
            )
        else:
            prompt_param = "body.prompt"
            explicit = body.max_tokens
            max_param = "body.max_tokens"
        prompt = self._render_body(body)
        report = None
        if envelope.context is not None:
            body, prompt, report = self._fit(envelope.context, body, prompt, explicit)
        text, token_ids, n_prompt, reasoning, tools = prompt
        max_tokens = self._max_tokens(n_prompt, explicit, prompt_param, max_param)
        size = ResultSize(body.choices(), max_tokens, body.top_logprobs_k())
        if explicit is None:  # only the context's room: clamped to the result bound
            size = size.fitting(self.max_result_bytes)
            max_tokens = size.max_tokens
        result_bytes = size.check(self.max_result_bytes, max_param=max_param)
        sampling = sampling_from_body(body, max_tokens, self.generation_defaults)
        forced = forced_call(body) if isinstance(body, ChatCompletionBody) else None
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
            conversation=(
                body if self.tokenizer is None and isinstance(body, ChatCompletionBody) else None
            ),
            result_bytes=result_bytes,
        )

    # ------------------------------------------------------------------ internals

    def _render_body(self, body: ChatCompletionBody | CompletionBody) -> _Prompt:
        if isinstance(body, ChatCompletionBody):
            return self._render_chat(body)
        text, token_ids, n_prompt = self._render_completion(body)
        return _Prompt(text, token_ids, n_prompt, False, None)

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

    def _measure(self, body: ChatCompletionBody | CompletionBody, prompt: _Prompt) -> int:
        """A prompt's tokens as the policy counts them: the rendered prompt's, or without a
        tokenizer (echo) the words of the whole conversation, not just the echoed part."""
        if self.tokenizer is None and isinstance(body, ChatCompletionBody):
            return sum(len(content_text(m.content).split()) for m in body.messages)
        return prompt.n_prompt

    def _codec(self) -> cw.Codec:
        if self.tokenizer is None:
            return cw.WordCodec()
        return _TokenizerCodec(self.tokenizer)

    def _fit(
        self,
        policy: ContextPolicy,
        body: ChatCompletionBody | CompletionBody,
        prompt: _Prompt,
        explicit: int | None,
    ) -> tuple[ChatCompletionBody | CompletionBody, _Prompt, ContextReport]:
        """Apply the request's context policy (see `worker.context_window`)."""
        strategy = policy.strategy
        before = self._measure(body, prompt)
        window = self._window(policy, explicit)
        report = ContextReport(
            strategy=strategy,
            window=window,
            prompt_tokens_before=before,
            prompt_tokens_after=before,
        )
        if before <= window or window < 1:  # fits, or max_tokens alone is over the context
            return body, prompt, report
        chat = isinstance(body, ChatCompletionBody)
        param = "body.messages" if chat else "body.prompt"
        if strategy is ContextStrategy.error:
            if policy.max_prompt_tokens is None:  # today's rule, checked by _max_tokens
                return body, prompt, report
            raise ContractError(
                f"the prompt is {before} tokens, over context.max_prompt_tokens "
                f"({policy.max_prompt_tokens}); set context.strategy to cut it",
                param=param,
                code=ErrorCode.context_length_exceeded,
            )
        codec = self._codec()
        dropped: list[int] = []
        truncated: list[Truncation] = []
        if isinstance(body, ChatCompletionBody):
            chat_body = body

            def measure(messages: Sequence[Message]) -> int:
                trial = chat_body.model_copy(update={"messages": list(messages)})
                return self._measure(trial, self._render_body(trial))

            fitted = cw.fit_messages(strategy, body.messages, window, measure, codec)
            body = body.model_copy(update={"messages": fitted.messages})
            dropped, truncated = fitted.dropped, fitted.truncated
        else:
            body, removed = self._fit_prompt(body, strategy, before - window, window, codec)
            truncated = [Truncation(message=None, tokens_removed=removed)]
        prompt = self._render_body(body)
        return (
            body,
            prompt,
            report.model_copy(
                update={
                    "prompt_tokens_after": self._measure(body, prompt),
                    "messages_dropped": len(dropped),
                    "dropped": dropped,
                    "truncated": truncated,
                }
            ),
        )

    def _fit_prompt(
        self,
        body: CompletionBody,
        strategy: ContextStrategy,
        over: int,
        window: int,
        codec: cw.Codec,
    ) -> tuple[CompletionBody, int]:
        value = body.prompt_value()
        if isinstance(value, str):

            def measure(text: str) -> int:
                return self._render_completion(body.model_copy(update={"prompt": text}))[2]

            text, removed = cw.fit_text(
                strategy, value, over, codec, measure, window, "body.prompt"
            )
            return body.model_copy(update={"prompt": text}), removed
        marker = codec.encode(TRUNCATION_MARKER.format(tokens=len(value)))
        ids, removed = cw.fit_ids(strategy, value, window, marker)
        return body.model_copy(update={"prompt": ids}), removed

    def _check_media(self, body: ChatCompletionBody) -> None:
        for i, message in enumerate(body.messages):
            content = getattr(message, "content", None)
            if content is None or type(content) is str:
                continue  # the common case: no parts to look at
            for j, part in media_parts(content):
                kind = _MEDIA_MODALITY[part.type]
                if kind not in self.modalities:
                    names = ", ".join(sorted(self.served_names)) or "the served model"
                    raise ContractError(
                        f"{part.type} parts need a model that reads {kind}; {names} is "
                        f"{'-'.join(sorted(self.modalities))}-only",
                        param=f"body.messages[{i}].content[{j}]",
                    )

    def _check_token_ids(self, body: ChatCompletionBody | CompletionBody) -> None:
        """Token ids a request names must be in the vocabulary (vLLM refuses them too)."""
        if self._vocab_size is None:
            return
        prompt = body.prompt_value() if isinstance(body, CompletionBody) else None
        named = {
            "logit_bias": [int(k) for k in body.logit_bias or ()],
            "allowed_token_ids": body.allowed_token_ids or (),
            "stop_token_ids": body.stop_token_ids or (),
            "prompt": prompt if isinstance(prompt, list) else (),
        }
        for name, ids in named.items():
            bad = next((i for i in ids if i >= self._vocab_size), None)
            if bad is not None:
                raise ContractError(
                    f"token id {bad} is out of the vocabulary (size {self._vocab_size})",
                    param=f"body.{name}",
                )

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

    def _render_chat(self, body: ChatCompletionBody) -> _Prompt:
        kwargs = dict(body.chat_template_kwargs or {})
        tools = body.tools if body.tools and body.tool_choice != "none" else None
        said = body.thinking()
        thinking = said is not False
        if said is not None and self._template_thinks:
            kwargs["enable_thinking"] = said  # reasoning_effort, mapped (openai_fields)
        if self.tokenizer is None:
            # No template (echo engine): the "model" may think unless the request said not to,
            # so `<think>` blocks a test sends come back as reasoning_content.
            text = echo_text(body)
            return _Prompt(text, None, len(text.split()), thinking, tools)
        reserved = _RESERVED_TEMPLATE_KWARGS.intersection(kwargs)
        if reserved:
            raise ContractError(
                f"may not set {', '.join(sorted(reserved))}",
                param="body.chat_template_kwargs",
            )
        try:
            text = self.tokenizer.apply_chat_template(
                messages_to_template(body.messages),
                tools=[tool.model_dump(exclude_none=True) for tool in tools] if tools else None,
                documents=body.documents,
                add_generation_prompt=body.add_generation_prompt is not False,
                continue_final_message=bool(body.continue_final_message),
                tokenize=False,
                **kwargs,
            )
        except ContractError:
            raise
        except Exception as exc:  # jinja TemplateError, raise_exception(...) in the template
            raise ContractError(
                f"the chat template rejected the conversation: {exc}", param="body.messages"
            ) from None
        if not isinstance(text, str):  # pragma: no cover - tokenize=False always gives str
            raise TypeError("apply_chat_template(tokenize=False) did not return text")
        special = bool(body.add_special_tokens)
        token_ids = list(self.tokenizer.encode(text, add_special_tokens=special))
        return _Prompt(text, token_ids, len(token_ids), thinking and self._template_thinks, tools)

    def _render_completion(self, body: CompletionBody) -> tuple[str, list[int] | None, int]:
        prompt = body.prompt_value()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                return prompt, None, len(prompt.split())
            # vLLM's completions default: special tokens on (Qwen3 has no BOS: no change).
            special = body.add_special_tokens is not False
            ids = list(self.tokenizer(prompt, add_special_tokens=special)["input_ids"])
            return prompt, ids, len(ids)
        ids = list(prompt)
        if self.tokenizer is None:
            return " ".join(map(str, ids)), ids, len(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=False), ids, len(ids)


_MEDIA_MODALITY = {"image_url": "image", "input_audio": "audio", "file": "file"}


def _token_id(tokenizer: Any, token: str) -> int | None:
    """The id of a single-token string, or None when the vocabulary has no such token."""
    ids = tokenizer.encode(token, add_special_tokens=False)
    return int(ids[0]) if len(ids) == 1 else None
