"""`echo`: a deterministic TEST engine that answers with its prompt.

It exists for plumbing tests and the overhead benchmark: with no model in the
way, what is measured is qbatch itself (Kafka, batching, Redis). Because the
reply is the rendered prompt (for chat, the last user message), a test can
make the "model" emit `<tool_call>` or `<think>` blocks by sending them.

It can also be slowed to a GPU-like shape: `--echo-delay-ms` per answer, at most
`--echo-concurrency` requests at a time (like vLLM's `max_num_seqs`), the rest waiting
in priority order (lower first, then arrival, like vLLM's priority scheduling; not
preemptive). The priority-lane tests and benchmarks use that shape.

With `--task embed` it answers `/v1/embeddings` with deterministic unit vectors of
`--echo-embed-size` components (`worker.embedding.echo_vector`: equal inputs, equal
vectors), shortened to any `dimensions` asked, at the same pace and concurrency.

With `--echo-prefix-cache-tokens N` it also reports `cached_tokens` from a simulated
prefix cache of N tokens (`worker.engines.prefix_cache`), keyed on the whole conversation,
so the CPU shows what prefix-aware placement does to the hit rate. Its `prompt_tokens`
are then the simulator's too (the whole conversation at 4 characters a token, not the
echoed part's words), so cached and prompt tokens are in one unit.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from schemas.endpoints import Task
from worker.embedding import echo_vector, shortened
from worker.engines.base import (
    EmbeddingShape,
    EmbedSpec,
    Engine,
    EngineOutput,
    EngineRequest,
    EngineStats,
    OnDone,
    TokenLogprob,
)
from worker.engines.prefix_cache import SimulatedPrefixCache
from worker.template_messages import conversation_text

if TYPE_CHECKING:
    from worker.config import WorkerSettings


def echo_embeddings(request: EngineRequest, spec: EmbedSpec, size: int) -> EngineOutput:
    vectors = [shortened(echo_vector(item, size), spec.dimensions) for item in spec.inputs]
    tokens = sum(len(item) if isinstance(item, list) else len(item.split()) for item in spec.inputs)
    return EngineOutput(request.key, "", tokens, 0, "stop", embeddings=vectors)


def echo_output(request: EngineRequest) -> EngineOutput:
    words = request.prompt.split()
    prompt_tokens = len(request.prompt_token_ids or ()) or len(words)
    spec = request.sampling
    if len(words) > spec.max_tokens:
        words = words[: spec.max_tokens]
        output = EngineOutput(request.key, " ".join(words), prompt_tokens, len(words), "length")
    else:
        output = EngineOutput(request.key, request.prompt, prompt_tokens, len(words), "stop")
    if spec.logprobs is None and spec.n == 1:
        return output  # the common case: nothing more to build
    if spec.logprobs is not None:
        output.logprobs = echo_logprobs(words, spec.logprobs)
    if spec.n > 1:
        sample = output.samples()[0]
        output.others = [replace(sample) for _ in range(spec.n - 1)]
    return output


def echo_logprobs(words: list[str], k: int) -> list[TokenLogprob]:
    """Deterministic log-probabilities for the echo "model": word i (its tokens are words,
    ids their positions) has logprob -(i % 4) / 4, alternatives `word~1`..`word~k` each one
    lower, so tests can check the OpenAI shapes exactly."""
    out = []
    for i, word in enumerate(words):
        token = word if i == 0 else " " + word
        logprob = -(i % 4) / 4
        top = tuple(
            (i, token, logprob) if j == 0 else (10_000 * j + i, f"{token}~{j}", logprob - j)
            for j in range(k)
        )
        out.append(TokenLogprob(token_id=i, token=token, logprob=logprob, top=top))
    return out


class EchoEngine(Engine):
    name = "echo"

    def __init__(
        self,
        *,
        served_name: str = "echo",
        max_model_len: int = 32_768,
        delay_ms: float = 0.0,
        concurrency: int = 0,
        prefix_cache_tokens: int = 0,
        task: str = "generate",
        embed_size: int = 64,
    ) -> None:
        self._served_name = served_name
        self.supported_tasks = frozenset({Task(task)})
        if task == Task.embed:
            self.embedding_shape = EmbeddingShape(embed_size, matryoshka=True)
        self.prefix_cache = (
            SimulatedPrefixCache(prefix_cache_tokens) if prefix_cache_tokens > 0 else None
        )
        self._max_model_len = max_model_len
        self._delay_s = delay_ms / 1000.0
        self._concurrency = concurrency
        self._waiting: list[tuple[int, int, EngineOutput, OnDone]] = []
        self._running: list[tuple[float, int, EngineOutput, OnDone]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    @classmethod
    def from_settings(cls, settings: WorkerSettings) -> EchoEngine:
        return cls(
            served_name=settings.served_name(),
            max_model_len=settings.max_model_len or 32_768,
            delay_ms=settings.echo_delay_ms,
            concurrency=settings.echo_concurrency,
            prefix_cache_tokens=settings.echo_prefix_cache_tokens,
            task=settings.task,
            embed_size=settings.echo_embed_size,
        )

    @property
    def _immediate(self) -> bool:
        return self._delay_s <= 0 and self._concurrency <= 0

    def _start(self) -> None:
        if not self._immediate and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="echo-delay", daemon=True)
            self._thread.start()

    def _output(self, request: EngineRequest) -> EngineOutput:
        if request.embed is not None and self.embedding_shape is not None:
            return echo_embeddings(request, request.embed, self.embedding_shape.size)
        output = echo_output(request)
        if self.prefix_cache is not None:
            chat = request.conversation
            text = request.prompt if chat is None else conversation_text(chat)
            # The simulator's unit (4 characters a token, the whole conversation) for both,
            # so cached <= prompt tokens and hits/queries is the simulated hit rate.
            output.cached_tokens, output.prompt_tokens = self.prefix_cache.lookup(
                text, request.cache_salt
            )
        return output

    def submit(self, batch: Sequence[EngineRequest], on_done: OnDone) -> None:
        if self._immediate:
            for request in batch:
                on_done(self._output(request))
            return
        with self._cond:
            for request in batch:
                item = (request.priority, next(self._seq), self._output(request), on_done)
                heapq.heappush(self._waiting, item)
            self._cond.notify()

    def capacity(self) -> tuple[int | None, int | None]:
        return (self._concurrency or None), None

    def abort(self, keys: Sequence[str]) -> None:
        """Requests still waiting (not "generating") finish at once with "abort"; those
        running finish as they would."""
        wanted = set(keys)
        with self._cond:
            gone = [w for w in self._waiting if w[2].key in wanted]
            if gone:
                self._waiting = [w for w in self._waiting if w[2].key not in wanted]
                heapq.heapify(self._waiting)
        for _, _, output, on_done in gone:
            on_done(EngineOutput(output.key, "", 0, 0, "abort"))

    def _admit(self, now: float) -> None:
        """Waiting -> running while there is room (caller holds the lock)."""
        while self._waiting and (self._concurrency <= 0 or len(self._running) < self._concurrency):
            _, seq, output, on_done = heapq.heappop(self._waiting)
            heapq.heappush(self._running, (now + self._delay_s, seq, output, on_done))

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        return
                    now = time.monotonic()
                    self._admit(now)
                    if self._running and self._running[0][0] <= now:
                        _, _, output, on_done = heapq.heappop(self._running)
                        break
                    timeout = self._running[0][0] - now if self._running else None
                    self._cond.wait(timeout)
            on_done(output)

    def stats(self) -> EngineStats:
        cache = self.prefix_cache
        with self._cond:
            return EngineStats(
                kv_cache_tokens=cache.capacity_tokens if cache is not None else None,
                running=len(self._running),
                waiting=len(self._waiting),
            )

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
