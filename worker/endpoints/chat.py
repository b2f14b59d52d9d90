"""`/v1/chat/completions` on the worker.

Rendered with the model's own chat template (`tokenizer.apply_chat_template`), exactly as
vLLM's OpenAI server would (see `worker.rendering` for the mapping rules); without a
tokenizer (the echo engine) the last user message, or the trailing `tool` messages' contents
(the scripted tool-loop "model"). Context policies drop or cut whole turns
(`worker.context_window.fit_messages`). The response parses each choice's reasoning and
tool calls (`worker.toolcalls`) and maps log-probabilities to chat's shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from schemas.context import ContextStrategy, Truncation
from schemas.endpoints import CHAT
from schemas.errors import ContractError
from schemas.request import ChatCompletionBody, Message, RequestEnvelope, content_text, media_parts
from schemas.result import AssistantOutput, ChatChoice, ChatCompletion, ToolCallError
from worker import context_window as cw
from worker.endpoints.base import EndpointHandler, Prompt, RenderedPrompt
from worker.engines.base import EngineOutput
from worker.outputs import chat_logprobs, finish_reason, reasoning_tokens, usage_of
from worker.template_messages import echo_text, messages_to_template
from worker.tool_loop.forced_calls import ForcedCall, as_blocks, forced_call
from worker.toolcalls import IdFactory, parse_output

if TYPE_CHECKING:
    from worker.rendering import PromptRenderer

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
_MEDIA_MODALITY = {"image_url": "image", "input_audio": "audio", "file": "file"}


class ChatHandler(EndpointHandler):
    spec = CHAT
    prompt_param = "body.messages"

    def output_budget(self, body: ChatCompletionBody) -> tuple[int | None, str]:
        if body.max_completion_tokens:
            return body.max_completion_tokens, "body.max_completion_tokens"
        return body.max_tokens, "body.max_tokens"

    def check(self, renderer: PromptRenderer, body: ChatCompletionBody) -> None:
        for i, message in enumerate(body.messages):
            content = getattr(message, "content", None)
            if content is None or type(content) is str:
                continue  # the common case: no parts to look at
            for j, part in media_parts(content):
                kind = _MEDIA_MODALITY[part.type]
                if kind not in renderer.modalities:
                    names = ", ".join(sorted(renderer.served_names)) or "the served model"
                    raise ContractError(
                        f"{part.type} parts need a model that reads {kind}; {names} is "
                        f"{'-'.join(sorted(renderer.modalities))}-only",
                        param=f"body.messages[{i}].content[{j}]",
                    )

    def render(self, renderer: PromptRenderer, body: ChatCompletionBody) -> Prompt:
        kwargs = dict(body.chat_template_kwargs or {})
        tools = body.tools if body.tools and body.tool_choice != "none" else None
        said = body.thinking()
        thinking = said is not False
        if said is not None and renderer.template_thinks:
            kwargs["enable_thinking"] = said  # reasoning_effort, mapped (openai_fields)
        tokenizer = renderer.tokenizer
        if tokenizer is None:
            # No template (echo engine): the "model" may think unless the request said not to,
            # so `<think>` blocks a test sends come back as reasoning_content.
            text = echo_text(body)
            return Prompt(text, None, len(text.split()), thinking, tools)
        reserved = _RESERVED_TEMPLATE_KWARGS.intersection(kwargs)
        if reserved:
            raise ContractError(
                f"may not set {', '.join(sorted(reserved))}",
                param="body.chat_template_kwargs",
            )
        try:
            text = tokenizer.apply_chat_template(
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
        if body.add_special_tokens or renderer.prompt_encoder is None:
            special = bool(body.add_special_tokens)
            token_ids = list(tokenizer.encode(text, add_special_tokens=special))
        else:
            token_ids = renderer.prompt_encoder.encode(text)
        return Prompt(text, token_ids, len(token_ids), thinking and renderer.template_thinks, tools)

    def measure(self, renderer: PromptRenderer, body: ChatCompletionBody, prompt: Prompt) -> int:
        """Without a tokenizer (echo) the words of the whole conversation, not just the
        echoed part."""
        if renderer.tokenizer is None:
            return sum(len(content_text(m.content).split()) for m in body.messages)
        return prompt.n_prompt

    def fit(
        self,
        renderer: PromptRenderer,
        body: ChatCompletionBody,
        strategy: ContextStrategy,
        before: int,
        window: int,
        codec: cw.Codec,
    ) -> tuple[ChatCompletionBody, list[int], list[Truncation]]:
        def measure(messages: Sequence[Message]) -> int:
            trial = body.model_copy(update={"messages": list(messages)})
            return self.measure(renderer, trial, self.render(renderer, trial))

        fitted = cw.fit_messages(strategy, body.messages, window, measure, codec)
        fitted_body = body.model_copy(update={"messages": fitted.messages})
        return fitted_body, fitted.dropped, fitted.truncated

    def forced(self, body: ChatCompletionBody) -> ForcedCall | None:
        return forced_call(body)

    def conversation(
        self, renderer: PromptRenderer, body: ChatCompletionBody
    ) -> ChatCompletionBody | None:
        return body if renderer.tokenizer is None else None

    def build_response(
        self,
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
                    ChatChoice(
                        index=index, message=message, finish_reason=finish, logprobs=logprobs
                    )
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


__all__ = ["ChatHandler"]
