"""`echo`: a deterministic TEST engine that answers at once with its prompt.

It exists for plumbing tests and the overhead benchmark: with no model in the
way, what is measured is qbatch itself (Kafka, batching, Redis). Because the
reply is the rendered prompt (for chat, the last user message), a test can
make the "model" emit `<tool_call>` or `<think>` blocks by sending them.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from worker.engines.base import Engine, EngineOutput, EngineRequest, OnDone

if TYPE_CHECKING:
    from worker.config import WorkerSettings


def echo_output(request: EngineRequest) -> EngineOutput:
    words = request.prompt.split()
    prompt_tokens = len(request.prompt_token_ids or ()) or len(words)
    if len(words) > request.sampling.max_tokens:
        text = " ".join(words[: request.sampling.max_tokens])
        return EngineOutput(request.key, text, prompt_tokens, request.sampling.max_tokens, "length")
    return EngineOutput(request.key, request.prompt, prompt_tokens, len(words), "stop")


class EchoEngine(Engine):
    name = "echo"

    def __init__(
        self, *, served_name: str = "echo", max_model_len: int = 32_768, delay_ms: float = 0.0
    ) -> None:
        self._served_name = served_name
        self._max_model_len = max_model_len
        self._delay_s = delay_ms / 1000.0
        self._due: list[tuple[float, int, EngineOutput, OnDone]] = []
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
        )

    def _start(self) -> None:
        if self._delay_s > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="echo-delay", daemon=True)
            self._thread.start()

    def submit(self, batch: Sequence[EngineRequest], on_done: OnDone) -> None:
        if self._delay_s <= 0:
            for request in batch:
                on_done(echo_output(request))
            return
        due = time.monotonic() + self._delay_s
        with self._cond:
            for request in batch:
                heapq.heappush(self._due, (due, next(self._seq), echo_output(request), on_done))
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (not self._due or self._due[0][0] > time.monotonic()):
                    timeout = self._due[0][0] - time.monotonic() if self._due else None
                    self._cond.wait(timeout)
                if self._closed:
                    return
                _, _, output, on_done = heapq.heappop(self._due)
            on_done(output)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
