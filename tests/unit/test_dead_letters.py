"""Dead letters (issue 39): a letter always fits the DLQ, sending never blocks the caller,
and a letter holds its own partition's commits only until it is delivered or given up.

Once, a refused letter was re-sent before every commit and the commit waited for it: a
letter too large for the DLQ producer, or a missing DLQ topic, stopped every commit of
every partition for good (and each send blocked the main loop 5 s)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from kafka.errors import KafkaError, KafkaTimeoutError, MessageSizeTooLargeError
from kafka.structs import TopicPartition

from schemas import ContractError, ErrorCode, dlq
from worker import metrics
from worker.config import WorkerSettings
from worker.dead_letters import DeadLetters, letter_of
from worker.records import SourceRecord

TP = TopicPartition("t", 3)


@dataclass
class Consumed:
    topic: str = "t"
    partition: int = 3
    offset: int = 42
    key: bytes = b"bad-1"
    value: bytes = b"\xff not json"
    timestamp: int = 0


def record(
    offset: int = 42, value: bytes = b"\xff not json", keep: int = 1_000_000
) -> SourceRecord:
    return SourceRecord.of(Consumed(offset=offset, value=value), keep)


class Future:
    def __init__(self, error: Exception | None) -> None:
        self.error = error

    def get(self, timeout: float) -> None:
        if self.error is not None:
            raise self.error


class Producer:
    """Refuses the first `refusals` sends (`error`); records every send."""

    def __init__(
        self, refusals: int = 0, fatal: bool = False, error: Exception | None = None
    ) -> None:
        self.refusals, self.fatal = refusals, fatal
        self.error = error or KafkaError("OutOfOrderSequenceNumberError")
        self.sent: list[tuple[bytes, bytes, list[tuple[str, bytes]]]] = []
        self.delivered: list[bytes] = []
        self.closed = False
        self.metadata = threading.Event()
        self.metadata.set()
        self.missing_topic = False
        self._transaction_manager = self

    def has_fatal_error(self) -> bool:
        return self.fatal

    def partitions_for(self, topic: str) -> set[int]:
        self.metadata.wait()
        if self.missing_topic:
            raise KafkaTimeoutError("Failed to update metadata after 5.0 secs.")
        return {0}

    def send(self, topic: str, key: bytes, value: bytes, headers: list[Any]) -> Future:
        self.sent.append((key, value, headers))
        if self.refusals > 0:
            self.refusals -= 1
            return Future(self.error)
        self.delivered.append(key)
        return Future(None)

    def flush(self, timeout: float) -> None:
        pass

    def close(self, timeout: float) -> None:
        self.closed = True


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def letters(producer: Producer, clock: Clock | None = None, **settings: Any) -> DeadLetters:
    return DeadLetters(
        WorkerSettings(dlq_topic="dlq", **settings),
        producer=producer,
        start=False,
        clock=clock or Clock(),
    )


def error() -> ContractError:
    return ContractError("not JSON", code=ErrorCode.invalid_request, request_id="bad-1")


def pump(dl: DeadLetters) -> None:
    """One round of the sender thread, on whatever is queued."""
    batch = list(dl._queue)
    dl._queue.clear()
    dl.pump(batch)


def test_a_letter_holds_its_partition_until_it_is_delivered() -> None:
    producer = Producer(refusals=1)
    dl = letters(producer)
    dl.send(record(42), error())
    dl.send(record(43), error())
    assert dl.holds() == {TP: 42} and dl.pending() == 2
    pump(dl)  # 42 refused, 43 delivered
    assert producer.delivered == [b"bad-1"] and dl.holds() == {TP: 42}
    pump(dl)
    assert dl.holds() == {} and dl.pending() == 0 and dl.pending_bytes() == 0
    headers = dict(producer.sent[-1][2])
    assert headers[dlq.SOURCE_OFFSET] == b"42"  # the same letter, dedupable
    assert headers[dlq.REQUEST_ID] == b"bad-1" and dlq.TRUNCATED not in headers


def test_a_letter_that_cannot_be_sent_is_given_up_and_counted() -> None:
    """A missing DLQ topic: retried for dlq_give_up_s, then the copy is dropped (the
    request was answered) and the partition commits on."""
    producer, clock = Producer(), Clock()
    producer.missing_topic = True
    dl = letters(producer, clock, dlq_give_up_s=30)
    lost = metrics.DEAD_LETTERS_LOST._value.get()
    dl.send(record(7), error())
    pump(dl)
    assert dl.holds() == {TP: 7}  # still trying
    clock.now += 31
    pump(dl)
    assert dl.holds() == {} and producer.delivered == []
    assert metrics.DEAD_LETTERS_LOST._value.get() == lost + 1


def test_a_record_over_the_dlq_size_goes_there_cut_to_fit() -> None:
    """A 1,048,401-byte record (under the broker's 1 MiB, over the envelope bound), or a
    100 MB gzip-bomb value kept only as its first bytes: the letter fits, says it is cut,
    and names the size as received."""
    producer = Producer()
    dl = letters(producer)
    big = record(value=b"x" * 1_048_401)
    dl.send(big, error())
    bomb = record(offset=43, value=b"a" * 100_000_000, keep=1_000_000)
    assert bomb.cut and len(bomb.value) == 1_000_000 and bomb.size == 100_000_000
    dl.send(bomb, error())
    pump(dl)
    for (key, value, headers), size in zip(producer.sent, (1_048_401, 100_000_000), strict=True):
        wire = len(key) + len(value) + sum(len(k) + len(v) for k, v in headers)
        assert wire <= 1_040_000
        assert dict(headers)[dlq.TRUNCATED] == b"1"
        assert dict(headers)[dlq.VALUE_BYTES] == str(size).encode()
        assert value == b"x" * len(value) or value == b"a" * len(value)
    assert dl.holds() == {}


def test_a_letter_the_broker_finds_too_large_is_halved() -> None:
    producer = Producer(refusals=2, error=MessageSizeTooLargeError("too large"))
    dl = letters(producer)
    dl.send(record(value=b"y" * 900_000), error())
    pump(dl)
    pump(dl)
    pump(dl)
    sizes = [len(value) for _, value, _ in producer.sent]
    assert sizes[1] == sizes[0] // 2 and sizes[2] == sizes[1] // 2
    assert producer.delivered == [b"bad-1"] and dl.holds() == {}


def test_a_producer_in_a_fatal_state_is_replaced() -> None:
    broken, fresh = Producer(fatal=True), Producer()
    dl = letters(broken)
    dl._new_producer = lambda: fresh  # type: ignore[method-assign]
    dl.send(record(), error())
    pump(dl)
    assert broken.closed and fresh.delivered == [b"bad-1"]


def test_send_returns_while_the_sender_is_stuck() -> None:
    """The sender thread waits for the topic's metadata (up to max_block_ms, on a missing
    topic); the caller (the main loop) never does."""
    producer = Producer()
    producer.metadata.clear()
    dl = DeadLetters(WorkerSettings(dlq_topic="dlq"), producer=producer)
    try:
        dl.send(record(1), error())
        dl.send(record(2), error())  # the thread is blocked on the first round
        assert dl.holds() == {TP: 1}
        producer.metadata.set()
        assert dl.settle(timeout_s=10)
        assert producer.delivered == [b"bad-1", b"bad-1"] and dl.holds() == {}
    finally:
        producer.metadata.set()
        dl.close(timeout_s=5)


def test_a_small_letter_is_the_record_unchanged() -> None:
    letter = letter_of(record(value=b"{}"), error(), 1_000_000, 0.0)
    assert letter.value == b"{}" and letter.key == b"bad-1"
    assert dlq.TRUNCATED not in dict(letter.headers)
