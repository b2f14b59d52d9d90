"""A dead letter is durable before its record's offset is committed: a send the broker
refused is sent again by the next flush, and flush() raises (the commit waits) until it
is delivered (the chaos soak lost 25 dead letters to OutOfOrderSequenceNumberError)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from kafka.errors import KafkaError
from tenacity import stop_after_attempt, wait_none

from schemas import ContractError, ErrorCode
from worker.config import WorkerSettings
from worker.dead_letters import DeadLetters


@dataclass
class Record:
    topic: str = "t"
    partition: int = 3
    offset: int = 42
    key: bytes = b"bad-1"
    value: bytes = b"\xff not json"


class Future:
    def __init__(self, error: Exception | None) -> None:
        self.error = error

    def add_errback(self, fn: Any) -> None:
        if self.error is not None:
            fn(self.error)  # as kafka-python does on its IO thread before flush returns


class Producer:
    """Refuses the first `refusals` sends; records every send."""

    def __init__(self, refusals: int, fatal: bool = False) -> None:
        self.refusals, self.fatal = refusals, fatal
        self.sent: list[tuple[bytes, list[tuple[str, bytes]]]] = []
        self.delivered: list[bytes] = []
        self.closed = False
        self._transaction_manager = self

    def has_fatal_error(self) -> bool:
        return self.fatal

    def send(self, topic: str, key: bytes, value: bytes, headers: list[Any]) -> Future:
        self.sent.append((key, headers))
        if self.refusals > 0:
            self.refusals -= 1
            return Future(KafkaError("OutOfOrderSequenceNumberError"))
        self.delivered.append(key)
        return Future(None)

    def flush(self, timeout: float) -> None:
        pass

    def close(self, timeout: float) -> None:
        self.closed = True


def letters(producer: Producer) -> DeadLetters:
    return DeadLetters(WorkerSettings(dlq_topic="dlq"), producer=producer)


def error() -> ContractError:
    return ContractError("not JSON", code=ErrorCode.invalid_request)


def test_a_refused_letter_is_sent_again_before_the_commit() -> None:
    producer = Producer(refusals=1)
    dl = letters(producer)
    dl.send(Record(), error())
    assert producer.delivered == []
    DeadLetters.flush.retry_with(wait=wait_none())(dl)  # type: ignore[attr-defined]
    assert producer.delivered == [b"bad-1"]
    assert len(producer.sent) == 2
    headers = dict(producer.sent[1][1])
    assert headers["qbatch.source.offset"] == b"42"  # the same letter, dedupable


def test_flush_raises_while_a_letter_is_still_refused() -> None:
    producer = Producer(refusals=10)
    dl = letters(producer)
    dl.send(Record(), error())
    flush = DeadLetters.flush.retry_with(  # type: ignore[attr-defined]
        wait=wait_none(), stop=stop_after_attempt(3)
    )
    with pytest.raises(KafkaError, match="not delivered"):
        flush(dl)
    assert producer.delivered == []
    producer.refusals = 0
    flush(dl)  # the letter was kept: the next commit's flush delivers it
    assert producer.delivered == [b"bad-1"]


def test_a_producer_in_a_fatal_state_is_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    broken, fresh = Producer(refusals=1, fatal=True), Producer(refusals=0)
    dl = letters(broken)
    monkeypatch.setattr(dl, "_new_producer", lambda: fresh)
    dl.send(Record(), error())
    DeadLetters.flush.retry_with(wait=wait_none())(dl)  # type: ignore[attr-defined]
    assert broken.closed and fresh.delivered == [b"bad-1"]


def test_nothing_refused_nothing_resent() -> None:
    producer = Producer(refusals=0)
    dl = letters(producer)
    dl.send(Record(), error())
    dl.flush()
    assert len(producer.sent) == 1
