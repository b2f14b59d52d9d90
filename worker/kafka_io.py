"""The Kafka side of the worker and the tool executor: a consumer owned by one thread.

kafka-python's consumer is not thread-safe, so this adapter is used only from
the service's main loop: poll, commit, pause and resume all happen there. The
rebalance callbacks are the exception: kafka-python 3 runs them on its own IO
thread, but only while the main thread is blocked inside `poll()` or `close()`,
so they never run beside the loop; they must not block (see `commit_nowait`).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kafka import ConsumerRebalanceListener, KafkaConsumer
from kafka.errors import CommitFailedError, KafkaError, RebalanceInProgressError
from kafka.structs import OffsetAndMetadata, TopicPartition
from tenacity import (
    retry,
    retry_if_exception_type,
    retry_if_not_exception_type,
    stop_after_attempt,
    wait_exponential,
)

from schemas.kafka_compat import (
    cap_record_headers,
    consumer_state,
    partition_states,
    resume_partitions,
    watch_fetch_responses,
)
from worker.config import WorkerSettings
from worker.logs import log

cap_record_headers()  # a record's headers cost memory without bound (kafka_compat, 5)

Partitions = Callable[[set[TopicPartition]], None]
RECONNECT_BACKOFF_MAX_MS = 2_000


def time_in_kafka_s(record_timestamp_ms: int | None, dequeued_ms: int) -> float:
    """How long a record waited in Kafka: its timestamp (the producer's CreateTime, or the
    broker's LogAppendTime) to its dequeue, in seconds; 0 when the record has none (-1).

    The batcher counts it against `batch_max_wait_ms`, so a lone request is not charged
    the broker's hop on top of the window; the batcher caps it at the window, so skewed
    clocks cannot stretch a batch.
    """
    if record_timestamp_ms is None or record_timestamp_ms < 0:
        return 0.0
    return max(0, dequeued_ms - record_timestamp_ms) / 1000


class _Listener(ConsumerRebalanceListener):
    def __init__(
        self, on_revoked: Partitions, on_assigned: Partitions, on_lost: Partitions | None = None
    ) -> None:
        self._on_revoked = on_revoked
        self._on_assigned = on_assigned
        self._on_lost = on_lost or on_revoked

    def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        self._on_revoked(set(revoked))

    def on_partitions_lost(self, lost: Iterable[TopicPartition]) -> None:
        """kafka-python 3 calls this instead of `on_partitions_revoked` when the member was
        already out of the group (session expired): the partitions belong to another member
        and cannot be committed (the default would call `on_partitions_revoked`)."""
        self._on_lost(set(lost))

    def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        self._on_assigned(set(assigned))


_STALL_CHECK_S = 1.0
_POLL_GAP_S = 5.0
_REACH_CHECK_S = 5.0
"""How often, while nothing is fetched, the brokers are probed (a TCP connect)."""


@dataclass(frozen=True, slots=True)
class ConsumerConfig:
    """What a `RequestConsumer` needs from its process's settings: the worker's
    (`of_worker`) or the tool executor's, which consumes the tool-calls topic the same way
    (manual commits, pauses, the stall watchdog)."""

    topics: list[str]
    group: str
    client_id: str
    kafka_bootstrap: str
    kafka: dict[str, Any] = field(default_factory=dict)
    """`ConnectionSettings.kafka_kwargs()`: bootstrap servers and security."""
    auto_offset_reset: str = "earliest"
    session_timeout_ms: int = 45_000
    max_poll_interval_ms: int = 300_000
    max_poll_records: int = 2000
    isolation_level: str = "read_committed"
    metadata_max_age_ms: int = 5_000
    stall_timeout_s: float = 30.0

    @classmethod
    def of_worker(cls, settings: WorkerSettings) -> ConsumerConfig:
        return cls(
            topics=[lane.topic for lane in settings.lane_policies()],
            group=settings.group,
            client_id=f"qbatch-{settings.worker_id}",
            kafka_bootstrap=settings.kafka_bootstrap,
            kafka=settings.kafka_kwargs(),
            auto_offset_reset=settings.auto_offset_reset,
            session_timeout_ms=settings.session_timeout_ms,
            max_poll_interval_ms=settings.max_poll_interval_ms,
            max_poll_records=settings.poll_max_records,
            isolation_level=settings.isolation_level,
            metadata_max_age_ms=settings.metadata_max_age_ms,
            stall_timeout_s=settings.kafka_stall_timeout_s,
        )


class RequestConsumer:
    def __init__(
        self,
        settings: WorkerSettings | ConsumerConfig,
        on_reachability: Callable[[bool], None] = lambda ok: None,
    ) -> None:
        if not isinstance(settings, ConsumerConfig):
            settings = ConsumerConfig.of_worker(settings)
        self._settings = settings
        self._listener: _Listener | None = None
        self._paused = False
        """Every partition paused (backpressure, a sink down, draining)."""
        self._held_topics: frozenset[str] = frozenset()
        """Topics whose partitions are paused on their own (lanes yielding, at their cap)."""
        self.topics = list(settings.topics)
        self.recreated = 0  # consumers replaced by the stall watchdog (see _check_stall)
        self._stall_s = settings.stall_timeout_s
        self._stall_limit = self._stall_s
        self._last_fetch_ok = time.monotonic()
        self._last_poll_end = time.monotonic()
        self._next_check = 0.0
        self._unfetchable_since: dict[TopicPartition, float] = {}
        self.kafka_ok = True
        """False while no bootstrap broker accepts a connection (readiness reads it)."""
        self.on_reachability = on_reachability
        self._stopping: Callable[[], bool] = lambda: False
        self._next_reach_check = 0.0
        # kafka-python's constructor blocks until a bootstrap broker answers: say why first.
        self._note_reachable(self._brokers_reachable())
        self._consumer = self._new_consumer()

    def _new_consumer(self) -> KafkaConsumer:
        settings = self._settings
        consumer = KafkaConsumer(
            group_id=settings.group,
            enable_auto_commit=False,
            auto_offset_reset=settings.auto_offset_reset,
            session_timeout_ms=settings.session_timeout_ms,
            max_poll_interval_ms=settings.max_poll_interval_ms,
            max_poll_records=settings.max_poll_records,
            fetch_max_bytes=64 * 1024 * 1024,
            max_partition_fetch_bytes=4 * 1024 * 1024,
            # kafka-python's default grows the reconnect backoff to 30 s while a broker is
            # down, so after a 15 s outage the worker sat idle ~35 s more before it looked
            # again (tests/reliability, kafka outage). 2 s caps that wait.
            reconnect_backoff_max_ms=RECONNECT_BACKOFF_MAX_MS,
            client_id=settings.client_id,
            # read_committed (the default): a record of an aborted transaction is never
            # answered, one of an open transaction only once it commits. With
            # transactional results it is required: offsets are committed inside
            # transactions, and a read_committed consumer fetches committed offsets with
            # require_stable (KIP-447), so a new owner waits for a pending transaction
            # instead of reading the offsets before it and running its records again.
            isolation_level=settings.isolation_level,
            # new partitions of a topic are seen at the next metadata refresh
            metadata_max_age_ms=settings.metadata_max_age_ms,
            **settings.kafka,
        )
        self._watch_fetches(consumer)
        return consumer

    def subscribe(
        self,
        on_revoked: Partitions,
        on_assigned: Partitions,
        stopping: Callable[[], bool] = lambda: False,
        on_lost: Partitions | None = None,
    ) -> None:
        # Subscribe, THEN load the topic's metadata, before the first JoinGroup (first
        # poll). kafka-python 3.0.12 rebuilds the coordinator's metadata snapshot only on
        # a metadata update that happens after subscribe(); without one, the first
        # generation is joined with an empty snapshot (or an empty assignment: "No
        # partition metadata for topic") and the next periodic metadata refresh forces a
        # second rebalance ~0.5 s after start. That rebalance is what dropped records
        # (see Worker._on_assigned) and, under load, never finished: the member expired,
        # the group went Empty and poll() spun at ~90% CPU without consuming.
        self._listener = _Listener(on_revoked, on_assigned, on_lost)
        self._stopping = stopping
        self._subscribe()

    def _subscribe(self) -> None:
        self._consumer.subscribe(self.topics, listener=self._listener)
        self._note_reachable(self._brokers_reachable())
        deadline = time.monotonic() + 30

        def missing() -> list[str]:
            try:
                return [t for t in self.topics if not self._consumer.partitions_for_topic(t)]
            except KafkaError as exc:
                # A broker down while this worker starts (a restart during a broker
                # outage, in the chaos soak): its metadata request fails. Ask again; the
                # consumer itself rides the outage out once subscribed.
                log.info("topic_metadata_retry", error=f"{type(exc).__name__}: {exc}")
                return list(self.topics)

        while missing() and time.monotonic() < deadline and not self._stopping():
            time.sleep(0.2)  # topic not created yet: go on after 30 s (rebalance later)
        if missing():
            log.warning("lane_topics_missing", topics=missing())

    def poll(self, timeout_s: float, max_records: int) -> list[Any]:
        start = time.monotonic()
        if start - self._last_poll_end > _POLL_GAP_S:
            # The loop was busy elsewhere (a long commit, a drain): no fetch could be sent
            # meanwhile, so that time is not a stall.
            self._reset_watch(start)
        batches = self._consumer.poll(
            timeout_ms=max(0, int(timeout_s * 1000)), max_records=max(1, max_records)
        )
        records: list[Any] = []
        for chunk in batches.values():
            records.extend(chunk)
        now = self._last_poll_end = time.monotonic()
        if records:
            self._last_fetch_ok = now
        if now >= self._next_reach_check:
            self._next_reach_check = now + _REACH_CHECK_S
            fetching = now - self._last_fetch_ok < _REACH_CHECK_S
            self._note_reachable(fetching or self._brokers_reachable())
        if self._stall_s > 0 and now >= self._next_check:
            self._next_check = now + _STALL_CHECK_S
            self._check_stall(now)
        return records

    # ------------------------------------------------------------------ stall watchdog
    #
    # kafka-python 3.0.12 can come out of a broker restart with a consumer that is in the
    # group (heartbeats fine, nothing logged above INFO) but never fetches again: one CI
    # run of tests/reliability/test_kafka_outage.py got no result for 120 s after the
    # broker was back. The watchdog notices "assigned, not paused by us, brokers
    # reachable, and no healthy fetch response (or a partition not fetchable) for
    # kafka_stall_timeout_s", logs kafka-python's internal state (to find the cause) and
    # replaces the KafkaConsumer: the old one is closed (its partitions revoked through
    # the listener, as in a rebalance), a new one joins the group.

    def _watch_fetches(self, consumer: KafkaConsumer) -> None:
        watch_fetch_responses(consumer, self._fetch_ok)

    def _fetch_ok(self) -> None:
        self._last_fetch_ok = time.monotonic()

    def _reset_watch(self, now: float) -> None:
        self._last_fetch_ok = now
        self._unfetchable_since.clear()

    def _check_stall(self, now: float) -> None:
        assigned = self.assignment()
        if not assigned or self._paused or all(tp.topic in self._held_topics for tp in assigned):
            self._reset_watch(now)  # nothing is meant to be fetched now
            return
        reasons: list[str] = []
        if now - self._last_fetch_ok > self._stall_limit:
            reasons.append(f"no fetch response for {now - self._last_fetch_ok:.0f}s")
        states = partition_states(self._consumer)
        for tp in assigned:
            state = states.get(tp)
            if state is None or getattr(state, "paused", False) or state.is_fetchable():
                self._unfetchable_since.pop(tp, None)
                continue
            since = self._unfetchable_since.setdefault(tp, now)
            if now - since > self._stall_limit:
                reasons.append(f"partition {tp.partition} not fetchable for {now - since:.0f}s")
        if not reasons:
            if now - self._last_fetch_ok < _STALL_CHECK_S * 2:
                self._stall_limit = self._stall_s  # healthy again: back to the base limit
            return
        if not self._brokers_reachable():
            # Kafka is down: kafka-python reconnects by itself; a new consumer would not help.
            self._reset_watch(now)
            return
        log.warning(
            "kafka_consumer_stalled",
            reasons=reasons,
            action="replacing the KafkaConsumer",
            state=consumer_state(self._consumer),
        )
        self._recreate()
        # A cause a new consumer does not cure (a partition offline while the broker
        # answers) must not make the worker rejoin every 30 s: back off up to 10 min.
        self._stall_limit = min(self._stall_limit * 2, 600.0)
        self._reset_watch(time.monotonic())

    def _brokers_reachable(self) -> bool:
        for server in self._settings.kafka_bootstrap.split(","):
            host, _, port = server.strip().rpartition(":")
            try:
                with socket.create_connection((host.strip("[]") or "localhost", int(port)), 1):
                    return True
            except (OSError, ValueError):
                continue
        return False

    def _note_reachable(self, ok: bool) -> None:
        """One plain line when Kafka goes away or comes back (kafka-python's own errors
        are rate-limited by worker.logs)."""
        if ok == self.kafka_ok:
            return
        self.kafka_ok = ok
        self.on_reachability(ok)
        if ok:
            log.info("kafka_reachable", bootstrap=self._settings.kafka_bootstrap)
        else:
            log.warning(
                "kafka_unreachable",
                bootstrap=self._settings.kafka_bootstrap,
                message=f"waiting for Kafka at {self._settings.kafka_bootstrap}",
            )

    def _recreate(self) -> None:
        """Close the consumer (revoking its partitions) and join the group with a new one."""
        old = self._consumer
        try:
            old.close(autocommit=False, timeout_ms=5_000)
        except Exception as exc:
            log.warning("kafka_consumer_close_failed", error=repr(exc))
        self._consumer = self._new_consumer()
        self.recreated += 1
        if self._listener is not None:
            self._subscribe()
        if self._paused:
            self.pause()

    def assignment(self) -> set[TopicPartition]:
        return set(self._consumer.assignment())

    def group_metadata(self) -> Any:
        """The group generation and member (KIP-447), for a transactional offset commit."""
        return self._consumer.group_metadata()

    @property
    def paused(self) -> bool:
        return self._paused

    def pause(self) -> None:
        """Pause every partition (backpressure); `resume` undoes it."""
        self._paused = True
        self._apply_pauses()

    def resume(self) -> None:
        self._paused = False
        self._apply_pauses()

    def hold_topics(self, topics: frozenset[str]) -> None:
        """Keep exactly these topics' partitions paused (lanes), besides a global pause."""
        if topics != self._held_topics:
            self._held_topics = topics
            self._apply_pauses()

    def reapply_pause(self, assigned: set[TopicPartition]) -> None:
        """A rebalance hands out partitions unpaused; keep them paused while we are."""
        if assigned:
            self._apply_pauses()

    def _apply_pauses(self) -> None:
        assigned = self.assignment()
        want = {tp for tp in assigned if self._paused or tp.topic in self._held_topics}
        now = set(self._consumer.paused())
        if want - now:
            self._consumer.pause(*(want - now))
        if now - want:
            resume_partitions(self._consumer, *(now - want))

    @retry(
        retry=retry_if_exception_type(KafkaError)
        & retry_if_not_exception_type((CommitFailedError, RebalanceInProgressError)),
        wait=wait_exponential(multiplier=0.1, max=2),
        stop=stop_after_attempt(5),
        reraise=True,
    )
    def commit(self, offsets: Mapping[TopicPartition, int]) -> None:
        """Commit `offsets` (next offset to read, per partition). Retries transient errors."""
        if offsets:
            self._consumer.commit(
                offsets={tp: OffsetAndMetadata(off, "", -1) for tp, off in offsets.items()}
            )

    def commit_nowait(self, offsets: Mapping[TopicPartition, int]) -> None:
        """Commit `offsets` without blocking; for the partitions-revoked callback.

        kafka-python 3.0.12 runs rebalance listeners on its IO thread, where the blocking
        `commit()` raises RuntimeError ("Cannot block on net.run() from the IO thread
        itself"): the rebalance failed and the exception escaped `poll()`, killing the
        worker whenever another worker joined or left the group. The async commit is
        queued on that IO loop ahead of the JoinGroup request; if it does not land, the
        new owner only gets those records redelivered, finds their results in Redis and
        skips them.
        """
        if not offsets:
            return

        def _done(_offsets: Any, response: Any) -> None:
            if isinstance(response, Exception):
                log.warning("revoke_commit_failed", error=str(response))

        self._consumer.commit_async(
            offsets={tp: OffsetAndMetadata(off, "", -1) for tp, off in offsets.items()},
            callback=_done,
        )

    def seek(self, tp: TopicPartition, offset: int) -> None:
        """Non-blocking: the next fetch of `tp` starts at `offset`."""
        self._consumer.seek(tp, offset)

    def lag(self, positions: Mapping[TopicPartition, int]) -> dict[TopicPartition, int]:
        """Records behind the high-water mark, from fetch metadata (no extra request)."""
        lags = {}
        for tp in self.assignment():
            high = self._consumer.highwater(tp)
            pos = positions.get(tp)
            if high is not None and pos is not None:
                lags[tp] = max(0, high - pos)
        return lags

    def position(self, tp: TopicPartition) -> int | None:
        try:
            return int(self._consumer.position(tp, timeout_ms=100))
        except Exception:
            return None

    def close(self) -> None:
        self._consumer.close(autocommit=False)
