"""The tool executor (`qbatch tools serve`): runs tool loops' calls and continues them.

A consumer group on the tool-calls topic, scaled by adding processes (a loop's turns are
keyed by request_id, so one partition keeps them in order). For each poll:

1. decode each record as a `ToolTurnEvent` (anything else goes to the dead-letter topic);
2. look up every call's record in Redis (`{prefix}:toolcall:{request_id}:{turn}:{fp}`):
   a redelivered turn reuses what was recorded instead of running the tool again;
3. run the rest concurrently (`producer.tools.runner`), and record each outcome with
   SET NX before anything is published: when two executors race on one turn, the
   first record wins and both continue with it;
4. publish each continuation (or an aborted one) to the requests topic, flush, and only
   then commit the poll's offsets.

So a crash anywhere re-runs at most the calls whose outcome was not recorded yet: a tool
whose side effect happened just before the crash runs again (HTTP tools carry an
idempotency key for that case). A continuation may be published twice (after a crash
between the flush and the commit); its final result is written once (SET NX), so the
caller sees one answer.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any, Literal, TypeVar

import redis
from kafka import KafkaConsumer, KafkaProducer
from kafka.errors import KafkaError
from pydantic import Field, ValidationError
from tenacity import Retrying, retry_if_exception_type, stop_when_event_set, wait_exponential

from producer.tools.continuation import (
    ContinuationError,
    aborted,
    continuation,
    fingerprint,
    pending_calls,
)
from producer.tools.registry import ToolRegistry
from producer.tools.runner import PendingCall, run_calls
from schemas import ConnectionSettings, ContractError, ErrorCode, ErrorInfo, RequestEnvelope, dlq
from schemas.decode import encode_request
from schemas.kafka_compat import cap_record_headers, repair_idempotent_reset
from schemas.limits import MAX_ENVELOPE_BYTES
from schemas.loop_auth import load_signer
from schemas.redis_conn import connect, mget
from schemas.tool_events import ToolTurnEvent
from schemas.tool_loop import CallRecord, LoopState
from worker import failpoints, metrics
from worker.health import ServiceState as ExecutorState
from worker.logs import log
from worker.records import SourceRecord
from worker.supervision import StrikeBook, StrikeStore, Suspect, Verdict

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
    tools_metrics_host: str = "0.0.0.0"
    tools_metrics_port: int = Field(9101, ge=0, le=65_535, description="0 disables /metrics.")
    executor_id: str = Field(default_factory=lambda: f"tools-{time.time_ns() % 10**9}")
    log_level: str = "info"
    log_format: Literal["json", "console"] = "json"


class CallLedger:
    """The executor's memory of calls, in Redis: one SET NX string per call."""

    def __init__(self, client: redis.Redis, settings: ConnectionSettings) -> None:
        self._client = client
        self._keys = settings.keys

    def key(self, call: PendingCall) -> str:
        return self._keys.tool_call(call.request_id, call.turn, fingerprint(call))

    def lookup(self, keys: list[str]) -> dict[str, CallRecord]:
        if not keys:
            return {}
        values: list[Any] = mget(self._client, keys)
        found: dict[str, CallRecord] = {}
        for key, value in zip(keys, values, strict=True):
            if value is None:
                continue
            try:
                found[key] = CallRecord.model_validate_json(value)
            except ValidationError:
                log.warning("tool_record_unreadable", key=key)  # run it again
        return found

    def record(self, items: list[tuple[str, CallRecord, int]]) -> dict[str, CallRecord]:
        """SET NX each (key, record, ttl_s); where another executor was first, its record."""
        if not items:
            return {}
        pipe = self._client.pipeline(transaction=False)
        for key, record, ttl in items:
            pipe.set(key, record.model_dump_json(exclude_none=True), nx=True, ex=ttl)
        created = pipe.execute()
        lost = [key for (key, _, _), ok in zip(items, created, strict=True) if not ok]
        winners = self.lookup(lost)
        out = {key: record for key, record, _ in items}
        for key in lost:
            if key in winners:
                out[key] = winners[key].model_copy(update={"reused": True})
        return out


def malformed_answer(value: bytes | None, reason: str) -> RequestEnvelope | None:
    """A malformed event whose envelope still validates: that envelope, aborted, so the
    worker answers its request `tool_loop_aborted` instead of leaving it unanswered."""
    try:
        data = json.loads(value or b"")
        env = RequestEnvelope.model_validate(data["envelope"])
    except (ValueError, KeyError, TypeError):
        return None
    if env.tool_loop is None:
        return None
    turn = min(max(2, (env.loop.turn + 1) if env.loop else 2), env.tool_loop.max_turns)
    loop = LoopState(
        turn=max(turn, 2),
        transcript=env.loop.transcript if env.loop else [],
        lane=env.loop.lane if env.loop else None,
        abort=ErrorInfo(
            code=ErrorCode.tool_loop_aborted,
            message=f"the tool executor got a malformed turn event ({reason[:300]})",
        ),
    )
    return env.model_copy(update={"loop": loop})


def abort_reason(exc: Exception) -> str:
    return (
        str(exc)
        if isinstance(exc, ContinuationError)
        else f"the executor could not build it ({type(exc).__name__})"
    )


def next_envelope(
    event: ToolTurnEvent, records: list[CallRecord]
) -> tuple[RequestEnvelope, Exception | None]:
    """The continuation of `event` once its calls ran (`records`), and None; or, when it
    cannot be built (ContinuationError, or anything else one event can cause), the aborted
    envelope that still answers the request, and why. Never raises for one event: a
    forged 16-turn transcript once stopped every executor here."""
    try:
        return continuation(event, records), None
    except Exception as exc:
        env = aborted(event, records, abort_reason(exc))
        if len(encode_request(env)) > MAX_ENVELOPE_BYTES:
            assert env.loop is not None
            env = env.model_copy(update={"loop": env.loop.model_copy(update={"transcript": []})})
        return env, exc


def continuation_topic(settings: ConnectionSettings, env: RequestEnvelope) -> str:
    """Where a loop's next turn goes: the requests topic of the pool serving its model
    (the route table's interactive `topic`: the turn keeps its first turn's engine
    priority through `loop.lane`), else the interactive topic. A model the table does not
    know goes there too, and the worker answers it `unknown_model`: visible, not lost."""
    if settings.routes is None:
        return settings.topic
    try:
        return settings.routes.route(env.body.model).topic
    except ContractError:
        return settings.topic


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
        self.current: list[Any] = []
        """The records being handled (what a fault is blamed on)."""
        self._consumer = KafkaConsumer(
            group_id=settings.tools_group,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            max_poll_records=settings.tools_max_batch,
            client_id=f"qbatch-{settings.executor_id}",
            **kafka,
        )
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
        self._consumer.subscribe([self.settings.tool_calls_topic])
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
        except Exception as exc:
            self.state.fault = f"{type(exc).__name__}: {exc}"
            blamed = self.strikes.add(self.suspects())
            log.exception("executor_failed", blamed=[StrikeBook.field_of(s) for s in blamed[:20]])
            self._strike_store.record(blamed)
            return 70
        finally:
            for closer in (self._consumer.close, self._producer.close, self._redis.close):
                try:
                    closer()
                except Exception as exc:
                    log.warning("close_failed", error=str(exc))
            log.info("executor_stopped", fault=self.state.fault)
        return 0

    def step(self) -> int:
        """One poll: its events' calls run, their continuations published, then committed.

        No event stops the executor twice (the worker's strike rule, `worker.supervision`):
        a fault blames the events in hand (a strike each, in Redis); an event with one
        strike is handled alone, so a second fault blames it and nothing else; an event
        with two is not handled again but dead-lettered, its request answered
        `tool_loop_aborted` when its envelope can be read."""
        polled = self._consumer.poll(timeout_ms=200, max_records=self.settings.tools_max_batch)
        self.state.assigned = len(self._consumer.assignment())
        records = [r for batch in polled.values() for r in batch]
        if not records:
            return 0
        sources = [SourceRecord.of(r, MAX_ENVELOPE_BYTES) for r in records]
        verdicts = [self.strikes.verdict(source) for source in sources]
        together = [r for r, v in zip(records, verdicts, strict=True) if v is Verdict.run]
        alone = [r for r, v in zip(records, verdicts, strict=True) if v is Verdict.isolate]
        futures: list[Any] = []
        handled = 0
        for group in ([together] if together else []) + [[r] for r in alone]:
            self.current = group
            events, answers = self._decode_all(group)
            failpoints.hit("executor", [event.request_id for event in events])
            continuations = (*self.handle(events), *answers)
            futures += [self._send(self.signer.sign(env)) for env in continuations]
            handled += len(events)
        self.current = []
        for record, verdict in zip(records, verdicts, strict=True):
            if verdict is Verdict.quarantine:
                answer = self._dead_letter(record, QUARANTINED)
                if answer is not None:
                    futures.append(self._send(self.signer.sign(answer)))
        self._producer.flush(timeout=30)
        for future in futures:
            future.get(timeout=0)  # raises the send's error: nothing is committed then
        self._consumer.commit()
        return handled

    def _decode_all(self, records: list[Any]) -> tuple[list[ToolTurnEvent], list[RequestEnvelope]]:
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
        return [SourceRecord.of(r, 0).suspect() for r in self.current]

    def handle(self, events: list[ToolTurnEvent]) -> list[RequestEnvelope]:
        """The continuations of a poll's turn events (Redis I/O, then the tools)."""
        calls = [
            (event, call, self.ledger.key(call))
            for event in events
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

    def _decode(self, record: Any) -> ToolTurnEvent | RequestEnvelope | None:
        """The event; for a malformed one whose envelope is still readable, an aborted
        continuation (so its request is answered); else None. Bad records are
        dead-lettered either way."""
        try:
            return ToolTurnEvent.model_validate_json(record.value or b"")
        except ValidationError as exc:
            reason = f"not a tool-turn event: {exc.errors(include_url=False)[:1]}"
        metrics.TOOL_EVENTS_BAD.inc()
        return self._dead_letter(record, reason)

    def _dead_letter(self, record: Any, reason: str) -> RequestEnvelope | None:
        """The record to the DLQ with `reason`; the aborted continuation that answers its
        request when its envelope can be read."""
        answer = malformed_answer(record.value, reason)
        log.warning(
            "tool_event_bad",
            partition=record.partition,
            offset=record.offset,
            reason=reason[:500],
        )
        headers = [
            (dlq.ERROR_CODE, b"invalid_request"),
            (dlq.ERROR_MESSAGE, reason[:4000].encode()),
            (dlq.SOURCE_TOPIC, str(record.topic).encode()),
            (dlq.SOURCE_PARTITION, str(record.partition).encode()),
            (dlq.SOURCE_OFFSET, str(record.offset).encode()),
        ]
        try:
            self._producer.send(
                self.settings.dlq_topic, key=record.key, value=record.value or b"", headers=headers
            )
        except KafkaError as exc:
            log.error("dead_letter_failed", topic=self.settings.dlq_topic, error=str(exc))
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


__all__ = [
    "CallLedger",
    "ExecutorSettings",
    "ExecutorState",
    "ToolExecutor",
    "malformed_answer",
    "next_envelope",
]
