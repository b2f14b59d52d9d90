"""Workload W on a GPU: raw vLLM vs qbatch static vs qbatch continuous, same requests.

Runs on the lent GPU machine with the whole stack there (deploy/gpu/README.md):

    python3 -m tests.benchmarks.bench_gpu static     --out $OUT   # A, B16, B64 (one engine)
    python3 -m tests.benchmarks.bench_gpu continuous --out $OUT   # C, low-load latency, wait sweep
    python3 -m tests.benchmarks.bench_gpu report     --out $OUT   # ratios, table, plot

- A: `LLM.generate` over all requests at once (the engine's ceiling);
- B16 / B64: qbatch `static` mode (one blocking generate per micro-batch of 16 / 64),
  over the first 320 / 640 requests;
- C: qbatch `continuous` mode (the default).
B and C go through the real pipeline: records pre-loaded on Kafka, results read back
from Redis, timed from the first record dequeued to the last result seen in Redis.
Every request is a `/v1/completions` envelope whose prompt is the same token ids A
gets, with `max_tokens` fixed per request and `ignore_eos` (random weights).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import statistics
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
MODEL_DIR = REPO / "tests" / "fixtures" / "qwen3-14b"
VOCAB_TOP = 151_000  # plain BPE tokens only; the added special tokens start at 151643


@dataclass(frozen=True)
class Req:
    rid: str
    prompt: list[int]
    max_tokens: int


def workload(n: int = 1500, seed: int = 0) -> list[Req]:
    """Workload W: prompts of 256-1024 random tokens, outputs of 16-512 tokens."""
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        plen = rng.randint(256, 1024)
        reqs.append(
            Req(
                f"w{i:05d}",
                [rng.randrange(100, VOCAB_TOP) for _ in range(plen)],
                rng.randint(16, 512),
            )
        )
    return reqs


def engine_kwargs(**overrides: Any) -> dict[str, Any]:
    from worker.config import WorkerSettings
    from worker.engines.vllm_engine import engine_kwargs as from_settings

    settings = WorkerSettings(
        engine="vllm",
        model=str(MODEL_DIR),
        served_model_name="Qwen3-14B",
        load_format="dummy",
        dtype="bfloat16",
        max_model_len=4096,
        gpu_memory_utilization=0.9,
        **overrides,
    )
    return from_settings(settings)


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    qs = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": round(qs[49], 3), "p90": round(qs[89], 3), "p99": round(qs[98], 3)}


class _KeepOpen:
    """Lets one loaded engine serve several worker runs (the worker closes its engine)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def close(self) -> None:
        return


def run_raw(engine: Any, reqs: list[Req]) -> dict[str, Any]:
    from vllm import SamplingParams

    params = [
        SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, temperature=0.7, seed=i)
        for i, r in enumerate(reqs)
    ]
    prompts = [{"prompt_token_ids": r.prompt} for r in reqs]
    t0 = time.perf_counter()
    outs = engine._llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "name": "A",
        "n": len(reqs),
        "elapsed_s": round(elapsed, 3),
        "req_per_s": round(len(reqs) / elapsed, 3),
        "out_tok_per_s": round(tokens / elapsed, 1),
        "latency_s": {"p50": round(elapsed, 3), "p90": round(elapsed, 3), "p99": round(elapsed, 3)},
        "note": "LLM.generate returns all outputs at once: every latency is the whole run",
    }


def run_qbatch(engine: Any, reqs: list[Req], name: str, **worker_settings: Any) -> dict[str, Any]:
    """Pre-load the requests on a fresh topic, run a worker until all results are in Redis."""
    import redis
    from kafka import KafkaProducer
    from kafka.admin import KafkaAdminClient, NewTopic

    from worker.config import WorkerSettings
    from worker.kafka_io import DeadLetters, RequestConsumer
    from worker.redis_io import RedisReplies
    from worker.service import Worker

    run = f"{name.lower()}-{uuid.uuid4().hex[:6]}"
    topic, prefix, job = f"bench.{run}", f"bench{run}", run
    bootstrap = os.environ.get("QBATCH_KAFKA_BOOTSTRAP", "127.0.0.1:9092")
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics([NewTopic(topic, 8, 1)])
    admin.close()
    r = redis.Redis.from_url(os.environ.get("QBATCH_REDIS_URL", "redis://127.0.0.1:6379/0"))
    r.hset(f"{prefix}:job:{job}", mapping={"total": len(reqs), "status": "running"})
    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=20, acks="all")
    for i, req in enumerate(reqs):
        env = {
            "request_id": req.rid,
            "endpoint": "/v1/completions",
            "job_id": job,
            "body": {
                "prompt": req.prompt,
                "max_tokens": req.max_tokens,
                "ignore_eos": True,
                "temperature": 0.7,
                "seed": i,
            },
        }
        producer.send(topic, key=req.rid.encode(), value=json.dumps(env).encode())
    producer.flush()
    producer.close()

    settings = WorkerSettings(
        engine="vllm",
        model=str(MODEL_DIR),
        topic=topic,
        dlq_topic=f"{topic}.dlq",
        group=f"{run}-workers",
        prefix=prefix,
        metrics_port=0,
        dead_letter=False,
        log_level="warning",
        **worker_settings,
    )
    worker = Worker(
        settings,
        _KeepOpen(engine),  # type: ignore[arg-type]
        RequestConsumer(settings),
        RedisReplies.from_url(settings.redis_url, settings.keys),
        DeadLetters(settings),
    )
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    deadline = time.time() + 1800
    while time.time() < deadline:
        if int(r.hget(f"{prefix}:job:{job}", "succeeded") or 0) >= len(reqs):
            break
        time.sleep(0.02)
    seen_all = time.time()
    worker.request_stop()
    thread.join(timeout=120)
    results = [
        json.loads(raw)
        for raw in r.mget([f"{prefix}:result:{req.rid}" for req in reqs])
        if raw is not None
    ]
    ok = [res for res in results if res["status"] == "succeeded"]
    first = min(res["timings"]["dequeued"] for res in results) / 1000
    elapsed = seen_all - first
    tokens = sum(res["response"]["usage"]["completion_tokens"] for res in ok)
    latencies = [res["timings"]["finished"] / 1000 - first for res in ok]
    batch_sizes = [res["worker"]["batch_size"] for res in ok]
    return {
        "name": name,
        "n": len(reqs),
        "succeeded": len(ok),
        "elapsed_s": round(elapsed, 3),
        "req_per_s": round(len(reqs) / elapsed, 3),
        "out_tok_per_s": round(tokens / elapsed, 1),
        "latency_s": percentiles(latencies),
        "mean_batch_size": round(statistics.mean(batch_sizes), 1) if batch_sizes else None,
        "settings": {k: v for k, v in worker_settings.items()},
    }


def lone_latency(engine: Any, waits: list[float], count: int) -> list[dict[str, Any]]:
    """Lone requests at a slow steady rate: qbatch end to end vs the raw engine, per wait."""
    import redis
    from kafka import KafkaProducer
    from kafka.admin import KafkaAdminClient, NewTopic

    from worker.config import WorkerSettings
    from worker.engines.base import EngineRequest, SamplingSpec
    from worker.kafka_io import DeadLetters, RequestConsumer
    from worker.redis_io import RedisReplies
    from worker.service import Worker

    rng = random.Random(7)
    prompt = [rng.randrange(100, VOCAB_TOP) for _ in range(256)]
    spec = SamplingSpec(max_tokens=32, ignore_eos=True, temperature=0.7)

    def raw_once(i: int) -> float:
        done = threading.Event()
        t0 = time.perf_counter()
        engine.submit(
            [EngineRequest(f"raw-{uuid.uuid4().hex[:8]}-{i}", "", prompt, spec)],
            lambda _out: done.set(),
        )
        done.wait(60)
        return time.perf_counter() - t0

    raw = [raw_once(i) for i in range(count)]
    rows = []
    bootstrap = os.environ.get("QBATCH_KAFKA_BOOTSTRAP", "127.0.0.1:9092")
    r = redis.Redis.from_url(os.environ.get("QBATCH_REDIS_URL", "redis://127.0.0.1:6379/0"))
    for wait in waits:
        run = f"lone{int(wait)}-{uuid.uuid4().hex[:6]}"
        topic = f"bench.{run}"
        admin = KafkaAdminClient(bootstrap_servers=bootstrap)
        admin.create_topics([NewTopic(topic, 8, 1)])
        admin.close()
        settings = WorkerSettings(
            engine="vllm", model=str(MODEL_DIR), topic=topic, group=f"{run}-w", prefix=run,
            metrics_port=0, dead_letter=False, log_level="warning", batch_max_wait_ms=wait,
        )  # fmt: skip
        worker = Worker(
            settings, _KeepOpen(engine),  # type: ignore[arg-type]
            RequestConsumer(settings), RedisReplies.from_url(settings.redis_url, settings.keys),
            DeadLetters(settings),
        )  # fmt: skip
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=0, acks=1)
        time.sleep(5)  # group join
        e2e: list[float] = []
        reach: list[float] = []  # producer's submitted_at -> handed to the engine
        for i in range(count + 2):
            rid = f"{run}-{i}"
            env: dict[str, Any] = {
                "request_id": rid, "endpoint": "/v1/completions",
                "body": {"prompt": prompt, "max_tokens": 32, "ignore_eos": True, "temperature": 0.7},
            }  # fmt: skip
            env["submitted_at"] = datetime.now(UTC).isoformat()
            t0 = time.perf_counter()
            producer.send(topic, key=rid.encode(), value=json.dumps(env).encode())
            producer.flush()
            r.blpop([f"{run}:done:{rid}"], timeout=60)
            if i >= 2:  # the first two warm the path up
                e2e.append(time.perf_counter() - t0)
                timings = json.loads(r.get(f"{run}:result:{rid}") or b"{}").get("timings", {})
                if timings.get("submitted") and timings.get("dispatched"):
                    reach.append((timings["dispatched"] - timings["submitted"]) / 1000)
            time.sleep(0.3)
        producer.close()
        worker.request_stop()
        thread.join(timeout=60)
        added = [(a - statistics.median(raw)) * 1000 for a in e2e]
        rows.append(
            {
                "batch_max_wait_ms": wait,
                "raw_engine_s": percentiles(raw),
                "qbatch_e2e_s": percentiles(e2e),
                "reach_engine_s": percentiles(reach),
                "added_ms_p50": round(statistics.median(added), 1),
                "added_ms_p90": round(percentiles(added)["p90"], 1),
            }
        )
    return rows


def phase_static(out: Path, n: int) -> None:
    from worker.engines.vllm_engine import VllmEngine

    reqs = workload(n)
    engine = VllmEngine(engine_kwargs(), mode="static")
    t0 = time.perf_counter()
    engine.start()
    startup = time.perf_counter() - t0
    rows = [run_raw(engine, reqs)]
    print(json.dumps(rows[-1]), flush=True)
    rows.append(run_qbatch(engine, reqs[:320], "B16", engine_mode="static", batch_max_size=16))
    print(json.dumps(rows[-1]), flush=True)
    rows.append(run_qbatch(engine, reqs[:640], "B64", engine_mode="static", batch_max_size=64))
    print(json.dumps(rows[-1]), flush=True)
    (out / "static.json").write_text(json.dumps({"startup_s": startup, "runs": rows}, indent=2))


def phase_continuous(out: Path, n: int, sweep: int, lone: int) -> None:
    from worker.engines.vllm_engine import VllmEngine

    reqs = workload(n)
    engine = VllmEngine(engine_kwargs(), mode="continuous")
    t0 = time.perf_counter()
    engine.start()
    startup = time.perf_counter() - t0
    rows = [run_qbatch(engine, reqs, "C", batch_max_size=64, batch_max_wait_ms=50)]
    print(json.dumps(rows[-1]), flush=True)
    latency = lone_latency(engine, [0, 10, 50], lone) if lone else []
    for row in latency:
        print(json.dumps(row), flush=True)
    sweep_rows = []
    for wait in (0, 10, 50) if sweep else ():
        sweep_rows.append(
            run_qbatch(
                engine, reqs[:sweep], f"C-wait{wait}", batch_max_size=64, batch_max_wait_ms=wait
            )
        )
        print(json.dumps(sweep_rows[-1]), flush=True)
    (out / "continuous.json").write_text(
        json.dumps(
            {"startup_s": startup, "runs": rows, "lone": latency, "sweep": sweep_rows}, indent=2
        )
    )


def report(out: Path) -> None:
    static = json.loads((out / "static.json").read_text())
    cont = json.loads((out / "continuous.json").read_text())
    runs = {row["name"]: row for row in static["runs"] + cont["runs"]}
    a, b16, b64, c = runs["A"], runs["B16"], runs["B64"], runs["C"]
    ratios = {
        "C/A": round(c["req_per_s"] / a["req_per_s"], 3),
        "C/B64": round(c["req_per_s"] / b64["req_per_s"], 3),
        "C/B16": round(c["req_per_s"] / b16["req_per_s"], 3),
    }
    lines = [
        "| run | requests | req/s | output tok/s | p50 s | p90 s | p99 s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in (a, b16, b64, c):
        lat = row["latency_s"]
        lines.append(
            f"| {row['name']} | {row['n']} | {row['req_per_s']} | {row['out_tok_per_s']} | "
            f"{lat.get('p50')} | {lat.get('p90')} | {lat.get('p99')} |"
        )
    lines.append("")
    lines.append(" ".join(f"{k} = {v}" for k, v in ratios.items()))
    if cont.get("lone"):
        lines += ["", "| batch_max_wait_ms | raw engine p50 s | qbatch e2e p50 s | added p50 ms | added p90 ms |",
                  "| ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
        for row in cont["lone"]:
            lines.append(
                f"| {row['batch_max_wait_ms']} | {row['raw_engine_s']['p50']} | "
                f"{row['qbatch_e2e_s']['p50']} | {row['added_ms_p50']} | {row['added_ms_p90']} |"
            )
    if cont.get("sweep"):
        lines += [
            "",
            "| batch_max_wait_ms | requests | req/s | p50 s | p99 s |",
            "| ---: | ---: | ---: | ---: | ---: |",
        ]
        for row in cont["sweep"]:
            lines.append(
                f"| {row['settings']['batch_max_wait_ms']} | {row['n']} | {row['req_per_s']} | "
                f"{row['latency_s'].get('p50')} | {row['latency_s'].get('p99')} |"
            )
    text = "\n".join(lines)
    print(text)
    (out / "report.md").write_text(text + "\n")
    (out / "summary.json").write_text(json.dumps({"runs": runs, "ratios": ratios}, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        names = ["A", "B16", "B64", "C"]
        ax.bar(names, [runs[x]["req_per_s"] for x in names], color=["grey", "C1", "C1", "C0"])
        ax.set_ylabel("requests/s")
        ax.set_title("Workload W, Qwen3-14B (dummy weights), 1x H200")
        for i, x in enumerate(names):
            ax.text(
                i, runs[x]["req_per_s"], f"{runs[x]['req_per_s']:.2f}", ha="center", va="bottom"
            )
        fig.tight_layout()
        fig.savefig(out / "throughput.png", dpi=120)
    except ImportError:
        print("matplotlib not available: no plot")


def main() -> None:
    parser = argparse.ArgumentParser(description="Workload W: raw vLLM vs qbatch")
    parser.add_argument("phase", choices=["static", "continuous", "report"])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    parser.add_argument("--n", type=int, default=1500)
    parser.add_argument(
        "--sweep", type=int, default=600, help="requests per wait setting; 0 = skip"
    )
    parser.add_argument("--lone", type=int, default=10, help="lone requests per wait; 0 = skip")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.phase == "report":
        report(args.out)
        return
    if args.phase == "static":
        phase_static(args.out, args.n)
    else:
        phase_continuous(args.out, args.n, args.sweep, args.lone)
    # Results are on disk. vLLM's engine teardown at interpreter exit can hang for
    # minutes (seen with the LLM class): do not spend device time waiting for it, but do
    # not leave the engine-core process holding the GPU for the next phase either.
    for child in multiprocessing.active_children():
        child.kill()
        child.join(10)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
