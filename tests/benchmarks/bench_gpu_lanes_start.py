"""Interactive latency from before a bulk job starts to its end, at the worker's default
settings, with the engine gate off and on side by side on one loaded engine (`bench_gpu
lanes-start`); then a cancel mid-job.

Per variant (a worker with `engine_gate` off or on, everything else default):
  * idle: interactive requests (256-token prompt, 64 out) one a second, alone;
  * bulk alone: a job of `n` requests of workload W, its throughput;
  * bulk with interactive: the one-a-second trickle starts 3 s before the same-sized job
    (another draw of W) is published and runs until it ends: every interactive request's
    latency, when it was sent relative to the job's start, and the stage timings in its
    result (where the slowest ones spent their time);
  * cancel (gate on only): a job of `n`, cancelled once 10% succeeded: lines that
    succeeded after the cancel, seconds to the last line answered.

    python -m tests.benchmarks.bench_gpu lanes-start --out DIR --n 1000 [--dry]

Writes lanes_start.json in `--out` as figures come, and prints one summary line per
variant.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from tests.benchmarks.bench_gpu_latency import interactive_loop
from tests.benchmarks.gpu_harness import (
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
from tests.benchmarks.gpu_runs import Req, preload, warm_up, workload

LEAD_S = 3.0
"""The trickle runs this long before the job is published."""


def phase_lanes_start(out: Path, n: int, dry: bool, warmup: int, variants: list[str]) -> None:
    engine = make_engine("continuous", dry)
    t0 = time.perf_counter()
    engine.start()
    doc: dict[str, Any] = {"startup_s": round(time.perf_counter() - t0, 1), "n": n, "runs": []}
    warm_up(engine, warmup, "continuous")
    for k, variant in enumerate(variants):
        doc["runs"].append(one_variant(engine, n, variant, seed=31 + 3 * k))
        write_json(out / "lanes_start.json", doc)
    if "on" in variants:
        doc["cancel"] = cancel_run(engine, n, seed=97)
        write_json(out / "lanes_start.json", doc)
    for run in doc["runs"]:
        print(json.dumps({"gate": run["gate"]} | run["summary"]))
    if "cancel" in doc:
        print(json.dumps({"cancel": doc["cancel"]}))


def one_variant(engine: Any, n: int, variant: str, seed: int) -> dict[str, Any]:
    run = f"ls-{variant}-{uuid.uuid4().hex[:6]}"
    topic = f"bench.{run}"
    create_topic(topic)
    worker, thread = start_worker(engine, run, engine_gate=variant == "on")
    time.sleep(5)  # group join
    interactive_loop(run, topic, 3, 0.5, threading.Event(), "warm")
    doc: dict[str, Any] = {"gate": variant}
    doc["idle_s"] = interactive_loop(run, topic, 10, 1.0, threading.Event(), "idle")
    doc["bulk_alone"] = bulk_job(engine, run, f"{run}-alone", n, seed, trickle=None)
    doc["bulk_with_interactive"] = bulk_job(engine, run, f"{run}-mixed", n, seed + 1, trickle=topic)
    worker.request_stop()
    thread.join(timeout=120)
    idle = doc["idle_s"]
    mixed = [x["latency_s"] for x in doc["bulk_with_interactive"]["interactive"]]
    doc["summary"] = {
        "interactive_idle": percentiles(idle),
        "interactive_from_job_start": percentiles(mixed),
        "p99_over_idle_p99": round(percentiles(mixed)["p99"] / percentiles(idle)["p99"], 3),
        "bulk_alone_req_per_s": doc["bulk_alone"]["req_per_s"],
        "bulk_with_interactive_req_per_s": doc["bulk_with_interactive"]["req_per_s"],
        "bulk_ratio": round(
            doc["bulk_with_interactive"]["req_per_s"] / doc["bulk_alone"]["req_per_s"], 3
        ),
        "slowest": sorted(
            doc["bulk_with_interactive"]["interactive"], key=lambda x: -x["latency_s"]
        )[:5],
    }
    return doc


def bulk_job(
    engine: Any, run: str, job: str, n: int, seed: int, trickle: str | None
) -> dict[str, Any]:
    """One job of `n` W requests; with `trickle` (the interactive topic) one interactive
    request a second from `LEAD_S` before the job until it ends."""
    reqs = [Req(f"{job}-{q.rid}", q.prompt, q.max_tokens) for q in workload(n, seed=seed)]
    reset_prefix_cache(engine)
    sent: list[tuple[str, float]] = []
    stop = threading.Event()
    latencies: list[float] = []
    live = None
    if trickle is not None:
        live = threading.Thread(
            target=lambda: latencies.extend(
                interactive_loop(run, trickle, None, 1.0, stop, f"{job}-i", sent=sent)
            ),
            daemon=True,
        )
        live.start()
        time.sleep(LEAD_S)
    start = time.time()
    preload(f"bench.{run}.bulk", run, job, reqs)
    wait_done(run, job, n, timeout_s=1800)
    stop.set()
    if live is not None:
        live.join(600)
    r = redis_client()
    keys = keys_for(run)
    results = [json.loads(x) for x in mget_all(r, [keys.result(q.rid) for q in reqs]) if x]
    first = min(x["timings"]["dequeued"] for x in results)
    last = max(x["timings"]["finished"] for x in results)
    doc: dict[str, Any] = {
        "n": len(results),
        "req_per_s": round(len(results) / ((last - first) / 1000), 3),
        "out_tok_per_s": round(
            sum(x["response"]["usage"]["completion_tokens"] for x in results)
            / ((last - first) / 1000),
            1,
        ),
    }
    if trickle is not None:
        raws = mget_all(r, [keys.result(rid) for rid, _ in sent])
        doc["interactive"] = [
            {
                "sent_after_job_start_s": round(at - start, 2),
                "latency_s": round(lat, 3),
                "stages_ms": _stages(raw),
            }
            for (rid, at), lat, raw in zip(sent, latencies, raws, strict=False)
        ]
    return doc


def _stages(raw: Any) -> dict[str, float]:
    if not raw:
        return {}
    t = json.loads(raw)["timings"]
    names = ("queue", "batch_wait", "admission", "render", "engine_wait", "prefill", "generation")
    return {k: t[f"{k}_ms"] for k in names if t.get(f"{k}_ms") is not None}


def wait_done(run: str, job: str, n: int, timeout_s: float) -> None:
    """Until every line of the job is answered (succeeded, failed or cancelled)."""
    r = redis_client()
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        h = r.hgetall(keys_for(run).job(job))
        done = sum(
            int(h.get(k.encode(), 0)) for k in ("succeeded", "failed", "cancelled", "expired")
        )
        if done >= n:
            return
        time.sleep(0.05)


def cancel_run(engine: Any, n: int, seed: int) -> dict[str, Any]:
    """A job cancelled once 10% succeeded (the worker's defaults, gate on)."""
    from producer.client import QBatchClient
    from producer.jobs import JobStore

    run = f"ls-cancel-{uuid.uuid4().hex[:6]}"
    create_topic(f"bench.{run}")
    worker, thread = start_worker(engine, run)
    time.sleep(5)
    job = f"{run}-job"
    reqs = [Req(f"{job}-{q.rid}", q.prompt, q.max_tokens) for q in workload(n, seed=seed)]
    reset_prefix_cache(engine)
    preload(f"bench.{run}.bulk", run, job, reqs)
    r = redis_client()
    key = keys_for(run).job(job)
    while int(r.hget(key, "succeeded") or 0) < n // 10:
        time.sleep(0.02)
    before = int(r.hget(key, "succeeded") or 0)
    client = QBatchClient(redis_client=r, prefix=run)
    t0 = time.monotonic()
    JobStore.of(client).cancel(job)
    wait_done(run, job, n, timeout_s=600)
    took = time.monotonic() - t0
    h = {k.decode(): v.decode() for k, v in r.hgetall(key).items()}
    worker.request_stop()
    thread.join(timeout=120)
    return {
        "n": n,
        "succeeded_at_cancel": before,
        "succeeded_after_cancel": int(h.get("succeeded", 0)) - before,
        "cancelled": int(h.get("cancelled", 0)),
        "seconds_to_last_answer": round(took, 2),
    }


__all__ = ["phase_lanes_start"]
