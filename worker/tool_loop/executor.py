"""The tool executor (`qbatch tools serve`): runs tool loops' calls and continues them.

A consumer group on the tool-calls topic, scaled by adding processes (a loop's turns are
keyed by request_id, so one partition keeps them in order). For each poll:

1. decode each record as a `ToolTurnEvent` (anything else goes to the dead-letter topic);
2. look up every call's record in Redis (`{prefix}:toolcall:{request_id}:{turn}:{fp}`):
   a redelivered turn reuses what was recorded instead of running the tool again;
3. run the rest concurrently (`worker.tool_loop.runner`), and record each outcome with
   SET NX before anything is published: when two executors race on one turn, the
   first record wins and both continue with it;
4. publish each continuation (or an aborted one) to the requests topic, flush, and only
   then commit the poll's offsets.

So a crash anywhere re-runs at most the calls whose outcome was not recorded yet: a tool
whose side effect happened just before the crash runs again (HTTP tools carry an
idempotency key for that case). A continuation may be published twice (after a crash
between the flush and the commit); its final result is written once (SET NX), so the
caller sees one answer.

The Kafka side is the worker's: `RequestConsumer` (its stall watchdog, pauses, commits of
explicit offsets) and `DeadLetters` (a letter always fits, never blocks the loop, and
holds only its own partition's commit until delivered). A poll's calls run on a thread of
their own while the main thread keeps polling with every partition paused, so a tool
slower than kafka-python's `max.poll.interval.ms` costs no rebalance.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Literal, TypeVar

import redis
from kafka import KafkaProducer
from kafka.errors import CommitFailedError, IllegalStateError, RebalanceInProgressError
from kafka.structs import TopicPartition
from pydantic import Field, ValidationError
from tenacity import Retrying, retry_if_exception_type, stop_when_event_set, wait_exponential

from schemas import ConnectionSettings, ContractError, RequestEnvelope
from schemas.decode import encode_request
from schemas.kafka_compat import cap_record_headers, repair_idempotent_reset
from schemas.limits import MAX_ENVELOPE_BYTES
from schemas.loop_auth import load_signer
from schemas.redis_conn import connect
from schemas.tool_events import ToolTurnEvent
from schemas.tool_loop import CallRecord
from worker import failpoints, metrics
from worker.dead_letters import DeadLetterConfig, DeadLetters
from worker.health import ServiceState as ExecutorState
from worker.kafka_io import ConsumerConfig, RequestConsumer
from worker.logs import log
from worker.records import SourceRecord
from worker.supervision import StrikeBook, StrikeStore, Suspect, Verdict
from worker.tool_loop.answers import (
    abort_reason,
    continuation_topic,
    malformed_answer,
    next_envelope,
)
from worker.tool_loop.continuation import aborted, pending_calls
from worker.tool_loop.ledger import CallLedger
from worker.tool_loop.registry import ToolRegistry
from worker.tool_loop.runner import PendingCall, run_calls

cap_record_headers()  # a record's headers cost memory without bound (kafka_compat, 5)

T = TypeVar("T")
UNKNOWN_TOOL_LABEL = "(unknown)"
QUARANTINED = (
    "the tool executor stopped on an internal fault twice while handling this event; it "
    "is not handled again"
)


class ExecutorSettings(ConnectionSettings):
    """`qbatch tools serve` settings (flags, or `QBATCH_*` variables)."""

    tools_group: str = Field("qbatch-tools", description="The executors' consumer group.")
    tools_max_batch: int = Field(256, ge=1, le=10_000, description="Turn events per poll.")
    tools_session_timeout_ms: int = Field(45_000, ge=1_000)
    tools_max_poll_interval_ms: int = Field(
        300_000,
        ge=1_000,
        description="kafka-python's max.poll.interval.ms. Calls may run longer: while they "
        "run the executor keeps polling with its partitions paused, so it stays in the group.",
    )
    tools_busy_poll_s: float = Field(
        0.5,
        gt=0,
        description="A poll's calls still running after this long: pause the partitions "
        "and poll while waiting for them.",
    )
    tools_metrics_host: str = "0.0.0.0"
    tools_metrics_port: int = Field(9101, ge=0, le=65_535, description="0 disables /metrics.")
    executor_id: str = Field(default_factory=lambda: f"tools-{time.time_ns() % 10**9}")
    log_level: str = "info"
    log_format: Literal["json", "console"] = "json"


class ToolExecutor:
    def __init__(
        self,
        settings: ExecutorSettings,
        registry: ToolRegistry,
        *,
        state: ExecutorState | None = None,
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.state = state or ExecutorState()
        self._stop = threading.Event()
        kafka = settings.kafka_kwargs()
        self._redis = connect(
            settings.redis_url,
            socket_timeout=5,
            socket_connect_timeout=5,
            **settings.redis_kwargs(),
        )
        self.ledger = CallLedger(self._redis, settings)
        self.signer = load_signer(settings.loop_key, self._redis, settings.keys.loop_key())
        """Signs every continuation's loop: workers run no other (`schemas.loop_auth`)."""
        self._strike_store = StrikeStore(self._redis, settings.keys.strikes(settings.tools_group))
        self.strikes = self._strike_store.load()
        self.current: list[SourceRecord] = []
        """The records being handled (what a fault is blamed on)."""
        self._consumer = RequestConsumer(
            ConsumerConfig(
                topics=[settings.tool_calls_topic],
                group=settings.tools_group,
                client_id=f"qbatch-{settings.executor_id}",
                kafka_bootstrap=settings.kafka_bootstrap,
                kafka=kafka,
                session_timeout_ms=settings.tools_session_timeout_ms,
                max_poll_interval_ms=settings.tools_max_poll_interval_ms,
                max_poll_records=settings.tools_max_batch,
            )
        )
        self._dead = DeadLetters(
            DeadLetterConfig(
                topic=settings.dlq_topic,
                client_id=f"qbatch-dlq-{settings.executor_id}",
                kafka=kafka,
            )
        )
        self._calls = ThreadPoolExecutor(1, thread_name_prefix="qbatch-tool-calls")
        """Where a poll's calls run while the main thread keeps polling (`_while_polling`)."""
        self._done: dict[TopicPartition, int] = {}
        """Per partition, the next offset to commit: every record before it is handled."""
        self._committed: dict[TopicPartition, int] = {}
        self._producer = repair_idempotent_reset(
            KafkaProducer(
                acks="all",
                enable_idempotence=True,
                linger_ms=2,
                max_request_size=MAX_ENVELOPE_BYTES + 65_536,
                max_block_ms=10_000,
                client_id=f"qbatch-{settings.executor_id}",
                **kafka,
            )
        )

    def request_stop(self) -> None:
        self.state.stopping = True
        self._stop.set()

    # ------------------------------------------------------------------ loop

    def run(self) -> int:
        self._consumer.subscribe(
            self._on_revoked, self._on_assigned, self._stop.is_set, on_lost=self._forget
        )
        self.state.engine_ready = True
        log.info(
            "executor_started",
            executor_id=self.settings.executor_id,
            topic=self.settings.tool_calls_topic,
            group=self.settings.tools_group,
            continuations_to=(
                "routes by model" if self.settings.routes is not None else self.settings.topic
            ),
            tools=self.registry.names,
        )
        try:
            while not self._stop.is_set():
                self.state.last_loop = time.monotonic()
                self.step()
            self._dead.settle(10)
            self._commit_done()
        except Exception as exc:
            self.state.fault = f"{type(exc).__name__}: {exc}"
            blamed = self.strikes.add(self.suspects())
            log.exception("executor_failed", blamed=[StrikeBook.field_of(s) for s in blamed[:20]])
            self._strike_store.record(blamed)
            return 70
        finally:
            self._calls.shutdown(wait=False, cancel_futures=True)
            for closer in (self._consumer.close, self._dead.close, self._producer.close):
                try:
                    closer()
                except Exception as exc:
                    log.warning("close_failed", error=str(exc))
            self._redis.close()
            log.info("executor_stopped", fault=self.state.fault)
        return 0

    def step(self) -> int:
        """One poll: its events' calls run, their continuations published, then committed.

        No event stops the executor twice (the worker's strike rule, `worker.supervision`):
        a fault blames the events in hand (a strike each, in Redis); an event with one
        strike is handled alone, so a second fault blames it and nothing else; an event
        with two is not handled again but dead-lettered, its request answered
        `tool_loop_aborted` when its envelope can be read."""
        records = self._consumer.poll(0.2, self.settings.tools_max_batch)
        self.state.assigned = len(self._consumer.assignment())
        if not records:
            self._commit_done()  # offsets a dead letter held, now delivered
            return 0
        sources = [SourceRecord.of(r, MAX_ENVELOPE_BYTES) for r in records]
        verdicts = [self.strikes.verdict(source) for source in sources]
        together = [r for r, v in zip(sources, verdicts, strict=True) if v is Verdict.run]
        alone = [r for r, v in zip(sources, verdicts, strict=True) if v is Verdict.isolate]
        futures: list[Any] = []
        handled = 0
        for group in ([together] if together else []) + [[r] for r in alone]:
            self.current = group
            events, answers = self._decode_all(group)
            failpoints.hit("executor", [event.request_id for event in events])
            continuations = (*self._while_polling(functools.partial(self.handle, events)), *answers)
            futures += [self._send(self.signer.sign(env)) for env in continuations]
            handled += len(events)
        self.current = []
        for source, verdict in zip(sources, verdicts, strict=True):
            if verdict is Verdict.quarantine:
                answer = self._dead_letter(source, QUARANTINED)
                if answer is not None:
                    futures.append(self._send(self.signer.sign(answer)))
        self._producer.flush(timeout=30)
        for future in futures:
            future.get(timeout=0)  # raises the send's error: nothing is committed then
        assigned = self._consumer.assignment()
        for source in sources:
            tp = TopicPartition(source.topic, source.partition)
            if tp in assigned:  # a partition revoked meanwhile is its new owner's
                self._done[tp] = max(self._done.get(tp, 0), source.offset + 1)
        self._commit_done()
        return handled

    def _while_polling(self, work: Callable[[], T]) -> T:
        """`work()` on the calls thread while this thread keeps polling, every partition
        paused: a tool may run for minutes (HTTP tools up to 600 s), past kafka-python's
        max.poll.interval.ms, and a consumer that stops polling that long leaves the group,
        its commit fails and its events run again elsewhere."""
        future: Future[T] = self._calls.submit(work)
        try:
            return future.result(timeout=self.settings.tools_busy_poll_s)
        except FutureTimeout:
            pass
        self._consumer.pause()
        try:
            while True:
                stray = self._consumer.poll(0.2, 1)
                if stray:  # a partition assigned unpaused mid-rebalance: read it again later
                    first: dict[TopicPartition, int] = {}
                    for record in stray:
                        tp = TopicPartition(record.topic, record.partition)
                        first[tp] = min(first.get(tp, record.offset), record.offset)
                    for tp, offset in first.items():
                        self._consumer.seek(tp, offset)
                    self._consumer.pause()
                self.state.last_loop = time.monotonic()
                try:
                    return future.result(timeout=0)
                except FutureTimeout:
                    continue
        finally:
            self._consumer.resume()

    def _commit_done(self) -> None:
        """Commit what is handled, never past a dead letter not yet delivered (its record
        is read again after a crash, and dead-lettered again)."""
        holds = self._dead.holds()
        assigned = self._consumer.assignment()
        want = {
            tp: min(offset, holds.get(tp, offset))
            for tp, offset in self._done.items()
            if tp in assigned
        }
        fresh = {tp: off for tp, off in want.items() if self._committed.get(tp) != off}
        if not fresh:
            return
        try:
            self._consumer.commit(fresh)
        except (CommitFailedError, RebalanceInProgressError, IllegalStateError) as exc:
            # The group moved on (a rebalance): those records are redelivered to their new
            # owner, which finds each call's record in the ledger and runs nothing again.
            log.warning("commit_lost_to_rebalance", error=f"{type(exc).__name__}: {exc}")
            return
        self._committed.update(fresh)

    def _on_revoked(self, revoked: set[TopicPartition]) -> None:
        done = {tp: off for tp, off in self._done.items() if tp in revoked}
        done = {tp: off for tp, off in done.items() if self._committed.get(tp) != off}
        holds = self._dead.holds()
        self._consumer.commit_nowait({tp: min(off, holds.get(tp, off)) for tp, off in done.items()})
        self._forget(revoked)

    def _forget(self, partitions: set[TopicPartition]) -> None:
        """Partitions no longer ours (revoked, or lost with an expired session: those cannot
        be committed, their records are their new owner's)."""
        self._dead.release(set(partitions))
        for tp in partitions:
            self._done.pop(tp, None)
            self._committed.pop(tp, None)

    def _on_assigned(self, assigned: set[TopicPartition]) -> None:
        self._consumer.reapply_pause(assigned)

    def _decode_all(
        self, records: list[SourceRecord]
    ) -> tuple[list[ToolTurnEvent], list[RequestEnvelope]]:
        events: list[ToolTurnEvent] = []
        answers: list[RequestEnvelope] = []
        now_ms = time.time_ns() // 1_000_000
        for record in records:
            decoded = self._decode(record)
            if isinstance(decoded, ToolTurnEvent):
                events.append(decoded)
                metrics.TOOL_TURN_LATENCY.observe(max(0, now_ms - decoded.emitted_ms) / 1000)
            elif decoded is not None:
                answers.append(decoded)
        return events, answers

    def _send(self, env: RequestEnvelope) -> Any:
        return self._producer.send(
            continuation_topic(self.settings, env),
            key=env.request_id.encode(),
            value=encode_request(env),
        )

    def suspects(self) -> list[Suspect]:
        return [source.suspect() for source in self.current]

    def handle(self, events: list[ToolTurnEvent]) -> list[RequestEnvelope]:
        """The continuations of a poll's turn events (Redis I/O, then the tools). A turn
        of a cancelled job runs no tool: its envelope goes back aborted, and the worker
        answers it `cancelled` at admission."""
        jobs = sorted({e.envelope.job_id for e in events if e.envelope.job_id})
        stopped = self._retry_redis(lambda: self.ledger.cancelled_jobs(jobs)) if jobs else set()
        calls = [
            (event, call, self.ledger.key(call))
            for event in events
            if event.envelope.job_id not in stopped
            for call in pending_calls(event)
        ]
        known = self._retry_redis(lambda: self.ledger.lookup([key for _, _, key in calls]))
        fresh: list[tuple[ToolTurnEvent, PendingCall, str]] = []
        twins: set[str] = set()  # a turn delivered twice in one poll: its calls run once
        for event, call, key in calls:
            if key in known:
                continue
            if key in twins:
                continue
            twins.add(key)
            fresh.append((event, call, key))
        ran = run_calls(self.registry, [call for _, call, _ in fresh])
        for (_, call, _), rec in zip(fresh, ran, strict=True):
            name = self._label(call.name)
            metrics.TOOL_CALLS.labels(name, rec.error.value if rec.error else "ok").inc()
            metrics.TOOL_CALL_SECONDS.labels(name).observe(rec.duration_ms / 1000)
        items = [
            (key, rec, event.envelope.result_ttl_s)
            for (event, _, key), rec in zip(fresh, ran, strict=True)
        ]
        outcome = self._retry_redis(lambda: self.ledger.record(items))
        for key, rec in known.items():
            outcome[key] = rec.model_copy(update={"reused": True})
            metrics.TOOL_CALLS.labels(self._label(rec.name), "reused").inc()
        first = {key: event for event, _, key in fresh}
        out: list[RequestEnvelope] = []
        for event in events:
            if event.envelope.job_id in stopped:
                metrics.TOOL_CONTINUATIONS.labels("aborted").inc()
                out.append(aborted(event, [], f"job {event.envelope.job_id} was cancelled"))
                continue
            mine = [
                outcome[key]
                if first.get(key) is event or key in known
                else outcome[key].model_copy(update={"reused": True})
                for e, _, key in calls
                if e is event
            ]
            out.append(self._continue(event, mine))
        return out

    def _label(self, name: str) -> str:
        """A metric label: the tool's name when the registry has it, else one shared label
        (each name a model made up once added series of its own, without bound)."""
        return name if name in self.registry.names else UNKNOWN_TOOL_LABEL

    def _continue(self, event: ToolTurnEvent, records: list[CallRecord]) -> RequestEnvelope:
        env, failure = next_envelope(event, records)
        if failure is None:
            metrics.TOOL_CONTINUATIONS.labels("continued").inc()
            return env
        log.warning(
            "continuation_aborted",
            request_id=event.request_id,
            turn=event.turn,
            reason=abort_reason(failure)[:500],
            error=f"{type(failure).__name__}: {failure}"[:500],
        )
        metrics.TOOL_CONTINUATIONS.labels("aborted").inc()
        return env

    def _decode(self, record: SourceRecord) -> ToolTurnEvent | RequestEnvelope | None:
        """The event; for a malformed one whose envelope is still readable, an aborted
        continuation (so its request is answered); else None. Bad records are
        dead-lettered either way."""
        try:
            return ToolTurnEvent.model_validate_json(record.value or b"")
        except ValidationError as exc:
            reason = f"not a tool-turn event: {exc.errors(include_url=False)[:1]}"
        metrics.TOOL_EVENTS_BAD.inc()
        return self._dead_letter(record, reason)

    def _dead_letter(self, record: SourceRecord, reason: str) -> RequestEnvelope | None:
        """The record to the DLQ with `reason` (`worker.dead_letters`: it always fits, and
        holds only its own partition's commit until delivered); the aborted continuation
        that answers its request when its envelope can be read."""
        answer = malformed_answer(record.value, reason)
        log.warning(
            "tool_event_bad",
            partition=record.partition,
            offset=record.offset,
            reason=reason[:500],
        )
        self._dead.send(
            record,
            ContractError(reason, request_id=answer.request_id if answer is not None else None),
        )
        return answer

    def _retry_redis(self, fn: Callable[[], T]) -> T:
        """Wait Redis out (the poll's events are held meanwhile; nothing is committed).
        Only the ledger's calls are retried, never the tools: a record that failed to
        be written is written again, not run again."""
        for attempt in Retrying(
            retry=retry_if_exception_type((redis.ConnectionError, redis.TimeoutError)),
            wait=wait_exponential(multiplier=0.05, max=2),
            stop=stop_when_event_set(self._stop),
            before_sleep=lambda rs: self._redis_down(
                rs.outcome.exception() if rs.outcome else None
            ),
            reraise=True,
        ):
            with attempt:
                value = fn()
        self.state.redis_ok = True
        return value

    def _redis_down(self, error: BaseException | None) -> None:
        if self.state.redis_ok:
            log.warning("redis_unavailable", error=str(error))
        self.state.redis_ok = False
        self.state.last_loop = time.monotonic()


__all__ = ["ExecutorSettings", "ExecutorState", "ToolExecutor"]
