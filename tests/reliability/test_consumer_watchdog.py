"""The worker's Kafka-consumer stall watchdog (worker/kafka_io.py, RequestConsumer).

A consumer that stays in its group but stops fetching (what kafka-python 3.0.12 did once
after a broker restart, tests/reliability/README.md) is simulated by parking every
assigned partition in "awaiting offset validation" with a retry time an hour away: no
fetch is sent, nothing is logged. The watchdog must notice within
kafka_stall_timeout_s, replace the KafkaConsumer (revoking and re-assigning the
partitions through the listener) and records must flow again.
"""

from __future__ import annotations

import time
from typing import Any

from tests.reliability.conftest import EnvLane, figures, produce
from worker.config import WorkerSettings
from worker.kafka_io import RequestConsumer


def _consume(rc: RequestConsumer, n: int, timeout: float) -> set[tuple[int, int]]:
    """(partition, offset) of what `rc` returns, until n distinct ones or the timeout."""
    got: set[tuple[int, int]] = set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and len(got) < n:
        for record in rc.poll(0.2, 500):
            got.add((record.partition, record.offset))
    return got


def test_stalled_consumer_is_replaced(lane: EnvLane) -> None:
    settings = WorkerSettings(
        engine="echo",
        kafka_bootstrap=lane.bootstrap,
        topic=lane.topic,
        bulk_topic=lane.bulk_topic,
        group=lane.group,
        kafka_stall_timeout_s=3,
    )
    events: list[tuple[str, set[Any]]] = []
    rc = RequestConsumer(settings)
    rc.subscribe(lambda p: events.append(("revoked", p)), lambda p: events.append(("assigned", p)))
    try:
        produce(lane, [(b"k%d" % i, b"v%d" % i) for i in range(200)])
        assert len(_consume(rc, 200, 30)) == 200
        # The stall: every partition waits for an offset validation that never comes.
        for state in rc._consumer._subscription.assignment.values():
            state._awaiting_validation = True
            state.next_allowed_retry_time = time.monotonic() + 3600
        stuck_at = time.monotonic()
        produce(lane, [(b"n%d" % i, b"n%d" % i) for i in range(100)])
        # no commit was made: the new member starts from `earliest` again (300 records)
        got = _consume(rc, 300, 30)
        recovered_s = time.monotonic() - stuck_at
        figures(
            "consumer_watchdog",
            stall_timeout_s=3,
            recreated=rc.recreated,
            records_after_stall=len(got),
            recovered_s=recovered_s,
        )
        assert rc.recreated == 1
        assert len(got) == 300, "records did not flow again after the consumer was replaced"
        # (kafka-python also reports empty revocations at each join)
        kinds = [kind for kind, partitions in events if partitions]
        assert kinds == ["assigned", "revoked", "assigned"], events
    finally:
        rc.close()
