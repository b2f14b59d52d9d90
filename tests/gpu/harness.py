"""What the GPU smoke modules share: a worker on a loaded engine, on its own topics, and a
`send` that publishes one envelope and waits for its result in Redis."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class Pipeline:
    send: Callable[[dict[str, Any]], dict[str, Any]]
    worker: Any
    producer: Any
    redis: Any
    thread: threading.Thread

    def stop(self) -> None:
        self.worker.request_stop()
        self.thread.join(timeout=120)  # the worker closes the engine (AsyncLLM.shutdown)
        self.producer.close()


def create_topics(settings: Any, topics: list[tuple[str, int]]) -> None:
    from kafka.admin import KafkaAdminClient, NewTopic

    admin = KafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
    admin.create_topics([NewTopic(name, partitions, 1) for name, partitions in topics])
    admin.close()


def start_pipeline(settings: Any, engine: Any) -> Pipeline:
    """A worker for `settings` on the started `engine`, in a thread."""
    import redis
    from kafka import KafkaProducer

    from worker.service import build_worker

    worker = build_worker(settings, engine)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    producer = KafkaProducer(bootstrap_servers=settings.kafka_bootstrap, acks="all")
    r = redis.Redis.from_url(settings.redis_url, decode_responses=True)
    prefix = settings.prefix

    def send(envelope: dict[str, Any]) -> dict[str, Any]:
        rid = envelope["request_id"]
        producer.send(settings.topic, key=rid.encode(), value=json.dumps(envelope).encode())
        producer.flush()
        r.blpop([f"{prefix}:done:{rid}"], timeout=300)
        raw = r.get(f"{prefix}:result:{rid}")
        assert raw is not None, f"no result for {rid}"
        return dict(json.loads(raw))

    return Pipeline(send, worker, producer, r, thread)
