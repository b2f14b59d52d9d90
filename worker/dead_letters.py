"""Dead letters: a bad record's bytes on the DLQ topic, with headers naming the fault and
its source (schemas.dlq).

A dead letter is a copy for operators; the request itself is answered in Redis (`failed`)
before its letter is even sent. Three rules keep the copy from ever costing more than a
copy (issue 39: a letter that never fit, or a missing DLQ topic, stopped every commit):

- **A letter always fits.** A record whose value, key and headers pass
  `dlq_max_record_bytes` goes there cut to the prefix that fits, with its size as received
  in `qbatch.value.bytes` and `qbatch.value.truncated: 1` (a 100 MB gzip-bomb value, a
  1,048,401-byte record plus its fault headers). A broker that still refuses it as too
  large (a topic whose `max.message.bytes` is smaller) gets half of it, down to 1 KiB.
- **Sending never blocks the caller.** `send` queues the letter; a thread of its own sends
  them, so a missing or unwritable topic blocks that thread (kafka-python waits up to
  `max_block_ms` for its metadata), never the main loop.
- **A letter holds only its own partition, and only for a while.** Until it is delivered
  its record's offset is not committed (`holds()`: intake caps each partition's commit
  there), so a crash sends it again; other partitions commit meanwhile. After
  `dlq_give_up_s` of failed attempts the copy is dropped: logged `dead_letter_lost`,
  counted in `qbatch_dead_letters_lost_total`, and the partition commits on.

Repeats are harmless: consumers dedupe dead letters by their source topic, partition and
offset headers.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kafka import KafkaProducer
from kafka.errors import KafkaError, MessageSizeTooLargeError, RecordListTooLargeError
from kafka.structs import TopicPartition

from schemas import ContractError, dlq
from schemas.kafka_compat import producer_in_fatal_state, repair_idempotent_reset
from worker import metrics
from worker.config import WorkerSettings
from worker.kafka_io import RECONNECT_BACKOFF_MAX_MS
from worker.logs import log
from worker.records import SourceRecord

RECORD_OVERHEAD = 256
"""Bytes a Kafka record (and its batch) adds around key, value and headers, rounded up."""
ROUND_S = 30.0
"""How long one round waits for its letters' acknowledgements."""
MIN_CUT = 1024
"""A letter refused as too large is halved down to this, then given up on."""
_TOO_LARGE = (MessageSizeTooLargeError, RecordListTooLargeError)


@dataclass(slots=True, eq=False)
class Letter:
    tp: TopicPartition
    offset: int
    key: bytes | None
    value: bytes
    headers: list[tuple[str, bytes]]
    born: float
    """When it was first queued (monotonic): it is given up `dlq_give_up_s` after."""
    size: int
    """The value's size as received."""
    born_bytes: int = 0
    """Its value's bytes when queued (what it counts in `pending_bytes`)."""
    holding: bool = True
    """Its offset still holds its partition's commits (not once the partition was
    revoked: the next owner reads the record again and sends its own letter)."""

    def cut_to(self, room: int) -> None:
        """Keep the first `room` bytes of the value, and say so in the headers."""
        if room >= len(self.value):
            return
        self.value = self.value[: max(0, room)]
        self.mark_cut()

    def mark_cut(self) -> None:
        """Headers saying the value is only the first bytes of the record's."""
        self.headers = [h for h in self.headers if h[0] not in (dlq.TRUNCATED, dlq.VALUE_BYTES)]
        self.headers += [(dlq.TRUNCATED, b"1"), (dlq.VALUE_BYTES, str(self.size).encode())]


def letter_of(record: SourceRecord, error: ContractError, max_bytes: int, now: float) -> Letter:
    """The dead letter of `record`: its bytes, cut to fit `max_bytes` with its headers."""
    headers = [
        (dlq.ERROR_CODE, error.code.value.encode()),
        (dlq.ERROR_MESSAGE, error.message[:4000].encode("utf-8", "replace")),
        (dlq.ERROR_PARAM, (error.param or "")[:1000].encode("utf-8", "replace")),
        (dlq.SOURCE_TOPIC, str(record.topic).encode()),
        (dlq.SOURCE_PARTITION, str(record.partition).encode()),
        (dlq.SOURCE_OFFSET, str(record.offset).encode()),
    ]
    if error.request_id:
        headers.append((dlq.REQUEST_ID, error.request_id.encode()))
    key = record.key[:1024] if record.key is not None else None
    letter = Letter(
        TopicPartition(record.topic, record.partition),
        record.offset,
        key,
        record.value,
        headers,
        now,
        record.size,
    )
    if record.cut:  # already only its first bytes (SourceRecord)
        letter.mark_cut()
    overhead = RECORD_OVERHEAD + len(key or b"") + sum(len(k) + len(v) + 8 for k, v in headers)
    letter.cut_to(max_bytes - overhead - 64)  # 64: the two headers a cut adds
    return letter


@dataclass(frozen=True, slots=True)
class DeadLetterConfig:
    """What `DeadLetters` needs from its process's settings (the worker's, `of_worker`, or
    the tool executor's: both send their bad records the same way)."""

    topic: str
    client_id: str
    kafka: dict[str, Any] = field(default_factory=dict)
    max_record_bytes: int = 1_040_000
    give_up_s: float = 60.0

    @classmethod
    def of_worker(cls, settings: WorkerSettings) -> DeadLetterConfig:
        return cls(
            topic=settings.dlq_topic,
            client_id=f"qbatch-dlq-{settings.worker_id}",
            kafka=settings.kafka_kwargs(),
            max_record_bytes=settings.dlq_max_record_bytes,
            give_up_s=settings.dlq_give_up_s,
        )


class DeadLetters:
    """Queues letters, sends them on a thread of its own, and tells intake which offsets
    must wait for theirs (see the module docstring)."""

    def __init__(
        self,
        settings: WorkerSettings | DeadLetterConfig,
        producer: Any = None,
        *,
        start: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(settings, DeadLetterConfig):
            settings = DeadLetterConfig.of_worker(settings)
        self._topic = settings.topic
        self._max_bytes = settings.max_record_bytes
        self._give_up_s = settings.give_up_s
        self._clock = clock
        self._config: dict[str, Any] = {
            "acks": "all",
            "retries": 3,
            "linger_ms": 5,
            "max_block_ms": 5_000,
            "max_request_size": max(1_048_576, self._max_bytes + 65_536),
            "reconnect_backoff_max_ms": RECONNECT_BACKOFF_MAX_MS,
            "client_id": settings.client_id,
            **settings.kafka,
        }
        self._producer = producer or self._new_producer()
        self._cond = threading.Condition()
        self._queue: deque[Letter] = deque()
        self._held: dict[TopicPartition, Counter[int]] = {}
        self._letters: set[Letter] = set()
        """Every letter not delivered or given up yet."""
        self._bytes = 0
        self._closing = False
        self._closed = threading.Event()
        self._backoff = 0.0
        self._last_error = ""
        self._thread: threading.Thread | None = None
        if start:
            self._thread = threading.Thread(target=self._run, name="qbatch-dlq", daemon=True)
            self._thread.start()

    def _new_producer(self) -> Any:
        return repair_idempotent_reset(KafkaProducer(**self._config))

    # ------------------------------------------------------------------ callers' side

    def send(self, record: SourceRecord, error: ContractError) -> None:
        """Queue `record`'s letter; returns at once."""
        letter = letter_of(record, error, self._max_bytes, self._clock())
        with self._cond:
            self._held.setdefault(letter.tp, Counter())[letter.offset] += 1
            letter.born_bytes = len(letter.value)
            self._bytes += letter.born_bytes
            self._letters.add(letter)
            self._queue.append(letter)
            metrics.DEAD_LETTERS_PENDING.set(self._pending())
            self._cond.notify()

    def holds(self) -> dict[TopicPartition, int]:
        """Per partition, the lowest offset whose letter is not delivered or given up yet:
        no commit of that partition may pass it."""
        with self._cond:
            return {tp: min(offsets) for tp, offsets in self._held.items() if offsets}

    def release(self, partitions: set[TopicPartition]) -> None:
        """These partitions were revoked (or lost): their letters are still sent, but no
        longer hold commits (the next owner's records and commits are its own; a hold
        kept here would cap a later assignment below the group's commit)."""
        with self._cond:
            for tp in partitions:
                self._held.pop(tp, None)
            for letter in self._letters:
                if letter.tp in partitions:
                    letter.holding = False

    def pending(self) -> int:
        """Letters not delivered or given up yet."""
        with self._cond:
            return self._pending()

    def pending_bytes(self) -> int:
        """Their values' bytes (they count against the worker's max_inflight_bytes)."""
        with self._cond:
            return self._bytes

    def _pending(self) -> int:
        return len(self._letters)

    def settle(self, timeout_s: float) -> bool:
        """Wait (draining) until every queued letter is delivered or given up; True if so."""
        deadline = self._clock() + timeout_s
        with self._cond:
            while self._pending():
                left = deadline - self._clock()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.1))
        return True

    def close(self, timeout_s: float = 10) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        with contextlib.suppress(KafkaError):
            self._producer.close(timeout=min(timeout_s, 10))

    # ------------------------------------------------------------------ the sender

    def _run(self) -> None:
        while True:
            if self._backoff:  # after a failed round; new letters do not cut it short
                self._closed.wait(self._backoff)
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if self._closing and not self._queue:
                    return
                batch = list(self._queue)
                self._queue.clear()
            try:
                self.pump(batch)
            except Exception as exc:  # this thread must not die: retried, then given up
                log.exception("dead_letter_round_failed")
                again: list[Letter] = []
                self._failed(batch, exc, again)
                with self._cond:
                    self._queue.extendleft(reversed(again))
                    self._backoff = 5.0

    def pump(self, batch: list[Letter]) -> None:
        """One round: send `batch`, settle what was delivered or is given up, queue the
        rest again (the sender thread's body; tests call it directly)."""
        again: list[Letter] = []
        try:
            if producer_in_fatal_state(self._producer):
                log.warning("dead_letter_producer_replaced")
                old, self._producer = self._producer, self._new_producer()
                with contextlib.suppress(KafkaError):
                    old.close(timeout=1)
            # one wait for the topic's metadata per round, not one per letter (a missing
            # topic made each send block max_block_ms)
            self._producer.partitions_for(self._topic)
        except Exception as exc:  # KafkaError, or ValueError for a topic name it refuses
            self._failed(batch, exc, again)
            batch = []
        sent = []
        for letter in batch:
            try:
                sent.append((letter, self._send(letter)))
            except Exception as exc:  # refused before sending (too large for the client)
                self._refused(letter, exc, again)
        try:
            if sent:
                self._producer.flush(timeout=ROUND_S)
        except Exception:
            pass  # each future says how its letter fared
        deadline = time.monotonic() + ROUND_S
        for letter, future in sent:
            try:  # a batch the broker split is done after flush returns: wait for it
                future.get(timeout=max(0.0, deadline - time.monotonic()))
            except Exception as exc:
                self._refused(letter, exc, again)
            else:
                self._settle(letter)
        with self._cond:
            self._queue.extendleft(reversed(again))
            self._backoff = min(max(0.2, self._backoff * 2), 5.0) if again else 0.0
            metrics.DEAD_LETTERS_PENDING.set(self._pending())
        if again:
            log.warning(
                "dead_letter_failed",
                topic=self._topic,
                count=len(again),
                error=self._last_error[:300],
                message="sent again; their partitions' commits wait for them",
            )

    def _refused(self, letter: Letter, exc: BaseException, again: list[Letter]) -> None:
        """A letter refused as too large is halved at once (down to MIN_CUT); any other
        refusal is retried until its give-up time."""
        if isinstance(exc, _TOO_LARGE) and len(letter.value) > MIN_CUT:
            self._last_error = f"{type(exc).__name__}: {exc} (halved)"
            letter.cut_to(max(MIN_CUT, len(letter.value) // 2))
            again.append(letter)
        else:
            self._failed([letter], exc, again)

    def _send(self, letter: Letter) -> Any:
        return self._producer.send(
            self._topic, key=letter.key, value=letter.value, headers=letter.headers
        )

    def _failed(self, letters: list[Letter], exc: BaseException, again: list[Letter]) -> None:
        now = self._clock()
        self._last_error = f"{type(exc).__name__}: {exc}"
        with self._cond:
            letters = [letter for letter in letters if letter in self._letters]  # not settled
        for letter in letters:
            if now - letter.born < self._give_up_s:
                again.append(letter)
                continue
            metrics.DEAD_LETTERS_LOST.inc()
            log.error(
                "dead_letter_lost",
                topic=self._topic,
                partition=letter.tp.partition,
                offset=letter.offset,
                error=f"{type(exc).__name__}: {exc}"[:300],
                message=f"the dead-letter copy could not be sent for {self._give_up_s:.0f}s "
                "and is dropped; the request itself was answered",
            )
            self._settle(letter)

    def _settle(self, letter: Letter) -> None:
        """Delivered or given up (once: a second call does nothing)."""
        with self._cond:
            if letter not in self._letters:
                return
            self._letters.discard(letter)
            self._bytes -= letter.born_bytes
            offsets = self._held.get(letter.tp) if letter.holding else None
            if offsets is not None:
                offsets[letter.offset] -= 1
                if offsets[letter.offset] <= 0:
                    del offsets[letter.offset]
                if not offsets:
                    del self._held[letter.tp]
            self._cond.notify_all()


__all__ = ["DeadLetters", "Letter", "letter_of"]
