"""Priority lanes: interactive latency with and without a bulk backlog, bulk throughput
with and without interactive traffic, in one run (echo engine shaped like a GPU).

    .venv/bin/python -m tests.benchmarks.bench_lanes                 # 500 ms x 64, 5,000 bulk
    .venv/bin/python -m tests.benchmarks.bench_lanes --delay-ms 100 --bulk 20000

Phases, each on fresh topics with a fresh worker, one after the other on this machine:

1. `idle`: interactive requests alone, one per `--every-s`;
2. `bulk`: the bulk backlog alone (its throughput: first dequeue -> last result);
3. `bulk+interactive`: the same backlog, with interactive requests at 1 req/s throughout;
4. `one lane`: `--one-lane` interactive requests sent together on the bulk lane's topic,
   behind the same backlog: what every request got before lanes existed.

Targets (issue 21): p99 of interactive in phase 3 <= 2 x its p99 in phase 1 plus the
batch window; bulk throughput in phase 3 >= 0.95 x phase 2.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import redis
from kafka import KafkaProducer

from tests.integration.workers import Lane, start_worker, stop_worker


def _bulk_record(i: int) -> tuple[bytes, bytes]:
    env = {
        "request_id": f"bulk-{i}",
        "job_id": "nightly",
        "priority": 10,
        "body": {"messages": [{"role": "user", "content": f"line {i}"}], "max_tokens": 8},
    }
    return env["request_id"].encode(), json.dumps(env).encode()


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Burst(threading.Thread):
    """`count` requests sent together on `topic_lane`; each one's send-to-result time."""

    def __init__(self, lane: Lane, count: int, topic_lane: str | None) -> None:
        super().__init__(daemon=True)
        self.lane, self.count, self.topic_lane = lane, count, topic_lane
        self.latencies: list[float] = []
        self.stop = threading.Event()

    def run(self) -> None:
        with self.lane.client(poll_s=0.02) as client:
            body = {"messages": [{"role": "user", "content": "now"}], "max_tokens": 8}
            t0 = time.monotonic()
            ids = client.submit_many([body] * self.count, lane=self.topic_lane)
            pending = set(ids)
            while pending and time.monotonic() - t0 < 900:
                for rid, result in client.get_many(sorted(pending)).items():
                    if result is not None:
                        pending.discard(rid)
                        self.latencies.append(time.monotonic() - t0)
                time.sleep(0.05)


class Interactive(threading.Thread):
    """One request every `every_s` (waiting for each), on `topic_lane`; the first is a
    warm-up and not counted, unless `warmup` is False."""

    def __init__(
        self,
        lane: Lane,
        every_s: float,
        count: int | None,
        topic_lane: str | None,
        warmup: bool = True,
    ) -> None:
        super().__init__(daemon=True)
        self.lane, self.every_s, self.count, self.topic_lane = lane, every_s, count, topic_lane
        self.warmup = warmup
        self.latencies: list[float] = []
        self.stop = threading.Event()

    def run(self) -> None:
        with self.lane.client(poll_s=0.02) as client:
            i = 0
            while not self.stop.is_set() and (self.count is None or i < self.count):
                t0 = time.monotonic()
                rid = client.submit(
                    {"messages": [{"role": "user", "content": f"now {i}"}], "max_tokens": 8},
                    request_id=f"live-{i}",
                    lane=self.topic_lane,
                )
                if client.wait(rid, timeout=600) is not None and (i > 0 or not self.warmup):
                    self.latencies.append(time.monotonic() - t0)
                i += 1
                self.stop.wait(max(0.0, self.every_s - (time.monotonic() - t0)))


def _phase(
    name: str, n_bulk: int, interactive: tuple[Any, ...] | None, args: Any
) -> dict[str, Any]:
    lane = Lane.new("lanes")
    lane.create_topics(8)
    r = redis.Redis.from_url(lane.redis_url)
    if n_bulk:
        producer = KafkaProducer(bootstrap_servers=lane.bootstrap, linger_ms=20, acks="all")
        for i in range(n_bulk):
            key, value = _bulk_record(i)
            producer.send(lane.bulk_topic, key=key, value=value)
        producer.flush()
        producer.close()
        r.hset(f"{lane.prefix}:job:nightly", mapping={"total": n_bulk, "status": "running"})
    flags = ["--echo-delay-ms", str(args.delay_ms), "--echo-concurrency", str(args.concurrency)]
    log = Path(os.environ.get("QBATCH_BENCH_LOG", "/dev/null"))
    worker = start_worker(lane, *flags, log=log)
    live: Interactive | Burst | None = None
    if interactive and interactive[0] == "burst":
        live = Burst(lane, *interactive[1:])
    elif interactive:
        live = Interactive(lane, *interactive)
    try:
        started = time.monotonic()
        if n_bulk:  # the backlog is being worked on: the worker has its partitions
            while not r.exists(f"{lane.prefix}:result:bulk-0") and time.monotonic() - started < 60:
                time.sleep(0.05)
        else:
            time.sleep(3)  # group join
        if live:
            live.start()
        if n_bulk:
            while time.monotonic() - started < 900:
                h = r.hmget(f"{lane.prefix}:job:nightly", "succeeded", "failed")
                if sum(int(x or 0) for x in h) >= n_bulk:
                    break
                time.sleep(0.05)
        if live:
            if n_bulk:
                live.stop.set()
            live.join(900)
        bulk_rate = None
        if n_bulk:
            dequeued, finished = [], []
            keys = [f"{lane.prefix}:result:bulk-{i}" for i in range(n_bulk)]
            for start in range(0, n_bulk, 5000):
                for raw in r.mget(keys[start : start + 5000]):
                    t = json.loads(raw)["timings"]
                    dequeued.append(t["dequeued"])
                    finished.append(t["finished"])
            bulk_rate = n_bulk / ((max(finished) - min(dequeued)) / 1000)
    finally:
        stop_worker(worker)
        lane.clean_redis()
        lane.delete_topics()
    lat = live.latencies if live else []
    return {
        "phase": name,
        "bulk": n_bulk,
        "bulk_per_s": round(bulk_rate, 1) if bulk_rate else None,
        "interactive": len(lat),
        "interactive_p50_s": round(statistics.median(lat), 3) if lat else None,
        "interactive_p99_s": round(_percentile(lat, 0.99), 3) if lat else None,
        "interactive_max_s": round(max(lat), 3) if lat else None,
        "interactive_s": [round(x, 3) for x in lat],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bulk", type=int, default=5_000)
    parser.add_argument("--delay-ms", type=float, default=500)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--idle", type=int, default=30, help="interactive requests, phase 1")
    parser.add_argument("--every-s", type=float, default=1.0)
    parser.add_argument("--one-lane", type=int, default=20, help="interactive requests, phase 4")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    print(f"machine: {platform.node()} {os.cpu_count()} cores, python {platform.python_version()}")
    print(f"echo engine: {args.delay_ms} ms per answer, {args.concurrency} at a time")
    rows = [
        _phase("idle", 0, (args.every_s, args.idle, None), args),
        _phase("bulk", args.bulk, None, args),
        _phase("bulk+interactive", args.bulk, (args.every_s, None, None), args),
    ]
    if args.one_lane:
        rows.append(_phase("one lane", args.bulk, ("burst", args.one_lane, "bulk"), args))
    print(
        f"{'phase':>18} {'bulk':>6} {'bulk req/s':>11} {'inter.':>7} {'p50 s':>7} {'p99 s':>7}"
        f" {'max s':>7}"
    )
    for row in rows:
        print(
            f"{row['phase']:>18} {row['bulk']:>6} {row['bulk_per_s'] or '-':>11}"
            f" {row['interactive']:>7} {row['interactive_p50_s'] or '-':>7}"
            f" {row['interactive_p99_s'] or '-':>7} {row['interactive_max_s'] or '-':>7}"
        )
    idle, bulk, mixed = rows[0], rows[1], rows[2]
    window_s = 0.05
    p99_ratio = mixed["interactive_p99_s"] / idle["interactive_p99_s"]
    loss = 1 - mixed["bulk_per_s"] / bulk["bulk_per_s"]
    print(
        f"interactive p99 under the backlog / idle: {p99_ratio:.2f} (target <= 2 + window: "
        f"{mixed['interactive_p99_s']} <= {2 * idle['interactive_p99_s'] + window_s:.3f} s: "
        f"{'met' if mixed['interactive_p99_s'] <= 2 * idle['interactive_p99_s'] + window_s else 'NOT met'})"
    )
    print(
        f"bulk throughput with 1 interactive req/s: {1 - loss:.3f} x alone "
        f"(target >= 0.95: {'met' if loss <= 0.05 else 'NOT met'})"
    )
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
