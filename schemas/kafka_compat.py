"""Every work-around for a kafka-python 3.0.12 defect, in one place (the version is pinned
in pyproject.toml). Shared by the producer and the worker, which is why it lives in the
package both import; it is not part of the wire contract.

Each patch says what breaks without it, which test reproduces that, and what to check
before removing it. Searched upstream (dpkp/kafka-python) on 2026-12-03: no issue or fix
was found for any of the first three defects below (the fourth was found and searched for
the same way later that day); they are unreported as far as we know, and each test named
here is what would show a newer kafka-python no longer needs the patch.

1. `repair_idempotent_reset(producer)` -- an idempotent producer wedged for good.
   Defect: when in-flight batches expire (delivery timeout during a broker outage) the
   sender calls `TransactionManager.reset_producer_id()`, which sets the producer id to
   -1 but leaves the state READY; the sender asks for a new id only from UNINITIALIZED,
   and without an id its `run_once()` returns before draining or expiring anything: every
   later send waits, `flush()` times out, nothing is failed. Java's
   `resetIdempotentProducerId` goes back to UNINITIALIZED; the patch does the same.
   Reproduced by: tests/unit/test_kafka_compat.py (unpatched: no InitProducerId ever);
   end to end by tests/reliability/test_kafka_outage.py (the feeder's producer recovers).

2. `resume_partitions(consumer, *tps)` -- a resumed partition that never fetches again.
   Defect: records fetched for a partition when it is paused are parked in
   `Fetcher._paused_partition_records` (the KAFKA-7548 port, kafka-python PR #2981);
   `fetch_records()` restores them only when `Fetcher._next_partition_records` is None,
   but a drained PartitionRecords is left there (falsy, not None), so the partition is
   neither returned nor fetched again: a stall after every backpressure pause in about
   half the runs. The patch resets the drained slot.
   Reproduced by: tests/integration/test_stack.py::test_pause_resume_with_buffered_records.

3. `watch_fetch_responses(consumer, on_ok)` and `consumer_state(consumer)` -- a consumer
   that stops fetching after a broker restart while staying in its group (heartbeats fine,
   nothing logged above INFO): one CI run of the Kafka-outage test got no record for 120 s
   with the broker back. Not a fix: the worker's stall watchdog (worker.kafka_io) uses the
   hook to see successful fetch responses (records alone cannot tell "idle" from "stuck")
   and replaces the consumer; `consumer_state` logs the internals that decide fetching,
   to find the cause next time it happens. Read-only use of private attributes, guarded:
   on another kafka-python both degrade to "records only" and "unavailable".
   Reproduced by: tests/reliability/test_consumer_watchdog.py (a consumer made to stall).

4. `forget_stale_txn_offsets(producer)` -- offsets of an aborted transaction committed by
   the next one. Defect: `send_offsets_to_transaction` puts the offsets into the
   transaction manager's `_pending_txn_offset_commits`, and only a partition the broker
   accepted is removed from it; nothing clears it when the transaction aborts. After a
   TxnOffsetCommit refused with IllegalGeneration (the consumer group rebalanced between
   the snapshot of its metadata and the commit; the transaction is aborted as it must be),
   the next transaction's TxnOffsetCommit carries the stale offsets with the fresh ones,
   and the broker commits them: offsets of partitions this worker no longer owns, for
   results that were aborted. Those records are never redelivered and their results
   never reach the topic (seen as ~300-700 results missing of 3,000 in about one run in
   three of the rebalance test). The patch clears the map before a transaction begins,
   when no transaction is open and anything in it is left from a failed one.
   Reproduced by: tests/integration/test_kafka_txn_offsets.py (unpatched: the stale
   offset is committed); end to end by
   tests/reliability/test_results_topic.py::test_rebalances_keep_the_transactional_topic_exactly_once.

5. `cap_record_headers()` -- memory without bound per record. Not a defect of
   kafka-python but of the protocol's freedom: a record of 1 MB may carry 500,000 empty
   headers, and kafka-python makes a Python tuple of each as it decodes the record (35 MB
   of objects per record; 64 such records in flight OOM-killed a worker in a 1 GiB cgroup
   on every start, issue 39). Nothing in qbatch reads a request's headers, so a record with
   more than `MAX_RECORD_HEADERS` headers is decoded without them: the patch skips them by
   the record's length instead of parsing them. Every kafka-python consumer in the process
   gets the cap (the worker and the tool executor apply it at import; qbatch's own dead
   letters carry 9 headers).
   Reproduced by: tests/unit/test_kafka_compat.py (a 500,000-header record decoded with
   and without the patch); end to end by tests/reliability/test_worker_core.py.

Not patches, but call-order rules the worker follows for the same version (kept where
they are used, in worker/kafka_io.py): subscribe, *then* load the topic's metadata
before the first poll (else a second rebalance ~0.5 s after start, which under load
never finished); commit without blocking inside a rebalance callback (kafka-python runs
listeners on its IO thread, where a blocking commit raises RuntimeError); and a 2 s cap
on the reconnect backoff (the default grows to 30 s while a broker is down).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

__all__ = [
    "MAX_RECORD_HEADERS",
    "cap_record_headers",
    "consumer_state",
    "fetch_response_ok",
    "forget_stale_txn_offsets",
    "partition_states",
    "producer_in_fatal_state",
    "repair_idempotent_reset",
    "resume_partitions",
    "watch_fetch_responses",
]


# ---------------------------------------------------------------- 1. idempotent producer


def repair_idempotent_reset(producer: Any) -> Any:
    """Patch `producer` (a kafka-python KafkaProducer) in place; returns it."""
    tm = getattr(producer, "_transaction_manager", None)
    if tm is None or getattr(tm, "_qbatch_reset_repaired", False):
        return producer
    try:
        from kafka.producer.transaction_manager import TransactionState
    except ImportError:  # another kafka-python layout: nothing to repair
        return producer
    if tm.is_transactional() or not hasattr(tm, "_current_state"):
        return producer
    original = tm.reset_producer_id

    def reset_producer_id() -> None:
        original()
        with tm._lock:
            # kafka-python forbids this transition (is_transition_valid); Java's
            # resetIdempotentProducerId does exactly this for idempotent producers.
            if tm._current_state == TransactionState.READY:
                tm._current_state = TransactionState.UNINITIALIZED

    tm.reset_producer_id = reset_producer_id
    tm._qbatch_reset_repaired = True
    return producer


def producer_in_fatal_state(producer: Any) -> bool:
    """Whether a transactional producer can no longer be used (kafka-python keeps this in
    its transaction manager; there is no public accessor): it must be closed and made anew."""
    tm = getattr(producer, "_transaction_manager", None)
    return bool(tm is not None and tm.has_fatal_error())


# ---------------------------------------------------------------- 2. resume after pause


def resume_partitions(consumer: Any, *partitions: Any) -> None:
    """`consumer.resume()`, plus the reset of a drained parked-records slot (defect 2)."""
    consumer.resume(*partitions)
    fetcher = getattr(consumer, "_fetcher", None)
    current = getattr(fetcher, "_next_partition_records", None)
    if fetcher is not None and current is not None and not current:
        fetcher._next_partition_records = None


# ---------------------------------------------------------------- 3. stall diagnosis


def fetch_response_ok(response: Any) -> bool:
    """A FetchResponse without a session error, and with a partition without error (or no
    partitions at all: an incremental fetch session lists only the changed ones)."""
    if getattr(response, "error_code", 0):
        return False
    codes = [p.error_code for topic in response.responses for p in topic.partitions]
    return not codes or any(code == 0 for code in codes)


def watch_fetch_responses(consumer: Any, on_ok: Callable[[], None]) -> bool:
    """Call `on_ok()` for every healthy fetch response `consumer` handles; False when this
    kafka-python has no such hook (the caller then relies on records alone)."""
    fetcher = getattr(consumer, "_fetcher", None)
    handler = getattr(fetcher, "_handle_fetch_response", None)
    if fetcher is None or handler is None:
        return False

    def _handle(node_id: Any, fetch_offsets: Any, send_time: Any, response: Any) -> Any:
        try:
            if fetch_response_ok(response):
                on_ok()
        except Exception:
            pass
        return handler(node_id, fetch_offsets, send_time, response)

    fetcher._handle_fetch_response = _handle
    return True


def partition_states(consumer: Any) -> dict[Any, Any]:
    """kafka-python's per-partition fetch state (`is_fetchable()`, `paused`), {} if hidden."""
    return dict(getattr(getattr(consumer, "_subscription", None), "assignment", None) or {})


def consumer_state(consumer: Any) -> str:
    """kafka-python internals that decide whether the consumer fetches (for the log)."""
    try:
        now = time.monotonic()
        parts = []
        for tp, st in list(consumer._subscription.assignment.items()):
            pos = st.position
            retry = st.next_allowed_retry_time
            parts.append(
                f"p{tp.partition}:pos={pos and (pos.offset, pos.leader_epoch)}"
                f",fetchable={st.is_fetchable()},paused={st.paused}"
                f",validating={st.awaiting_validation},reset={st.reset_strategy}"
                f",retry_in={retry and round(retry - now, 1)},hw={st.highwater}"
            )
        fetcher, coord, mgr = consumer._fetcher, consumer._coordinator, consumer._manager
        pending = set(fetcher._nodes_with_pending_fetch_requests)
        parked = [*fetcher._paused_completed_fetches, *fetcher._paused_partition_records]
        epochs = {
            tp.partition: mgr.cluster.leader_epoch_for_partition(tp)
            for tp in list(consumer._subscription.assignment)
        }
        cluster = mgr.cluster

        def task(future: Any) -> str:
            return f"dead: {future.exception!r}" if future and future.is_done else "alive"

        conns = [
            f"{c} in_flight={len(c.in_flight_requests)} paused={sorted(c.paused)}"
            for c in list(mgr._conns.values())
        ]
        return (
            f"metadata_age_s={now - cluster._last_successful_refresh_ms / 1000:.1f}"
            f" need_update={cluster.need_update}"
            f" refresh_loop={task(cluster._refresh_loop_future)}"
            f" heartbeat_loop={task(coord._heartbeat_loop_future)}"
            f" coordinator={coord.coordinator_id} member={coord.state} gen={coord._generation}"
            f" rejoin={coord.rejoin_needed} pending_fetch={pending}"
            f" fetch_futures={len(fetcher._fetch_futures)}"
            f" completed={len(fetcher._completed_fetches)} parked={parked}"
            f" backoff={ {k: v[0] for k, v in list(mgr._backoff.items())} }"
            f" conns={conns} leader_epochs={epochs}"
            f" {' '.join(parts)}"
        )
    except Exception as exc:
        return f"unavailable ({exc!r})"


# ---------------------------------------------------------------- 4. aborted txn offsets


def forget_stale_txn_offsets(producer: Any) -> None:
    """Call before `begin_transaction()`: drop offsets a failed transaction left pending
    (defect 4), so the transaction about to begin commits only its own."""
    tm = getattr(producer, "_transaction_manager", None)
    pending = getattr(tm, "_pending_txn_offset_commits", None)
    if tm is None or not isinstance(pending, dict):
        return
    with tm._lock:
        pending.clear()


# ---------------------------------------------------------------- 5. headers without bound

MAX_RECORD_HEADERS = 64
"""A record with more headers than this reaches the worker with none (module docstring, 5)."""


def cap_record_headers(limit: int = MAX_RECORD_HEADERS) -> bool:
    """Make every record kafka-python decodes in this process keep its headers only when it
    has at most `limit` of them (defect 5); True once patched. Idempotent."""
    try:
        from kafka.record.default_records import ControlRecord, DefaultRecord, DefaultRecordBatch
        from kafka.record.util import decode_varint
    except ImportError:  # another kafka-python layout: left as it is
        return False
    if getattr(DefaultRecordBatch, "_qbatch_headers_capped", False):
        return True
    original = DefaultRecordBatch._read_msg

    def _read_msg(self: Any, decode_varint: Callable[..., Any] = decode_varint) -> Any:
        buffer = self._buffer
        length, start = decode_varint(buffer, self._pos)
        pos = start
        _, pos = decode_varint(buffer, pos)  # attributes
        ts_delta, pos = decode_varint(buffer, pos)
        offset_delta, pos = decode_varint(buffer, pos)
        key_len, pos = decode_varint(buffer, pos)
        key_at, pos = pos, pos + max(key_len, 0)
        value_len, pos = decode_varint(buffer, pos)
        value_at, pos = pos, pos + max(value_len, 0)
        count, _ = decode_varint(buffer, pos)
        if count <= limit:
            return original(self, decode_varint)
        # the headers are skipped unread: the record's length says where it ends
        self._pos = start + length
        if self.timestamp_type == self.LOG_APPEND_TIME:
            timestamp = self.max_timestamp
        else:
            timestamp = self.first_timestamp + ts_delta
        key = bytes(buffer[key_at : key_at + key_len]) if key_len >= 0 else None
        value = bytes(buffer[value_at : value_at + value_len]) if value_len >= 0 else None
        kind = ControlRecord if self.is_control_batch else DefaultRecord
        return kind(
            length, self.base_offset + offset_delta, timestamp, self.timestamp_type, key, value, []
        )

    DefaultRecordBatch._read_msg = _read_msg
    DefaultRecordBatch._qbatch_headers_capped = True
    return True
