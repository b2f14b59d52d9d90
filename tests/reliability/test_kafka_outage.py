"""Scenario 1: the Kafka broker is stopped mid-stream, then started again.

A PRIVATE stack (deploy/local/stack.sh with its own directory and ports) is used, so
the shared broker is never stopped. The broker is stopped for real (SIGTERM to its
process group, as `stack.sh down` does; not SIGSTOP) and started again by
`stack.sh up` on the same data directory. A producer (`QBatchClient`, retries on)
keeps submitting throughout: sends that Kafka does not acknowledge are counted as
not sent and sent again afterwards. The worker is never restarted. Afterwards every
acknowledged request has exactly one result, and the job counters prove once-only.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from kafka.errors import KafkaError

from producer.client import PublishError, QBatchClient, build_envelope
from tests.reliability.conftest import (
    PrivateStack,
    chat,
    done_lengths,
    figures,
    free_port,
    job_finished,
    log_events,
    make_lane,
    private_stack,
    produce_envelopes,
    wait_committed,
    wait_http,
    wait_job,
)

JOB = "job-kafka-outage"


@pytest.fixture(scope="module")
def pstack() -> Iterator[PrivateStack]:
    with private_stack("kafka-outage") as ps:
        yield ps


class Feeder(threading.Thread):
    """Submits `per_tick` requests every `tick` s until stopped; records what Kafka acked.

    After a failed flush the client is closed and a new one made. (kafka-python 3.0.12's
    idempotent producer whose batches expired during the outage used to stay wedged
    after the broker was back; QBatchClient now repairs that, see
    schemas/kafka_compat.py, but records that expired are not sent again by
    kafka-python, so the feeder still starts over with a fresh client.)
    """

    def __init__(
        self, make_client: Callable[[], QBatchClient], per_tick: int = 20, tick: float = 0.1
    ) -> None:
        super().__init__(daemon=True)
        self.make_client = make_client
        self.client = make_client()
        self.client_restarts = 0
        self.progress: list[tuple[float, int]] = []  # (time, acked so far)
        self.per_tick = per_tick
        self.tick = tick
        self.acked: set[str] = set()
        self.unacked: list[str] = []  # not acknowledged: to be sent again
        self.not_sent_events = 0
        self.stop_event = threading.Event()
        self._seq = 0

    def _send(self, rids: list[str]) -> list[str]:
        """Send and flush; returns the ids Kafka did not acknowledge."""
        futures = []
        failed: list[str] = []
        for rid in rids:
            env = build_envelope(
                {"messages": [{"role": "user", "content": f"outage {rid}"}], "max_tokens": 16},
                request_id=rid,
                job_id=JOB,
            )
            try:
                futures.append((rid, self.client.send(env)))
            except KafkaError:
                failed.append(rid)
        try:
            self.client.flush(futures, timeout=15)
        except PublishError as exc:
            failed.extend(exc.failed)
        except KafkaError:
            failed.extend(rid for rid, _ in futures)
        if failed:
            with contextlib.suppress(Exception):
                self.client.close(timeout=0)
            self.client = self.make_client()
            self.client_restarts += 1
        return failed

    def run(self) -> None:
        while not self.stop_event.is_set():
            rids = [f"ko{self._seq + i}" for i in range(self.per_tick)]
            self._seq += self.per_tick
            failed = self._send(rids)
            self.not_sent_events += len(failed)
            self.unacked.extend(failed)
            self.acked.update(set(rids) - set(failed))
            self.progress.append((time.monotonic(), len(self.acked)))
            time.sleep(self.tick)

    def resend_unacked(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while self.unacked and time.monotonic() < deadline:
            batch, self.unacked = self.unacked, []
            failed = self._send(batch)
            self.unacked.extend(failed)
            self.acked.update(set(batch) - set(failed))
            if failed:
                time.sleep(1)


def run_outage(pstack: PrivateStack, spawn: Any, outage_s: float, worker_log: Path) -> None:
    lane = make_lane("qbko", pstack.bootstrap, pstack.redis_url)
    lane.create_topics(partitions=4)
    r = redis.Redis.from_url(pstack.redis_url, decode_responses=True)
    port = free_port()
    worker = spawn(lane, "--echo-delay-ms", "5", "--max-inflight", "512", metrics_port=port)
    wait_http(port)

    def make_client() -> QBatchClient:
        return QBatchClient(
            bootstrap=lane.bootstrap,
            redis_url=lane.redis_url,
            topic=lane.topic,
            prefix=lane.prefix,
            producer_config={
                "request_timeout_ms": 5_000,
                "delivery_timeout_ms": 10_000,
                "max_block_ms": 3_000,
                "linger_ms": 5,
            },
            send_timeout_s=15,
        )

    feeder = Feeder(make_client)
    feeder.start()
    try:
        assert wait_job(r, lane.prefix, JOB, 300, 60) >= 300, "results never started flowing"
        before = job_finished(r, lane.prefix, JOB)
        t_stop = time.monotonic()
        pstack.stop_kafka()
        t_gone = time.monotonic()
        time.sleep(outage_s)
        assert worker.poll() is None, "the worker died while Kafka was down"
        during = job_finished(r, lane.prefix, JOB)
        t_up = time.monotonic()
        pstack.start()
        t_back = time.monotonic()
        at_back = job_finished(r, lane.prefix, JOB)
        # a probe from a fresh producer: the worker's recovery, whatever the feeder does
        probes = [chat(f"kprobe{i}", "probe", job_id=JOB) for i in range(50)]
        produce_envelopes(lane, probes)
        probe_ids = [p["request_id"] for p in probes]
        recovered_at = probes_at = None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and probes_at is None:
            if recovered_at is None and job_finished(r, lane.prefix, JOB) > at_back:
                recovered_at = time.monotonic()
            if all(done_lengths(r, lane.prefix, probe_ids)):
                probes_at = time.monotonic()
            time.sleep(0.05)
        assert recovered_at is not None and probes_at is not None, (
            "no result after the broker came back"
        )
        # the producer must get going again too: 200 more acknowledged sends
        acked_at_back = max((c for t, c in feeder.progress if t <= t_back), default=0)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and len(feeder.acked) < acked_at_back + 200:
            time.sleep(0.2)
        feeder_back = next(
            (t for t, c in feeder.progress if t > t_back and c > acked_at_back), None
        )
    finally:
        feeder.stop_event.set()
        feeder.join(60)
    feeder.resend_unacked()
    assert not feeder.unacked, f"{len(feeder.unacked)} requests could not be sent after recovery"
    rids = sorted(feeder.acked) + probe_ids
    n = len(rids)
    done = wait_job(r, lane.prefix, JOB, n, 120)
    assert wait_committed(lane, 60), "offsets did not reach the log end"
    lengths = done_lengths(r, lane.prefix, rids)
    results_found = sum(1 for x in lengths if x >= 1)
    job = r.hgetall(f"{lane.prefix}:job:{JOB}")
    stream_len = r.xlen(f"{lane.prefix}:job:{JOB}:done")
    assert worker.poll() is None, "the worker must have kept running"
    figures(
        f"kafka_outage_{int(outage_s)}s",
        sent=n,
        not_sent_during_outage=feeder.not_sent_events,
        producer_restarts=feeder.client_restarts,
        results=results_found,
        lost=n - results_found,
        written_twice=sum(1 for x in lengths if x > 1),
        results_before_stop=before,
        results_while_down=during - before,
        broker_stop_s=t_gone - t_stop,
        broker_down_s=t_back - t_gone,
        broker_restart_s=t_back - t_up,
        recovery_s=recovered_at - t_back,
        probe_results_s=probes_at - t_back,
        producer_recovery_s=(feeder_back - t_back) if feeder_back else None,
        # the worker's stall watchdog (worker/kafka_io.py): consumers it had to replace
        consumer_replaced=len(log_events(worker_log, "kafka_consumer_stalled")),
    )
    assert done == n
    assert results_found == n, "lost requests"
    assert all(x == 1 for x in lengths), "a result was written more than once"
    assert int(job.get("succeeded", 0)) == n and stream_len == n
    feeder.client.close(timeout=5)
    r.close()


# In CI again since 2026-12-03. It was out after one clean-clone CI run (2026-12-02) in
# which the worker's consumer stayed in its group without fetching for the whole 120 s
# after the broker came back. The stall watchdog (worker/kafka_io.py) now replaces such a
# consumer after `kafka_stall_timeout_s` (30 s), well inside this test's 120 s, and the
# figures say when it had to (`consumer_replaced`). Runs since the watchdog (16 of both
# variants, 13 more of this one on 2026-12-03): none failed, 0 replaced, recovery
# 0.1-2.3 s (tests/reliability/README.md).
def test_kafka_broker_down_5s(pstack: PrivateStack, spawn: Any, tmp_path: Path) -> None:
    run_outage(pstack, spawn, 5, tmp_path / "worker.log")


@pytest.mark.slow
def test_kafka_broker_down_15s(pstack: PrivateStack, spawn: Any, tmp_path: Path) -> None:
    run_outage(pstack, spawn, 15, tmp_path / "worker.log")
