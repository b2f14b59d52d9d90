"""Outages the chaos soak found a worker mistaking for something else: a worker
(re)started while a broker is down must not die at subscribe (its first metadata request
may fail: it exited with KafkaConnectionError from `partitions_for_topic`), and a Redis
Cluster failing over is an outage for the sink, not a refusal of the result."""

from __future__ import annotations

from typing import Any

import pytest
import redis
from kafka.errors import KafkaConnectionError

from schemas.replica_ack import ReplicasBehind
from worker.config import WorkerSettings
from worker.kafka_io import RequestConsumer
from worker.sinks.base import SinkRefused, SinkUnavailable
from worker.sinks.redis_sink import call


class Consumer:
    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.asked = 0

    def subscribe(self, topics: list[str], listener: Any) -> None:
        self.topics = topics

    def partitions_for_topic(self, topic: str) -> set[int] | None:
        self.asked += 1
        if self.failures > 0:
            self.failures -= 1
            raise KafkaConnectionError("111 ECONNREFUSED")
        return {0, 1}


def test_subscribe_rides_out_a_failing_metadata_request() -> None:
    rc = object.__new__(RequestConsumer)  # no broker: only the subscribe step is under test
    rc._settings = WorkerSettings(kafka_bootstrap="127.0.0.1:1")
    rc.topics = ["qbatch.requests"]
    rc._consumer = Consumer(failures=2)  # type: ignore[assignment]
    rc._listener = None
    rc.kafka_ok = True
    rc.on_reachability = lambda ok: None
    rc._stopping = lambda: False
    rc._subscribe()
    assert rc._consumer.asked >= 3  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "exc",
    [
        redis.exceptions.ClusterDownError("The cluster is down"),
        redis.exceptions.MasterDownError("Link with MASTER is down"),
        redis.exceptions.TryAgainError("Multiple keys request during rehashing of slot"),
        redis.exceptions.SlotNotCoveredError("Slot 42 is not covered by the cluster."),
        redis.exceptions.RedisClusterException("Redis Cluster cannot be connected."),
    ],
)
def test_a_cluster_failing_over_is_an_outage_not_a_refusal(exc: Exception) -> None:
    """The sink pauses and retries on these; a refusal would answer the request `failed`
    (the chaos soak: a master failover failed 76 results and lost 67)."""

    def fail() -> None:
        raise exc

    with pytest.raises(SinkUnavailable):
        call(fail)


@pytest.mark.parametrize(
    "text",
    [
        "WRONGTYPE Operation against a key holding the wrong kind of value",
        "value is not an integer or out of range",  # ERR, stripped by redis-py
        "Error running script (call to f_0123): @user_script:3: bad argument",
        "Command # 2 (GET p:result:{r1}) of pipeline caused error: WRONGTYPE Operation "
        "against a key holding the wrong kind of value",
    ],
)
def test_a_real_refusal_stays_a_refusal(text: str) -> None:
    def fail() -> None:
        raise redis.exceptions.ResponseError(text)

    with pytest.raises(SinkRefused):
        call(fail)


@pytest.mark.parametrize(
    "text",
    [
        "BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE.",
        "MISCONF Redis is configured to save RDB snapshots, but it's currently unable to "
        "persist to disk.",
        "NOREPLICAS Not enough good replicas to write.",
        "UNBLOCKED client unblocked via CLIENT UNBLOCK",
        "SOMENEWSTATE a code this release does not know",
        # redis-py's cluster pipeline wraps the reply (mget_nonatomic on a cluster)
        "Command # 1 (MGET p:result:{bad-434}) of pipeline caused error: BUSY Redis is busy "
        "running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE.",
    ],
)
def test_a_reply_that_says_not_now_is_an_outage(text: str) -> None:
    """Issue 39: BUSY (another client's script past busy-reply-threshold) and MISCONF (a
    failed RDB/AOF write) were refusals: each result in flight was answered `failed`, that
    write failed too, and the offsets were committed: 40 of 40 and 50 of 50 results lost.
    Any code but the data ones (WRONGTYPE, ...) names a server state that passes."""

    def fail() -> None:
        raise redis.exceptions.ResponseError(text)

    with pytest.raises(SinkUnavailable):
        call(fail)


def test_a_socket_closed_under_the_reader_is_an_outage() -> None:
    """redis-py's cluster client closing a socket another thread reads (a layout reload
    after a failover) stopped a worker in CI's chaos soak."""

    def closed() -> None:
        raise ValueError("I/O operation on closed file.")

    with pytest.raises(SinkUnavailable):
        call(closed)

    def bug() -> None:
        raise ValueError("invalid literal for int()")

    with pytest.raises(ValueError, match="invalid literal"):  # a real bug still surfaces
        call(bug)


@pytest.mark.parametrize(
    ("exc", "timed_out"),
    [
        (redis.TimeoutError("Timeout reading from 127.0.0.1:6379"), True),
        (redis.TimeoutError("Timeout connecting to server"), False),
        # replicas slow to acknowledge: an outage however long (the CI chaos soak once had
        # a worker stop on 2 minutes of a master without its replica)
        (ReplicasBehind("0 of 1"), False),
    ],
)
def test_only_a_read_that_timed_out_may_count_as_a_stalled_call(
    exc: Exception, timed_out: bool
) -> None:
    def fail() -> None:
        raise exc

    with pytest.raises(SinkUnavailable) as caught:
        call(fail)
    assert caught.value.timed_out is timed_out
