"""The micro-batching rule: when a group of pending requests is handed to the engine.

A batch is due when ``max_size`` items are gathered or its first item has waited
``max_wait_ms``, whichever comes first. An item's wait can start before it reaches the
batcher: the worker passes the time a record spent in Kafka (its timestamp to now), so the
window is a bound on the wait since submission rather than one paid on top of the broker's
hop (4-5 ms on the H200 machine, more behind a consumer lag). Larger batches use the GPU
better; the wait bound caps the latency a lone request pays at low load.

The rule is kept free of I/O, threads and real time so that it can be tested exactly under
a fake clock: the worker's loop drives it by calling :meth:`MicroBatcher.add` for every
record of a fetch and :meth:`MicroBatcher.poll` once after them, using
:meth:`MicroBatcher.time_until_due` as its poll timeout.

At most one batch is ever pending: an ``add`` that fills it hands it out, so
``len(batcher) < max_size`` between calls and no queue of ready batches can build up inside
the batcher. Only ``poll`` closes a batch by age: records that arrived together (one fetch)
therefore share a batch even with ``max_wait_ms=0``, which then means "no waiting for
company that has not arrived yet" rather than "one request per batch": per-request batches
would cost a Redis admission round trip and a thread hand-off to the engine each, for
records that were all in hand at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

__all__ = ["Batch", "BatchReason", "Clock", "MicroBatcher"]

T = TypeVar("T")

Clock = Callable[[], float]
BatchReason = Literal["size", "timeout", "flush"]


@dataclass(frozen=True, slots=True)
class Batch(Generic[T]):
    """A closed micro-batch, with the timing the worker exports as its batch-wait metric."""

    items: list[T]
    # When the earliest item started waiting (its arrival, back-dated by the wait it
    # brought along): the instant the wait bound is measured from.
    opened_at: float
    closed_at: float
    reason: BatchReason

    @property
    def wait_s(self) -> float:
        """How long the oldest item waited for company; the cost paid for batching."""
        return self.closed_at - self.opened_at

    def __len__(self) -> int:
        return len(self.items)


@dataclass(slots=True)
class _Entry(Generic[T]):
    priority: int
    # Arrival sequence: breaks priority ties in arrival order, so the sort stays stable.
    seq: int
    arrived_at: float
    item: T


class MicroBatcher(Generic[T]):
    """Gathers items into micro-batches by size or by the age of the oldest item.

    Membership of a batch is decided by arrival (the first ``max_size`` arrivals form it);
    only the order inside a batch follows priority, lower values first as in vLLM, so a
    high-priority item cannot starve earlier arrivals out of their batch.

    Every method that reads time takes an optional ``now`` so a loop can read the clock once
    per iteration and apply it consistently; without it the injected clock is read.
    """

    def __init__(
        self,
        max_size: int = 64,
        max_wait_ms: float = 50,
        clock: Clock = time.monotonic,
    ) -> None:
        if isinstance(max_size, bool) or not isinstance(max_size, int):
            raise TypeError(f"max_size must be an int, got {type(max_size).__name__}")
        if max_size < 1:
            raise ValueError(f"max_size must be >= 1, got {max_size}")
        if not max_wait_ms >= 0:  # also rejects NaN
            raise ValueError(f"max_wait_ms must be >= 0, got {max_wait_ms}")
        self._max_size = max_size
        self._max_wait_s = max_wait_ms / 1000.0
        self._clock = clock
        self._pending: list[_Entry[T]] = []
        # Cached earliest arrival among pending items; kept in step by add/drop/_close so
        # that the per-iteration poll is O(1) instead of a scan of the pending items.
        self._opened_at: float | None = None
        self._seq = 0

    @property
    def max_size(self) -> int:
        return self._max_size

    @property
    def max_wait_s(self) -> float:
        return self._max_wait_s

    def __len__(self) -> int:
        return len(self._pending)

    def _now(self, now: float | None) -> float:
        return self._clock() if now is None else now

    @property
    def opened_at(self) -> float | None:
        """Arrival time of the oldest pending item, or None when nothing is pending.

        After ``drop`` removes the oldest item this moves to the oldest item still waiting,
        so the deadline follows the items actually in the batch.
        """
        return self._opened_at

    def deadline(self) -> float | None:
        """Clock time at which the pending batch becomes due by age; None when empty."""
        opened = self.opened_at
        return None if opened is None else opened + self._max_wait_s

    def add(
        self, item: T, priority: int = 0, now: float | None = None, waited_s: float = 0.0
    ) -> Batch[T] | None:
        """Queue ``item``; returns the pending batch, this item included, if it is now full.

        ``waited_s`` is how long the item already waited before it got here (the worker:
        its time in Kafka). It counts against the window, clamped to ``[0, max_wait]``: a
        clock skewed backwards cannot hold a batch longer than the window, one skewed
        forwards can at most make the batch due at the next poll, as ``max_wait_ms=0``.

        A batch that is due by age is left for the next :meth:`poll`, which the caller runs
        once after adding everything it has in hand: an item that arrives after the pending
        batch's deadline but before that poll joins the batch, since taking it along costs
        no wait at all.
        """
        t = self._now(now)
        waited = waited_s if waited_s > 0 else 0.0  # negative (skew) and NaN: no wait
        arrived = t - min(waited, self._max_wait_s)
        self._pending.append(_Entry(priority, self._seq, arrived, item))
        self._seq += 1
        # min() rather than "first wins": a later item may have waited longer (and keeps
        # the bound honest if a caller-supplied ``now`` ever steps backwards).
        self._opened_at = arrived if self._opened_at is None else min(self._opened_at, arrived)
        if len(self._pending) >= self._max_size:
            return self._close(t, "size")
        return None

    def poll(self, now: float | None = None) -> Batch[T] | None:
        """The pending batch if its oldest item has waited ``max_wait_ms``, else None."""
        if not self._pending:
            return None
        t = self._now(now)
        deadline = self.deadline()
        assert deadline is not None
        if t >= deadline:
            return self._close(t, "timeout")
        return None

    def time_until_due(self, now: float | None = None) -> float | None:
        """Seconds until the pending batch is due (never negative); None when empty.

        The worker uses it as its consumer poll timeout, so that it wakes up in time to
        dispatch a partial batch instead of sleeping for a whole fetch interval.
        """
        deadline = self.deadline()
        if deadline is None:
            return None
        return max(0.0, deadline - self._now(now))

    def flush(self, now: float | None = None) -> Batch[T] | None:
        """Hands out whatever is pending regardless of size or age (shutdown, rebalance)."""
        if not self._pending:
            return None
        return self._close(self._now(now), "flush")

    def drop(self, predicate: Callable[[T], bool]) -> list[T]:
        """Removes and returns pending items matching ``predicate``, in arrival order.

        Used when partitions are revoked: their records will be redelivered to the new owner,
        so running them here would only waste GPU time and race the new owner's replies.
        """
        kept: list[_Entry[T]] = []
        dropped: list[T] = []
        for e in self._pending:
            if predicate(e.item):
                dropped.append(e.item)
            else:
                kept.append(e)
        if dropped:
            self._pending = kept
            self._opened_at = min((e.arrived_at for e in kept), default=None)
        return dropped

    def _close(self, now: float, reason: BatchReason) -> Batch[T]:
        # Invariant: fewer than max_size items are pending between calls, so the whole
        # pending list always fits in one batch.
        entries = self._pending
        opened = self._opened_at
        assert opened is not None and 0 < len(entries) <= self._max_size
        self._pending = []
        self._opened_at = None
        entries.sort(key=lambda e: (e.priority, e.seq))
        return Batch(
            items=[e.item for e in entries],
            opened_at=opened,
            closed_at=now,
            reason=reason,
        )
