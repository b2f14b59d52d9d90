"""The one small interface every engine implements.

An engine takes a micro-batch of already rendered, already admitted requests
and reports each request's output through a callback, from whatever thread it
likes. It never touches Kafka or Redis: the service owns all I/O, so an engine
is easy to swap (vLLM on GPUs, transformers on a laptop, echo in tests).
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from worker.config import WorkerSettings

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
    """Lifecycle: `start()` (runs `_start` once, however often it is called), `submit()`
    many times, `close()` once. Built by `from_settings`, through the registry in
    `worker.engines`.

    `submit` must not block for the length of generation in continuous mode:
    the service keeps feeding micro-batches while earlier ones are running.
    Every submitted request gets exactly one `on_done` call, errors included.
    """

    name: str = "engine"
    mode: str = "continuous"

    _served_name: str = "engine"
    _max_model_len: int = 0
    _tokenizer: Any = None
    _generation_defaults: dict[str, Any] | None = None
    _start_lock = threading.Lock()
    _started: bool = False

    @classmethod
    @abc.abstractmethod
    def from_settings(cls, settings: WorkerSettings) -> Engine:
        """The engine `settings` describe (not started)."""

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

    @property
    def generation_defaults(self) -> dict[str, Any] | None:
        """Sampling defaults of the model (its generation_config.json), applied by the
        renderer to fields a request leaves unset, as vLLM's `generation_config="auto"`."""
        return self._generation_defaults

    def start(self) -> None:
        """Load weights, start background loops: once, whoever calls it first."""
        with self._start_lock:
            if self._started:
                return
            self._start()
            self._started = True

    def _start(self) -> None:  # noqa: B027 - optional hook
        """What `start` does the first time."""

    @abc.abstractmethod
    def submit(self, batch: Sequence[EngineRequest], on_done: OnDone) -> None:
        """Hand a micro-batch to the engine; outputs arrive through `on_done`."""

    def stats(self) -> EngineStats:
        return EngineStats()

    def close(self) -> None:  # noqa: B027 - optional hook
        """Stop background loops; outstanding requests may be abandoned."""
