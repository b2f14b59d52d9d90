"""The one small interface every engine implements.

An engine takes a micro-batch of already rendered, already admitted requests
and reports each request's output through a callback, from whatever thread it
likes. It never touches Kafka or Redis: the service owns all I/O, so an engine
is easy to swap (vLLM on GPUs, transformers on a laptop, echo in tests).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

EngineFinish = Literal["stop", "length", "abort", "error"]


@dataclass(frozen=True, slots=True)
class SamplingSpec:
    """Engine-neutral sampling settings, mapped from the OpenAI body by `rendering`."""

    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    json_schema: dict[str, Any] | None = None
    json_object: bool = False


@dataclass(slots=True)
class EngineRequest:
    key: str
    """Unique per submission (not the request_id: a duplicate id may be in flight twice)."""
    prompt: str
    prompt_token_ids: list[int] | None
    sampling: SamplingSpec
    priority: int = 0


@dataclass(slots=True)
class EngineOutput:
    key: str
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish: EngineFinish
    error: str | None = None
    """Set with finish="error": the engine could not run this request."""


@dataclass(slots=True)
class EngineStats:
    """What an engine can say about itself for metrics; None where unknown."""

    kv_cache_usage: float | None = None
    running: int | None = None
    waiting: int | None = None
    extra: dict[str, float] = field(default_factory=dict)


OnDone = Callable[[EngineOutput], None]


class Engine(abc.ABC):
    """Lifecycle: `start()` once, `submit()` many times, `close()` once.

    `submit` must not block for the length of generation in continuous mode:
    the service keeps feeding micro-batches while earlier ones are running.
    Every submitted request gets exactly one `on_done` call, errors included.
    """

    name: str = "engine"
    mode: str = "continuous"

    _served_name: str = "engine"
    _max_model_len: int = 0
    _tokenizer: Any = None

    @property
    def model_name(self) -> str:
        """The served model name results report and requests may name."""
        return self._served_name

    @property
    def max_model_len(self) -> int:
        """Prompt plus output tokens must fit in this (known once the engine is built)."""
        return self._max_model_len

    @property
    def tokenizer(self) -> Any | None:
        """A transformers tokenizer with the model's chat template, or None (echo)."""
        return self._tokenizer

    def start(self) -> None:  # noqa: B027 - optional hook
        """Load weights, start background loops."""

    @abc.abstractmethod
    def submit(self, batch: Sequence[EngineRequest], on_done: OnDone) -> None:
        """Hand a micro-batch to the engine; outputs arrive through `on_done`."""

    def stats(self) -> EngineStats:
        return EngineStats()

    def close(self) -> None:  # noqa: B027 - optional hook
        """Stop background loops; outstanding requests may be abandoned."""
