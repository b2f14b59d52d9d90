"""Interactive latency from before a bulk job starts to its end, at the worker's default
settings and beside them, side by side on one loaded engine (`bench_gpu lanes-start`); then
a cancel mid-job.

The engine runs vLLM's scheduler with qbatch's step cap in front (the lane scheduler), so
a worker's `interactive_step_tokens` takes effect per run; with 0 the cap is inert and the
engine schedules as vLLM's own. Variants, one worker each: `off` (engine gate off, no
step cap), `on` (gate on, no step cap), `capN` (gate on, step cap N tokens).

Per variant:
  * idle: interactive requests (256-token prompt, 64 out) one a second, alone;
  * bulk alone (the first variant only, and every `off`/`on`: the step cap acts only while
    an interactive request is in the engine, so a cap variant's bulk alone is the `on`
    one's): the job, its throughput;
  * bulk with interactive: the one-a-second trickle starts 3 s before the same job is
    published and runs until it ends: every interactive request's latency, when it was
    sent relative to the job's start, and the stage timings in its result (where the
    slowest ones spent their time);
  * cancel (when `on` ran on W): a job of W, cancelled once 10% succeeded: lines that succeeded
    after the cancel, seconds to the last line answered.

The job (`--workload`): `w`, `n` requests of workload W; `families`, the night of job
families (tests/benchmarks/families.py: 1,438 chat lines of 300 families, long shared
system prompts), the same lines in every variant.

    python -m tests.benchmarks.bench_gpu lanes-start --out DIR --n 1000 \
        [--variants on,cap512] [--workload families] [--engine echo]

Writes lanes_start.json in `--out` as figures come, and prints one summary line per
variant.
"""

from __future__ import annotations

import argparse
import json
import statistics
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
from tests.benchmarks.gpu_runs import (
    Req,
    envelope,
    preload,
    preload_envelopes,
    warm_up,
    workload,
)

LEAD_S = 3.0
"""The trickle runs this long before the job is published."""


def phase_lanes_start(
    out: Path, n: int, dry: bool, warmup: int, variants: list[str], workload_name: str = "w"
) -> None:
    for variant in variants:
        parse_variant(variant)  # refuse a typo before the engine loads
    engine = make_engine("continuous", dry, interactive_step_tokens=1)  # the lane scheduler
    t0 = time.perf_counter()
    engine.start()
    doc: dict[str, Any] = {
        "startup_s": round(time.perf_counter() - t0, 1),
        "n": n,
        "workload": workload_name,
        "runs": [],
    }
    warm_up(engine, warmup, "continuous")
    job = job_envelopes(workload_name, n)
    alone: dict[str, Any] | None = None
    for variant in variants:
        measure_alone = alone is None or not variant.startswith("cap")
        run = one_variant(engine, job, variant, None if measure_alone else alone)
        if measure_alone:
            alone = run["bulk_alone"]
        doc["runs"].append(run)
        write_json(out / "lanes_start.json", doc)
    if "on" in variants and workload_name == "w":
        doc["cancel"] = cancel_run(engine, n, seed=97)
        write_json(out / "lanes_start.json", doc)
    for run in doc["runs"]:
        print(json.dumps({"variant": run["variant"]} | run["summary"]))
    if "cancel" in doc:
        print(json.dumps({"cancel": doc["cancel"]}))


def parse_variant(variant: str) -> tuple[bool, int]:
    """`off` / `on` / `capN` -> (engine gate, step cap tokens)."""
    if variant in ("off", "on"):
        return variant == "on", 0
    if variant.startswith("cap") and variant[3:].isdigit() and int(variant[3:]) > 0:
        return True, int(variant[3:])
    raise SystemExit(f"unknown variant {variant!r}: off, on or capN")


def job_envelopes(workload_name: str, n: int) -> list[dict[str, Any]]:
    """The bulk job's envelopes (request ids without the job's tag)."""
    if workload_name == "w":
        return [envelope(req, i) for i, req in enumerate(workload(n, seed=31))]
    if workload_name == "families":
        from tests.benchmarks import bench_runbatch as rb
        from tests.benchmarks import families

        return [
            {"request_id": line["custom_id"], "endpoint": line["url"], "body": line["body"]}
            for line in families.night_lines(rb.vocab_words())
        ]
    raise SystemExit(f"unknown workload {workload_name!r}: w or families")


def one_variant(
    engine: Any, job: list[dict[str, Any]], variant: str, alone: dict[str, Any] | None
) -> dict[str, Any]:
    gate, cap = parse_variant(variant)
    run = f"ls-{variant}-{uuid.uuid4().hex[:6]}"
    topic = f"bench.{run}"
    create_topic(topic)
    engine.step_tokens = cap  # what this worker's first-lane requests ask for
    worker, thread = start_worker(engine, run, engine_gate=gate, interactive_step_tokens=cap)
    time.sleep(5)  # group join
    interactive_loop(run, topic, 3, 0.5, threading.Event(), "warm")
    doc: dict[str, Any] = {"variant": variant, "gate": gate, "step_tokens": cap}
    doc["idle_s"] = interactive_loop(run, topic, 10, 1.0, threading.Event(), "idle")
    if alone is None:
        doc["bulk_alone"] = bulk_job(engine, run, f"{run}-alone", job, trickle=None)
    else:
        doc["bulk_alone"] = alone | {"measured_by": "an earlier variant"}
    doc["bulk_with_interactive"] = bulk_job(engine, run, f"{run}-mixed", job, trickle=topic)
    worker.request_stop()
    thread.join(timeout=120)
    doc["summary"] = summarize(doc)
    return doc


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    """One variant's figures from its raw records (also for a JSON written before a
    figure was added here: `report` recomputes every summary)."""
    idle = run["idle_s"]
    interactive = run["bulk_with_interactive"]["interactive"]
    mixed = [x["latency_s"] for x in interactive]
    alone, mixed_rate = run["bulk_alone"]["req_per_s"], run["bulk_with_interactive"]["req_per_s"]
    return {
        "interactive_idle": percentiles(idle),
        "interactive_from_job_start": percentiles(mixed),
        "p99_over_idle_p99": round(percentiles(mixed)["p99"] / percentiles(idle)["p99"], 3),
        "interactive_generation_ms": _p50_max(
            [x["stages_ms"].get("generation") for x in interactive]
        ),
        "interactive_engine_queue_and_prefill_ms": _p50_max(
            [
                x["stages_ms"].get("engine_wait", 0) + x["stages_ms"].get("prefill", 0)
                for x in interactive
                if x["stages_ms"]
            ]
        ),
        "bulk_alone_req_per_s": alone,
        "bulk_with_interactive_req_per_s": mixed_rate,
        "bulk_ratio": round(mixed_rate / alone, 3),
        "slowest": sorted(interactive, key=lambda x: -x["latency_s"])[:5],
    }


def _p50_max(values: list[float | None]) -> dict[str, float] | None:
    present = sorted(v for v in values if v is not None)
    if not present:
        return None
    return {"p50": statistics.median(present), "max": present[-1]}


def report(docs: dict[str, dict[str, Any]]) -> str:
    """A markdown table of every variant of every run (name -> lanes_start.json)."""
    rows = [
        "| job | variant | idle p50 / p99 | from the job's start p50 / p90 / p99 | p99 / idle p99 "
        "| interactive `generation` p50 / max | vLLM queue + prefill p50 / max | bulk alone "
        "| bulk with interactive |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, doc in docs.items():
        for run in doc["runs"]:
            s = summarize(run)
            idle, mixed = s["interactive_idle"], s["interactive_from_job_start"]
            gen, wait = s["interactive_generation_ms"], s["interactive_engine_queue_and_prefill_ms"]
            alone = run["bulk_alone"].get("measured_by") is None
            rows.append(
                f"| {name} | {run.get('variant', run.get('gate'))} "
                f"| {idle['p50']:.3f} / {idle['p99']:.3f} s "
                f"| {mixed['p50']:.3f} / {mixed['p90']:.3f} / {mixed['p99']:.3f} s "
                f"| {s['p99_over_idle_p99']:.1f}x "
                f"| {_span(gen)} | {_span(wait)} "
                f"| {'' if alone else '('}{s['bulk_alone_req_per_s']:.2f}{'' if alone else ')'} "
                f"| {s['bulk_with_interactive_req_per_s']:.2f} ({s['bulk_ratio']:.3f}x) |"
            )
    return "\n".join(rows)


def _span(p: dict[str, float] | None) -> str:
    return "-" if p is None else f"{p['p50'] / 1000:.2f} / {p['max'] / 1000:.2f} s"


def bulk_job(
    engine: Any, run: str, job: str, lines: list[dict[str, Any]], trickle: str | None
) -> dict[str, Any]:
    """One job of `lines` (envelopes); with `trickle` (the interactive topic) one
    interactive request a second from `LEAD_S` before the job until it ends."""
    envs = [e | {"request_id": f"{job}-{e['request_id']}"} for e in lines]
    n = len(envs)
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
    preload_envelopes(f"bench.{run}.bulk", run, job, envs)
    wait_done(run, job, n, timeout_s=1800)
    stop.set()
    if live is not None:
        live.join(600)
    r = redis_client()
    keys = keys_for(run)
    results = [
        json.loads(x) for x in mget_all(r, [keys.result(e["request_id"]) for e in envs]) if x
    ]
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


def main() -> None:
    parser = argparse.ArgumentParser(description="lanes-start JSON -> the RESULTS table")
    parser.add_argument("runs", nargs="+", help="NAME=PATH of a lanes_start.json")
    args = parser.parse_args()
    docs = {}
    for item in args.runs:
        name, _, path = item.partition("=")
        docs[name] = json.loads(Path(path).read_text())
    print(report(docs))


if __name__ == "__main__":
    main()


__all__ = ["phase_lanes_start", "report", "summarize"]
