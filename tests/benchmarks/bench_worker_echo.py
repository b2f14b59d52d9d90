"""Worker overhead: records already on Kafka -> results in Redis, echo engine.

The echo engine answers at once, so what is measured is qbatch itself:
consume, decode and validate, micro-batch, admission look-up, result build,
the once-only Lua write and the commit. Run with the local stack up:

    .venv/bin/python -m tests.benchmarks.bench_worker_echo --n 10000 --n 100000

Prints requests/s (first record dequeued -> last result seen in Redis) and the
worker's peak RSS, for each N, one run after the other on the same machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import redis
from kafka import KafkaProducer

from tests.integration.workers import Lane, start_worker, stop_worker


def _envelope(i: int) -> bytes:
    return json.dumps(
        {
            "request_id": f"b{i}",
            "body": {
                "messages": [
                    {"role": "system", "content": "You are terse."},
                    {"role": "user", "content": f"request number {i}: say something short"},
                ],
                "max_tokens": 32,
            },
            "metadata": {"n": i},
        }
    ).encode()


def _rss_kb(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


def run_once(n: int, partitions: int, redis_db: int, extra: list[str]) -> dict[str, Any]:
    lane = Lane.new("bench")
    base_url = lane.redis_url.rsplit("/", 1)[0]
    lane.redis_url = f"{base_url}/{redis_db}"
    r = redis.Redis.from_url(lane.redis_url)
    r.flushdb()
    lane.create_topics(partitions)
    producer = KafkaProducer(
        bootstrap_servers=lane.bootstrap, linger_ms=20, batch_size=256 * 1024, acks="all"
    )
    t0 = time.perf_counter()
    for i in range(n):
        producer.send(lane.topic, key=f"b{i}".encode(), value=_envelope(i))
    producer.flush()
    produce_s = time.perf_counter() - t0
    producer.close()

    worker = start_worker(lane, *extra, log=Path(os.environ.get("QBATCH_BENCH_LOG", "/dev/null")))
    peak_rss_sample = 0
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            keys = r.dbsize()
            peak_rss_sample = max(peak_rss_sample, _rss_kb(worker.pid, "VmRSS:"))
            if keys >= 2 * n:
                break
            time.sleep(0.02)
        seen_all = time.time()
        peak_rss = _rss_kb(worker.pid, "VmHWM:")
    finally:
        stop_worker(worker)
    dequeued = []
    batch_sizes = []
    rids = [f"b{i}" for i in range(n)]
    statuses: dict[str, int] = {}
    for start in range(0, n, 5000):
        chunk = [f"{lane.prefix}:result:{rid}" for rid in rids[start : start + 5000]]
        for raw in r.mget(chunk):
            if raw is None:
                statuses["missing"] = statuses.get("missing", 0) + 1
                continue
            res = json.loads(raw)
            statuses[res["status"]] = statuses.get(res["status"], 0) + 1
            dequeued.append(res["timings"]["dequeued"])
            batch_sizes.append(res["worker"]["batch_size"])
    first_ms = min(dequeued)
    elapsed = seen_all - first_ms / 1000
    r.flushdb()
    lane.delete_topics()
    return {
        "n": n,
        "partitions": partitions,
        "produce_s": round(produce_s, 2),
        "elapsed_s": round(elapsed, 3),
        "req_per_s": round(n / elapsed, 1),
        "peak_rss_mb": round(max(peak_rss, peak_rss_sample) / 1024, 1),
        "mean_batch_size": round(statistics.mean(batch_sizes), 1),
        "statuses": statuses,
    }


def lone(waits: list[float], count: int, worker_args: list[str]) -> list[dict[str, Any]]:
    """Lone requests, one at a time: how long until each reaches the engine.

    "Reaches the engine" is the producer's `submitted_at` -> the worker's `dispatched`
    (both in the result's timings), the figure the spec's latency target names; the
    client's whole round trip (send, ack, result, BLPOP wake-up) is printed beside it.
    """
    from datetime import UTC, datetime

    rows = []
    r = redis.Redis.from_url(Lane.new().redis_url)
    for wait in waits:
        lane = Lane.new("lone")
        lane.create_topics(8)
        worker = start_worker(lane, "--batch-max-wait-ms", str(wait), *worker_args)
        producer = KafkaProducer(bootstrap_servers=lane.bootstrap, linger_ms=0, acks=1)
        time.sleep(3)  # group join
        reach, e2e, hop, worker_ms = [], [], [], []
        try:
            for i in range(count + 3):
                rid = f"l{i}"
                env = {
                    "request_id": rid,
                    "submitted_at": datetime.now(UTC).isoformat(),
                    "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
                }
                t0 = time.perf_counter()
                producer.send(lane.topic, key=rid.encode(), value=json.dumps(env).encode())
                producer.flush()
                r.blpop([f"{lane.prefix}:done:{rid}"], timeout=10)
                elapsed = time.perf_counter() - t0
                timings = json.loads(r.get(f"{lane.prefix}:result:{rid}") or b"{}")["timings"]
                if i >= 3:  # warm-up
                    e2e.append(elapsed * 1000)
                    reach.append(timings["dispatched"] - timings["submitted"])
                    hop.append(timings["dequeued"] - timings["submitted"])
                    worker_ms.append(timings["dispatched"] - timings["dequeued"])
                time.sleep(0.1)
        finally:
            producer.close()
            stop_worker(worker)
            lane.clean_redis()
            lane.delete_topics()
        rows.append(
            {
                "batch_max_wait_ms": wait,
                "reach_engine_ms_p50": statistics.median(reach),
                "reach_engine_ms_max": max(reach),
                "round_trip_ms_p50": round(statistics.median(e2e), 1),
                "kafka_hop_ms_p50": statistics.median(hop),
                "worker_ms_p50": statistics.median(worker_ms),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, action="append", help="requests (repeatable)")
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--redis-db", type=int, default=9)
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--lone", type=int, default=0, help="lone requests per wait (0, 10, 50)")
    parser.add_argument("worker_args", nargs="*", help="extra qbatch-worker flags after --")
    args = parser.parse_args()
    if args.lone:
        print(
            f"{'wait ms':>8} {'reach engine p50 ms':>20} {'max ms':>8} {'round trip p50 ms':>18}"
            f" {'Kafka hop p50 ms':>17} {'worker p50 ms':>14}"
        )
        for row in lone([0, 10, 50], args.lone, args.worker_args):
            print(
                f"{row['batch_max_wait_ms']:>8} {row['reach_engine_ms_p50']:>20} "
                f"{row['reach_engine_ms_max']:>8} {row['round_trip_ms_p50']:>18}"
                f" {row['kafka_hop_ms_p50']:>17} {row['worker_ms_p50']:>14}"
            )
        return
    sizes = args.n or [10_000, 100_000]
    print(f"machine: {platform.node()} {os.cpu_count()} cores, python {platform.python_version()}")
    rows = [run_once(n, args.partitions, args.redis_db, args.worker_args) for n in sizes]
    print(
        f"{'N':>8} {'produce s':>10} {'elapsed s':>10} {'req/s':>10} {'peak RSS MB':>12}"
        f" {'mean batch':>11}  statuses"
    )
    for row in rows:
        print(
            f"{row['n']:>8} {row['produce_s']:>10} {row['elapsed_s']:>10} {row['req_per_s']:>10}"
            f" {row['peak_rss_mb']:>12} {row['mean_batch_size']:>11}  {row['statuses']}"
        )
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()
