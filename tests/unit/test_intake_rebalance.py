"""Intake's rebalance callbacks with transactional results, without sockets: where a
partition that comes back is sought to (its last commit, after the transaction that
was running at the revoke has finished), and which completions still count."""

from __future__ import annotations

import queue
from collections.abc import Mapping
from typing import Any

import pytest
from kafka.structs import TopicPartition

from worker.config import WorkerSettings
from worker.intake import Intake
from worker.records import DispatchQueue
from worker.supervision import StrikeBook

TP = TopicPartition("qbatch.requests", 0)


class Consumer:
    def __init__(self) -> None:
        self.seeks: list[tuple[TopicPartition, int]] = []
        self.owned: set[TopicPartition] = set()

    def assignment(self) -> set[TopicPartition]:
        return set(self.owned)

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.seeks.append((tp, offset))

    def reapply_pause(self, partitions: set[TopicPartition]) -> None:
        return


class TransactionalCommitter:
    """A transaction for offsets below `in_flight` is running when the revoke comes."""

    rewinds_to_commit = True

    def __init__(self, in_flight: dict[TopicPartition, int], commits: bool) -> None:
        self.in_flight, self.commits = in_flight, commits
        self.settled = False

    def commit(self, offsets: Mapping[TopicPartition, int], *, blocking: bool = True) -> bool:
        return False

    def completed(self) -> list[Mapping[TopicPartition, int]]:
        return []

    def settle(self, timeout_s: float) -> list[Mapping[TopicPartition, int]]:
        self.settled = True
        return [self.in_flight] if self.commits else []

    def revoked(
        self, partitions: set[TopicPartition], epochs: Mapping[TopicPartition, int]
    ) -> None:
        self.revoked_epochs = dict(epochs)

    def close(self) -> None:
        return


def intake(committer: Any, consumer: Consumer) -> Intake:
    return Intake(
        WorkerSettings(engine="echo"),
        consumer,  # type: ignore[arg-type]
        committer,
        None,
        DispatchQueue(),
        queue.SimpleQueue(),
        strikes=StrikeBook(),
        worker_info=lambda *a, **k: None,
        pending_in_sinks=lambda: 0,
        sinks_ok=lambda: True,
        on_assigned=lambda n: None,
    )


@pytest.mark.parametrize("commits", [True, False], ids=["it-commits", "it-fails"])
def test_a_partition_that_comes_back_is_sought_to_the_settled_commit(commits: bool) -> None:
    consumer = Consumer()
    committer = TransactionalCommitter({TP: 10}, commits=commits)
    it = intake(committer, consumer)
    consumer.owned = {TP}
    it.on_assigned({TP})
    for offset in range(10):  # ten records taken and answered; their results wait for
        it.tracker.track(TP, offset)  # the transaction that is running
    it._mark_done([(TP, offset, 0) for offset in range(10)])

    it.on_revoked({TP})
    assert committer.settled
    assert committer.revoked_epochs == {TP: 1}
    it.on_assigned({TP})  # eager rebalance: the same partition comes back
    # committed by the running transaction: nothing to take again (a seek to 0 would
    # publish those ten results a second time); failed: all ten come again
    assert consumer.seeks == ([] if commits else [(TP, 0)])
    # a completion of the old assignment does not count for the new one
    it.tracker.track(TP, 10)
    it._mark_done([(TP, 10, 0)])
    assert it.tracker.in_flight == 1
    it._mark_done([(TP, 10, 1)])
    assert it.tracker.in_flight == 0


class PlainCommitter:
    """At-least-once (worker.commits.ConsumerCommitter): records every commit asked for."""

    rewinds_to_commit = False

    def __init__(self) -> None:
        self.commits: list[tuple[dict[TopicPartition, int], bool]] = []

    def commit(self, offsets: Mapping[TopicPartition, int], *, blocking: bool = True) -> bool:
        self.commits.append((dict(offsets), blocking))
        return True

    def completed(self) -> list[Mapping[TopicPartition, int]]:
        return []

    def settle(self, timeout_s: float) -> list[Mapping[TopicPartition, int]]:
        return []

    def revoked(
        self, partitions: set[TopicPartition], epochs: Mapping[TopicPartition, int]
    ) -> None:
        self.revoked_epochs = dict(epochs)

    def close(self) -> None:
        return


def holding(consumer: Consumer, committer: PlainCommitter) -> Intake:
    """Offsets 0-9 of TP taken; 0-3 answered, 4-9 still running."""
    it = intake(committer, consumer)
    consumer.owned = {TP}
    it.on_assigned({TP})
    for offset in range(10):
        it.tracker.track(TP, offset)
    it._mark_done([(TP, offset, 0) for offset in range(4)])
    return it


def test_a_revoked_partition_commits_its_done_prefix_and_rewinds_if_it_stays() -> None:
    consumer, committer = Consumer(), PlainCommitter()
    it = holding(consumer, committer)
    it.on_revoked({TP})
    assert committer.commits == [({TP: 4}, False)]
    it.on_assigned({TP})  # eager rebalance: kafka-python kept the fetch position (10)
    assert consumer.seeks == [(TP, 4)]


def test_a_lost_partition_is_neither_committed_nor_rewound() -> None:
    """Session expired (a long pause, SIGSTOP): another member owns the partition and may
    have committed past 10. kafka-python dropped its position, so when it comes back it
    starts at the group's commit; a seek to 4 would re-read what the other member
    answered and commit below its commit (tests/reliability/test_zombie.py)."""
    consumer, committer = Consumer(), PlainCommitter()
    it = holding(consumer, committer)
    it.on_lost({TP})
    assert committer.commits == []
    assert committer.revoked_epochs == {TP: 1}
    assert it.tracker.in_flight == 0 and TP not in it.tracker
    it.on_assigned({TP})
    assert consumer.seeks == []
    # the stale batch finishing late counts for nothing in the new assignment
    it.tracker.track(TP, 25)
    it._mark_done([(TP, offset, 0) for offset in range(4, 10)])
    assert it.tracker.in_flight == 1 and it.tracker.committable() == {TP: 25}


def test_a_loss_after_a_revoke_forgets_the_rewind() -> None:
    consumer, committer = Consumer(), PlainCommitter()
    it = holding(consumer, committer)
    it.on_revoked({TP})  # rewind to 4 recorded ...
    it.on_lost({TP})  # ... but the member was expelled before the partition came back
    it.on_assigned({TP})
    assert consumer.seeks == []


def test_the_listener_routes_a_loss() -> None:
    from worker.kafka_io import _Listener

    calls: list[tuple[str, set[TopicPartition]]] = []
    listener = _Listener(
        lambda p: calls.append(("revoked", p)),
        lambda p: calls.append(("assigned", p)),
        lambda p: calls.append(("lost", p)),
    )
    listener.on_partitions_lost([TP])
    listener.on_partitions_revoked([TP])
    assert calls == [("lost", {TP}), ("revoked", {TP})]
    plain = _Listener(lambda p: calls.append(("revoked", p)), lambda p: None)
    plain.on_partitions_lost([TP])  # no loss handler: handled as a revoke
    assert calls[-1] == ("revoked", {TP})


class Letters:
    """worker.dead_letters.DeadLetters' side that intake sees: the offsets held."""

    def __init__(self) -> None:
        self.held: dict[TopicPartition, int] = {}

    def holds(self) -> dict[TopicPartition, int]:
        return dict(self.held)

    def release(self, partitions: set[TopicPartition]) -> None:
        for tp in partitions:
            self.held.pop(tp, None)

    def pending(self) -> int:
        return len(self.held)

    def pending_bytes(self) -> int:
        return 0

    def settle(self, timeout_s: float) -> bool:
        return not self.held


def test_a_letter_not_sent_holds_its_partition_and_only_while_it_is_owned() -> None:
    """Issue 39: commits stop at a record whose dead letter is not delivered (not past it,
    as a flush failing before each commit once stopped every partition); a revoke commits
    up to it and lets go, so the partition coming back (after another member committed
    further) never commits below the group's offset."""
    consumer, committer, letters = Consumer(), PlainCommitter(), Letters()
    it = intake(committer, consumer)
    it.dead_letters = letters  # type: ignore[assignment]
    other = TopicPartition("qbatch.requests", 1)
    consumer.owned = {TP, other}
    it.on_assigned({TP, other})
    for offset in range(10):
        it.tracker.track(TP, offset)
        it.tracker.track(other, offset)
    it._mark_done([(tp, offset, 0) for tp in (TP, other) for offset in range(10)])
    letters.held = {TP: 4}
    assert it.committable() == {TP: 4, other: 10}
    it.maybe_commit(force=True)
    assert committer.commits[-1] == ({TP: 4, other: 10}, True)
    assert it.committable() == {}  # nothing new until the letter is sent
    it.on_revoked({TP, other})
    assert letters.held == {}  # let go: the next owner reads the record again
    it.on_assigned({TP})  # back, after the group's offset moved on (to 500, say)
    it.tracker.track(TP, 500)
    it._mark_done([(TP, 500, 1)])
    assert it.committable() == {TP: 501}
