"""The one small interface every engine implements.

An engine takes a micro-batch of already rendered, already admitted requests
and reports each request's output through a callback, from whatever thread it
likes. It never touches Kafka or Redis: the service owns all I/O, so an engine
is easy to swap (vLLM on GPUs, transformers on a laptop, echo in tests).
"""

from __future__ import annotations

import abc
import hashlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from typing import TYPE_CHECKING, Any, Literal

from schemas.endpoints import Task

if TYPE_CHECKING:
    from worker.config import WorkerSettings

EngineFinish = Literal["stop", "length", "abort", "error"]

try:
    _QBATCH_VERSION = metadata.version("qbatch")
except metadata.PackageNotFoundError:  # pragma: no cover - running from a bare checkout
    _QBATCH_VERSION = "0"


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
    choice: tuple[str, ...] | None = None
    """The output is exactly one of these strings (vLLM structured outputs)."""
    n: int = 1
    logprobs: int | None = None
    """Report each output token's log-probability and this many alternatives (0: none)."""
    min_p: float | None = None
    repetition_penalty: float | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class EmbedSpec:
    """What an embed request asks (`/v1/embeddings`): one vector per input, last-token
    pooled and L2-normalised, cut to `dimensions` (Matryoshka) when set."""

    inputs: tuple[list[int], ...] | tuple[str, ...]
    """Each input's token ids (what the request gave, or its tokenised text); without a
    tokenizer (echo) a text input stays text."""
    dimensions: int | None = None


@dataclass(frozen=True, slots=True)
class EmbeddingShape:
    """The vectors an embed engine makes: `size` components, and which `dimensions` a
    request may ask (vLLM's rule: none unless the model says it is Matryoshka-trained;
    then the listed sizes, or any size up to `size` when it lists none)."""

    size: int
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None

    def dimensions_problem(self, dimensions: int) -> str | None:
        """Why a request may not ask `dimensions` of this model, or None."""
        if not self.matryoshka:
            return (
                "the served model is not Matryoshka-trained: its vectors cannot be shortened "
                f"(leave dimensions unset for its {self.size})"
            )
        if self.matryoshka_dimensions is not None:
            if dimensions not in self.matryoshka_dimensions:
                sizes = ", ".join(map(str, self.matryoshka_dimensions))
                return f"the served model takes dimensions {sizes}"
        elif dimensions > self.size:
            return f"over the served model's {self.size} dimensions"
        return None

    @classmethod
    def of_config(cls, config: Any, size: int) -> EmbeddingShape:
        """From a Hugging Face config (`is_matryoshka`, `matryoshka_dimensions`; the keys
        vLLM reads)."""
        dims = getattr(config, "matryoshka_dimensions", None)
        matryoshka = bool(getattr(config, "is_matryoshka", False) or dims)
        return cls(size, matryoshka, tuple(int(d) for d in dims) if dims else None)


@dataclass(slots=True)
class EngineRequest:
    key: str
    """Unique per submission (not the request_id: a duplicate id may be in flight twice)."""
    prompt: str
    prompt_token_ids: list[int] | None
    sampling: SamplingSpec
    priority: int = 0
    cache_salt: str | None = None
    conversation: Any = None
    """The chat body where `prompt` is only part of it (echo renders the last user
    message): what the echo's simulated prefix cache keys on. None: `prompt` is all."""
    first_lane: bool = False
    """Of the worker's best lane: an engine may hold other work back while it runs (vLLM:
    the step cap, `QBATCH_INTERACTIVE_STEP_TOKENS`)."""
    embed: EmbedSpec | None = None
    """Set for an embed request: the engine pools its inputs instead of generating."""


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One generated token's log-probability, with the likeliest alternatives (best first).
    `token` is the token's text; raw model log-probabilities, as vLLM reports them."""

    token_id: int
    token: str
    logprob: float
    top: tuple[tuple[int, str, float], ...] = ()


@dataclass(slots=True)
class EngineSample:
    """One of the `n` choices of a request."""

    text: str
    completion_tokens: int
    finish: EngineFinish
    token_ids: list[int] | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass(slots=True)
class EngineOutput:
    """A finished request. The fields after `error` are optional: an engine that cannot
    tell leaves them unset. With `n` > 1 the first choice is the output's own fields and
    the others are in `others`, so the common single-choice case allocates nothing more."""

    key: str
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish: EngineFinish
    error: str | None = None
    """Set with finish="error": the engine could not run this request."""
    token_ids: list[int] | None = None
    logprobs: list[TokenLogprob] | None = None
    cached_tokens: int | None = None
    """Prompt tokens served from the prefix cache (vLLM's count)."""
    others: list[EngineSample] = field(default_factory=list)
    scheduled_ms: int | None = None
    """Epoch ms when the engine first scheduled it (None: the engine cannot tell)."""
    first_token_ms: int | None = None
    """Epoch ms of its first generated token (None: the engine cannot tell)."""
    embeddings: list[list[float]] | None = None
    """An embed request's vectors, one per input, in input order."""

    @property
    def total_completion_tokens(self) -> int:
        if not self.others:
            return self.completion_tokens
        return self.completion_tokens + sum(s.completion_tokens for s in self.others)

    def samples(self) -> list[EngineSample]:
        first = EngineSample(
            self.text, self.completion_tokens, self.finish, self.token_ids, self.logprobs
        )
        return [first, *self.others]

    @classmethod
    def of_samples(
        cls,
        key: str,
        samples: Sequence[EngineSample],
        prompt_tokens: int,
        cached_tokens: int | None = None,
    ) -> EngineOutput:
        first, *others = samples
        return cls(
            key=key,
            text=first.text,
            prompt_tokens=prompt_tokens,
            completion_tokens=first.completion_tokens,
            finish=first.finish,
            token_ids=first.token_ids,
            logprobs=first.logprobs,
            cached_tokens=cached_tokens,
            others=list(others),
        )


@dataclass(slots=True)
class EngineStats:
    """What an engine can say about itself for metrics; None where unknown."""

    kv_cache_usage: float | None = None
    kv_cache_tokens: int | None = None
    """The cache's capacity, fixed at start-up (vLLM: blocks x block size)."""
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
    supported_tasks: frozenset[Task] = frozenset({Task.generate})
    """What it runs (vLLM's `supported_tasks`): a request whose endpoint needs another task
    (`schemas.endpoints`) is answered `invalid_request` naming `endpoint`, never submitted."""
    embedding_shape: EmbeddingShape | None = None
    """An embed engine's vectors (known once started); None for a generate engine."""

    _served_name: str = "engine"
    _max_model_len: int = 0
    _tokenizer: Any = None
    _generation_defaults: dict[str, Any] | None = None
    _start_lock = threading.Lock()
    _started: bool = False
    _fingerprint: str | None = None

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

    @property
    def fingerprint(self) -> str:
        """OpenAI's `system_fingerprint`: changes when what answers changes (qbatch version,
        engine, mode, served model, context, and the engine's own settings), so a caller
        can tell two results apart that came from different backends. Kept once the
        engine has started (what it hashes is settled then; every result asks)."""
        if self._fingerprint is not None:
            return self._fingerprint
        parts = [
            _QBATCH_VERSION,
            self.name,
            self.mode,
            self.model_name,
            str(self.max_model_len),
            *self._fingerprint_parts(),
        ]
        value = "fp_" + hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:12]
        if self._started:
            self._fingerprint = value
        return value

    def _fingerprint_parts(self) -> list[str]:
        """Engine settings that change answers (vLLM: parallelism, dtype, quantization)."""
        return []

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

    def capacity(self) -> tuple[int | None, int | None]:
        """(requests it runs at once, KV-cache tokens): what `worker.engine_gate` keeps
        worse lanes under; (None, None) for an engine that takes whatever it is given."""
        return None, None

    def abort(self, keys: Sequence[str]) -> None:  # noqa: B027 - optional hook
        """Stop these requests if the engine can (a cancelled job's): each still gets one
        `on_done`, with finish "abort" when it was stopped. Default: nothing stops."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Stop background loops; outstanding requests may be abandoned."""
