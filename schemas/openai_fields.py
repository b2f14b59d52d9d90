"""What qbatch does with every field of an OpenAI (or vLLM) chat or completions body.

One table, `RULES`, decides each field: **supported** (it has its OpenAI/vLLM meaning),
**ignored** (accepted and validated, changes nothing, and the note says why), or
**refused** (a clear error naming the field and saying why; a refused field is still
accepted at `null` and at its harmless default, e.g. `stream: false`, so bodies written
by SDKs that send defaults run unchanged).

The body models in `schemas.bodies` declare every supported and ignored field and read the
refused ones from here (`refused_reason`); `tests/unit/test_openai_fields.py` checks that
each body field has exactly one rule here and each rule a field, and that
the table in `schemas/README.md` is `markdown_table()` (`python -m schemas.openai_fields`
prints it), so the models, this table and the docs cannot drift apart.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "REASONING_EFFORT_THINKS",
    "RULES",
    "FieldRule",
    "markdown_table",
    "refused_names",
    "refused_reason",
    "refused_schema",
]

Where = Literal["both", "chat", "completions"]
Decision = Literal["supported", "ignored", "refused"]


class _Nothing:
    def __repr__(self) -> str:
        return "(nothing)"


NOTHING: Any = _Nothing()


@dataclass(frozen=True, slots=True)
class FieldRule:
    name: str
    where: Where
    decision: Decision
    note: str
    """The meaning (supported), or why it changes nothing (ignored) or is refused."""
    accepted: Any = NOTHING
    """For a refused field: the one non-null value accepted as if the field were absent."""

    def applies_to(self, endpoint: Literal["chat", "completions"]) -> bool:
        return self.where in ("both", endpoint)


_ENGINES = "vLLM and transformers; the echo test engine ignores it"

RULES: tuple[FieldRule, ...] = (
    # ---------------------------------------------------------- the OpenAI API
    FieldRule("messages", "chat", "supported", "the conversation (see Messages)"),
    FieldRule(
        "prompt",
        "completions",
        "supported",
        "a string or token ids; a one-item list "
        "is that item; several prompts are refused (one prompt per request)",
    ),
    FieldRule("model", "both", "supported", "must name the served model or an alias"),
    FieldRule("max_tokens", "both", "supported", "1-262144; prompt plus output must fit"),
    FieldRule("max_completion_tokens", "chat", "supported", "as `max_tokens` (wins over it)"),
    FieldRule("temperature", "both", "supported", "0-2; 0 is greedy"),
    FieldRule("top_p", "both", "supported", "(0, 1]"),
    FieldRule("stop", "both", "supported", "up to 16 strings, not included in the text"),
    FieldRule("seed", "both", "supported", "0 <= seed < 2^63; reproducible given the batch"),
    FieldRule("presence_penalty", "both", "supported", "-2..2, OpenAI semantics"),
    FieldRule("frequency_penalty", "both", "supported", "-2..2, OpenAI semantics"),
    FieldRule(
        "n",
        "both",
        "supported",
        "1-16 choices, each with its own index, text or tool "
        "calls and finish reason; usage counts the prompt once; not with `tool_loop`",
    ),
    FieldRule(
        "logprobs",
        "both",
        "supported",
        "chat: `true` returns `choices[].logprobs."
        "content`; completions: an integer k (0-20) returns `tokens`, "
        "`token_logprobs`, `top_logprobs`, `text_offset`. Raw model log-probabilities "
        "(before temperature and penalties, like vLLM); every engine",
    ),
    FieldRule(
        "top_logprobs", "chat", "supported", "0-20 alternatives per token; needs `logprobs: true`"
    ),
    FieldRule(
        "logit_bias",
        "both",
        "supported",
        "token id (a decimal string) -> bias "
        f"-100..100 added to the logits, up to 1024 ids inside the vocabulary; {_ENGINES}",
    ),
    FieldRule(
        "response_format",
        "both",
        "supported",
        "`text`, `json_object`, `json_schema` (enforced on vLLM by structured outputs)",
    ),
    FieldRule(
        "tools", "chat", "supported", "function tools (up to 128); `custom` tools are refused"
    ),
    FieldRule(
        "tool_choice",
        "chat",
        "supported",
        "`none`, `auto`, `required` or a named "
        "function (forced calls are decoded against a schema on vLLM)",
    ),
    FieldRule(
        "parallel_tool_calls",
        "chat",
        "supported",
        "`false`: only the first valid "
        "call is kept, each further one is reported in `tool_call_errors`",
    ),
    FieldRule(
        "reasoning_effort",
        "chat",
        "supported",
        "Qwen3 thinking: `none`/`minimal` "
        "turn it off (`enable_thinking: false`), `low` to `max` leave it on; "
        "contradicting `chat_template_kwargs.enable_thinking` is refused",
    ),
    FieldRule(
        "user",
        "both",
        "ignored",
        "an end-user id for OpenAI's abuse monitoring; "
        "qbatch has none (use `metadata` of the envelope to tag requests)",
    ),
    FieldRule("safety_identifier", "chat", "ignored", "as `user`"),
    FieldRule(
        "store",
        "chat",
        "ignored",
        "OpenAI's stored completions; every qbatch result "
        "is stored in Redis for `result_ttl_s` whatever it says",
    ),
    FieldRule(
        "metadata",
        "chat",
        "ignored",
        "tags of OpenAI's stored completions (16 "
        "string pairs); the envelope's `metadata` is the one echoed in results",
    ),
    FieldRule(
        "service_tier",
        "both",
        "ignored",
        "OpenAI's capacity tiers; qbatch's "
        "lanes are the topic a request is published on, and `priority`",
    ),
    FieldRule(
        "prompt_cache_key",
        "chat",
        "ignored",
        "vLLM's prefix cache needs no key (`cache_salt` isolates it)",
    ),
    FieldRule(
        "prompt_cache_retention",
        "chat",
        "ignored",
        "the prefix cache lives as long as the engine's memory allows",
    ),
    FieldRule(
        "verbosity", "chat", "ignored", "a hint to OpenAI's GPT-5 models; Qwen3 has no such control"
    ),
    FieldRule(
        "prediction",
        "chat",
        "ignored",
        "predicted outputs only make OpenAI faster; the answer is the same without them",
    ),
    FieldRule(
        "modalities", "chat", "refused", "the served model answers in text only", accepted=["text"]
    ),
    FieldRule("audio", "chat", "refused", "the served model answers in text only"),
    FieldRule(
        "stream",
        "both",
        "refused",
        "results are delivered to Redis (and the results "
        "topic), never streamed; leave it out or send false",
        accepted=False,
    ),
    FieldRule(
        "stream_options",
        "both",
        "refused",
        "only means something with `stream`, which qbatch never does",
    ),
    FieldRule(
        "web_search_options",
        "chat",
        "refused",
        "no web search here; give the model a search tool and run it with `tool_loop`",
    ),
    FieldRule("functions", "chat", "refused", "deprecated by OpenAI; use `tools`"),
    FieldRule("function_call", "chat", "refused", "deprecated by OpenAI; use `tool_choice`"),
    FieldRule(
        "echo",
        "completions",
        "supported",
        "the prompt text before the completion (not with `logprobs`)",
    ),
    FieldRule(
        "best_of",
        "completions",
        "supported",
        "only equal to `n`: vLLM V1 does not "
        "rank candidates, so a larger value is refused (ask `n` with `logprobs`)",
    ),
    FieldRule(
        "suffix",
        "completions",
        "refused",
        "no fill-in-the-middle: Qwen3's completions take a prefix only",
    ),
    # ---------------------------------------------------------- vLLM's extensions
    FieldRule("top_k", "both", "supported", "-1 (off) or 1-100000"),
    FieldRule("min_p", "both", "supported", f"0-1, relative to the likeliest token; {_ENGINES}"),
    FieldRule(
        "repetition_penalty",
        "both",
        "supported",
        f"(0, 2], multiplicative over prompt and output tokens (1 is off); {_ENGINES}",
    ),
    FieldRule("min_tokens", "both", "supported", "no EOS or stop before this many tokens"),
    FieldRule("ignore_eos", "both", "supported", "keep generating past EOS to `max_tokens`"),
    FieldRule("stop_token_ids", "both", "supported", f"up to 64 token ids that stop; {_ENGINES}"),
    FieldRule(
        "include_stop_str_in_output",
        "both",
        "supported",
        f"keep the matched stop string in the text; {_ENGINES}",
    ),
    FieldRule(
        "allowed_token_ids", "both", "supported", f"sample only these ids (up to 4096); {_ENGINES}"
    ),
    FieldRule(
        "bad_words",
        "both",
        "supported",
        f"up to 64 words never generated (as vLLM: with and without a leading space); {_ENGINES}",
    ),
    FieldRule(
        "cache_salt",
        "both",
        "supported",
        "isolates this request's prefix-cache "
        "entries (vLLM); engines without a prefix cache need nothing",
    ),
    FieldRule(
        "structured_outputs",
        "both",
        "supported",
        "exactly one of `json` (a JSON "
        "Schema), `choice` (strings), `json_object`; enforced on vLLM only (like "
        "`response_format`), not with it. `regex`, `grammar` and `structural_tag` are "
        "refused: compiling a caller's grammar on the GPU worker has no time bound",
    ),
    FieldRule(
        "include_reasoning",
        "chat",
        "supported",
        "`false` leaves `reasoning_content` "
        "out of the message (the tokens still count as reasoning tokens)",
    ),
    FieldRule(
        "chat_template_kwargs",
        "chat",
        "supported",
        "passed to the model's chat "
        'template, e.g. `{"enable_thinking": false}`; template-owned names refused',
    ),
    FieldRule(
        "documents",
        "chat",
        "supported",
        "passed to the chat template (RAG templates use it; Qwen3's ignores it)",
    ),
    FieldRule(
        "add_generation_prompt",
        "chat",
        "supported",
        "default true; false renders the conversation without the assistant header",
    ),
    FieldRule(
        "continue_final_message",
        "chat",
        "supported",
        "the last (assistant) message "
        "is continued, not closed: prefill; needs `add_generation_prompt: false`",
    ),
    FieldRule(
        "add_special_tokens",
        "both",
        "supported",
        "add the tokenizer's special tokens "
        "(BOS) around the prompt; default false (chat) and true (completions), as vLLM",
    ),
    FieldRule(
        "return_tokens_as_token_ids",
        "both",
        "supported",
        "logprob tokens are written `token_id:N`, for tokens that are not valid UTF-8 on their own",
    ),
    FieldRule("request_id", "both", "ignored", "the envelope's `request_id` names the request"),
    FieldRule(
        "priority",
        "both",
        "refused",
        "set the envelope's `priority` (bulk lines: `qbatch bulk` moves a body's `priority` there)",
    ),
    FieldRule(
        "use_beam_search",
        "both",
        "refused",
        "beam search is not offered by the batch path",
        accepted=False,
    ),
    FieldRule("length_penalty", "both", "refused", "only beam search uses it", accepted=1.0),
    FieldRule(
        "prompt_logprobs", "both", "refused", "prompt log-probabilities are not returned yet"
    ),
    FieldRule(
        "truncate_prompt_tokens",
        "both",
        "refused",
        "a silently cut prompt changes the answer; the envelope's `context` policy cuts "
        "by rule and reports what it cut",
    ),
    FieldRule("truncation_side", "both", "refused", "as `truncate_prompt_tokens`"),
    FieldRule(
        "skip_special_tokens",
        "both",
        "refused",
        "the reasoning and tool-call parsers read the text as the worker decodes it",
        accepted=True,
    ),
    FieldRule(
        "spaces_between_special_tokens",
        "both",
        "refused",
        "as `skip_special_tokens`",
        accepted=True,
    ),
    FieldRule(
        "return_token_ids",
        "both",
        "refused",
        "token ids are not returned yet "
        "(`logprobs` with `return_tokens_as_token_ids` gives them per token)",
    ),
    FieldRule("return_prompt_text", "chat", "refused", "the rendered prompt is not returned"),
    FieldRule(
        "thinking_token_budget",
        "both",
        "refused",
        "needs vLLM's reasoning parser in the engine; qbatch parses reasoning itself",
    ),
    FieldRule("repetition_detection", "both", "refused", "not offered yet"),
    FieldRule("kv_transfer_params", "both", "refused", "disaggregated prefill is not deployed"),
    FieldRule("vllm_xargs", "both", "refused", "no custom engine extensions are loaded"),
    FieldRule(
        "echo",
        "chat",
        "refused",
        "vLLM's chat `echo` only repeats a prefilled assistant message; read it from your request",
        accepted=False,
    ),
    FieldRule(
        "chat_template",
        "chat",
        "refused",
        "a request may not replace the model's "
        "template (the parsers rely on it); set it on the worker",
    ),
    FieldRule("media_io_kwargs", "chat", "refused", "the served model is text-only"),
    FieldRule("mm_processor_kwargs", "chat", "refused", "the served model is text-only"),
    FieldRule("prompt_embeds", "completions", "refused", "prompts are text or token ids"),
)

REASONING_EFFORT_THINKS: dict[str, bool] = {
    "none": False,
    "minimal": False,
    "low": True,
    "medium": True,
    "high": True,
    "xhigh": True,
    "max": True,
}
"""`reasoning_effort` -> Qwen3's `enable_thinking` (its template has no finer control)."""

_BY_KEY: dict[tuple[str, str], FieldRule] = {(rule.where, rule.name): rule for rule in RULES}


def rule_for(where: Where, name: str) -> FieldRule:
    """The rule of `name` on `where` ("chat" and "completions" also find "both" rules)."""
    rule = _BY_KEY.get((where, name)) or _BY_KEY.get(("both", name))
    if rule is None:
        raise KeyError(f"no rule for {name!r} on {where}")
    return rule


def refused_names(endpoint: Literal["chat", "completions"]) -> frozenset[str]:
    """The fields refused on `endpoint` (its own rules and the "both" ones)."""
    return frozenset(
        rule.name for rule in RULES if rule.decision == "refused" and rule.applies_to(endpoint)
    )


def refused_reason(endpoint: Literal["chat", "completions"], name: str, value: Any) -> str | None:
    """For an undeclared body key: None if no rule refuses it (an unknown field), "" if it
    is refused but `value` passes as absent (null, or the rule's accepted default), else
    the reason it is refused."""
    rule = _BY_KEY.get((endpoint, name)) or _BY_KEY.get(("both", name))
    if rule is None or rule.decision != "refused":
        return None
    if value is None:
        return ""
    accepted = rule.accepted
    if accepted is not NOTHING and type(value) is type(accepted) and value == accepted:
        return ""
    return rule.note


def refused_schema(schema: dict[str, Any], endpoint: Literal["chat", "completions"]) -> None:
    """JSON Schema of a body: the refused fields described, other keys forbidden (the
    model itself takes unknown keys as extras to word their errors)."""
    properties = schema.setdefault("properties", {})
    for rule in RULES:
        if rule.decision == "refused" and rule.applies_to(endpoint):
            accepted = "" if rule.accepted is NOTHING else f" (accepted: {rule.accepted!r})"
            properties[rule.name] = {"description": f"Refused{accepted}: {rule.note}."}
    schema["additionalProperties"] = False


def markdown_table() -> str:
    """The decision table as it appears in schemas/README.md."""
    lines = ["| field | endpoint | decision | meaning, or why |", "| --- | --- | --- | --- |"]
    for rule in RULES:
        decision: str = rule.decision
        if rule.accepted is not NOTHING:
            shown = str(rule.accepted).lower() if isinstance(rule.accepted, bool) else rule.accepted
            decision = f"refused (`{shown}` accepted)".replace("'", '"')
        lines.append(f"| `{rule.name}` | {rule.where} | {decision} | {rule.note} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown_table())
