"""The level planner, pure: how big a chunk is, what each level asks, when it is done.

Level 1 asks one map request per chunk (a document that fits one chunk gets one
single-pass request, already its final summary). Level k+1 concatenates a document's
level-k summaries in order; if the reduce prompt fits one pass (its tokens <= context -
summary max_tokens - margin) it is one final request, else consecutive summaries are
grouped greedily, each group fitting, at least two a group (but a lone last one: it did
not fit the group before it, and is reduced on its own). `check_budget` refuses, up
front, a budget where two max-length summaries do not fit one reduce prompt, so every
level at least halves the count and the reduce always converges.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from producer.summarize.chunking import check_sizes
from producer.summarize.templates import SEPARATOR, Templates, render
from producer.summarize.tokens import Tokenizer

DEFAULT_CONTEXT = 32_768
"""Qwen3-14B's native context."""
DEFAULT_SUMMARY_TOKENS = 512
DEFAULT_MARGIN = 64
"""Tokens kept for what the chat template adds around a prompt (roles, think tags)."""
MAX_DEFAULT_CHUNK = 8_192
MAX_DEFAULT_OVERLAP = 256


class PlanError(ValueError):
    """The sizes asked for cannot work (a usage error)."""


@dataclass(frozen=True, slots=True)
class Budget:
    context: int = DEFAULT_CONTEXT
    summary_tokens: int = DEFAULT_SUMMARY_TOKENS
    margin: int = DEFAULT_MARGIN
    chunk_tokens: int | None = None
    overlap_tokens: int | None = None

    @property
    def prompt_limit(self) -> int:
        """Most tokens a prompt may have."""
        return self.context - self.summary_tokens - self.margin


def _overhead(template: str, tokenizer: Tokenizer, instructions: str) -> int:
    return tokenizer.count(render(template, text="", instructions=instructions, part=0, parts=0))


def chunk_sizes(
    budget: Budget, tokenizer: Tokenizer, templates: Templates, instructions: str
) -> tuple[int, int]:
    """(chunk tokens, overlap tokens) for a document with these instructions."""
    overhead = max(
        _overhead(templates.map, tokenizer, instructions) + 2 * len(str(1 << 20)),
        _overhead(templates.single, tokenizer, instructions),
    )
    room = budget.prompt_limit - overhead
    size = budget.chunk_tokens if budget.chunk_tokens is not None else min(MAX_DEFAULT_CHUNK, room)
    if size > room or size < 1:
        raise PlanError(
            f"a chunk of {size} tokens does not fit: the context is {budget.context}, the "
            f"summary {budget.summary_tokens}, the margin {budget.margin} and the map prompt "
            f"{overhead} tokens, which leaves {room}"
        )
    overlap = (
        budget.overlap_tokens
        if budget.overlap_tokens is not None
        else min(MAX_DEFAULT_OVERLAP, size // 16)
    )
    try:
        check_sizes(size, overlap)
    except ValueError as exc:
        raise PlanError(str(exc)) from None
    return size, overlap


def check_budget(budget: Budget, tokenizer: Tokenizer, templates: Templates) -> None:
    """PlanError unless two max-length summaries fit one reduce prompt."""
    if budget.summary_tokens < 1 or budget.margin < 0:
        raise PlanError("summary tokens must be >= 1 and the margin >= 0")
    need = (
        _overhead(templates.reduce, tokenizer, templates.instructions)
        + 2 * budget.summary_tokens
        + tokenizer.count(SEPARATOR)
    )
    if need > budget.prompt_limit:
        raise PlanError(
            f"the reduce step cannot converge: two summaries of {budget.summary_tokens} tokens "
            f"make a {need}-token prompt, over the {budget.prompt_limit} that fit "
            f"(context {budget.context} - summary {budget.summary_tokens} - margin "
            f"{budget.margin}); lower --summary-tokens or raise --context-tokens"
        )


@dataclass(frozen=True, slots=True)
class Task:
    """One request of a document at one level."""

    level: int
    index: int
    final: bool
    prompt: str
    covers: tuple[int, int] = (0, 0)
    """[first, end) of the previous level's summaries this one reduces (level 1: the chunk)."""


def map_task(templates: Templates, instructions: str, text: str, index: int, parts: int) -> Task:
    """Level 1 request for chunk `index` of `parts` (one part: the single-pass prompt)."""
    template = templates.single if parts == 1 else templates.map
    prompt = render(template, text=text, instructions=instructions, part=index + 1, parts=parts)
    return Task(1, index, parts == 1, prompt, (index, index + 1))


def reduce_tasks(
    summaries: Sequence[str],
    level: int,
    tokenizer: Tokenizer,
    templates: Templates,
    instructions: str,
    budget: Budget,
) -> list[Task]:
    """Level `level` requests reducing the previous level's `summaries` (in order)."""
    m = len(summaries)
    if m == 0:
        raise ValueError("nothing to reduce")

    def prompt(first: int, end: int, part: int, parts: int) -> str:
        text = SEPARATOR.join(summaries[first:end])
        return render(
            templates.reduce, text=text, instructions=instructions, part=part, parts=parts
        )

    def fits(first: int, end: int) -> bool:
        return tokenizer.count(prompt(first, end, m, m)) <= budget.prompt_limit

    if fits(0, m):
        return [Task(level, 0, True, prompt(0, m, 1, 1), (0, m))]
    groups: list[tuple[int, int]] = []
    first = 0
    while first < m:
        end = min(first + 2, m)
        while end < m and fits(first, end + 1):
            end += 1
        groups.append((first, end))
        first = end
    n = len(groups)
    return [
        Task(level, i, n == 1, prompt(a, b, i + 1, n), (a, b)) for i, (a, b) in enumerate(groups)
    ]


@dataclass(slots=True)
class Summary:
    """A document's outcome: its output line (`as_dict`)."""

    custom_id: str | None = None
    status: str = "succeeded"
    summary: str | None = None
    chunks: int = 0
    levels: int = 0
    usage: dict[str, int] = field(
        default_factory=lambda: {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    )
    error: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return self.status == "succeeded"

    def add_usage(self, prompt_tokens: int, completion_tokens: int) -> None:
        self.usage["prompt_tokens"] += prompt_tokens
        self.usage["completion_tokens"] += completion_tokens
        self.usage["total_tokens"] += prompt_tokens + completion_tokens

    def as_dict(self) -> dict[str, Any]:
        return {
            "custom_id": self.custom_id,
            "status": self.status,
            "summary": self.summary,
            "chunks": self.chunks,
            "levels": self.levels,
            "usage": dict(self.usage),
            "error": self.error,
        }


def request_body(
    prompt: str,
    *,
    summary_tokens: int,
    model: str | None = None,
    system: str | None = None,
    thinking: bool = False,
) -> dict[str, Any]:
    """The chat body of one summarisation request."""
    messages: list[dict[str, str]] = []
    if system:
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": prompt})
    body: dict[str, Any] = {"messages": messages, "max_tokens": summary_tokens}
    if not thinking:
        body["chat_template_kwargs"] = {"enable_thinking": False}
    if model:
        body["model"] = model
    return body


__all__ = [
    "DEFAULT_CONTEXT",
    "DEFAULT_MARGIN",
    "DEFAULT_SUMMARY_TOKENS",
    "Budget",
    "PlanError",
    "Summary",
    "Task",
    "check_budget",
    "chunk_sizes",
    "map_task",
    "reduce_tasks",
    "request_body",
]
