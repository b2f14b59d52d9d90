"""The writer thread: finished work -> result envelopes -> every reply sink -> offsets done.

Chunks of up to `write_batch_max` replies go to the sinks in order, the dedupe store
(Redis) first: its verdict on each reply decides what the others get (a redelivered
request's stored result, a duplicate id's `failed` answer). Only when every sink holds a
chunk are its offsets handed back for commit.

What no retry can fix is contained to the replies it concerns: a sink that refuses a
chunk (`SinkRefused`) has it split in halves until the refused replies stand alone; each
of those, like a reply the store answers `wrong_type`, gets a `failed` result where one
can be written and goes to the dead-letter topic. What waiting fixes (`SinkUnavailable`)
is retried with capped backoff while intake pauses; results stay queued meanwhile. A
chunk holds at most `write_batch_max` replies and `write_batch_max_bytes` of result JSON
(one larger result goes alone): a chunk's memory and its script's run time are bounded.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from schemas import ContractError, ErrorCode, ResultEnvelope, WorkerInfo
from schemas.ref import RequestRef
from schemas.replies import WriteReply, WriteStatus
from schemas.result_size import DEFAULT_MAX_RESULT_BYTES
from worker import failpoints, metrics
from worker.dead_letters import DeadLetters
from worker.logs import log
from worker.records import Done, Finished, Reply
from worker.result_budget import ResultBudget
from worker.results import duplicate_result, finished_result
from worker.sinks.base import ReplySink, SinkHealth, SinkRefused
from worker.sinks.retrying import GiveUp, retrying
from worker.supervision import Suspect
from worker.tool_loop import routing

T = TypeVar("T")
_QUEUE_POLL_S = 0.05


class Writer:
    def __init__(
        self,
        sinks: Sequence[ReplySink],
        dead_letters: DeadLetters | None,
        inbox: queue.SimpleQueue[Reply | Finished | None],
        done: Callable[[Done], None],
        *,
        model: Callable[[], str],
        worker_info: Callable[[], WorkerInfo],
        chunk_max: int,
        stopping: Callable[[], bool],
        drain_timeout_s: float,
        health: SinkHealth,
        turn_max_bytes: int = 1_000_000,
        fingerprint: Callable[[], str | None] = lambda: None,
        chunk_max_bytes: int = 32 * 1024 * 1024,
        stall_s: float = 120.0,
        max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES,
        budget: ResultBudget | None = None,
    ) -> None:
        self._chunk_max_bytes = chunk_max_bytes
        self._stall_s = stall_s
        self.max_result_bytes = max_result_bytes
        """Set again by the worker at start when Redis takes less (`Worker.result_limit`)."""
        self._budget = budget or ResultBudget(2**62)
        self._turn_max_bytes = turn_max_bytes
        self._fingerprint = fingerprint
        self.sinks = list(sinks)
        self.store = next((s for s in self.sinks if s.dedupes), None)
        self.others = [s for s in self.sinks if not s.dedupes]
        self.dead_letters = dead_letters
        self.inbox = inbox
        self._done = done
        self._model = model
        self._worker_info = worker_info
        self.chunk_max = chunk_max
        self._stopping = stopping
        self._drain_timeout_s = drain_timeout_s
        self.health = health
        self.current: list[Reply] = []
        """The chunk being written (what a fault in this thread is blamed on)."""
        self.closed = False

    # ------------------------------------------------------------------ loop

    def run(self) -> None:
        held: Reply | None = None
        while True:
            first: Reply | Finished | None = held
            held = None
            if first is None:
                try:
                    first = self.inbox.get(timeout=_QUEUE_POLL_S)
                except queue.Empty:
                    if self.closed:
                        return
                    continue
                if first is None:
                    self.closed = True
                    continue
            chunk = [self._reply(first)]
            size = chunk[0].size()
            if not chunk[0].isolate:
                while len(chunk) < self.chunk_max and size < self._chunk_max_bytes:
                    try:
                        more = self.inbox.get_nowait()
                    except queue.Empty:
                        break
                    if more is None:
                        self.closed = True
                        break
                    reply = self._reply(more)
                    if reply.isolate or size + reply.size() > self._chunk_max_bytes:
                        held = reply  # it starts the next chunk
                        break
                    chunk.append(reply)
                    size += reply.size()
            self.current = chunk
            failpoints.hit(
                "write", [r.result.request_id for r in chunk if r.result and r.result.ok]
            )
            try:
                self.write(chunk)
            except GiveUp:
                log.warning("writer_gave_up", pending=len(chunk))
            self._budget.release(sum(r.reserved for r in chunk))
            self.current = []

    def suspects(self) -> list[Suspect]:
        return [r.record.suspect() for r in self.current if r.record is not None]

    def _reply(self, item: Reply | Finished) -> Reply:
        if isinstance(item, Reply):
            return item
        inbound = item.running.inbound
        env = inbound.envelope
        result = finished_result(
            item, model=self._model(), worker=self._worker_info(), fingerprint=self._fingerprint()
        )
        output = item.output
        if output.finish != "error":
            metrics.PROMPT_TOKENS.inc(output.prompt_tokens)
            metrics.COMPLETION_TOKENS.inc(output.total_completion_tokens)
            if output.embeddings is not None:
                metrics.EMBEDDINGS.inc(len(output.embeddings))
            if output.cached_tokens is not None:  # an engine with a prefix cache
                metrics.PREFIX_CACHE_QUERIES.inc(output.prompt_tokens)
                metrics.PREFIX_CACHE_HITS.inc(output.cached_tokens)
        reply = Reply(
            inbound.tp,
            inbound.offset,
            inbound.record,
            result,
            env.result_ttl_s,
            lane=inbound.lane,
            epoch=inbound.epoch,
            isolate=inbound.isolate,
            reserved=item.running.rendered.result_bytes,
        )
        if env.tool_loop is not None:
            try:
                self._route_turn(reply, item, result)
            except Exception as exc:  # a turn that cannot be built costs its request only
                log.error("tool_turn_failed", request_id=env.request_id, error=repr(exc)[:300])
                reply.turn = None
                reply.result = ResultEnvelope.failure(
                    env,
                    ErrorCode.internal_error,
                    f"building the next tool-loop turn: {type(exc).__name__}: {exc}",
                    timings=result.timings,
                    worker=result.worker,
                )
        self._bound_size(reply)
        return reply

    def _bound_size(self, reply: Reply) -> None:
        """A result larger than max_result_bytes (its estimate passed, its output did not:
        very long tokens, say) is answered `result_too_large` instead of written: Redis
        would reset the connection for a value past its limit, and the write be retried
        for ever."""
        result = reply.result
        if result is None or len(reply.encoded()) <= self.max_result_bytes:
            return
        size = len(reply.encoded())
        log.warning("result_too_large", request_id=result.request_id, bytes=size)
        reply.result = _failed(
            result,
            ErrorCode.result_too_large,
            f"the result came out {size:,} bytes, over the {self.max_result_bytes:,} "
            "bytes results may have (max_result_bytes): lower max_tokens, n or top_logprobs",
        )

    def _route_turn(self, reply: Reply, item: Finished, result: ResultEnvelope) -> None:
        """The reply of a tool-loop request: its final result, or the next turn for the
        executor (an error result when that turn would be over the topic's record size)."""
        env = item.running.inbound.envelope
        routed = routing.route(env, result, lane=reply.lane, now_ms=item.finished_ms)
        if isinstance(routed, ResultEnvelope):
            reply.result = routed
            return
        reply.result, reply.turn = None, routed
        size = len(reply.encoded_turn())
        if size > self._turn_max_bytes:
            reply.result = routing.event_too_large(env, result, size, self._turn_max_bytes)
            reply.turn = None
        else:
            metrics.TOOL_TURNS.inc()

    # ------------------------------------------------------------------ one chunk

    def write(self, chunk: list[Reply]) -> None:
        """Write a chunk to every sink; hand its offsets back when all hold it."""
        metrics.PENDING_WRITES.set(len(chunk))
        now_ms = _epoch_ms()
        if self.store is not None:
            verdicts = self._store_write(chunk, now_ms)
            self._settle(chunk, verdicts, now_ms)
        for sink in self.others:
            self._write_other_retrying(sink, chunk, now_ms)
        metrics.PENDING_WRITES.set(0)
        self._done([(r.tp, r.offset, r.epoch) for r in chunk])

    def _store_write(self, chunk: list[Reply], now_ms: int) -> list[WriteReply]:
        """The dedupe store's verdicts; refused replies found by halving the chunk."""
        store = self.store
        assert store is not None
        try:
            return self._retrying(store, lambda: store.write(chunk, now_ms))
        except SinkRefused as exc:
            if len(chunk) == 1:
                return [WriteReply(WriteStatus.wrong_type, str(exc))]
            half = len(chunk) // 2
            return self._store_write(chunk[:half], now_ms) + self._store_write(chunk[half:], now_ms)

    def _settle(self, chunk: list[Reply], verdicts: list[WriteReply], now_ms: int) -> None:
        """Act on the store's verdicts; fill `stored` for the other sinks."""
        store = self.store
        assert store is not None
        again: list[Reply] = []
        for reply, verdict in zip(chunk, verdicts, strict=True):
            result = reply.result
            if result is None:
                if reply.answered is not None:
                    again.append(reply)  # answered before: others get the stored result
            elif verdict.status is WriteStatus.written:
                _observe(result, now_ms, reply.lane)
            elif verdict.status is WriteStatus.existed:
                metrics.DUPLICATES_SKIPPED.inc()
                reply.result, reply.answered = None, result.request_id  # first answer stands
                again.append(reply)
            elif verdict.status is WriteStatus.other_job and result is not None:
                reply.result = duplicate_result(result)
                self._record_duplicate(reply, now_ms)
            elif verdict.status is WriteStatus.wrong_type:
                self._refused(reply, verdict.detail, now_ms)
        if self.others and again:
            ids = [r.answered for r in again if r.answered]
            stored = self._retrying(store, lambda: store.stored(ids))
            for reply in again:
                reply.stored = stored.get(reply.answered) if reply.answered else None
            gone = [r.answered for r in again if r.answered and r.stored is None]
            if gone:
                # Answered before, but the result expired (result_ttl_s) before this
                # redelivery: the other sinks get nothing to republish for it.
                log.warning("stored_result_missing", count=len(gone), request_ids=gone[:10])

    def _record_duplicate(self, reply: Reply, now_ms: int) -> None:
        store = self.store
        assert store is not None and reply.result is not None
        metrics.DUPLICATE_IDS.inc()
        log.warning(
            "duplicate_request_id",
            request_id=reply.result.request_id,
            job_id=reply.result.job_id,
            partition=reply.tp.partition,
            offset=reply.offset,
        )
        result = reply.result
        try:
            verdict = self._retrying(
                store, lambda: store.record_duplicate(result, reply.ttl_s, now_ms)
            )
        except SinkRefused as exc:
            verdict = WriteReply(WriteStatus.wrong_type, str(exc))
        if verdict.status is WriteStatus.written:
            _observe(result, now_ms, reply.lane)
        elif verdict.status is WriteStatus.wrong_type:
            self._dead_letter(reply, f"duplicate request_id, and {verdict.detail}")

    def _refused(self, reply: Reply, why: str, now_ms: int) -> None:
        """A reply the store cannot hold: a failed result if one fits anywhere, and a
        dead letter either way."""
        store = self.store
        assert store is not None
        metrics.SINK_REFUSED.labels(store.name).inc()
        result = reply.result
        rid = result.request_id if result is not None else reply.answered
        log.error(
            "result_refused",
            sink=store.name,
            request_id=rid,
            partition=reply.tp.partition,
            offset=reply.offset,
            reason=why,
        )
        self._dead_letter(reply, f"{store.name} refused the result: {why}")
        if result is None:
            return
        failed = _failed(
            result,
            ErrorCode.internal_error,
            f"the result could not be stored ({why}); the record is in the dead-letter topic",
        )
        reply.result = failed
        try:
            verdict = self._retrying(
                store, lambda: store.write([reply], now_ms, job_bookkeeping=False)
            )[0]
        except SinkRefused:
            verdict = WriteReply(WriteStatus.wrong_type)
        if verdict.status is WriteStatus.written:
            _observe(failed, now_ms, reply.lane)
        else:
            reply.result = None  # nowhere to put it: the dead letter is its only trace

    def _write_other_retrying(self, sink: ReplySink, chunk: list[Reply], now_ms: int) -> None:
        def attempt() -> None:
            self._write_other(sink, chunk, now_ms)

        self._retrying(sink, attempt)

    def _write_other(self, sink: ReplySink, chunk: list[Reply], now_ms: int) -> None:
        try:
            sink.write(chunk, now_ms)
            sink.flush()
        except SinkRefused as exc:
            if len(chunk) == 1:
                metrics.SINK_REFUSED.labels(sink.name).inc()
                self._dead_letter(chunk[0], f"{sink.name} refused the result: {exc}")
                return
            half = len(chunk) // 2
            self._write_other(sink, chunk[:half], now_ms)
            self._write_other(sink, chunk[half:], now_ms)

    def _dead_letter(self, reply: Reply, why: str) -> None:
        if self.dead_letters is None or reply.record is None:
            return
        rid = reply.result.request_id if reply.result else reply.answered
        error = ContractError(why, code=ErrorCode.internal_error, request_id=rid)
        self.dead_letters.send(reply.record, error)
        metrics.DEAD_LETTERED.labels(error.code.value).inc()

    # ------------------------------------------------------------------ retries

    def _retrying(self, sink: ReplySink, call: Callable[[], T]) -> T:
        """`call`, retried while `sink` is unavailable (`worker.sinks.retrying`): gives up
        only when stopping past the drain deadline (the chunk is then redelivered), and
        stops the worker on a call that did nothing but time out for the stall limit."""
        return retrying(
            sink,
            call,
            health=self.health,
            stopping=self._stopping,
            give_up_after_s=self._drain_timeout_s,
            stall_s=self._stall_s,
        )


def _observe(result: ResultEnvelope, now_ms: int, lane: str) -> None:
    code = result.error.code.value if result.error else ""
    metrics.labelled(metrics.REQUESTS, result.status.value, code).inc()
    t = result.timings
    if t.queue_ms is not None:
        metrics.QUEUE_LATENCY.observe(t.queue_ms / 1000)
    if t.inference_ms is not None:
        metrics.INFERENCE_LATENCY.observe(t.inference_ms / 1000)
    if t.submitted is not None:
        e2e = max(0, now_ms - t.submitted) / 1000
        metrics.E2E_LATENCY.observe(e2e)
        metrics.labelled(metrics.LANE_LATENCY, lane).observe(e2e)
    observe = metrics.STAGE_SECONDS.observe
    for stage, ms in (
        ("queue", t.queue_ms),
        ("batch_wait", t.batch_wait_ms),
        ("admission", t.admission_ms),
        ("render", t.render_ms),
        ("engine_wait", t.engine_wait_ms),
        ("prefill", t.prefill_ms),
        ("generation", t.generation_ms),
    ):
        if ms is not None:
            observe(stage, lane, ms / 1000 if ms > 0 else 0.0)
    if t.finished is not None:
        observe("write", lane, max(0, now_ms - t.finished) / 1000)


def _epoch_ms() -> int:
    return time.time_ns() // 1_000_000


def _failed(result: ResultEnvelope, code: ErrorCode, message: str) -> ResultEnvelope:
    """An error answer in place of `result`, for the same request (its ids, metadata,
    timings and worker kept), when the result itself cannot be delivered."""
    return ResultEnvelope.failure(
        RequestRef(
            request_id=result.request_id,
            job_id=result.job_id,
            custom_id=result.custom_id,
            metadata=result.metadata,
        ),
        code,
        message,
        timings=result.timings,
        worker=result.worker,
    )


__all__ = ["Writer"]
