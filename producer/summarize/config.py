"""A summarisation job's settings (what its plan depends on) and its run report."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from producer.summarize.plan import Budget
from producer.summarize.templates import Templates
from schemas.settings import BULK


@dataclass(slots=True)
class Config:
    job: str
    work_dir: Path
    out: Path
    budget: Budget = field(default_factory=Budget)
    templates: Templates = field(default_factory=Templates)
    model: str | None = None
    thinking: bool = False
    options: dict[str, Any] = field(default_factory=dict)
    """Envelope options of every request: priority, deadline, result_ttl_s, metadata."""
    lane: str = BULK
    timeout: float | None = None
    job_ttl_s: int | None = None

    def fingerprint(self) -> str:
        """What the work directory's plan depends on (a re-run must not change it)."""
        data = {
            "job": self.job,
            "budget": [self.budget.context, self.budget.summary_tokens, self.budget.margin],
            "chunk": [self.budget.chunk_tokens, self.budget.overlap_tokens],
            "templates": self.templates.fingerprint(),
            "model": self.model,
            "thinking": self.thinking,
            "options": self.options,
        }
        return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


@dataclass(slots=True)
class Report:
    documents: int = 0
    succeeded: int = 0
    failed: int = 0
    complete: bool = False
    rounds: int = 0
    published: int = 0
    out: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "documents": self.documents,
            "succeeded": self.succeeded,
            "failed": self.failed,
            "complete": self.complete,
            "rounds": self.rounds,
            "published": self.published,
            "out": self.out,
        }


__all__ = ["Config", "Report"]
