"""Scale-out: three echo workers on the three-broker Kafka and the Redis Cluster against
one worker on one broker and one Redis, the same records, side by side in one run.

    bash deploy/local/stack.sh up && bash deploy/local/stack.sh up --brokers 3 --redis-cluster
    .venv/bin/python -m tests.benchmarks.bench_scaleout --n 30000 --rounds 3

Modes (alternating, `--rounds` times): `single` (1 worker; 127.0.0.1:9092, Redis 6379),
`single-x3` (3 workers on the same single broker and Redis: what the extra workers alone
give on this machine), `cluster-x3` (3 workers; 3 brokers, replication 3, acks=all
everywhere, and the six-node Redis Cluster). N records are on the topic (12 partitions)
before the workers start; requests/s is first record dequeued -> last result visible in
Redis, read back by the benchmark. The echo engine answers at once, so this measures the
queue layer, not a GPU; on a 2-core machine the brokers, the Redis nodes and the workers
share the same cores, which caps what three workers can add. `cluster-x3-wait1` (not in
the default set) is `cluster-x3` with `--redis-wait-replicas 1`: the price of WAIT.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from typing import Any

from kafka import KafkaProducer

from schemas import RedisKeys
from schemas.redis_conn import connect, is_cluster_url, mget
from tests.benchmarks.bench_worker_echo import _envelope
from tests.integration.cluster_stack import cluster_up
from tests.integration.workers import BOOTSTRAP, REDIS_URL, Lane, start_worker, stop_worker

MODES = {"single": 1, "single-x3": 3, "cluster-x3": 3, "cluster-x3-wait1": 3}
WAIT_FLAGS = {"cluster-x3-wait1": ("--redis-wait-replicas", "1")}
"""Modes whose workers wait for a replica's acknowledgement of every result (Redis WAIT):
its price in throughput, against `cluster-x3` in the same run."""


def run_once(mode: str, n: int, partitions: int) -> dict[str, Any]:
    cluster = mode.startswith("cluster")
    if cluster:
        stack = cluster_up()
        bootstrap, redis_url, replication = stack.kafka_bootstrap, stack.redis_url, 3
    else:
        bootstrap, redis_url, replication = BOOTSTRAP, REDIS_URL, 1
    lane = Lane.on(bootstrap, redis_url, "scale")
    lane.create_topics(partitions, replication=replication)
    producer = KafkaProducer(
        bootstrap_servers=bootstrap.split(","), linger_ms=20, batch_size=256 * 1024, acks="all"
    )
    for i in range(n):
        producer.send(lane.topic, key=f"b{i}".encode(), value=_envelope(i))
    producer.flush()
    producer.close()
    keys = RedisKeys(lane.prefix, cluster=is_cluster_url(redis_url))
    client = connect(redis_url)
    workers = [start_worker(lane, *WAIT_FLAGS.get(mode, ())) for _ in range(MODES[mode])]
    todo = [f"b{i}" for i in range(n)]
    seen_all = None
    try:
        deadline = time.monotonic() + 900
        while todo and time.monotonic() < deadline:
            left = []
            for start in range(0, len(todo), 5_000):
                chunk = todo[start : start + 5_000]
                values = mget(client, [keys.result(r) for r in chunk])
                left += [r for r, v in zip(chunk, values, strict=True) if v is None]
            todo = left
            if not todo:
                seen_all = time.time()
                break
            time.sleep(0.05)
    finally:
        for w in workers:
            stop_worker(w)
    if seen_all is None:
        raise RuntimeError(f"{mode}: {len(todo)} of {n} results missing after 15 minutes")
    first_dequeued = min(
        json.loads(v)["timings"]["dequeued"]
        for start in range(0, n, 5_000)
        for v in mget(client, [keys.result(f"b{i}") for i in range(start, min(n, start + 5_000))])
    )
    lane.clean_redis()
    lane.delete_topics()
    client.close()
    elapsed = seen_all - first_dequeued / 1000
    return {
        "mode": mode,
        "n": n,
        "elapsed_s": round(elapsed, 2),
        "req_per_s": round(n / elapsed, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=30_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--partitions", type=int, default=12)
    parser.add_argument(
        "--modes",
        default="single,single-x3,cluster-x3",
        help="comma-separated, from " + ", ".join(MODES) + "; ratios are over the first",
    )
    args = parser.parse_args()
    modes = args.modes.split(",")
    if unknown := set(modes) - MODES.keys():
        parser.error(f"unknown modes {sorted(unknown)}")
    rows = []
    for r in range(args.rounds):
        for mode in modes:
            row = run_once(mode, args.n, args.partitions) | {"round": r}
            rows.append(row)
            print(json.dumps(row), flush=True)
    summary: dict[str, Any] = {"machine": f"{platform.node()} {platform.processor()}", "rows": rows}
    per_mode = {m: [x["req_per_s"] for x in rows if x["mode"] == m] for m in modes}
    summary["median_req_per_s"] = {m: statistics.median(v) for m, v in per_mode.items()}
    base = modes[0]
    for m in modes[1:]:
        ratios = [
            a["req_per_s"] / b["req_per_s"]
            for a, b in zip(
                [x for x in rows if x["mode"] == m],
                [x for x in rows if x["mode"] == base],
                strict=True,
            )
        ]
        summary[f"ratio_{m}_over_{base}"] = {
            "per_round": [round(x, 3) for x in ratios],
            "median": round(statistics.median(ratios), 3),
        }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
