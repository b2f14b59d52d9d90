"""The main loop: it owns the Kafka consumer (kafka-python's is not thread-safe).

Each turn: poll, decode and micro-batch the records, dispatch a due batch, take back the
offsets the writer finished, commit the contiguous done prefix, and pause or resume
fetching. An offset is marked done only after every sink holds its result (or, for a
record with no recoverable request_id, after it is dead-lettered), and only the
contiguous done prefix of a partition is committed: at-least-once, nothing lost. In-flight
work is bounded by `max_inflight`: past it, and whenever a sink is failing, fetching is
paused while the consumer keeps polling, so the group does not evict the worker.
"""

from __future__ import annotations

import contextlib
import queue
import time
from collections.abc import Callable
from typing import Any

from kafka.structs import TopicPartition

from schemas import ContractError, decode_request
from schemas.limits import MAX_ENVELOPE_BYTES
from schemas.loop_auth import LoopSigner
from schemas.ref import RequestRef
from worker import failpoints, metrics
from worker.bad_records import BadRecords
from worker.batching import Batch, MicroBatcher
from worker.commits import Committer
from worker.config import WorkerSettings
from worker.dead_letters import DeadLetters
from worker.kafka_io import RequestConsumer, time_in_kafka_s
from worker.lanes import LaneGate, LaneLoad
from worker.logs import log
from worker.offsets import OffsetTracker
from worker.records import DispatchQueue, Done, Finished, Inbound, Reply, SourceRecord
from worker.supervision import StrikeBook, Suspect, Verdict

_QUEUE_POLL_S = 0.05
_LAG_INTERVAL_S = 5.0
_TXN_SETTLE_S = 30.0
"""How long a revoke waits for a transaction in flight (well inside max_poll_interval)."""


class Intake:
    def __init__(
        self,
        settings: WorkerSettings,
        consumer: RequestConsumer,
        committer: Committer,
        dead_letters: DeadLetters | None,
        dispatch_q: DispatchQueue,
        results_q: queue.SimpleQueue[Reply | Finished | None],
        *,
        strikes: StrikeBook,
        worker_info: Callable[..., Any],
        pending_in_sinks: Callable[[], int],
        sinks_ok: Callable[[], bool],
        on_assigned: Callable[[int], None],
        report_engine: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.consumer = consumer
        self.committer = committer
        self.dead_letters = dead_letters
        self.dispatch_q = dispatch_q
        self.results_q = results_q
        self.strikes = strikes
        self._worker_info = worker_info
        self._pending_in_sinks = pending_in_sinks
        self._sinks_ok = sinks_ok
        self._on_assigned_count = on_assigned
        self.lanes = settings.lane_policies()
        self.gate = LaneGate(
            self.lanes, yield_above=settings.lane_yield_above, resume_ratio=settings.resume_ratio
        )
        self._lane_by_topic = {lane.topic: lane.name for lane in self.lanes}
        self._topic_by_lane = {lane.name: lane.topic for lane in self.lanes}
        self.lane_in_flight: dict[str, int] = dict.fromkeys(self._topic_by_lane, 0)
        self._held: frozenset[str] = frozenset()
        self._loads: dict[str, LaneLoad] = {}
        self._rank = {lane.name: lane.rank for lane in self.lanes}
        self._report_engine = report_engine
        self.clock = clock
        self.tracker: OffsetTracker[TopicPartition] = OffsetTracker()
        self.batcher: MicroBatcher[Inbound] = MicroBatcher(
            max_size=settings.batch_max_size,
            max_wait_ms=settings.batch_max_wait_ms,
            clock=clock,
        )
        self.written_q: queue.SimpleQueue[Done] = queue.SimpleQueue()
        self.epochs: dict[TopicPartition, int] = {}
        """Per partition, how many times it was revoked: a record carries the epoch it was
        taken in, and a completion from an earlier epoch (a record of a partition revoked
        meanwhile, maybe assigned back) must not count for the records taken since."""
        self._positions: dict[TopicPartition, int] = {}
        self._rewind: dict[TopicPartition, int] = {}
        """Revoked partitions with unanswered records: where to seek if they come back."""
        self._last_commit = clock()
        self._last_lag = clock()
        self.current: Any = None
        """The record being accepted (what a fault in this loop is blamed on)."""
        self.bad = BadRecords(dead_letters, results_q, worker_info)
        self._keep_bytes = max(settings.dlq_max_record_bytes, MAX_ENVELOPE_BYTES)
        self.signer: LoopSigner | None = None
        """Checks continuations' loops (set at start, `Worker.run`); None: none runs."""
        """A record's value is kept whole up to this (every request that can run fits)."""

    # ------------------------------------------------------------------ one turn

    def step(self) -> None:
        due_in = self.batcher.time_until_due(self.clock())
        timeout = _QUEUE_POLL_S if due_in is None else min(due_in, _QUEUE_POLL_S)
        room = self.gate.poll_room(
            self._loads, self._held, self.settings.max_inflight - self.in_flight
        )
        records = self.consumer.poll(timeout, min(self.settings.poll_max_records, room))
        if records:
            metrics.RECORDS_CONSUMED.inc(len(records))
            wall_ms = _epoch_ms()
            for record in records:
                self.current = record
                self.accept(record, wall_ms)
            self.current = None
        batch = self.batcher.poll(self.clock())
        if batch is not None:
            self.dispatch(batch)
        self.absorb_written()
        self.maybe_commit()
        self.apply_backpressure()
        self.maybe_report_lag()

    def suspects(self) -> list[Suspect]:
        record = self.current
        if record is None:
            return []
        return [SourceRecord.of(record, 0).suspect()]  # keep 0: only its checksum

    @property
    def in_flight(self) -> int:
        """Records taken and not yet answered; with transactional results, the results
        held for the next commit count too, but only beyond one max_inflight of them (a
        commit interval's worth of answered work must not pause intake, as it would at
        8k results/s; memory stays bounded by 2 x max_inflight results); and dead letters
        not sent yet (a DLQ that is down must not let them pile up)."""
        held = self._pending_in_sinks() - self.settings.max_inflight
        letters = self.dead_letters.pending() if self.dead_letters is not None else 0
        return self.tracker.in_flight + max(0, held) + letters

    @property
    def in_flight_bytes(self) -> int:
        """Bytes as received of the records in flight and of the dead letters not sent."""
        letters = self.dead_letters.pending_bytes() if self.dead_letters is not None else 0
        return self.tracker.in_flight_weight + letters

    def lane_of(self, topic: str) -> str:
        return self._lane_by_topic.get(topic, self.lanes[0].name)

    def accept(self, consumed: Any, wall_ms: int) -> None:
        """Take one record. Only a `SourceRecord` of it is kept past this call: never the
        consumer's record object with its headers, nor more than `dlq_max_record_bytes` of
        its value (memory per record in flight is bounded by its bytes, see there)."""
        tp = TopicPartition(consumed.topic, consumed.partition)
        record = SourceRecord.of(consumed, self._keep_bytes)
        weight = record.size + len(record.key or b"")
        if not self.tracker.track(tp, record.offset, weight=weight, at=self.clock()):
            return
        self._positions[tp] = record.offset + 1
        lane = self.lane_of(record.topic)
        self.lane_in_flight[lane] += 1
        verdict = self.strikes.verdict(record)
        if verdict is Verdict.quarantine:
            self.quarantine(record, tp, lane, wall_ms)
            return
        try:
            envelope = decode_request(consumed.value or b"", record.key)
        except ContractError as error:
            self.reject(record, tp, error, wall_ms, lane)
            return
        if envelope.loop is not None and not (self.signer and self.signer.valid(envelope)):
            forged = ContractError(
                "loop is set by a tool executor, and this one is not signed by this "
                "deployment's executors (schemas.loop_auth): not run",
                param="loop",
                ref=RequestRef.of(envelope),
            )
            self.reject(record, tp, forged, wall_ms, lane)
            return
        failpoints.hit("accept", [envelope.request_id])
        item = Inbound(
            tp,
            record.offset,
            record,
            envelope,
            wall_ms,
            lane=lane,
            epoch=self.epochs.get(tp, 0),
            isolate=verdict is Verdict.isolate,
        )
        if item.isolate:  # on probation: alone in its batch (see worker.supervision)
            pending = self.batcher.flush(self.clock())
            if pending is not None:
                self.dispatch(pending)
            now = self.clock()
            self.dispatch(Batch([item], now, now, "flush"))
            return
        batch = self.batcher.add(
            item,
            priority=envelope.priority,
            waited_s=time_in_kafka_s(record.timestamp, wall_ms),
        )
        if batch is not None:
            self.dispatch(batch)

    def reject(
        self,
        record: SourceRecord,
        tp: TopicPartition,
        error: ContractError,
        wall_ms: int,
        lane: str,
    ) -> None:
        self.bad.reject(record, error, wall_ms, lane=lane, epoch=self.epochs.get(tp, 0))

    def quarantine(self, record: SourceRecord, tp: TopicPartition, lane: str, wall_ms: int) -> None:
        self.bad.quarantine(record, wall_ms, lane=lane, epoch=self.epochs.get(tp, 0))

    def dead_letter(self, record: SourceRecord, error: ContractError) -> None:
        self.bad.dead_letter(record, error)

    def dispatch(self, batch: Batch[Inbound]) -> None:
        metrics.BATCH_SIZE.observe(len(batch.items))
        metrics.BATCH_WAIT.observe(batch.closed_at - batch.opened_at)
        self.dispatch_q.put(batch, min(self._rank.get(item.lane, 0) for item in batch.items))

    # ------------------------------------------------------------------ offsets

    def absorb_written(self) -> None:
        while True:
            try:
                done = self.written_q.get_nowait()
            except queue.Empty:
                return
            self._mark_done(done)

    def wait_written(self, timeout: float) -> None:
        try:
            first = self.written_q.get(timeout=timeout)
        except queue.Empty:
            return
        self._mark_done(first)

    def _mark_done(self, done: Done) -> None:
        for tp, offset, epoch in done:
            if epoch == self.epochs.get(tp, 0) and self.tracker.done(tp, offset):
                self.lane_in_flight[self.lane_of(tp.topic)] -= 1

    def maybe_commit(self, force: bool = False) -> None:
        self._committed(self.committer.completed())
        now = self.clock()
        if not force and (now - self._last_commit) * 1000 < self.settings.commit_interval_ms:
            return
        self._last_commit = now
        offsets = self.committable()
        if offsets:
            self.commit(offsets)

    def committable(self) -> dict[TopicPartition, int]:
        """What may be committed now: the contiguous done prefix of each partition, but
        never past a record whose dead letter is not delivered (or given up) yet."""
        offsets = self._capped(self.tracker.committable())
        return {tp: off for tp, off in offsets.items() if self.tracker.advances(tp, off)}

    def _capped(self, offsets: dict[TopicPartition, int]) -> dict[TopicPartition, int]:
        if self.dead_letters is None or not offsets:
            return offsets
        for tp, held_at in self.dead_letters.holds().items():
            if tp in offsets:
                offsets[tp] = min(offsets[tp], held_at)
        return offsets

    def commit(self, offsets: dict[TopicPartition, int], *, blocking: bool = True) -> None:
        if self.committer.commit(offsets, blocking=blocking):
            self._committed([offsets])

    def _committed(self, done: list[Any]) -> None:
        for offsets in done:
            self.tracker.mark_committed(offsets)
            metrics.COMMITS.inc()

    # ------------------------------------------------------------------ flow control

    def apply_backpressure(self) -> None:
        in_flight, in_bytes = self.in_flight, self.in_flight_bytes
        metrics.IN_FLIGHT.set(in_flight)
        metrics.IN_FLIGHT_BYTES.set(in_bytes)
        sinks_ok = self._sinks_ok()
        settings = self.settings
        if not self.consumer.paused:
            full = in_flight >= settings.max_inflight or in_bytes >= settings.max_inflight_bytes
            if full or not sinks_ok:
                self.consumer.pause()
                metrics.PAUSED.set(1)
                log.info("fetch_paused", in_flight=in_flight, bytes=in_bytes, sinks_ok=sinks_ok)
        elif (
            sinks_ok
            and in_flight <= settings.resume_below
            and in_bytes <= settings.max_inflight_bytes * settings.resume_ratio
        ):
            self.consumer.resume()
            metrics.PAUSED.set(0)
            log.info("fetch_resumed", in_flight=in_flight, bytes=in_bytes)
        self.apply_lanes()

    def lane_loads(self) -> dict[str, LaneLoad]:
        waiting = dict.fromkeys(self._topic_by_lane, 0)
        for tp, lag in self.consumer.lag(self._positions).items():
            waiting[self.lane_of(tp.topic)] += lag
        return {
            name: LaneLoad(self.lane_in_flight[name], waiting[name]) for name in self._topic_by_lane
        }

    def apply_lanes(self) -> None:
        """Hold back the lanes the rule says must yield (worker.lanes)."""
        if len(self.lanes) < 2:
            return
        loads = self._loads = self.lane_loads()
        held = self.gate.paused(loads)
        if held != self._held:
            self._held = held
            self.consumer.hold_topics(frozenset(self._topic_by_lane[name] for name in held))
            log.debug("lanes_held", lanes=sorted(held))
        for name, load in loads.items():
            metrics.LANE_IN_FLIGHT.labels(name).set(load.in_flight)
            metrics.LANE_WAITING.labels(name).set(load.waiting)
            metrics.LANE_HELD.labels(name).set(1 if name in held else 0)

    def maybe_report_lag(self) -> None:
        now = self.clock()
        if now - self._last_lag < _LAG_INTERVAL_S:
            return
        self._last_lag = now
        for tp, lag in self.consumer.lag(self._positions).items():
            metrics.CONSUMER_LAG.labels(tp.topic, str(tp.partition)).set(lag)
        oldest = self.tracker.oldest_uncommitted()
        metrics.OLDEST_UNCOMMITTED.set(0 if oldest is None else max(0.0, now - oldest))
        self._report_engine()

    # ------------------------------------------------------------------ rebalance

    def on_assigned(self, assigned: set[TopicPartition]) -> None:
        # A partition that comes back to this worker keeps kafka-python's fetch position,
        # past the records dropped or still unanswered at the revoke: rewind to the first
        # of them (at-least-once; answered ones are skipped at admission).
        rewind, self._rewind = self._rewind, {}
        for tp in assigned:
            if tp in rewind:
                self.consumer.seek(tp, rewind[tp])
        self.tracker.assign(assigned)
        self.consumer.reapply_pause(assigned)
        self._on_assigned_count(len(self.consumer.assignment()))
        log.info("partitions_assigned", partitions=_names(assigned))

    def on_revoked(self, revoked: set[TopicPartition], *, lost: bool = False) -> None:
        """Commit what is done; what is not will be redelivered to the new owner.

        `lost` (see `on_lost`): the group has already given these partitions to another
        member; nothing is committed and nothing is rewound.
        """
        self.absorb_written()
        if self.committer.rewinds_to_commit:
            # A transaction still running may yet commit these partitions (the group
            # accepts this member's generation until it rejoins), or may have committed
            # unread: wait for it, so the seek-back below starts from the real commit
            # (from an older one, the next transaction would publish results again).
            with contextlib.suppress(Exception):  # a fault stays sticky in the committer
                self._committed(self.committer.settle(timeout_s=_TXN_SETTLE_S))
        dropped = self.batcher.drop(lambda item: item.tp in revoked)
        for tp in revoked:
            # Where to come back to if this partition stays here: the first record not
            # answered; with transactional results, the first record not committed (the
            # answered ones' results wait in memory for the commit, dropped just below).
            if lost:
                self._rewind.pop(tp, None)
                continue
            if self.committer.rewinds_to_commit:
                offset = self.tracker.uncommitted_from(tp)
            else:
                offset = self.tracker.resume_offset(tp)
            if offset is not None:
                self._rewind[tp] = offset
        for tp in revoked:
            self.lane_in_flight[self.lane_of(tp.topic)] -= self.tracker.in_flight_for(tp)
        final = self._capped(self.tracker.revoke(revoked))
        if self.dead_letters is not None:  # their letters go on, holding nothing here
            self.dead_letters.release(revoked)
        for tp in revoked:
            self._positions.pop(tp, None)
            with contextlib.suppress(KeyError):
                metrics.CONSUMER_LAG.remove(tp.topic, str(tp.partition))
        if final and not lost:
            self.commit(final, blocking=False)
        for tp in revoked:
            self.epochs[tp] = self.epochs.get(tp, 0) + 1
        self.committer.revoked(revoked, {tp: self.epochs[tp] for tp in revoked})
        self._on_assigned_count(max(0, len(self.consumer.assignment()) - len(revoked)))
        if lost:
            log.warning(
                "partitions_lost",
                partitions=_names(revoked),
                undispatched_handed_back=len(dropped),
                not_committed={f"{tp.topic}/{tp.partition}": off for tp, off in final.items()},
                message="this worker was out of the group (session timeout) and its "
                "partitions went to another member; their done offsets are not committed",
            )
            return
        log.info(
            "partitions_revoked",
            partitions=_names(revoked),
            undispatched_handed_back=len(dropped),
        )

    def on_lost(self, lost: set[TopicPartition]) -> None:
        """The group took these partitions away without a revoke: this member's session
        expired (a long pause: GC, SIGSTOP, a VM freeze; a network partition), and another
        member owns them now and may have answered and committed past anything seen here.

        Unlike a revoke, nothing is committed (this member's generation is gone; the group
        refuses it) and nothing is rewound: kafka-python has dropped their fetch positions
        (its lost-membership path resets the assignment), so a partition that comes back
        starts at the group's committed offset. A seek back to this worker's stale first
        unanswered offset would re-read records the other member already answered, and
        commit offsets BELOW that member's commit (tests/reliability/test_zombie.py)."""
        self.on_revoked(lost, lost=True)

    # ------------------------------------------------------------------ drain

    def drain(self, timeout_s: float, can_finish: Callable[[], bool]) -> bool:
        """Stop fetching, finish what is in flight (within the timeout), write, commit.

        `can_finish` False (a thread that would finish the work has died) ends the wait
        at once: what is not written is handed back by not committing it.
        """
        deadline = self.clock() + timeout_s
        self.consumer.pause()
        pending = self.batcher.flush(self.clock())
        if pending is not None:
            self.dispatch(pending)
        log.info("draining", in_flight=self.tracker.in_flight)
        while self.tracker.in_flight and self.clock() < deadline and can_finish():
            self.wait_written(0.05)
            self.absorb_written()
            self.maybe_commit()
            self.consumer.poll(0, 1)  # keep the group membership alive while draining
        self.absorb_written()
        if self.dead_letters is not None:  # the letters' offsets commit once they are sent
            self.dead_letters.settle(timeout_s=max(1.0, min(10.0, deadline - self.clock())))
        self._committed(self.committer.settle(timeout_s=30))
        self.maybe_commit(force=True)  # a transactional commit runs in the background:
        self._committed(self.committer.settle(timeout_s=30))  # ... wait for it
        clean = self.tracker.in_flight == 0
        if not clean:
            log.warning("drain_incomplete_handing_back", in_flight=self.tracker.in_flight)
        return clean


def _names(partitions: set[TopicPartition]) -> list[str]:
    return sorted(f"{tp.topic}/{tp.partition}" for tp in partitions)


def _epoch_ms() -> int:
    return time.time_ns() // 1_000_000


__all__ = ["Intake"]
