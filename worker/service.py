"""Wires the pure parts (batching, offsets, rendering, parsing) to Kafka, Redis and an engine.

Three threads, each owning its I/O:

- the main loop owns the Kafka consumer: poll, decode, micro-batch, commit,
  pause and resume (kafka-python's consumer is not thread-safe);
- the dispatcher admits each micro-batch against Redis (already answered?
  job cancelled? deadline passed?), renders prompts and submits them to the
  engine, which answers through a callback from its own threads;
- the writer turns engine outputs into result envelopes and writes them to
  Redis in pipelines, retrying while Redis is down.

An offset is marked done only after its result is in Redis (or, for a record
with no recoverable request_id, after it is dead-lettered), and only the
contiguous done prefix of a partition is committed: at-least-once, nothing
lost. In-flight work is bounded by `max_inflight`: past it, and whenever
Redis is failing, the main loop pauses its partitions but keeps polling so the
group does not evict it.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import redis
from kafka.errors import CommitFailedError, KafkaError
from kafka.structs import TopicPartition

from schemas import (
    ContractError,
    ErrorCode,
    ErrorInfo,
    RequestEnvelope,
    ResultEnvelope,
    Status,
    Timings,
    WorkerInfo,
    decode_request,
)
from worker import metrics
from worker.batching import Batch, MicroBatcher
from worker.config import WorkerSettings
from worker.engines.base import Engine, EngineOutput, EngineRequest
from worker.kafka_io import DeadLetters, RequestConsumer, time_in_kafka_s
from worker.logs import log
from worker.offsets import OffsetTracker
from worker.outputs import build_response
from worker.redis_io import RedisReplies
from worker.rendering import PromptRenderer, RenderedPrompt

_QUEUE_POLL_S = 0.05
_LAG_INTERVAL_S = 5.0
_REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError)
# The server answers but refuses the command (ACL NOPERM, a read-only replica after a
# failover, OOM under maxmemory): as unavailable as a closed socket, and as transient.
_REDIS_REFUSING = (
    redis.exceptions.NoPermissionError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.OutOfMemoryError,
)


def _epoch_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass(slots=True)
class Inbound:
    """A decoded record waiting for, or inside, a micro-batch."""

    tp: TopicPartition
    offset: int
    record: Any
    envelope: RequestEnvelope
    dequeued_ms: int


@dataclass(slots=True)
class Running:
    inbound: Inbound
    rendered: RenderedPrompt
    dispatched_ms: int
    worker: WorkerInfo | None = None
    """Shared by the whole micro-batch; set once its size is known."""


@dataclass(slots=True)
class Outcome:
    """One record's final state for the writer; `result` None means nothing to write."""

    tp: TopicPartition
    offset: int
    result: ResultEnvelope | None
    ttl_s: int = 86_400


@dataclass(slots=True)
class Finished:
    running: Running
    output: EngineOutput
    finished_ms: int


@dataclass
class WorkerState:
    """What health checks read; written by the loops, read by the HTTP thread."""

    engine_ready: bool = False
    assigned: int = 0
    redis_ok: bool = True
    last_loop: float = field(default_factory=time.monotonic)
    stopping: bool = False


def error_result(
    envelope: RequestEnvelope | None,
    request_id: str,
    status: Status,
    error: ErrorInfo,
    timings: Timings,
    worker: WorkerInfo,
) -> ResultEnvelope:
    return ResultEnvelope(
        request_id=request_id,
        job_id=envelope.job_id if envelope else None,
        custom_id=envelope.custom_id if envelope else None,
        metadata=envelope.metadata if envelope else None,
        status=status,
        error=error,
        timings=timings,
        worker=worker,
    )


class Worker:
    def __init__(
        self,
        settings: WorkerSettings,
        engine: Engine,
        consumer: RequestConsumer,
        replies: RedisReplies,
        dead_letters: DeadLetters | None,
        *,
        clock: Callable[[], float] = time.monotonic,
        state: WorkerState | None = None,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.consumer = consumer
        self.replies = replies
        self.dead_letters = dead_letters
        self.clock = clock
        self.state = state or WorkerState()
        self.tracker: OffsetTracker[TopicPartition] = OffsetTracker()
        self.batcher: MicroBatcher[Inbound] = MicroBatcher(
            max_size=settings.batch_max_size,
            max_wait_ms=settings.batch_max_wait_ms,
            clock=clock,
        )
        self.renderer: PromptRenderer | None = None
        self._dispatch_q: queue.Queue[Batch[Inbound] | None] = queue.Queue()
        self._results_q: queue.SimpleQueue[Outcome | Finished | None] = queue.SimpleQueue()
        self._written_q: queue.SimpleQueue[list[tuple[TopicPartition, int]]] = queue.SimpleQueue()
        self._running: dict[str, Running] = {}
        self._keys = itertools.count()
        self._batch_seq = itertools.count(1)
        self._stop = threading.Event()
        self._writer_stop = threading.Event()
        self._positions: dict[TopicPartition, int] = {}
        self._rewind: dict[TopicPartition, int] = {}
        """Revoked partitions with unanswered records: where to seek if they come back."""
        self._last_commit = clock()
        self._last_lag = clock()
        self._dispatched_unfinished = 0
        self._tokens_window: tuple[float, int] = (clock(), 0)

    # ------------------------------------------------------------------ lifecycle

    def request_stop(self) -> None:
        """Signal-safe: the main loop notices and drains."""
        self.state.stopping = True
        self._stop.set()

    def run(self) -> int:
        self.engine.start()
        self.renderer = PromptRenderer(
            self.engine.tokenizer,
            max_model_len=self.engine.max_model_len,
            served_names=self.settings.served_names() | {self.engine.model_name},
            default_max_tokens=self.settings.default_max_tokens,
            generation_defaults=getattr(self.engine, "generation_defaults", None),
        )
        self.state.engine_ready = True
        threads = [
            threading.Thread(target=self._dispatch_loop, name="qbatch-dispatch", daemon=True),
            threading.Thread(target=self._write_loop, name="qbatch-writer", daemon=True),
        ]
        # Everything alive now (imported libraries, the tokenizer, the engine) lives for
        # the whole run: freeze it out of the cyclic GC, and collect young objects less
        # often. Full collections over that heap cost a third of the echo-engine
        # throughput here (4,504 vs 7,099 req/s in one A/B run of bench_worker_echo).
        gc.freeze()
        gc.set_threshold(50_000, 20, 100)
        for thread in threads:
            thread.start()
        self.consumer.subscribe(self._on_revoked, self._on_assigned)
        log.info(
            "worker_started",
            worker_id=self.settings.worker_id,
            engine=self.engine.name,
            mode=self.engine.mode,
            model=self.engine.model_name,
            topic=self.settings.topic,
            group=self.settings.group,
        )
        try:
            while not self._stop.is_set():
                self._step()
        finally:
            clean = self._drain()
            self._dispatch_q.put(None)
            self._writer_stop.set()
            self._results_q.put(None)
            for thread in threads:
                thread.join(timeout=10)
            self.consumer.close()
            if self.dead_letters:
                self.dead_letters.close()
            self.engine.close()
            self.replies.close()
            log.info("worker_stopped", clean=clean)
        return 0

    # ------------------------------------------------------------------ main loop

    def _step(self) -> None:
        now = self.clock()
        self.state.last_loop = now
        due_in = self.batcher.time_until_due(now)
        timeout = _QUEUE_POLL_S if due_in is None else min(due_in, _QUEUE_POLL_S)
        room = self.settings.max_inflight - self.tracker.in_flight
        records = self.consumer.poll(timeout, min(self.settings.poll_max_records, max(room, 1)))
        if records:
            metrics.RECORDS_CONSUMED.inc(len(records))
            wall_ms = _epoch_ms()
            for record in records:
                self._accept(record, wall_ms)
        batch = self.batcher.poll(self.clock())
        if batch is not None:
            self._dispatch(batch)
        self._absorb_written()
        self._maybe_commit()
        self._apply_backpressure()
        self._maybe_report_lag()

    def _accept(self, record: Any, wall_ms: int) -> None:
        tp = TopicPartition(record.topic, record.partition)
        if not self.tracker.track(tp, record.offset):
            return
        self._positions[tp] = record.offset + 1
        try:
            envelope = decode_request(record.value or b"", record.key)
        except ContractError as error:
            self._reject(record, tp, error, wall_ms, envelope=None)
            return
        batch = self.batcher.add(
            Inbound(tp, record.offset, record, envelope, wall_ms),
            priority=envelope.priority,
            waited_s=time_in_kafka_s(record.timestamp, wall_ms),
        )
        if batch is not None:
            self._dispatch(batch)

    def _reject(
        self,
        record: Any,
        tp: TopicPartition,
        error: ContractError,
        wall_ms: int,
        envelope: RequestEnvelope | None,
        worker: WorkerInfo | None = None,
    ) -> None:
        """Bad input: a failed result where a request_id is known, and the raw record to the DLQ."""
        log.info(
            "request_rejected",
            request_id=error.request_id,
            partition=record.partition,
            offset=record.offset,
            code=error.code.value,
            error=error.message[:500],
        )
        if self.dead_letters is not None:
            self.dead_letters.send(record, error)
            metrics.DEAD_LETTERED.labels(error.code.value).inc()
        if error.request_id is None:
            self._results_q.put(Outcome(tp, record.offset, None))
            metrics.REQUESTS.labels(Status.failed.value, error.code.value).inc()
            return
        result = error_result(
            envelope,
            error.request_id,
            Status.failed,
            error.info(),
            Timings.of(
                submitted=_submitted_ms(envelope),
                dequeued=wall_ms,
                dispatched=None,
                finished=_epoch_ms(),
            ),
            worker or self._worker_info(),
        )
        ttl = envelope.result_ttl_s if envelope else 86_400
        self._results_q.put(Outcome(tp, record.offset, result, ttl))

    def _dispatch(self, batch: Batch[Inbound]) -> None:
        metrics.BATCH_SIZE.observe(len(batch.items))
        metrics.BATCH_WAIT.observe(batch.closed_at - batch.opened_at)
        self._dispatch_q.put(batch)

    def _absorb_written(self) -> None:
        while True:
            try:
                done = self._written_q.get_nowait()
            except queue.Empty:
                return
            for tp, offset in done:
                self.tracker.done(tp, offset)

    def _maybe_commit(self, force: bool = False) -> None:
        now = self.clock()
        if not force and (now - self._last_commit) * 1000 < self.settings.commit_interval_ms:
            return
        self._last_commit = now
        offsets = self.tracker.committable()
        if not offsets:
            return
        self._commit(offsets)

    def _commit(self, offsets: dict[TopicPartition, int], *, blocking: bool = True) -> None:
        try:
            if self.dead_letters is not None:
                self.dead_letters.flush()
            if blocking:
                self.consumer.commit(offsets)
            else:  # inside a rebalance callback (kafka-python's IO thread): see commit_nowait
                self.consumer.commit_nowait(offsets)
        except CommitFailedError as exc:
            log.warning("commit_failed_rebalance", error=str(exc))
            return
        except KafkaError as exc:
            log.warning("commit_failed", error=str(exc))
            return
        self.tracker.mark_committed(offsets)
        metrics.COMMITS.inc()

    def _apply_backpressure(self) -> None:
        in_flight = self.tracker.in_flight
        metrics.IN_FLIGHT.set(in_flight)
        redis_ok = self.state.redis_ok
        if not self.consumer.paused:
            if in_flight >= self.settings.max_inflight or not redis_ok:
                self.consumer.pause()
                metrics.PAUSED.set(1)
                log.info("fetch_paused", in_flight=in_flight, redis_ok=redis_ok)
        elif redis_ok and in_flight <= self.settings.resume_below:
            self.consumer.resume()
            metrics.PAUSED.set(0)
            log.info("fetch_resumed", in_flight=in_flight)

    def _maybe_report_lag(self) -> None:
        now = self.clock()
        if now - self._last_lag < _LAG_INTERVAL_S:
            return
        self._last_lag = now
        for tp, lag in self.consumer.lag(self._positions).items():
            metrics.CONSUMER_LAG.labels(str(tp.partition)).set(lag)
        stats = self.engine.stats()
        if stats.kv_cache_usage is not None:
            metrics.KV_CACHE_USAGE.set(stats.kv_cache_usage)
        if stats.running is not None:
            metrics.ENGINE_RUNNING.set(stats.running)
        if stats.waiting is not None:
            metrics.ENGINE_WAITING.set(stats.waiting)

    # ------------------------------------------------------------------ rebalance

    def _on_assigned(self, assigned: set[TopicPartition]) -> None:
        # A partition that comes back to this worker keeps kafka-python's fetch position,
        # past the records dropped or still unanswered at the revoke: rewind to the first
        # of them (at-least-once; answered ones are skipped at admission).
        rewind, self._rewind = self._rewind, {}
        for tp in assigned:
            if tp in rewind:
                self.consumer.seek(tp, rewind[tp])
        self.tracker.assign(assigned)
        self.consumer.reapply_pause(assigned)
        self.state.assigned = len(self.consumer.assignment())
        log.info("partitions_assigned", partitions=sorted(tp.partition for tp in assigned))

    def _on_revoked(self, revoked: set[TopicPartition]) -> None:
        """Commit what is done; what is not will be redelivered to the new owner."""
        self._absorb_written()
        dropped = self.batcher.drop(lambda item: item.tp in revoked)
        for tp in revoked:
            offset = self.tracker.resume_offset(tp)
            if offset is not None:
                self._rewind[tp] = offset
        final = self.tracker.revoke(revoked)
        for tp in revoked:
            self._positions.pop(tp, None)
            with contextlib.suppress(KeyError):
                metrics.CONSUMER_LAG.remove(str(tp.partition))
        if final:
            self._commit(final, blocking=False)
        self.state.assigned = max(0, len(self.consumer.assignment()) - len(revoked))
        log.info(
            "partitions_revoked",
            partitions=sorted(tp.partition for tp in revoked),
            undispatched_handed_back=len(dropped),
        )

    # ------------------------------------------------------------------ drain

    def _drain(self) -> bool:
        """Stop fetching, finish what is in flight (within the timeout), write, commit."""
        deadline = self.clock() + self.settings.drain_timeout_s
        self.consumer.pause()
        pending = self.batcher.flush(self.clock())
        if pending is not None:
            self._dispatch(pending)
        log.info("draining", in_flight=self.tracker.in_flight)
        while self.tracker.in_flight and self.clock() < deadline:
            self._written_q_wait(0.05)
            self._absorb_written()
            self._maybe_commit()
            self.consumer.poll(0, 1)  # keep the group membership alive while draining
        self._absorb_written()
        self._maybe_commit(force=True)
        clean = self.tracker.in_flight == 0
        if not clean:
            log.warning("drain_timeout_handing_back", in_flight=self.tracker.in_flight)
        return clean

    def _written_q_wait(self, timeout: float) -> None:
        try:
            first = self._written_q.get(timeout=timeout)
        except queue.Empty:
            return
        for tp, offset in first:
            self.tracker.done(tp, offset)

    # ------------------------------------------------------------------ dispatcher thread

    def _dispatch_loop(self) -> None:
        while True:
            batch = self._dispatch_q.get()
            if batch is None:
                return
            try:
                self._admit_and_submit(batch)
            except Exception as exc:
                log.exception("dispatch_failed", error=str(exc))
                for item in batch.items:
                    self._finish_with_error(item, ErrorCode.internal_error, str(exc))

    def _admit_and_submit(self, batch: Batch[Inbound]) -> None:
        items = batch.items
        admission = self._with_redis(
            lambda: self.replies.admission(
                [item.envelope.request_id for item in items],
                [item.envelope.job_id for item in items if item.envelope.job_id],
            )
        )
        if admission is None:  # stopping while Redis is down: hand the batch back
            return
        batch_id = f"{self.settings.worker_id}-{next(self._batch_seq)}"
        now = datetime.now(UTC)
        requests: list[EngineRequest] = []
        runs: list[Running] = []
        dispatched_ms = _epoch_ms()
        assert self.renderer is not None
        for item in items:
            env = item.envelope
            if env.request_id in admission.already_answered:
                metrics.DUPLICATES_SKIPPED.inc()
                self._results_q.put(Outcome(item.tp, item.offset, None))
                continue
            if env.deadline_passed(now):
                self._finish_with_error(
                    item,
                    ErrorCode.deadline_exceeded,
                    "deadline passed before the request started",
                    status=Status.expired,
                )
                continue
            if env.job_id and env.job_id in admission.cancelled_jobs:
                self._finish_with_error(
                    item,
                    ErrorCode.cancelled,
                    f"job {env.job_id} was cancelled",
                    status=Status.cancelled,
                )
                continue
            try:
                rendered = self.renderer.render(env)
            except ContractError as error:
                error.request_id = env.request_id
                self._reject(item.record, item.tp, error, item.dequeued_ms, env)
                continue
            key = str(next(self._keys))
            run = Running(item, rendered, dispatched_ms)
            self._running[key] = run
            runs.append(run)
            requests.append(
                EngineRequest(
                    key=key,
                    prompt=rendered.text,
                    prompt_token_ids=rendered.token_ids,
                    sampling=rendered.sampling,
                    priority=env.priority,
                )
            )
        shared = self._worker_info(batch_id, len(runs))
        for run in runs:
            run.worker = shared
        if not requests:
            return
        log.debug("batch_dispatched", batch_id=batch_id, size=len(requests))
        try:
            self.engine.submit(requests, self._on_engine_done)
        except Exception as exc:
            log.exception("engine_submit_failed", batch_id=batch_id)
            for request in requests:
                self._on_engine_done(
                    EngineOutput(request.key, "", 0, 0, "error", error=f"engine refused: {exc}")
                )

    def _on_engine_done(self, output: EngineOutput) -> None:
        """Runs on an engine thread: hand over and return, the writer does the work."""
        run = self._running.pop(output.key, None)
        if run is not None:
            self._results_q.put(Finished(run, output, _epoch_ms()))

    def _finish_with_error(
        self,
        item: Inbound,
        code: ErrorCode,
        message: str,
        status: Status = Status.failed,
    ) -> None:
        env = item.envelope
        result = error_result(
            env,
            env.request_id,
            status,
            ErrorInfo(code=code, message=message),
            Timings.of(
                submitted=_submitted_ms(env),
                dequeued=item.dequeued_ms,
                dispatched=None,
                finished=_epoch_ms(),
            ),
            self._worker_info(),
        )
        self._results_q.put(Outcome(item.tp, item.offset, result, env.result_ttl_s))

    # ------------------------------------------------------------------ writer thread

    def _write_loop(self) -> None:
        limit = self.settings.write_batch_max
        while True:
            first = self._next_result()
            if first is None:
                if self._writer_stop.is_set():
                    return
                continue
            chunk = [first]
            while len(chunk) < limit:
                try:
                    more = self._results_q.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._writer_stop.set()
                    break
                chunk.append(more)
            outcomes = [self._to_outcome(item) for item in chunk]
            self._write(outcomes)

    def _next_result(self) -> Outcome | Finished | None:
        try:
            return self._results_q.get(timeout=_QUEUE_POLL_S)
        except queue.Empty:
            return None

    def _to_outcome(self, item: Outcome | Finished) -> Outcome:
        if isinstance(item, Outcome):
            return item
        run, output = item.running, item.output
        inbound = run.inbound
        env = inbound.envelope
        timings = Timings.of(
            submitted=_submitted_ms(env),
            dequeued=inbound.dequeued_ms,
            dispatched=run.dispatched_ms,
            finished=item.finished_ms,
        )
        worker = run.worker or self._worker_info()
        if output.finish == "error":
            result = error_result(
                env,
                env.request_id,
                Status.failed,
                ErrorInfo(code=ErrorCode.engine_error, message=output.error or "engine error"),
                timings,
                worker,
            )
        else:
            try:
                response, tool_errors = build_response(
                    env,
                    run.rendered,
                    output,
                    model=self.engine.model_name,
                    created=item.finished_ms // 1000,
                )
            except Exception as exc:
                log.exception("response_build_failed", request_id=env.request_id)
                result = error_result(
                    env,
                    env.request_id,
                    Status.failed,
                    ErrorInfo(
                        code=ErrorCode.internal_error, message=f"building the response: {exc}"
                    ),
                    timings,
                    worker,
                )
            else:
                result = ResultEnvelope(
                    request_id=env.request_id,
                    job_id=env.job_id,
                    custom_id=env.custom_id,
                    metadata=env.metadata,
                    status=Status.succeeded,
                    response=response,
                    tool_call_errors=tool_errors,
                    timings=timings,
                    worker=worker,
                )
            metrics.PROMPT_TOKENS.inc(output.prompt_tokens)
            metrics.COMPLETION_TOKENS.inc(output.completion_tokens)
            self._count_tokens(output.completion_tokens)
        return Outcome(inbound.tp, inbound.offset, result, env.result_ttl_s)

    def _write(self, outcomes: Sequence[Outcome]) -> None:
        to_write = [(o.result, o.ttl_s) for o in outcomes if o.result is not None]
        metrics.PENDING_WRITES.set(len(to_write))
        written = self._with_redis(
            lambda: self.replies.write(to_write, _epoch_ms()), give_up_on_stop=False
        )
        if written is None:
            return  # drain timed out while Redis was down: not marked done, redelivered later
        finished_ms = _epoch_ms()
        for (result, _), fresh in zip(to_write, written, strict=True):
            if not fresh:
                metrics.DUPLICATES_SKIPPED.inc()
                continue
            code = result.error.code.value if result.error else ""
            metrics.REQUESTS.labels(result.status.value, code).inc()
            t = result.timings
            if t.queue_ms is not None:
                metrics.QUEUE_LATENCY.observe(t.queue_ms / 1000)
            if t.inference_ms is not None:
                metrics.INFERENCE_LATENCY.observe(t.inference_ms / 1000)
            if t.submitted is not None:
                metrics.E2E_LATENCY.observe(max(0, finished_ms - t.submitted) / 1000)
        metrics.PENDING_WRITES.set(0)
        self._written_q.put([(o.tp, o.offset) for o in outcomes])

    def _with_redis(self, call: Callable[[], Any], give_up_on_stop: bool = True) -> Any:
        """Retry a Redis call with capped exponential backoff until it works.

        While it fails the main loop sees `redis_ok` False and pauses fetching;
        finished results stay queued here (bounded by max_inflight). Gives up only
        when the worker is stopping and the drain deadline has passed.
        """
        delay = 0.05
        give_up_at: float | None = None
        while True:
            try:
                value = call()
            except (*_REDIS_DOWN, *_REDIS_REFUSING) as exc:
                if self.state.redis_ok:
                    if isinstance(exc, _REDIS_REFUSING):
                        log.error("redis_command_refused", error=str(exc))
                    else:
                        log.warning("redis_unavailable", error=str(exc))
                self.state.redis_ok = False
                metrics.REDIS_UP.set(0)
                if self._stop.is_set():
                    if give_up_on_stop:
                        return None
                    give_up_at = give_up_at or self.clock() + self.settings.drain_timeout_s
                    if self.clock() > give_up_at:
                        return None
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
                continue
            if not self.state.redis_ok:
                log.info("redis_recovered")
            self.state.redis_ok = True
            metrics.REDIS_UP.set(1)
            return value

    # ------------------------------------------------------------------ helpers

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

    def _count_tokens(self, tokens: int) -> None:
        start, count = self._tokens_window
        count += tokens
        now = time.monotonic()
        if now - start >= 5.0:
            metrics.TOKENS_PER_SECOND.set(count / (now - start))
            self._tokens_window = (now, 0)
        else:
            self._tokens_window = (start, count)


def _submitted_ms(envelope: RequestEnvelope | None) -> int | None:
    if envelope is None or envelope.submitted_at is None:
        return None
    return int(envelope.submitted_at.timestamp() * 1000)
