"""Latency phases of bench_gpu: lone requests end to end against the raw engine, per
batch wait (part of `continuous`), and the priority lanes on a GPU (`lanes`: interactive
latency idle and under a bulk backlog, the backlog's throughput with and without it).
"""

from __future__ import annotations

import json
import random
import statistics
import threading
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tests.benchmarks.gpu_harness import (
    bootstrap,
    create_topic,
    keys_for,
    make_engine,
    mget_all,
    percentiles,
    redis_client,
    reset_prefix_cache,
    start_worker,
    write_json,
)
from tests.benchmarks.gpu_runs import (
    VOCAB_TOP,
    Req,
    envelope,
    preload,
    wait_job,
    warm_up,
    worker_sampling,
    workload,
)


def lone_latency(
    engine: Any, waits: list[float], count: int, gap_s: float = 0.2
) -> list[dict[str, Any]]:
    """Lone requests at a slow steady rate: qbatch end to end vs the raw engine, per wait.

    Raw and qbatch requests alternate, so both see the same GPU state (clocks drift by a
    few percent over a minute, which on a 0.28 s request is as much as the effect). Each
    qbatch request is also split by the timings in its result (epoch ms, one clock):
    Kafka hop (submitted -> dequeued), batching (dequeued -> dispatched), engine
    (dispatched -> finished), reply (finished -> the client's BLPOP wake-up).
    """
    from kafka import KafkaProducer

    from worker.engines.base import EngineRequest

    rng = random.Random(7)
    prompt = [rng.randrange(100, VOCAB_TOP) for _ in range(256)]
    # The raw requests sample exactly as the worker's do: in call 11 (H200) raw requests
    # without the model's top-k/top-p took 281-284 ms and the engine part of qbatch's,
    # with them, 287-291 ms, which made the "added" figure 5-7 ms too high.
    spec = worker_sampling(engine, [Req("lone", prompt, 32)])[0]

    def raw_once() -> float:
        done = threading.Event()
        t0 = time.perf_counter()
        engine.submit(
            [EngineRequest(f"raw-{uuid.uuid4().hex[:12]}", "", prompt, spec)],
            lambda _out: done.set(),
        )
        done.wait(60)
        return time.perf_counter() - t0

    r = redis_client()
    rows = []
    for wait in waits:
        run = f"lone{int(wait)}-{uuid.uuid4().hex[:6]}"
        create_topic(f"bench.{run}")
        worker, thread = start_worker(engine, run, batch_max_wait_ms=wait)
        producer = KafkaProducer(bootstrap_servers=bootstrap(), linger_ms=0, acks=1)
        raw: list[float] = []
        e2e: list[float] = []
        parts: dict[str, list[float]] = {
            k: [] for k in ("kafka", "batching", "engine", "reply", "reach", "outside")
        }
        for i in range(count + 2):  # the first two warm the path up (and wait for the group)
            if i >= 2:
                raw.append(raw_once())
                time.sleep(gap_s)
            rid = f"{run}-{i}"
            env = envelope(Req(rid, prompt, 32), i)
            env["submitted_at"] = datetime.now(UTC).isoformat()
            t0 = time.perf_counter()
            producer.send(f"bench.{run}", key=rid.encode(), value=json.dumps(env).encode())
            producer.flush()
            r.blpop([keys_for(run).done(rid)], timeout=60)
            took = time.perf_counter() - t0
            woke_ms = time.time() * 1000
            if i >= 2:
                e2e.append(took)
                t = json.loads(r.get(keys_for(run).result(rid)) or b"{}").get("timings", {})
                if all(t.get(k) for k in ("submitted", "dequeued", "dispatched", "finished")):
                    parts["kafka"].append(t["dequeued"] - t["submitted"])
                    parts["batching"].append(t["dispatched"] - t["dequeued"])
                    parts["engine"].append(t["finished"] - t["dispatched"])
                    parts["reply"].append(woke_ms - t["finished"])
                    parts["reach"].append(t["dispatched"] - t["submitted"])
                    parts["outside"].append(took * 1000 - (t["finished"] - t["dispatched"]))
            time.sleep(gap_s)
        producer.close()
        worker.request_stop()
        thread.join(timeout=60)
        raw_ms = [x * 1000 for x in raw]
        e2e_ms = [x * 1000 for x in e2e]
        added = [x - statistics.median(raw_ms) for x in e2e_ms]
        rows.append(
            {
                "batch_max_wait_ms": wait,
                "n": count,
                "raw_engine_ms": percentiles(raw_ms, 1),
                "qbatch_e2e_ms": percentiles(e2e_ms, 1),
                "added_ms": percentiles(added, 1),
                "parts_ms_p50": {k: round(statistics.median(v), 1) for k, v in parts.items() if v},
                "reach_engine_ms": percentiles(parts["reach"], 1)
                | ({"max": max(parts["reach"])} if parts["reach"] else {}),
                "target_ms": wait + 5,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def interactive_loop(
    run: str,
    topic: str,
    count: int | None,
    every_s: float,
    stop: threading.Event,
    tag: str,
    sent: list[tuple[str, float]] | None = None,
) -> list[float]:
    """Interactive requests (256-token prompt, 64 tokens out) one at a time, every
    `every_s`, on the interactive topic; seconds from send to result, each (`sent`: gets
    each one's request id and send time, epoch s)."""
    from kafka import KafkaProducer

    rng = random.Random(7)
    r = redis_client()
    producer = KafkaProducer(bootstrap_servers=bootstrap(), linger_ms=0, acks=1)
    out: list[float] = []
    i = 0
    try:
        while not stop.is_set() and (count is None or i < count):
            req = Req(f"{tag}{i:04d}", [rng.randrange(100, VOCAB_TOP) for _ in range(256)], 64)
            t0 = time.monotonic()
            if sent is not None:
                sent.append((req.rid, time.time()))
            producer.send(topic, key=req.rid.encode(), value=json.dumps(envelope(req, i)).encode())
            producer.flush()
            r.blpop([keys_for(run).done(req.rid)], timeout=600)
            out.append(time.monotonic() - t0)
            i += 1
            stop.wait(max(0.0, every_s - (time.monotonic() - t0)))
    finally:
        producer.close()
    return out


def phase_lanes(
    out: Path, n: int, dry: bool, warmup: int, every_s: float, caps: list[int | None]
) -> None:
    """Priority lanes on the GPU: interactive latency idle and under a bulk backlog of W,
    and W's throughput alone and with 1 interactive req/s, with one worker per bulk cap
    in `caps` (None: the worker's default), all on one loaded engine, side by side. The
    backlogs are different draws of W (no shared prefixes), and the prefix cache is reset
    before each. Each cap's figures are written as soon as they exist (lanes.json)."""
    engine = make_engine("continuous", dry)
    t0 = time.perf_counter()
    engine.start()
    doc: dict[str, Any] = {"startup_s": round(time.perf_counter() - t0, 1), "warmup": warmup}
    warm_up(engine, warmup, "continuous")
    doc["runs"] = []
    for k, cap in enumerate(caps):
        doc["runs"].append(lanes_one_cap(engine, n, every_s, cap, seed=11 + 2 * k))
        write_json(out / "lanes.json", doc)
    for one in doc["runs"]:
        print(json.dumps({"bulk_max_inflight": one["bulk_max_inflight"]} | one["summary"]))


def lanes_one_cap(
    engine: Any, n: int, every_s: float, cap: int | None, seed: int
) -> dict[str, Any]:
    run = f"lanes-{uuid.uuid4().hex[:6]}"
    topic = f"bench.{run}"
    create_topic(topic)
    r = redis_client()
    extra = {"bulk_max_inflight": cap} if cap else {}
    doc: dict[str, Any] = {"bulk_max_inflight": cap}
    worker, thread = start_worker(engine, run, batch_max_size=64, batch_max_wait_ms=50, **extra)
    time.sleep(5)  # group join
    interactive_loop(run, topic, 3, 0.5, threading.Event(), "warm")
    doc["idle_s"] = interactive_loop(run, topic, 15, every_s, threading.Event(), "idle")

    def backlog(job: str, with_interactive: bool, seed: int) -> dict[str, Any]:
        reqs = [Req(f"{job}-{q.rid}", q.prompt, q.max_tokens) for q in workload(n, seed=seed)]
        reset_prefix_cache(engine)
        preload(f"{topic}.bulk", run, job, reqs, extra={"priority": 10})
        stop = threading.Event()
        latencies: list[float] = []
        live = threading.Thread(
            target=lambda: latencies.extend(
                interactive_loop(run, topic, None, every_s, stop, f"live-{job}-")
            ),
            daemon=True,
        )
        while not r.exists(keys_for(run).result(reqs[0].rid)) and not r.hget(
            keys_for(run).job(job), "succeeded"
        ):
            time.sleep(0.05)
        if with_interactive:
            live.start()
        wait_job(run, job, len(reqs), timeout_s=1800)
        stop.set()
        if with_interactive:
            live.join(600)
        results = [json.loads(x) for x in mget_all(r, [keys_for(run).result(q.rid) for q in reqs])]
        first = min(x["timings"]["dequeued"] for x in results)
        last = max(x["timings"]["finished"] for x in results)
        tokens = sum(x["response"]["usage"]["completion_tokens"] for x in results)
        return {
            "n": len(reqs),
            "req_per_s": round(len(reqs) / ((last - first) / 1000), 3),
            "out_tok_per_s": round(tokens / ((last - first) / 1000), 1),
            "interactive_s": [round(x, 3) for x in latencies],
        }

    doc["bulk_alone"] = backlog(f"{run}-jb1", with_interactive=False, seed=seed)
    doc["bulk_with_interactive"] = backlog(f"{run}-jb2", with_interactive=True, seed=seed + 1)
    worker.request_stop()
    thread.join(timeout=120)
    idle, mixed = doc["idle_s"], doc["bulk_with_interactive"]["interactive_s"]
    doc["summary"] = {
        "interactive_idle": percentiles(idle),
        "interactive_under_backlog": percentiles(mixed) if mixed else {},
        "p99_ratio": round(percentiles(mixed)["p99"] / percentiles(idle)["p99"], 3)
        if mixed
        else None,
        "bulk_alone_req_per_s": doc["bulk_alone"]["req_per_s"],
        "bulk_ratio_with_interactive": round(
            doc["bulk_with_interactive"]["req_per_s"] / doc["bulk_alone"]["req_per_s"], 3
        ),
    }
    print(json.dumps({"bulk_max_inflight": cap} | doc["summary"]), flush=True)
    return doc
