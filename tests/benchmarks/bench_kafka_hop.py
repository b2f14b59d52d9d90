"""The Kafka hop alone, without qbatch: producer send -> broker ack, and -> consumer.

Lone requests spend 4-7 ms between the producer's `submitted_at` and the worker's
`dequeued` (tests/benchmarks/RESULTS.md). This measures the same path with nothing of
qbatch in it, to tell the broker's share from the worker's: a kafka-python producer
(`linger_ms=0`, `acks=1`, flush per record, as the lone-latency benchmarks send) and a
kafka-python consumer in a group, on a fresh topic of the local stack. Run with the
local stack up:

    .venv/bin/python -m tests.benchmarks.bench_kafka_hop --partitions 8 --count 50

Kafka's own Java producer gives the broker's acknowledgement latency without Python
(same settings), for comparison:

    java -cp 'deploy/local/.cache/jars/kafka-4.1.2/*' org.apache.kafka.tools.ProducerPerformance \\
        --topic <topic> --num-records 300 --record-size 200 --throughput 20 \\
        --producer-props bootstrap.servers=127.0.0.1:9092 acks=1 linger.ms=0
"""

from __future__ import annotations

import argparse
import threading
import time

from kafka import KafkaConsumer, KafkaProducer

from tests.benchmarks.gpu_harness import percentiles
from tests.integration.workers import BOOTSTRAP, create_topic, delete_topics, unique


def measure(
    bootstrap: str, partitions: int, count: int, gap_s: float
) -> dict[str, dict[str, float]]:
    topic = create_topic(unique("hop"), partitions, bootstrap)
    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id=topic,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
    )
    consumer.subscribe([topic])
    received: dict[bytes, float] = {}
    stop = threading.Event()

    def consume() -> None:
        while not stop.is_set():
            for records in consumer.poll(timeout_ms=100).values():
                for record in records:
                    received[record.value] = time.perf_counter()

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=0, acks=1)
    acks: list[float] = []
    hops: list[float] = []
    try:
        for i in range(count + 10):  # the first 10 wait for the group and warm the path
            value = f"m{i}".encode()
            t0 = time.perf_counter()
            producer.send(topic, key=value, value=value)
            producer.flush()
            acked = time.perf_counter()
            deadline = t0 + 30
            while value not in received and time.perf_counter() < deadline:
                time.sleep(0.0002)
            if value not in received:
                raise RuntimeError(f"record {i} not consumed within 30 s")
            if i >= 10:
                acks.append((acked - t0) * 1000)
                hops.append((received[value] - t0) * 1000)
            time.sleep(gap_s)
    finally:
        stop.set()
        thread.join(5)
        producer.close()
        consumer.close()
        delete_topics([topic], bootstrap)
    return {"ack_ms": percentiles(acks, 2), "hop_ms": percentiles(hops, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--count", type=int, default=50)
    parser.add_argument("--gap-s", type=float, default=0.1)
    args = parser.parse_args()
    row = measure(BOOTSTRAP, args.partitions, args.count, args.gap_s)
    ack, hop = row["ack_ms"], row["hop_ms"]
    print(
        f"{args.count} records, {args.partitions} partitions: producer send -> ack "
        f"p50 {ack['p50']} ms, p90 {ack['p90']} ms; send -> consumer "
        f"p50 {hop['p50']} ms, p90 {hop['p90']} ms"
    )


if __name__ == "__main__":
    main()
