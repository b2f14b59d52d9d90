"""Wires the worker: the consumer, the engine, the reply sinks and three threads.

- intake (the main thread, `worker.intake`) owns the Kafka consumer: poll, decode,
  micro-batch, commit, pause and resume;
- the dispatcher (`worker.dispatch`) admits each micro-batch against the dedupe store,
  renders prompts and submits them to the engine, which answers from its own threads;
- the writer (`worker.writer`) turns outputs into result envelopes and hands them to
  every reply sink (`worker.sinks`), then gives the offsets back for commit.

Each loop runs under `worker.supervision.Supervisor`: a fault in any of them stops the
worker cleanly with a non-zero exit, and strikes the records it was handling.
"""

from __future__ import annotations

import gc
import queue
import threading
import time
from collections.abc import Callable, Sequence

from tenacity import RetryError, Retrying, retry_if_exception_type, stop_when_event_set, wait_fixed

from schemas import WorkerInfo
from schemas.loop_auth import LoopSigner, load_signer
from worker import metrics
from worker.commits import Committer, ConsumerCommitter, TransactionalCommitter
from worker.config import WorkerSettings
from worker.dead_letters import DeadLetters
from worker.dispatch import Dispatcher
from worker.engine_gate import Reserve
from worker.engines.base import Engine
from worker.health import ServiceState as WorkerState
from worker.intake import Intake
from worker.kafka_io import RequestConsumer
from worker.logs import log
from worker.records import DispatchQueue, Finished, Reply
from worker.rendering import PromptRenderer
from worker.result_budget import ResultBudget
from worker.sinks.base import ReplySink, SinkHealth
from worker.sinks.kafka_sink import KafkaResultsSink
from worker.sinks.redis_sink import RedisSink
from worker.sinks.tool_calls_sink import ToolCallsSink
from worker.supervision import StrikeStore, Supervisor
from worker.writer import Writer

EXIT_OK = 0
EXIT_FAULT = 70
"""A worker thread stopped on an unexpected exception (EX_SOFTWARE): restart me."""


class Worker:
    def __init__(
        self,
        settings: WorkerSettings,
        engine: Engine,
        consumer: RequestConsumer,
        sinks: Sequence[ReplySink],
        dead_letters: DeadLetters | None,
        *,
        state: WorkerState | None = None,
    ) -> None:
        if not sinks:
            raise ValueError("a worker needs at least one reply sink")
        self.settings = settings
        self.engine = engine
        self.consumer = consumer
        self.sinks = list(sinks)
        self.dead_letters = dead_letters
        self.state = state or WorkerState()
        self._stop = threading.Event()
        self._renderer: PromptRenderer | None = None
        self.health = SinkHealth(self._set_sinks_ok)
        store = next((s for s in self.sinks if s.dedupes), None)
        self.supervisor = Supervisor(
            self._on_fault,
            StrikeStore(
                store.client if isinstance(store, RedisSink) else None,
                settings.keys.strikes(settings.group),
            ),
        )
        budget = ResultBudget(settings.max_result_bytes_in_flight)
        dispatch_q = DispatchQueue()
        results_q: queue.SimpleQueue[Reply | Finished | None] = queue.SimpleQueue()
        self._dispatch_q, self._results_q = dispatch_q, results_q
        self.intake = Intake(
            settings,
            consumer,
            self._committer(),
            dead_letters,
            dispatch_q,
            results_q,
            strikes=self.supervisor.book,
            worker_info=self._worker_info,
            pending_in_sinks=lambda: sum(s.pending() for s in self.sinks),
            sinks_ok=lambda: self.health.ok,
            on_assigned=self._set_assigned,
            report_engine=self._report_engine,
        )
        self.dispatcher = Dispatcher(
            engine,
            self.renderer,
            store,
            dispatch_q,
            results_q,
            worker_id=settings.worker_id,
            worker_info=self._worker_info,
            lane_rank={lane.name: lane.rank for lane in settings.lane_policies()}.__getitem__,
            stopping=self._stop,
            health=self.health,
            dead_letter=lambda item, error: self.intake.dead_letter(item.record, error),
            stall_s=settings.redis_stall_timeout_s,
            budget=budget,
            reserve=Reserve(
                settings.engine_reserve_slots,
                settings.engine_reserve_fraction,
                settings.engine_reserve_hold_s,
            )
            if settings.engine_gate
            else None,
            cancel_poll_s=settings.cancel_poll_s,
        )
        self.writer = Writer(
            self.sinks,
            dead_letters,
            results_q,
            self.intake.written_q.put,
            model=lambda: self.engine.model_name,
            worker_info=self._worker_info,
            chunk_max=settings.write_batch_max,
            stopping=self._stop.is_set,
            drain_timeout_s=settings.drain_timeout_s,
            health=self.health,
            turn_max_bytes=settings.tool_calls_max_record_bytes,
            fingerprint=lambda: self.engine.fingerprint,
            chunk_max_bytes=settings.write_batch_max_bytes,
            stall_s=settings.redis_stall_timeout_s,
            max_result_bytes=settings.max_result_bytes,
            budget=budget,
        )
        self._threads: list[threading.Thread] = []
        self.on_stop: Callable[[], None] = lambda: None
        """Called once a stop is asked for (the CLI arms its backstop timer here)."""

    def _committer(self) -> Committer:
        kafka = next((s for s in self.sinks if isinstance(s, KafkaResultsSink)), None)
        if kafka is not None and kafka.transactional:
            return TransactionalCommitter(self.consumer, kafka)
        return ConsumerCommitter(self.consumer)

    # ------------------------------------------------------------------ lifecycle

    def request_stop(self) -> None:
        """Signal-safe: the main loop notices and drains."""
        self.state.stopping = True
        self._stop.set()
        self.on_stop()

    def _on_fault(self, fault: str) -> None:
        metrics.THREAD_FAULTS.labels(fault.split(":", 1)[0]).inc()
        self.state.fault = fault
        self.request_stop()

    def renderer(self) -> PromptRenderer:
        assert self._renderer is not None, "the renderer exists once run() has started"
        return self._renderer

    def run(self) -> int:
        """Serve until asked to stop; EXIT_OK after a clean stop, EXIT_FAULT after a fault."""
        self.engine.start()  # once: a no-op when the caller started it already
        self.writer.max_result_bytes = limit = self.result_limit()
        self.intake.signer = self.loop_signer()
        self._renderer = PromptRenderer(
            self.engine.tokenizer,
            max_model_len=self.engine.max_model_len,
            served_names=self.settings.served_names() | {self.engine.model_name},
            default_max_tokens=self.settings.default_max_tokens,
            generation_defaults=self.engine.generation_defaults,
            max_result_bytes=limit,
            tasks=self.engine.supported_tasks,
            embedding_shape=self.engine.embedding_shape,
        )
        self.state.engine_ready = True
        guard = self.supervisor.guard
        self._threads = [
            threading.Thread(
                target=guard("dispatcher", self.dispatcher.run, self.dispatcher.suspects),
                name="qbatch-dispatch",
                daemon=True,
            ),
            threading.Thread(
                target=guard("writer", self.writer.run, self.writer.suspects),
                name="qbatch-writer",
                daemon=True,
            ),
        ]
        # Everything alive now (imported libraries, the tokenizer, the engine) lives for
        # the whole run: freeze it out of the cyclic GC, and collect young objects less
        # often. Full collections over that heap cost a third of the echo-engine
        # throughput here (4,504 vs 7,099 req/s in one A/B run of bench_worker_echo).
        gc.freeze()
        gc.set_threshold(50_000, 20, 100)
        for thread in self._threads:
            thread.start()
        self.consumer.subscribe(
            self.intake.on_revoked,
            self.intake.on_assigned,
            self._stop.is_set,
            on_lost=self.intake.on_lost,
        )
        log.info(
            "worker_started",
            worker_id=self.settings.worker_id,
            engine=self.engine.name,
            mode=self.engine.mode,
            model=self.engine.model_name,
            topic=self.settings.topic,
            group=self.settings.group,
            sinks=[s.name for s in self.sinks],
        )
        try:
            guard("intake", self._serve, self.intake.suspects)()
        finally:
            self._shutdown()
        return EXIT_FAULT if self.state.fault else EXIT_OK

    def _serve(self) -> None:
        while not self._stop.is_set():
            self.state.last_loop = time.monotonic()
            self.intake.step()

    def loop_signer(self) -> LoopSigner | None:
        """What checks continuations (`schemas.loop_auth`): QBATCH_LOOP_KEY, else the key in
        Redis; None without either (no Redis sink and no key: no loop runs)."""
        store = next((s for s in self.sinks if isinstance(s, RedisSink)), None)
        if self.settings.loop_key is None and store is None:
            return None
        client = store.client if store is not None else None
        retrying = Retrying(  # Redis down at start: waited out like any outage
            retry=retry_if_exception_type(Exception),  # redis-py's errors, a cluster's own
            wait=wait_fixed(1.0),
            stop=stop_when_event_set(self._stop),
            # reported as Redis being down (log, qbatch_redis_up, readiness): nothing is
            # consumed meanwhile, and with a refusing Redis nothing could be written anyway
            before_sleep=lambda rs: (
                self.health.failed(store, rs.outcome.exception() or RuntimeError("no loop key"))
                if store is not None and rs.outcome is not None
                else None
            ),
        )
        try:
            signer = retrying(
                load_signer, self.settings.loop_key, client, self.settings.keys.loop_key()
            )
        except RetryError:  # stopped before Redis answered
            return None
        if store is not None:
            self.health.recovered(store)
        return signer

    def result_limit(self) -> int:
        """`max_result_bytes`, or less when Redis takes less in one value (its
        `proto-max-bulk-len`, less 64 KiB for the script's other arguments): a larger
        write would have its connection reset, and be retried for ever."""
        limit = self.settings.max_result_bytes
        store = next((s for s in self.sinks if isinstance(s, RedisSink)), None)
        value_limit = store.value_limit() if store is not None else None
        if value_limit is not None and value_limit - 65_536 < limit:
            limit = max(65_536, value_limit - 65_536)
            log.warning(
                "max_result_bytes_lowered",
                max_result_bytes=limit,
                message=f"Redis takes at most {value_limit} bytes in one value "
                "(proto-max-bulk-len): results are held under it",
            )
        return limit

    def _shutdown(self) -> bool:
        clean = False
        try:
            clean = self.intake.drain(self.settings.drain_timeout_s, can_finish=self._threads_alive)
        except Exception as exc:
            log.error("drain_failed", error=f"{type(exc).__name__}: {exc}", exc_info=exc)
            if self.state.fault is None:  # e.g. fenced while committing: not a clean stop
                self.state.fault = f"drain: {type(exc).__name__}: {exc}"
        self._dispatch_q.close()
        self._results_q.put(None)
        for thread in self._threads:
            thread.join(timeout=10)
        for closer in (
            self.intake.committer.close,
            self.consumer.close,
            *(s.close for s in self.sinks),
            *([self.dead_letters.close] if self.dead_letters else []),
            self.engine.close,
        ):
            try:
                closer()
            except Exception as exc:  # closing must not hide the exit status
                what = getattr(closer, "__qualname__", "?")
                log.warning("close_failed", what=what, error=str(exc))
        log.info("worker_stopped", clean=clean, fault=self.state.fault)
        return clean

    def _threads_alive(self) -> bool:
        return self.state.fault is None or all(t.is_alive() for t in self._threads)

    # ------------------------------------------------------------------ state

    def _set_assigned(self, count: int) -> None:
        self.state.assigned = count

    def _set_sinks_ok(self, ok: bool) -> None:
        self.state.redis_ok = ok

    def _worker_info(
        self, batch_id: str | None = None, batch_size: int | None = None
    ) -> WorkerInfo:
        return WorkerInfo(
            id=self.settings.worker_id,
            batch_id=batch_id,
            batch_size=batch_size,
            model=self.engine.model_name,
            engine=f"{self.engine.name}/{self.engine.mode}",
        )

    def _report_engine(self) -> None:
        stats = self.engine.stats()
        if stats.kv_cache_usage is not None:
            metrics.KV_CACHE_USAGE.set(stats.kv_cache_usage)
        if stats.kv_cache_tokens is not None:
            metrics.KV_CACHE_TOKENS.set(stats.kv_cache_tokens)
        if stats.running is not None:
            metrics.ENGINE_RUNNING.set(stats.running)
        if stats.waiting is not None:
            metrics.ENGINE_WAITING.set(stats.waiting)


def build_sinks(settings: WorkerSettings) -> list[ReplySink]:
    """Redis first (the dedupe store decides what the others get), then the results topic,
    then the tool-calls topic (tool loops' turns; it sends nothing until a loop runs)."""
    sinks: list[ReplySink] = []
    if settings.redis_sink:
        sinks.append(RedisSink.from_settings(settings))
    if settings.results_topic:
        sinks.append(KafkaResultsSink(settings))
    sinks.append(ToolCallsSink(settings))
    return sinks


def build_worker(
    settings: WorkerSettings, engine: Engine, *, state: WorkerState | None = None
) -> Worker:
    """A worker with its consumer, sinks and dead-letter producer made from `settings`."""
    state = state or WorkerState()

    def kafka_ok(ok: bool) -> None:
        state.kafka_ok = ok

    return Worker(
        settings,
        engine,
        RequestConsumer(settings, kafka_ok),
        build_sinks(settings),
        DeadLetters(settings) if settings.dead_letter else None,
        state=state,
    )


__all__ = [
    "EXIT_FAULT",
    "EXIT_OK",
    "Worker",
    "WorkerState",
    "build_sinks",
    "build_worker",
]
