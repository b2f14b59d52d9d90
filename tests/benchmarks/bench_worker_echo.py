"""Worker overhead: records already on Kafka -> results in the reply sinks, echo engine.

The echo engine answers at once, so what is measured is qbatch itself:
consume, decode and validate, micro-batch, admission look-up, result build,
the once-only Lua write, the results topic and the commit. Run with the local stack up:

    .venv/bin/python -m tests.benchmarks.bench_worker_echo --n 10000 --n 100000
    .venv/bin/python -m tests.benchmarks.bench_worker_echo --n 20000 \
        --sinks redis,topic,both,txn --rounds 2

Prints requests/s (first record dequeued -> last result visible in every sink: Redis
keys seen, or the results topic's last record timestamp, read read_committed) and the
worker's peak RSS, for each N and sink mode, one run after the other on the same
machine; with several modes, each as a ratio to Redis-only of the same round.
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


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds the process has used (less noisy than wall time on a
    machine whose two cores the broker and Redis share)."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


SINK_MODES: dict[str, list[str]] = {
    "redis": [],
    "topic": ["--no-redis-sink"],
    "both": [],
    "txn": ["--results-transactional"],
}
"""Worker flags per sink mode (every mode but `redis` also gets QBATCH_RESULTS_TOPIC)."""


class _Committed:
    """Whether the worker's group has committed every record of the requests topic: in the
    topic modes the commit follows the sinks (transactional: it is the transaction)."""

    def __init__(self, lane: Lane, partitions: int) -> None:
        from kafka import KafkaConsumer
        from kafka.structs import TopicPartition

        self._consumer = KafkaConsumer(bootstrap_servers=lane.bootstrap, group_id=lane.group)
        self._tps = [TopicPartition(lane.topic, p) for p in range(partitions)]
        self._ends = self._consumer.end_offsets(self._tps)

    def all(self) -> bool:
        return all((self._consumer.committed(tp) or 0) >= self._ends[tp] for tp in self._tps)

    def close(self) -> None:
        self._consumer.close()


def _read_topic(lane: Lane, topic: str) -> list[Any]:
    from kafka import KafkaConsumer

    consumer = KafkaConsumer(
        topic,
        bootstrap_servers=lane.bootstrap,
        group_id=None,
        auto_offset_reset="earliest",
        isolation_level="read_committed",
        consumer_timeout_ms=3000,
    )
    try:
        return list(consumer)
    finally:
        consumer.close()


def run_once(
    n: int, partitions: int, redis_db: int, extra: list[str], mode: str = "redis"
) -> dict[str, Any]:
    from tests.integration.workers import create_topic, delete_topics

    lane = Lane.new("bench")
    base_url = lane.redis_url.rsplit("/", 1)[0]
    lane.redis_url = f"{base_url}/{redis_db}"
    r = redis.Redis.from_url(lane.redis_url)
    r.flushdb()
    lane.create_topics(partitions)
    topic = None if mode == "redis" else f"{lane.topic}.results"
    if topic:
        create_topic(topic, partitions, lane.bootstrap)
        os.environ["QBATCH_RESULTS_TOPIC"] = topic
    producer = KafkaProducer(
        bootstrap_servers=lane.bootstrap, linger_ms=20, batch_size=256 * 1024, acks="all"
    )
    t0 = time.perf_counter()
    for i in range(n):
        producer.send(lane.topic, key=f"b{i}".encode(), value=_envelope(i))
    producer.flush()
    produce_s = time.perf_counter() - t0
    producer.close()

    log = Path(os.environ.get("QBATCH_BENCH_LOG", "/dev/null"))
    try:
        worker = start_worker(lane, *SINK_MODES[mode], *extra, log=log)
    finally:
        os.environ.pop("QBATCH_RESULTS_TOPIC", None)
    redis_on = mode != "topic"
    peak_rss_sample = 0
    seen_redis = None
    cpu_first = cpu_last = None
    committed = _Committed(lane, partitions) if topic else None
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            peak_rss_sample = max(peak_rss_sample, _rss_kb(worker.pid, "VmRSS:"))
            if cpu_first is None and redis_on and r.dbsize() > 0:
                cpu_first = _cpu_s(worker.pid)  # startup (imports, engine) left out
            if redis_on and seen_redis is None and r.dbsize() >= 2 * n:
                seen_redis = time.time()
            if (seen_redis or not redis_on) and (committed is None or committed.all()):
                cpu_last = _cpu_s(worker.pid)
                break
            time.sleep(0.02 if committed is None else 0.1)
        peak_rss = _rss_kb(worker.pid, "VmHWM:")
    finally:
        stop_worker(worker)
        if committed is not None:
            committed.close()
    dequeued = []
    batch_sizes = []
    statuses: dict[str, int] = {}
    results: list[dict[str, Any]] = []
    last_visible = seen_redis or 0.0
    if redis_on:
        rids = [f"b{i}" for i in range(n)]
        for start in range(0, n, 5000):
            chunk = [f"{lane.prefix}:result:{rid}" for rid in rids[start : start + 5000]]
            results += [json.loads(raw) for raw in r.mget(chunk) if raw is not None]
    on_topic = 0
    if topic:
        records = _read_topic(lane, topic)
        on_topic = len({rec.key for rec in records})
        last_visible = max(last_visible, max(rec.timestamp for rec in records) / 1000)
        if not redis_on:
            results = [json.loads(rec.value) for rec in records]
    for res in results:
        statuses[res["status"]] = statuses.get(res["status"], 0) + 1
        dequeued.append(res["timings"]["dequeued"])
        batch_sizes.append(res["worker"]["batch_size"])
    statuses["missing"] = n - len({res["request_id"] for res in results})
    first_ms = min(dequeued)
    elapsed = last_visible - first_ms / 1000
    r.flushdb()
    lane.delete_topics()
    if topic:
        delete_topics([topic], lane.bootstrap)
    return {
        "n": n,
        "mode": mode,
        "on_topic": on_topic,
        "partitions": partitions,
        "produce_s": round(produce_s, 2),
        "elapsed_s": round(elapsed, 3),
        "req_per_s": round(n / elapsed, 1),
        "peak_rss_mb": round(max(peak_rss, peak_rss_sample) / 1024, 1),
        "worker_cpu_us_per_req": (
            round((cpu_last - cpu_first) / n * 1e6, 1)
            if cpu_first is not None and cpu_last is not None
            else None
        ),
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
    parser.add_argument(
        "--sinks",
        default="redis",
        help=f"comma-separated sink modes, run in turn: {', '.join(SINK_MODES)}",
    )
    parser.add_argument("--rounds", type=int, default=1, help="repeat the modes, alternating")
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
    modes = [m.strip() for m in args.sinks.split(",") if m.strip()]
    unknown = set(modes) - set(SINK_MODES)
    if unknown:
        parser.error(f"unknown sink modes {sorted(unknown)}")
    print(f"machine: {platform.node()} {os.cpu_count()} cores, python {platform.python_version()}")
    rows = []
    for rnd in range(args.rounds):
        order = modes if rnd % 2 == 0 else modes[::-1]
        for n in sizes:
            for mode in order:
                row = run_once(n, args.partitions, args.redis_db, args.worker_args, mode)
                row["round"] = rnd + 1
                rows.append(row)
    baseline = {(r["round"], r["n"]): r["req_per_s"] for r in rows if r["mode"] == "redis"}
    print(
        f"{'round':>5} {'N':>8} {'sinks':>6} {'elapsed s':>10} {'req/s':>10} {'x redis':>8}"
        f" {'peak RSS MB':>12} {'cpu us/req':>11} {'mean batch':>11} {'on topic':>9}  statuses"
    )
    for row in rows:
        base = baseline.get((row["round"], row["n"]))
        row["ratio_to_redis"] = round(row["req_per_s"] / base, 3) if base else None
        print(
            f"{row['round']:>5} {row['n']:>8} {row['mode']:>6} {row['elapsed_s']:>10}"
            f" {row['req_per_s']:>10} {row['ratio_to_redis'] or '-':>8}"
            f" {row['peak_rss_mb']:>12} {row['worker_cpu_us_per_req'] or '-':>11}"
            f" {row['mean_batch_size']:>11} {row['on_topic']:>9}"
            f"  {row['statuses']}"
        )
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()
