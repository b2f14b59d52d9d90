"""One document summarised through a `QBatchClient` (no job, no work directory): the
same planner as the CLI, each level one `submit_many` + `wait_many`."""

from __future__ import annotations

import time
from typing import Any

from producer.envelopes import Request
from producer.summarize.chunking import chunk_text
from producer.summarize.plan import (
    Budget,
    Summary,
    Task,
    check_budget,
    chunk_sizes,
    map_task,
    reduce_tasks,
    request_body,
)
from producer.summarize.templates import Templates
from producer.summarize.tokens import Tokenizer


def summarize_text(
    client: Any,
    text: str,
    tokenizer: Tokenizer,
    *,
    budget: Budget | None = None,
    templates: Templates | None = None,
    instructions: str | None = None,
    model: str | None = None,
    thinking: bool = False,
    timeout: float | None = 600.0,
    lane: str | None = None,
    **options: Any,
) -> Summary:
    """Summarise `text`; a failed or timed-out request makes a failed `Summary` naming it.

    `options`: `schemas.RequestOptions` for every request (priority, deadline, ...).
    PlanError / TemplateError / ContractError are raised for bad settings.
    """
    budget = budget or Budget()
    templates = templates or Templates()
    said = instructions if instructions is not None else templates.instructions
    check_budget(budget, tokenizer, templates)
    out = Summary()
    if not text.strip():
        out.status = "failed"
        out.error = _error("empty_document", "the document is empty", None, None, None)
        return out
    size, overlap = chunk_sizes(budget, tokenizer, templates, said)
    chunks = chunk_text(text, tokenizer, size, overlap)
    out.chunks = len(chunks)
    tasks: list[Task] = [map_task(templates, said, c.text, c.index, len(chunks)) for c in chunks]
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        out.levels = tasks[0].level
        requests = [
            Request(
                request_body(
                    t.prompt, summary_tokens=budget.summary_tokens, model=model, thinking=thinking
                ),
                **options,
            )
            for t in tasks
        ]
        ids = client.submit_many(requests, lane=lane)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        found = client.wait_many(ids, timeout=left)
        summaries = []
        for task, rid in zip(tasks, ids, strict=True):
            result = found[rid]
            if result is None:
                out.status = "failed"
                out.error = _error("timeout", "no result in time", task.level, task.index, rid)
                return out
            usage = result.response.usage if result.response is not None else None
            if usage is not None:
                out.add_usage(usage.prompt_tokens, usage.completion_tokens)
            if not result.ok:
                err = result.error
                out.status = "failed"
                out.error = _error(
                    err.code.value if err else "failed",
                    err.message if err else "",
                    task.level,
                    task.index,
                    rid,
                )
                return out
            summaries.append(result.response.choices[0].message.content or "")
        if tasks[0].final:
            out.summary = summaries[0]
            return out
        tasks = reduce_tasks(summaries, tasks[0].level + 1, tokenizer, templates, said, budget)


def _error(
    code: str, message: str, level: int | None, chunk: int | None, rid: str | None
) -> dict[str, Any]:
    return {"code": code, "message": message, "level": level, "chunk": chunk, "request_id": rid}


__all__ = ["summarize_text"]
