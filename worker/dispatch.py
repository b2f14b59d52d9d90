"""The dispatcher thread: admit each micro-batch, render it, hand it to the engine.

Admission is one look-up in the dedupe store per batch (answered already? job
cancelled?); a request past its deadline is answered `expired` without GPU time. Each
request is rendered on its own, so one that cannot run (unknown model, over the context,
a template that chokes) is answered `failed` and costs its batch nothing. Requests of
worse lanes go into the engine only while they leave the best lane room
(`worker.engine_gate`); the rest wait here. The engine answers through a callback from
its own threads, which only hands over to the writer (and lets held requests in).

A cancel stops within `cancel_poll_s` (`watch_cancels`, on a thread of its own): the
jobs of the requests held here or in the engine are looked up; a cancelled job's held
requests are answered `cancelled` at once, and its requests in the engine are aborted
(waiting or generating; one that finished first keeps its answer) and answered
`cancelled`. Records not dispatched yet meet the cancel at admission.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime

from schemas import ContractError, ErrorCode, ErrorInfo, RequestEnvelope, Status, WorkerInfo
from schemas.ref import RequestRef
from worker import failpoints, metrics
from worker.engine_gate import Capacity, EngineGate, Reserve
from worker.engines.base import Engine, EngineOutput, EngineRequest
from worker.logs import log
from worker.records import DispatchQueue, Finished, Inbound, Reply, Running
from worker.rendering import PromptRenderer
from worker.result_budget import ResultBudget
from worker.results import refused_result
from worker.sinks.base import (
    NO_ADMISSION,
    Admission,
    ReplySink,
    SinkHealth,
    SinkRefused,
    SinkUnavailable,
)
from worker.sinks.retrying import GiveUp, retrying
from worker.supervision import Suspect
from worker.tool_loop import routing

DEFAULT_RESERVE = Reserve()
LANE_PRIORITY_STRIDE = 2**32
"""Engine priority = (2 * lane rank + fresh) * stride + request priority, `fresh` 0 for a
tool loop's continuation and 1 otherwise: every request of a better lane runs before any
of a worse one, and within a lane a continuation runs before fresh work, so loops finish
(request priorities are bounded by +-2**31)."""


def engine_priority(rank: int, envelope: RequestEnvelope) -> int:
    fresh = 0 if envelope.loop is not None else 1
    return (2 * rank + fresh) * LANE_PRIORITY_STRIDE + envelope.priority


class Dispatcher:
    def __init__(
        self,
        engine: Engine,
        renderer: Callable[[], PromptRenderer],
        store: ReplySink | None,
        inbox: DispatchQueue,
        outbox: queue.SimpleQueue[Reply | Finished | None],
        *,
        worker_id: str,
        worker_info: Callable[[str | None, int | None], WorkerInfo],
        lane_rank: Callable[[str], int],
        stopping: threading.Event,
        health: SinkHealth,
        dead_letter: Callable[[Inbound, ContractError], None],
        stall_s: float = 120.0,
        budget: ResultBudget | None = None,
        reserve: Reserve | None = DEFAULT_RESERVE,
        cancel_poll_s: float = 0.5,
    ) -> None:
        self._reserve = reserve
        self._gate: EngineGate | None = None
        self._cancel_poll_s = cancel_poll_s
        self._cancelled: dict[str, None] = {}
        """Jobs seen cancelled (the last `_CANCELLED_KEPT`, oldest first)."""
        self._stall_s = stall_s
        self._budget = budget or ResultBudget(2**62)
        self.engine = engine
        self._renderer = renderer
        self.store = store
        self.inbox = inbox
        self.outbox = outbox
        self._worker_id = worker_id
        self._worker_info = worker_info
        self._lane_rank = lane_rank
        self._stopping = stopping
        self.health = health
        self._dead_letter = dead_letter
        self._running: dict[str, Running] = {}
        self._keys = itertools.count()
        self._batch_seq = itertools.count(1)
        self.current: list[Inbound] = []

    def run(self) -> None:
        done = threading.Event()
        if self.store is not None and self._cancel_poll_s > 0:
            threading.Thread(
                target=self.watch_cancels, args=(done,), name="qbatch-cancels", daemon=True
            ).start()
        try:
            while True:
                batch = self.inbox.get()
                if batch is None:
                    return
                self.current = batch.items
                failpoints.hit("dispatch", [item.envelope.request_id for item in batch.items])
                self.admit_and_submit(batch.items)
                self.current = []
        finally:
            done.set()

    def suspects(self) -> list[Suspect]:
        return [item.record.suspect() for item in self.current]

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def gate(self) -> EngineGate:
        """Built on first use: the engine's capacity is known once it has started."""
        if self._gate is None:
            slots, tokens = self.engine.capacity() if self._reserve else (None, None)
            self._gate = EngineGate(Capacity(slots, tokens), self._reserve or Reserve(0, 0))
        return self._gate

    # ------------------------------------------------------------------ one batch

    def admit_and_submit(self, items: Sequence[Inbound]) -> None:
        dispatched_ms = _epoch_ms()
        admission = self._admission(items)
        if admission is None:  # stopping while the store is down: hand the batch back
            return
        admitted_ms = _epoch_ms()
        batch_id = f"{self._worker_id}-{next(self._batch_seq)}"
        now = datetime.now(UTC)
        requests: list[EngineRequest] = []
        offers: list[tuple[EngineRequest, bool, int]] = []
        runs: list[Running] = []
        renderer = self._renderer()
        for item in items:
            env = item.envelope
            seen = admission.answered_in(env.request_id, env.job_id)
            if seen is True:
                metrics.DUPLICATES_SKIPPED.inc()
                self.outbox.put(
                    Reply(
                        item.tp,
                        item.offset,
                        item.record,
                        None,
                        lane=item.lane,
                        epoch=item.epoch,
                        answered=env.request_id,
                        isolate=item.isolate,
                    )
                )
                continue
            if seen is False:
                # Another job's result holds this id: the writer answers this request
                # `duplicate_request_id` for its own job (no GPU time spent on it).
                self.finish(item, ErrorCode.duplicate_request_id, "duplicate request_id")
                continue
            if env.deadline_passed(now):
                self.finish(
                    item,
                    ErrorCode.deadline_exceeded,
                    "deadline passed before the request started",
                    status=Status.expired,
                )
                continue
            if env.job_id and env.job_id in admission.cancelled_jobs:
                # first: a cancelled job's lines are `cancelled`, an aborted turn's too
                self._cancel(item, env.job_id)
                continue
            if env.loop is not None and env.loop.abort is not None:
                self._answer(item, env.loop.abort, Status.failed)
                continue
            try:
                rendered = renderer.render(env)
            except ContractError as error:
                error.ref = RequestRef.of(env)
                self.reject(item, error)
                continue
            except Exception as exc:  # a template or tokenizer defect: this request only
                log.exception("render_failed", request_id=env.request_id)
                self.finish(
                    item,
                    ErrorCode.internal_error,
                    f"rendering the prompt: {type(exc).__name__}: {exc}",
                )
                continue
            key = str(next(self._keys))
            run = Running(item, rendered, dispatched_ms, admitted_ms=admitted_ms)
            self._running[key] = run
            runs.append(run)
            lane = env.loop.lane if env.loop is not None and env.loop.lane else item.lane
            rank = self._rank(lane)
            requests.append(
                rendered.engine_request(key, engine_priority(rank, env), first_lane=rank == 0)
            )
            offers.append((requests[-1], rank == 0, _kv_cost(requests[-1], rendered.prompt_tokens)))
        shared = self._worker_info(batch_id, len(runs))
        for run in runs:
            run.worker = shared
        if not requests:
            return
        if not self._budget.reserve(
            sum(run.rendered.result_bytes for run in runs), self._stopping.is_set
        ):  # stopping while the engine's results were over the budget: hand the batch back
            for request in requests:
                self._running.pop(request.key, None)
            return
        log.debug("batch_dispatched", batch_id=batch_id, size=len(requests))
        self._submit(self.gate.offer(offers))

    def _submit(self, requests: list[EngineRequest]) -> None:
        """Into the engine now (from this thread, or an engine thread letting held ones in)."""
        if self._cancelled:  # held while their job was cancelled: never go in
            stale = [r for r in requests if self._job_of(r.key) in self._cancelled]
            for request in stale:
                run = self._running.pop(request.key, None)
                if run is not None:
                    self._cancel(run.inbound, run.inbound.envelope.job_id or "")
            requests = [r for r in requests if r not in stale]
        if not requests:
            return
        submitted_ms = _epoch_ms()
        for request in requests:
            run = self._running.get(request.key)
            if run is not None:
                run.engine_submitted_ms = submitted_ms
        try:
            self.engine.submit(requests, self.on_engine_done)
        except Exception as exc:
            log.exception("engine_submit_failed", size=len(requests))
            for request in requests:
                self.on_engine_done(
                    EngineOutput(request.key, "", 0, 0, "error", error=f"engine refused: {exc}")
                )

    def _rank(self, lane: str) -> int:
        try:
            return self._lane_rank(lane)
        except KeyError:  # a continuation naming a lane this worker does not have
            return 0

    def _admission(self, items: Sequence[Inbound]) -> Admission | None:
        """The store's look-up, retried while it is unavailable (None: stop asked). A call
        that only times out for `stall_s` stops the worker (`worker.sinks.retrying`)."""
        store = self.store
        if store is None:
            return NO_ADMISSION
        envelopes = [item.envelope for item in items]

        def look_up() -> Admission:
            try:
                return store.admission(envelopes)
            except SinkRefused as exc:
                # A look-up cannot be split like a write: wait until the store answers.
                raise SinkUnavailable(str(exc)) from exc

        try:
            return retrying(
                store,
                look_up,
                health=self.health,
                stopping=self._stopping.is_set,
                give_up_after_s=0,
                stall_s=self._stall_s,
            )
        except GiveUp:
            return None

    def on_engine_done(self, output: EngineOutput) -> None:
        """Runs on an engine thread: hand over and return, the writer does the work; held
        requests that now fit go in."""
        run = self._running.pop(output.key, None)
        if run is not None:
            job = run.inbound.envelope.job_id
            if output.finish == "abort" and job is not None and job in self._cancelled:
                self._cancel(run.inbound, job)
            else:
                self.outbox.put(Finished(run, output, _epoch_ms()))
        if self._gate is not None:
            self._submit(self._gate.done(output.key))

    # ------------------------------------------------------------------ cancels

    def watch_cancels(self, done: threading.Event) -> None:
        """Every `cancel_poll_s`: the jobs of the requests held or in the engine, looked
        up; a cancelled one's are stopped (`stop_jobs`). A failed look-up waits for the
        next tick (admission still catches what is dispatched later)."""
        while not done.wait(self._cancel_poll_s):
            jobs = {r.inbound.envelope.job_id for r in list(self._running.values())}
            jobs.discard(None)
            if not jobs or self.store is None:
                continue
            try:
                cancelled = self.store.cancelled_jobs(sorted(j for j in jobs if j))
            except Exception:
                log.warning("cancel_lookup_failed", exc_info=True)
                continue
            if cancelled:
                self.stop_jobs(cancelled)

    def stop_jobs(self, jobs: Iterable[str]) -> None:
        """Answer a cancelled job's held requests `cancelled`, abort those in the engine."""
        wanted = set(jobs)
        for job in wanted:
            self._cancelled[job] = None
        while len(self._cancelled) > _CANCELLED_KEPT:
            del self._cancelled[next(iter(self._cancelled))]
        runs = {k: r for k, r in list(self._running.items()) if r.inbound.envelope.job_id in wanted}
        if not runs:
            return
        held = self.gate.drop(lambda request: request.key in runs)
        for request in held:
            run = self._running.pop(request.key, None)
            if run is not None:
                self._cancel(run.inbound, run.inbound.envelope.job_id or "")
        inside = [k for k in runs if k not in {r.key for r in held}]
        log.info("job_cancel_stopping", jobs=sorted(wanted), held=len(held), engine=len(inside))
        if inside:
            self.engine.abort(inside)

    def _job_of(self, key: str) -> str | None:
        run = self._running.get(key)
        return None if run is None else run.inbound.envelope.job_id

    def _cancel(self, item: Inbound, job: str) -> None:
        self.finish(item, ErrorCode.cancelled, f"job {job} was cancelled", status=Status.cancelled)

    # ------------------------------------------------------------------ answers

    def finish(
        self, item: Inbound, code: ErrorCode, message: str, status: Status = Status.failed
    ) -> None:
        self._answer(item, ErrorInfo(code=code, message=message), status)

    def reject(self, item: Inbound, error: ContractError) -> None:
        """Bad input found at rendering: a failed result and the record to the DLQ."""
        self._dead_letter(item, error)
        self._answer(item, error.info(), Status.failed)

    def _answer(self, item: Inbound, error: ErrorInfo, status: Status) -> None:
        """A request that never reaches the engine gets its result here."""
        env = item.envelope
        result = routing.finalize(
            env,
            refused_result(
                env,
                error,
                status=status,
                dequeued_ms=item.dequeued_ms,
                finished_ms=_epoch_ms(),
                worker=self._worker_info(None, None),
            ),
        )
        reply = Reply(item.tp, item.offset, item.record, result, env.result_ttl_s)
        reply.lane, reply.isolate, reply.epoch = item.lane, item.isolate, item.epoch
        self.outbox.put(reply)


_CANCELLED_KEPT = 1024


def _kv_cost(request: EngineRequest, prompt_tokens: int) -> int:
    """The KV-cache tokens a request can grow to: its prompt and every choice's output."""
    return prompt_tokens + request.sampling.max_tokens * max(1, request.sampling.n)


def _epoch_ms() -> int:
    return time.time_ns() // 1_000_000


__all__ = ["LANE_PRIORITY_STRIDE", "Dispatcher", "engine_priority"]
