"""Per-partition offset bookkeeping for at-least-once commits.

Kafka's committed offset N for a partition means "every record below N is done", but the
worker finishes records out of order (batches of different lengths, retries). Committing
the highest finished offset would therefore acknowledge records still in flight and lose
them on a crash. This tracker commits only the contiguous done prefix: the lowest offset
still in flight, or, with nothing in flight, one past the highest offset seen. Offsets may
have gaps (compaction, transaction markers); an offset never seen is simply not waited for.

All operations are O(1) amortized per record: each partition keeps its tracked offsets in
arrival order plus the set of those not yet done, and the head of the order is advanced past
done offsets only when the head itself finishes. Nothing scans the records of a partition.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = ["OffsetTracker"]

K = TypeVar("K", bound=Hashable)
TAKEN_RESOLUTION_S = 1.0


@dataclass(slots=True)
class _Partition:
    # Tracked offsets in increasing order, from the lowest still in flight onwards; done
    # offsets behind that head have already been popped.
    order: deque[int] = field(default_factory=deque)
    # Tracked offsets not yet done, with their weights (bytes). Invariant: order is empty or
    # order[0] is in pending.
    pending: dict[int, int] = field(default_factory=dict)
    # (offset, when it was tracked) of tracked offsets not yet covered by a commit, at most
    # one entry per TAKEN_RESOLUTION_S (memory bounded by time, not by records): an entry
    # stands for the offsets from its own to the next entry's, so the head's time is at
    # most that much older than the oldest uncommitted record's.
    taken: deque[tuple[int, float]] = field(default_factory=deque)
    highest: int | None = None
    committed: int | None = None
    first: int | None = None
    """The first offset tracked in this assignment."""

    def commit_offset(self) -> int | None:
        if self.order:
            return self.order[0]
        return None if self.highest is None else self.highest + 1


class OffsetTracker(Generic[K]):
    """Tracks received and finished records per partition and yields safe commit offsets.

    Partitions are keyed by any hashable (e.g. kafka-python's ``TopicPartition``). State for
    a partition lives from its first ``track`` (or ``assign``) until ``revoke``; a partition
    assigned again after a revoke starts fresh, because the new assignment resumes from the
    group's committed offset, which may be below anything this worker saw before (or, for a
    partition kafka-python leaves with the same member, from the ``resume_offset`` the
    service seeks it back to).
    """

    def __init__(self) -> None:
        self._parts: dict[K, _Partition] = {}
        self._in_flight = 0
        self._in_flight_weight = 0

    # -- assignment -----------------------------------------------------------------------

    def assign(self, partitions: Iterable[K]) -> None:
        """Starts tracking ``partitions``; a partition already held keeps its state.

        Keeping state matters: resetting a partition that is still owned would forget its
        in-flight records, and the next commit could then acknowledge them unfinished.
        """
        for p in partitions:
            self._parts.setdefault(p, _Partition())

    def resume_offset(self, partition: K) -> int | None:
        """The lowest offset of ``partition`` not yet done, or None if nothing is pending.

        Where a consumer that keeps the partition after a rebalance must seek back to:
        kafka-python keeps the fetch position of a partition that stays with the same
        member, so records dropped at the revoke would otherwise never come again.
        """
        state = self._parts.get(partition)
        if state is None or not state.pending:
            return None
        return state.order[0]

    def uncommitted_from(self, partition: K) -> int | None:
        """The lowest offset of ``partition`` not covered by a commit this tracker saw (None
        when everything tracked is committed, or nothing was tracked).

        Where to seek back to when "done" is not yet durable everywhere: with transactional
        results a done record's result waits in memory for the next commit, and is lost
        with the partition at a revoke, so everything past the last commit must come again.
        """
        state = self._parts.get(partition)
        if state is None or state.highest is None:
            return None
        start = state.committed if state.committed is not None else state.first
        if start is None or start > state.highest:
            return None
        return start

    def revoke(self, partitions: Iterable[K]) -> dict[K, int]:
        """Forgets ``partitions`` and returns their final commit offsets for the caller.

        Only offsets that advanced past the last ``mark_committed`` are returned, as with
        :meth:`committable`. Records still in flight are deliberately not covered: the new
        owner gets them redelivered, which is what at-least-once promises. Results that
        finish later for these partitions are ignored by :meth:`done`.
        """
        final: dict[K, int] = {}
        for p in partitions:
            state = self._parts.pop(p, None)
            if state is None:
                continue
            self._in_flight -= len(state.pending)
            self._in_flight_weight -= sum(state.pending.values())
            offset = state.commit_offset()
            if offset is not None and (state.committed is None or offset > state.committed):
                final[p] = offset
        return final

    @property
    def partitions(self) -> frozenset[K]:
        return frozenset(self._parts)

    def __contains__(self, partition: object) -> bool:
        return partition in self._parts

    # -- records --------------------------------------------------------------------------

    def track(self, partition: K, offset: int, *, weight: int = 0, at: float = 0.0) -> bool:
        """Records that ``offset`` was received; False means "already seen, skip it".

        ``weight`` (its bytes) counts in :attr:`in_flight_weight` until it is done; ``at``
        (when it was taken) dates it for :meth:`oldest_uncommitted` until a commit covers it.

        Within one assignment, offsets arrive in increasing order per partition, so an
        offset at or below the highest tracked one is a redelivery (e.g. the consumer
        re-fetched after a seek): it is either still in flight or already done, and
        processing it again would only duplicate work. An unknown partition is assigned
        implicitly so a caller without a rebalance listener still works.
        """
        if offset < 0:
            raise ValueError(f"offset must be >= 0, got {offset}")
        state = self._parts.get(partition)
        if state is None:
            state = self._parts[partition] = _Partition()
        if state.highest is not None and offset <= state.highest:
            return False
        if state.first is None:
            state.first = offset
        state.highest = offset
        state.order.append(offset)
        state.pending[offset] = weight
        if not state.taken or at - state.taken[-1][1] >= TAKEN_RESOLUTION_S:
            state.taken.append((offset, at))
        self._in_flight += 1
        self._in_flight_weight += weight
        return True

    def done(self, partition: K, offset: int) -> bool:
        """Marks ``offset`` finished (its result is durable); returns whether it counted.

        Unknown partitions and offsets are ignored rather than rejected: a result may
        finish after its partition was revoked, and a duplicate completion is harmless.
        """
        state = self._parts.get(partition)
        if state is None or offset not in state.pending:
            return False
        self._in_flight_weight -= state.pending.pop(offset)
        self._in_flight -= 1
        order = state.order
        while order and order[0] not in state.pending:
            order.popleft()
        return True

    # -- commits --------------------------------------------------------------------------

    def commit_offset(self, partition: K) -> int | None:
        """The offset it is safe to commit now for ``partition``; None if nothing tracked."""
        state = self._parts.get(partition)
        return None if state is None else state.commit_offset()

    def committable(self) -> dict[K, int]:
        """Commit offsets that advanced since the last :meth:`mark_committed`.

        Costs one step per held partition (not per record), cheap at the worker's commit
        interval.
        """
        out: dict[K, int] = {}
        for p, state in self._parts.items():
            offset = state.commit_offset()
            if offset is not None and (state.committed is None or offset > state.committed):
                out[p] = offset
        return out

    def advances(self, partition: K, offset: int) -> bool:
        """Whether committing ``offset`` would move ``partition``'s commit forward."""
        state = self._parts.get(partition)
        return state is not None and (state.committed is None or offset > state.committed)

    def mark_committed(self, offsets: Mapping[K, int]) -> None:
        """Records a successful commit, so the same offsets are not offered again.

        Partitions revoked between :meth:`committable` and the commit are ignored, and an
        older offset never moves the mark backwards (commits can complete out of order).
        """
        for p, offset in offsets.items():
            state = self._parts.get(p)
            if state is None:
                continue
            if state.committed is None or offset > state.committed:
                state.committed = offset
            taken = state.taken
            while len(taken) > 1 and taken[1][0] <= state.committed:
                taken.popleft()
            if state.highest is not None and state.committed > state.highest:
                taken.clear()

    def oldest_uncommitted(self) -> float | None:
        """When the oldest tracked record not covered by a commit was taken (the ``at`` it
        was tracked with), over all held partitions; None when every one is committed.
        Stuck commits show here even while every record is answered."""
        heads = [state.taken[0][1] for state in self._parts.values() if state.taken]
        return min(heads, default=None)

    # -- backpressure ---------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Records tracked but not done, over all held partitions."""
        return self._in_flight

    @property
    def in_flight_weight(self) -> int:
        """The summed weights (bytes) of the records tracked but not done."""
        return self._in_flight_weight

    def in_flight_for(self, partition: K) -> int:
        """Records tracked but not done for one partition (0 if not held)."""
        state = self._parts.get(partition)
        return 0 if state is None else len(state.pending)
