"""kafka-python 3.0.12 work-arounds: the idempotent producer's id reset, the stall check."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from kafka.producer.transaction_manager import (
    ProducerIdAndEpoch,
    TransactionManager,
    TransactionState,
)

from schemas.kafka_compat import fetch_response_ok, repair_idempotent_reset


def _ready_manager() -> TransactionManager:
    tm = TransactionManager(transactional_id=None)
    tm.init_producer_id()  # UNINITIALIZED -> INITIALIZING, InitProducerId queued
    tm.next_request_handler(False)  # the sender takes it
    tm.set_producer_id_and_epoch(ProducerIdAndEpoch(7, 0))
    tm._transition_to(TransactionState.READY)
    return tm


def test_unpatched_reset_leaves_the_producer_without_an_id_forever() -> None:
    """The defect: after reset_producer_id() the sender's init_producer_id() is a no-op."""
    tm = _ready_manager()
    tm.reset_producer_id()  # what the sender does when an in-flight batch expired
    tm.init_producer_id()  # what the sender does on every loop while it has no id
    assert not tm.has_producer_id()
    assert tm._current_state is TransactionState.READY
    assert tm.next_request_handler(False) is None  # no InitProducerId: wedged


def test_repaired_reset_asks_for_a_new_producer_id() -> None:
    tm = _ready_manager()
    repair_idempotent_reset(SimpleNamespace(_transaction_manager=tm))
    tm.reset_producer_id()
    assert tm._current_state is TransactionState.UNINITIALIZED
    tm.init_producer_id()
    assert tm._current_state is TransactionState.INITIALIZING
    handler = tm.next_request_handler(False)
    assert handler is not None and type(handler).__name__ == "InitProducerIdHandler"


def test_repair_leaves_transactional_and_plain_producers_alone() -> None:
    plain = SimpleNamespace(_transaction_manager=None)
    assert repair_idempotent_reset(plain) is plain
    txn = TransactionManager(transactional_id="t1")
    original = txn.reset_producer_id
    repair_idempotent_reset(SimpleNamespace(_transaction_manager=txn))
    assert txn.reset_producer_id == original


def _response(error_code: int = 0, partition_codes: tuple[int, ...] = ()) -> Any:
    parts = [SimpleNamespace(error_code=c) for c in partition_codes]
    return SimpleNamespace(
        error_code=error_code, responses=[SimpleNamespace(topic="t", partitions=parts)]
    )


def testfetch_response_ok() -> None:
    assert fetch_response_ok(_response())  # incremental session: nothing changed
    assert fetch_response_ok(_response(partition_codes=(0, 74)))
    assert not fetch_response_ok(_response(partition_codes=(74, 74)))  # all fenced
    assert not fetch_response_ok(_response(error_code=70))  # fetch session not found


def test_kafka_python_internals_are_touched_only_in_the_compat_module() -> None:
    """Every patch of kafka-python lives in schemas/kafka_compat.py, with its defect, its
    reproducing test and what to check before removing it."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    private = re.compile(
        r"\b_(fetcher|subscription|coordinator|transaction_manager|next_partition_records"
        r"|paused_partition_records|handle_fetch_response|current_state)\b"
    )
    offenders = [
        f"{path.relative_to(root)}:{n}"
        for package in ("schemas", "producer", "worker")
        for path in (root / package).rglob("*.py")
        if path.name != "kafka_compat.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if private.search(line)
    ]
    assert offenders == []


def test_a_record_with_more_headers_than_the_cap_is_decoded_without_them() -> None:
    """Defect 5 (issue 39): 500,000 empty headers in a 1 MB record cost 35 MB of Python
    objects each while it was in flight. Patched, a record past MAX_RECORD_HEADERS comes
    without its headers (skipped by the record's length, not parsed) and the records
    around it decode as before, gzip-compressed batches included."""
    from kafka.record.default_records import DefaultRecordBatch, DefaultRecordBatchBuilder

    from schemas.kafka_compat import MAX_RECORD_HEADERS, cap_record_headers

    assert cap_record_headers() and cap_record_headers()  # idempotent
    for codec in (0, DefaultRecordBatch.CODEC_GZIP):
        builder = DefaultRecordBatchBuilder(2, codec, 0, -1, -1, -1, batch_size=2**30)
        builder.append(0, timestamp=1_000, key=b"k0", value=b"v0", headers=[("a", b"1")])
        builder.append(
            1, timestamp=1_001, key=b"k1", value=b"x" * 300, headers=[("", b"")] * 200_000
        )
        many = [("h", b"2")] * MAX_RECORD_HEADERS
        builder.append(2, timestamp=1_002, key=None, value=None, headers=many)
        batch = DefaultRecordBatch(bytes(builder.build()))
        batch.validate_crc()
        first, bomb, last = list(batch)
        assert (first.offset, first.key, first.value, first.headers) == (
            0,
            b"k0",
            b"v0",
            [("a", b"1")],
        )
        assert (bomb.offset, bomb.timestamp, bomb.key, bomb.value) == (1, 1_001, b"k1", b"x" * 300)
        assert bomb.headers == []
        assert (last.offset, last.key, last.value, last.headers) == (2, None, None, many)
