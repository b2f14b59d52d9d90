"""Workload W on a GPU: raw vLLM vs qbatch static vs qbatch continuous, same requests.

Runs on the lent GPU machine with the whole stack there (deploy/gpu/README.md):

    python3 -m tests.benchmarks.bench_gpu full       --out $OUT   # C, then A, B64, B16; report
    python3 -m tests.benchmarks.bench_gpu static     --out $OUT   # A, B64, B16 (one engine)
    python3 -m tests.benchmarks.bench_gpu continuous --out $OUT   # C, low-load latency, wait sweep
    python3 -m tests.benchmarks.bench_gpu knobs      --out $OUT   # engine knobs, one engine each
        [--configs base,fp8 --workloads w400 --drift 64]       # fp8 weights: speed and drift
    python3 -m tests.benchmarks.bench_gpu report     --out $OUT   # ratios, table, plot
    python3 -m tests.benchmarks.bench_gpu knobs-report --out D --merge a/knobs.json,b/knobs.json

- A: `LLM.generate` over all requests at once (the engine's ceiling);
- B16 / B64: qbatch `static` mode (one blocking generate per micro-batch of 16 / 64),
  over the first `--b16` / `--b64` requests (320 / 640);
- C: qbatch `continuous` mode (the default).
B and C go through the real pipeline: records pre-loaded on Kafka, results read back
from Redis, timed from the first record dequeued to the last result seen in Redis.
Every request is a `/v1/completions` envelope whose prompt is the same token ids A
gets, with `max_tokens` fixed per request and `ignore_eos` (random weights).

`full` and `knobs` run each engine in a child process (its own process group, killed
when done) because `LLM` and `AsyncLLM` each take 90% of the GPU's memory, and write
what they have measured after every run, so a call cut short still brings back figures.
`--warmup N` first sends N requests of another seed through each engine, untimed: the
first sampled batch on a machine compiles Triton kernels, which would otherwise be billed
to whichever run comes first. vLLM's prefix cache is reset before every measured run.
`--engine echo` runs the same harness on the CPU with the echo engine (a dry run of the
plumbing; its figures mean nothing).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import multiprocessing
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NoReturn

REPO = Path(__file__).resolve().parents[2]
MODEL_DIR = REPO / "tests" / "fixtures" / "qwen3-14b"
VOCAB_TOP = 151_000  # plain BPE tokens only; the added special tokens start at 151643
DRY_DELAY_MS = 20.0  # the echo engine's answer time in dry runs


@dataclass(frozen=True)
class Req:
    rid: str
    prompt: list[int]
    max_tokens: int


# ---------------------------------------------------------------------------- workloads


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


def prefix_workload(n: int = 400, prefix_len: int = 1000, seed: int = 1) -> list[Req]:
    """A shared 1,000-token system prompt, then 64-192 tokens of its own, 32 tokens out:
    the shape of a bulk job that asks one long instruction of many documents."""
    rng = random.Random(seed)
    prefix = [rng.randrange(100, VOCAB_TOP) for _ in range(prefix_len)]
    return [
        Req(
            f"p{i:05d}",
            prefix + [rng.randrange(100, VOCAB_TOP) for _ in range(rng.randint(64, 192))],
            32,
        )
        for i in range(n)
    ]


def long_workload(n_long: int = 12, n_short: int = 240, seed: int = 2) -> list[Req]:
    """Long prompts (8K-16K tokens, 128 out) spread among W's short requests: what
    chunked prefill is for, so that a long prefill does not stall the others' decoding."""
    rng = random.Random(seed)
    short = workload(600 + n_short)[600:]
    longs = [
        Req(
            f"l{i:05d}",
            [rng.randrange(100, VOCAB_TOP) for _ in range(rng.randint(8192, 16000))],
            128,
        )
        for i in range(n_long)
    ]
    every = max(1, len(short) // max(1, n_long))
    mixed: list[Req] = []
    for i, req in enumerate(short):
        if i % every == 0 and longs:
            mixed.append(longs.pop(0))
        mixed.append(req)
    return mixed + longs


def group_of(rid: str) -> str:
    return {"l": "long", "p": "prefix"}.get(rid[0], "short")


# ---------------------------------------------------------------------------- engines


def engine_kwargs(**overrides: Any) -> dict[str, Any]:
    from worker.config import WorkerSettings
    from worker.engines.vllm_engine import engine_kwargs as from_settings

    fields: dict[str, Any] = {
        "engine": "vllm",
        "model": str(MODEL_DIR),
        "served_model_name": "Qwen3-14B",
        "load_format": "dummy",
        "dtype": "bfloat16",
        "max_model_len": 4096,
        "gpu_memory_utilization": 0.9,
    }
    fields.update(overrides)
    return from_settings(WorkerSettings(**fields))


def make_engine(mode: str, dry: bool, **overrides: Any) -> Any:
    if dry:
        from worker.engines.echo import EchoEngine

        return EchoEngine(
            served_name="Qwen3-14B",
            max_model_len=int(overrides.get("max_model_len", 4096)),
            delay_ms=DRY_DELAY_MS,
        )
    from worker.engines.vllm_engine import VllmEngine

    return VllmEngine(engine_kwargs(**overrides), mode=mode)


def kv_cache_tokens(engine: Any) -> int | None:
    """The engine's KV cache capacity in tokens, where this vLLM version tells it (AsyncLLM
    holds `vllm_config`, the offline `LLM` under `llm_engine`: raw.json of 2026-12-06 had
    null here)."""
    try:
        llm = engine._llm
        config = getattr(llm, "vllm_config", None) or llm.llm_engine.vllm_config
        cache = config.cache_config
        return int(cache.num_gpu_blocks) * int(cache.block_size)
    except (AttributeError, TypeError):
        return None


def reset_prefix_cache(engine: Any) -> None:
    """Forget the KV blocks earlier runs left behind, so that no run is served from the
    prefix cache of another. (The previous session's wait sweep ran the same prompts
    three times and credited the cache hits of the 2nd and 3rd runs to their settings;
    its B16 ran the prompts B64 had just run.)"""
    llm = getattr(engine, "_llm", None)
    if llm is None:
        return
    loop = getattr(engine, "_loop", None)
    if loop is not None:  # AsyncLLM: a coroutine, on the engine's loop
        import asyncio

        asyncio.run_coroutine_threadsafe(llm.reset_prefix_cache(), loop).result(60)
    else:
        llm.reset_prefix_cache()


def percentiles(values: list[float], digits: int = 3) -> dict[str, float]:
    if not values:
        return {}
    if len(values) == 1:
        v = round(values[0], digits)
        return {"p50": v, "p90": v, "p99": v}
    qs = statistics.quantiles(values, n=100, method="inclusive")
    return {k: round(qs[i], digits) for k, i in (("p50", 49), ("p90", 89), ("p99", 98))}


class _KeepOpen:
    """Lets one loaded engine serve several worker runs (the worker closes its engine)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def close(self) -> None:
        return


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)


# ---------------------------------------------------------------------------- runs


def worker_sampling(engine: Any, reqs: list[Req]) -> list[Any]:
    """The sampling each request gets inside the worker: the same envelope through the same
    renderer, with the model's generation defaults (Qwen3: top_k 20, top_p 0.95) filling
    what the request leaves unset. A must sample exactly as C does, or the comparison
    measures the sampler (top-k/top-p over a 151k vocabulary costs GPU time every step)."""
    from schemas import RequestEnvelope
    from worker.rendering import PromptRenderer

    renderer = PromptRenderer(
        engine.tokenizer,
        max_model_len=engine.max_model_len,
        served_names={"Qwen3-14B"},
        generation_defaults=getattr(engine, "generation_defaults", None),
    )
    return [
        renderer.render(RequestEnvelope.model_validate(_envelope(r, i))).sampling
        for i, r in enumerate(reqs)
    ]


def run_raw(engine: Any, reqs: list[Req]) -> dict[str, Any]:
    """A: all prompts in one `LLM.generate` (dry run: all through `submit`)."""
    specs = worker_sampling(engine, reqs)
    reset_prefix_cache(engine)
    t0 = time.perf_counter()
    if hasattr(engine, "_llm"):
        from worker.engines.vllm_engine import sampling_params

        params = [sampling_params(spec) for spec in specs]
        prompts = [{"prompt_token_ids": r.prompt} for r in reqs]
        outs = engine._llm.generate(prompts, params, use_tqdm=False)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    else:
        from worker.engines.base import EngineRequest

        left = threading.Semaphore(0)
        engine.submit(
            [EngineRequest(r.rid, "", r.prompt, spec) for r, spec in zip(reqs, specs, strict=True)],
            lambda _out: left.release(),
        )
        for _ in reqs:
            left.acquire()
        tokens = 0
    elapsed = time.perf_counter() - t0
    return {
        "name": "A",
        "n": len(reqs),
        "elapsed_s": round(elapsed, 3),
        "req_per_s": round(len(reqs) / elapsed, 3),
        "out_tok_per_s": round(tokens / elapsed, 1),
        "latency_s": {"p50": round(elapsed, 3), "p90": round(elapsed, 3), "p99": round(elapsed, 3)},
        "sampling": {k: getattr(specs[0], k) for k in ("temperature", "top_p", "top_k")},
        "note": "LLM.generate returns all outputs at once: every latency is the whole run",
    }


def _bootstrap() -> str:
    return os.environ.get("QBATCH_KAFKA_BOOTSTRAP", "127.0.0.1:9092")


def _redis_url() -> str:
    return os.environ.get("QBATCH_REDIS_URL", "redis://127.0.0.1:6379/0")


def _redis() -> Any:
    """A client for QBATCH_REDIS_URL: one Redis, or a Redis Cluster (redis+cluster://)."""
    from schemas.redis_conn import connect

    return connect(_redis_url())


def _keys(prefix: str) -> Any:
    """The contract's key names under `prefix` (hash-tagged on a Redis Cluster)."""
    from schemas import RedisKeys
    from schemas.redis_conn import is_cluster_url

    return RedisKeys(prefix, cluster=is_cluster_url(_redis_url()))


def _mget(client: Any, keys: list[str]) -> list[Any]:
    from schemas.redis_conn import mget

    return mget(client, keys)


def _create_topic(topic: str) -> None:
    """A run's requests topic and its bulk lane's (the worker subscribes to both)."""
    from kafka.admin import KafkaAdminClient, NewTopic

    admin = KafkaAdminClient(bootstrap_servers=_bootstrap().split(","))
    # Replicated where there are brokers to replicate to (a cluster's min.insync.replicas=2
    # refuses acks=all writes to a topic of one replica).
    replication = min(3, len(admin.describe_cluster()["brokers"]))
    admin.create_topics(
        [NewTopic(topic, 8, replication), NewTopic(f"{topic}.bulk", 8, replication)]
    )
    admin.close()


def _start_worker(engine: Any, run: str, **worker_settings: Any) -> tuple[Any, threading.Thread]:
    """A worker on topic `bench.<run>`, key prefix `<run>`, sharing the loaded engine."""
    from worker.config import WorkerSettings
    from worker.service import build_worker

    topic = f"bench.{run}"
    settings = WorkerSettings(
        engine="vllm",
        model=str(MODEL_DIR),
        topic=topic,
        bulk_topic=f"{topic}.bulk",
        dlq_topic=f"{topic}.dlq",
        group=f"{run}-workers",
        prefix=run,
        metrics_port=0,
        dead_letter=False,
        log_level="warning",
        **worker_settings,
    )
    worker = build_worker(settings, _KeepOpen(engine))  # type: ignore[arg-type]
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    return worker, thread


def _envelope(req: Req, seed: int, job: str | None = None) -> dict[str, Any]:
    env: dict[str, Any] = {
        "request_id": req.rid,
        "endpoint": "/v1/completions",
        "body": {
            "prompt": req.prompt,
            "max_tokens": req.max_tokens,
            "ignore_eos": True,
            "temperature": 0.7,
            "seed": seed,
        },
    }
    if job:
        env["job_id"] = job
    return env


def run_qbatch(engine: Any, reqs: list[Req], name: str, **worker_settings: Any) -> dict[str, Any]:
    """Pre-load the requests on a fresh topic, run a worker until all results are in Redis."""
    run = re.sub(r"[^a-z0-9-]", "-", f"{name.lower()}-{uuid.uuid4().hex[:6]}")
    topic = f"bench.{run}"
    _create_topic(topic)
    _preload(topic, run, run, reqs)
    reset_prefix_cache(engine)
    worker, thread = _start_worker(engine, run, **worker_settings)
    seen_all = _wait_job(run, run, len(reqs), timeout_s=1800)
    worker.request_stop()
    thread.join(timeout=120)
    return _summary(name, run, reqs, seen_all) | {"settings": dict(worker_settings)}


def _preload(
    topic: str, prefix: str, job: str, reqs: list[Req], extra: dict[str, Any] | None = None
) -> None:
    """The requests on `topic` before any worker takes them, as one job of `prefix`;
    `extra`: envelope fields every request gets (e.g. a priority)."""
    from kafka import KafkaProducer

    _redis().hset(_keys(prefix).job(job), mapping={"total": len(reqs), "status": "running"})
    producer = KafkaProducer(bootstrap_servers=_bootstrap(), linger_ms=20, acks="all")
    for i, req in enumerate(reqs):
        env = _envelope(req, i, job) | (extra or {})
        producer.send(topic, key=req.rid.encode(), value=json.dumps(env).encode())
    producer.flush()
    producer.close()


def _wait_job(prefix: str, job: str, n: int, timeout_s: float) -> float:
    """Until `n` of the job's requests succeeded; the wall time (epoch s) when they had."""
    r = _redis()
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if int(r.hget(_keys(prefix).job(job), "succeeded") or 0) >= n:
            break
        time.sleep(0.02)
    return time.time()


def _summary(name: str, prefix: str, reqs: list[Req], seen_all: float) -> dict[str, Any]:
    """Throughput and latency of one run, from the results' own timings (epoch ms)."""
    results = [
        json.loads(raw)
        for raw in _mget(_redis(), [_keys(prefix).result(req.rid) for req in reqs])
        if raw is not None
    ]
    ok = [res for res in results if res["status"] == "succeeded"]
    first = min(res["timings"]["dequeued"] for res in results) / 1000
    elapsed = seen_all - first
    tokens = sum(res["response"]["usage"]["completion_tokens"] for res in ok)
    latencies = {res["request_id"]: res["timings"]["finished"] / 1000 - first for res in ok}
    batch_sizes = [res["worker"]["batch_size"] for res in ok]
    by_group: dict[str, list[float]] = {}
    for rid, latency in latencies.items():
        by_group.setdefault(group_of(rid), []).append(latency)
    return {
        "name": name,
        "n": len(reqs),
        "succeeded": len(ok),
        "elapsed_s": round(elapsed, 3),
        "req_per_s": round(len(reqs) / elapsed, 3),
        "out_tok_per_s": round(tokens / elapsed, 1),
        "latency_s": percentiles(list(latencies.values())),
        "latency_s_by_group": {g: percentiles(v) for g, v in sorted(by_group.items())}
        if len(by_group) > 1
        else {},
        "mean_batch_size": round(statistics.mean(batch_sizes), 1) if batch_sizes else None,
        "by_worker": dict(sorted(collections.Counter(res["worker"]["id"] for res in ok).items())),
    }


def phase_external(out: Path, n: int, label: str, timeout_s: float, warmup: int) -> None:
    """Workload W through workers that are already running (deploy/gpu/run.sh with
    QBATCH_WORKERS=N: N pinned workers, one group) on QBATCH_TOPIC / QBATCH_PREFIX: the
    data-parallel layout, measured the way run_qbatch measures one in-process worker.
    `warmup` requests go through first, untimed (each engine compiles kernels on its
    first requests)."""
    topic = os.environ.get("QBATCH_TOPIC", "qbatch.requests")
    prefix = os.environ.get("QBATCH_PREFIX", "qbatch")
    if warmup:
        warm_job = f"{label}-warm-{uuid.uuid4().hex[:6]}"
        warm = [
            Req(f"{warm_job}-{q.rid}", q.prompt, q.max_tokens) for q in workload(warmup, seed=99)
        ]
        _preload(topic, prefix, warm_job, warm)
        _wait_job(prefix, warm_job, len(warm), timeout_s)
    job = f"{label}-{uuid.uuid4().hex[:6]}"
    reqs = [Req(f"{job}-{q.rid}", q.prompt, q.max_tokens) for q in workload(n)]
    _preload(topic, prefix, job, reqs)
    seen_all = _wait_job(prefix, job, len(reqs), timeout_s)
    doc = _summary(label, prefix, reqs, seen_all) | {"topic": topic}
    print(json.dumps(doc), flush=True)
    _write_json(out / f"external-{label}.json", doc)


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

    r = _redis()
    rows = []
    for wait in waits:
        run = f"lone{int(wait)}-{uuid.uuid4().hex[:6]}"
        _create_topic(f"bench.{run}")
        worker, thread = _start_worker(engine, run, batch_max_wait_ms=wait)
        producer = KafkaProducer(bootstrap_servers=_bootstrap(), linger_ms=0, acks=1)
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
            env = _envelope(Req(rid, prompt, 32), i)
            env["submitted_at"] = datetime.now(UTC).isoformat()
            t0 = time.perf_counter()
            producer.send(f"bench.{run}", key=rid.encode(), value=json.dumps(env).encode())
            producer.flush()
            r.blpop([_keys(run).done(rid)], timeout=60)
            took = time.perf_counter() - t0
            woke_ms = time.time() * 1000
            if i >= 2:
                e2e.append(took)
                t = json.loads(r.get(_keys(run).result(rid)) or b"{}").get("timings", {})
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


# ---------------------------------------------------------------------------- phases


def warm_up(engine: Any, n: int, mode: str) -> None:
    """n requests of their own (another seed) through the same path before anything is
    timed, so that one-off costs (Triton kernels compiled at the first sampling step,
    lazily started loops) are not billed to the first measured run."""
    if n:
        reqs = [
            Req(f"warm{i:05d}", r.prompt, r.max_tokens) for i, r in enumerate(workload(n, seed=99))
        ]
        if mode == "static":
            run_raw(engine, reqs)
        else:
            run_qbatch(engine, reqs, "warmup", batch_max_size=64, batch_max_wait_ms=50)


def phase_static(
    out: Path, n: int, dry: bool, b64: int = 640, b16: int = 320, warmup: int = 0
) -> None:
    reqs = workload(n)
    engine = make_engine("static", dry)
    t0 = time.perf_counter()
    engine.start()
    doc: dict[str, Any] = {"startup_s": round(time.perf_counter() - t0, 1), "runs": []}
    warm_up(engine, warmup, "static")
    doc["warmup"] = warmup
    plan: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("A", lambda: run_raw(engine, reqs)),
        ("B64", lambda: run_qbatch(engine, reqs[:b64], "B64", engine_mode="static", batch_max_size=64)),
        ("B16", lambda: run_qbatch(engine, reqs[:b16], "B16", engine_mode="static", batch_max_size=16)),
    ]  # fmt: skip
    sizes = {"A": n, "B64": b64, "B16": b16}
    for name, measure in plan:
        if not sizes[name]:
            continue
        doc["runs"].append(measure())
        print(json.dumps(doc["runs"][-1]), flush=True)
        _write_json(out / "static.json", doc)


def phase_continuous(out: Path, n: int, sweep: int, lone: int, dry: bool, warmup: int = 0) -> None:
    engine = make_engine("continuous", dry)
    t0 = time.perf_counter()
    engine.start()
    doc: dict[str, Any] = {
        "startup_s": round(time.perf_counter() - t0, 1),
        "warmup": warmup,
        "runs": [],
        "lone": [],
        "sweep": [],
    }
    warm_up(engine, warmup, "continuous")
    if n:
        reqs = workload(n)
        doc["runs"].append(run_qbatch(engine, reqs, "C", batch_max_size=64, batch_max_wait_ms=50))
        print(json.dumps(doc["runs"][-1]), flush=True)
        _write_json(out / "continuous.json", doc)
    if lone:
        doc["lone"] = lone_latency(engine, [0, 10, 50], lone)
        _write_json(out / "continuous.json", doc)
    if sweep:
        reqs = workload(sweep)
        for wait in (0, 10, 50):
            doc["sweep"].append(
                run_qbatch(engine, reqs, f"C-wait{wait}", batch_max_size=64, batch_max_wait_ms=wait)
            )
            print(json.dumps(doc["sweep"][-1]), flush=True)
            _write_json(out / "continuous.json", doc)
    _write_json(out / "continuous.json", doc)


_KV_LINE = re.compile(r"GPU KV cache size: ([\d,]+) tokens")


def _nvidia_smi(field: str) -> list[str]:
    """One value per GPU of `nvidia-smi --query-gpu=FIELD`; empty where there is none."""
    try:
        text = subprocess.run(
            ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in text.splitlines() if line.strip()]


def _gpu_memory_used_mib() -> int | None:
    values = _nvidia_smi("memory.used")
    try:
        return sum(int(x) for x in values) if values else None
    except ValueError:
        return None


def _wait_for_free_gpu(timeout_s: float = 60) -> None:
    """The driver frees a dead process's memory within seconds; the next engine sizes its
    KV cache from what is free, so it must not start before that."""
    until = time.time() + timeout_s
    while time.time() < until:
        used = _gpu_memory_used_mib()
        if used is None or used < 4096:
            return
        time.sleep(1)


def run_child(args: list[str], log: Any, deadline: float) -> tuple[int | None, list[str]]:
    """This module in a child process group; its output into `log` and our stdout.

    Killed (the engine-core processes with it) at `deadline`; returns its exit status
    (None when killed) and the lines it printed.
    """
    _wait_for_free_gpu()
    cmd = [sys.executable, "-m", "tests.benchmarks.bench_gpu", *args]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            log.write(line)
            log.flush()
            sys.stdout.write(line)
            sys.stdout.flush()

    pumper = threading.Thread(target=pump, daemon=True)
    pumper.start()
    try:
        rc: int | None = proc.wait(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        rc = None
        print(f"bench_gpu: {' '.join(args)} ran out of time: killed", flush=True)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    pumper.join(timeout=10)
    _wait_for_free_gpu()  # for whatever runs next, in this process or after it
    return rc, lines


def phase_full(
    out: Path, n: int, dry: bool, budget_s: float, b64: int, b16: int, warmup: int = 0
) -> None:
    """A, B64, B16 and C in one run, same requests: C's engine first, then the static one."""
    deadline = time.time() + budget_s
    extra = (["--engine", "echo"] if dry else []) + ["--warmup", str(warmup)]
    with (out / "full.log").open("a") as log:
        run_child(["continuous", "--out", str(out), "--n", str(n), "--lone", "0", "--sweep", "0", *extra], log, deadline)  # fmt: skip
        run_child(["static", "--out", str(out), "--n", str(n), "--b64", str(b64), "--b16", str(b16), *extra], log, deadline)  # fmt: skip
    report(out)


def _gpu_name() -> str:
    names = _nvidia_smi("name")
    return f"{len(names)}x {names[0]}" if names else "no GPU"


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _ceiling_cell(row: dict[str, Any]) -> str:
    """The run's total (prompt + output) tokens/s against the bf16 compute ceiling of this
    GPU (tests/benchmarks/ceiling.py). The first n requests of W are the run's requests
    (workload() draws them in order), so their prompt lengths are known exactly."""
    from tests.benchmarks import ceiling

    prompt = sum(len(r.prompt) for r in workload(row["n"]))
    total = row["out_tok_per_s"] + prompt / row["elapsed_s"]
    return ceiling.column(total, _gpu_name(), ceiling.model_params(MODEL_DIR))


def report(out: Path) -> None:
    """Tables (markdown), ratios and a plot from whatever static/continuous JSON is there."""
    static, cont = _load(out / "static.json"), _load(out / "continuous.json")
    runs = {row["name"]: row for row in static.get("runs", []) + cont.get("runs", [])}
    ratios = {
        f"C/{base}": round(runs["C"]["req_per_s"] / runs[base]["req_per_s"], 3)
        for base in ("A", "B64", "B16")
        if "C" in runs and base in runs
    }
    lines = []
    if runs:
        lines += [
            "| run | requests | req/s | output tok/s | p50 s | p90 s | p99 s"
            " | total tok/s vs bf16 ceiling |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
        ]
        for name in ("A", "B16", "B64", "C"):
            if name not in runs:
                continue
            row, lat = runs[name], runs[name]["latency_s"]
            lines.append(
                f"| {name} | {row['n']} | {row['req_per_s']} | {row['out_tok_per_s']} | "
                f"{lat.get('p50')} | {lat.get('p90')} | {lat.get('p99')} | "
                f"{_ceiling_cell(row)} |"
            )
        lines += ["", " ".join(f"{k} = {v}" for k, v in ratios.items())]
    if cont.get("lone"):
        lines += [
            "",
            "| batch_max_wait_ms | raw engine p50 ms | qbatch e2e p50 ms | added p50 / p90 ms"
            " | reaches engine p50 / max ms | Kafka / batching / engine / reply p50 ms | target ms |",
            "| ---: | ---: | ---: | ---: | ---: | --- | ---: |",
        ]
        for row in cont["lone"]:
            p = row["parts_ms_p50"]
            reach = row["reach_engine_ms"]
            lines.append(
                f"| {row['batch_max_wait_ms']} | {row['raw_engine_ms'].get('p50')} | "
                f"{row['qbatch_e2e_ms'].get('p50')} | {row['added_ms'].get('p50')} / "
                f"{row['added_ms'].get('p90')} | {reach.get('p50')} / {reach.get('max')} | "
                f"{p.get('kafka')} / {p.get('batching')} / {p.get('engine')} / {p.get('reply')} | "
                f"{row['target_ms']} |"
            )
    if cont.get("sweep"):
        lines += [
            "",
            "| batch_max_wait_ms | requests | req/s | p50 s | p99 s | mean batch size |",
            "| ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for row in cont["sweep"]:
            lines.append(
                f"| {row['settings']['batch_max_wait_ms']} | {row['n']} | {row['req_per_s']} | "
                f"{row['latency_s'].get('p50')} | {row['latency_s'].get('p99')} | "
                f"{row['mean_batch_size']} |"
            )
    text = "\n".join(lines)
    print(text)
    (out / "report.md").write_text(text + "\n")
    _write_json(out / "summary.json", {"device": _gpu_name(), "runs": runs, "ratios": ratios})
    names = [x for x in ("A", "B16", "B64", "C") if x in runs]
    if not names:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not available: no plot")
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    colours = {"A": "grey", "B16": "C1", "B64": "C1", "C": "C0"}
    ax.bar(names, [runs[x]["req_per_s"] for x in names], color=[colours[x] for x in names])
    ax.set_ylabel("requests/s")
    ax.set_title(f"Workload W, Qwen3-14B (dummy weights), {_gpu_name()}")
    for i, x in enumerate(names):
        ax.text(i, runs[x]["req_per_s"], f"{runs[x]['req_per_s']:.2f}", ha="center", va="bottom")
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=120)


def _interactive_loop(
    run: str, topic: str, count: int | None, every_s: float, stop: threading.Event, tag: str
) -> list[float]:
    """Interactive requests (256-token prompt, 64 tokens out) one at a time, every
    `every_s`, on the interactive topic; seconds from send to result, each."""
    from kafka import KafkaProducer

    rng = random.Random(7)
    r = _redis()
    producer = KafkaProducer(bootstrap_servers=_bootstrap(), linger_ms=0, acks=1)
    out: list[float] = []
    i = 0
    try:
        while not stop.is_set() and (count is None or i < count):
            req = Req(f"{tag}{i:04d}", [rng.randrange(100, VOCAB_TOP) for _ in range(256)], 64)
            t0 = time.monotonic()
            producer.send(topic, key=req.rid.encode(), value=json.dumps(_envelope(req, i)).encode())
            producer.flush()
            r.blpop([_keys(run).done(req.rid)], timeout=600)
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
        doc["runs"].append(_lanes_one_cap(engine, n, every_s, cap, seed=11 + 2 * k))
        _write_json(out / "lanes.json", doc)
    for one in doc["runs"]:
        print(json.dumps({"bulk_max_inflight": one["bulk_max_inflight"]} | one["summary"]))


def _lanes_one_cap(
    engine: Any, n: int, every_s: float, cap: int | None, seed: int
) -> dict[str, Any]:
    run = f"lanes-{uuid.uuid4().hex[:6]}"
    topic = f"bench.{run}"
    _create_topic(topic)
    r = _redis()
    extra = {"bulk_max_inflight": cap} if cap else {}
    doc: dict[str, Any] = {"bulk_max_inflight": cap}
    worker, thread = _start_worker(engine, run, batch_max_size=64, batch_max_wait_ms=50, **extra)
    time.sleep(5)  # group join
    _interactive_loop(run, topic, 3, 0.5, threading.Event(), "warm")
    doc["idle_s"] = _interactive_loop(run, topic, 15, every_s, threading.Event(), "idle")

    def backlog(job: str, with_interactive: bool, seed: int) -> dict[str, Any]:
        reqs = [Req(f"{job}-{q.rid}", q.prompt, q.max_tokens) for q in workload(n, seed=seed)]
        reset_prefix_cache(engine)
        _preload(f"{topic}.bulk", run, job, reqs, extra={"priority": 10})
        stop = threading.Event()
        latencies: list[float] = []
        live = threading.Thread(
            target=lambda: latencies.extend(
                _interactive_loop(run, topic, None, every_s, stop, f"live-{job}-")
            ),
            daemon=True,
        )
        while not r.exists(_keys(run).result(reqs[0].rid)) and not r.hget(
            _keys(run).job(job), "succeeded"
        ):
            time.sleep(0.05)
        if with_interactive:
            live.start()
        _wait_job(run, job, len(reqs), timeout_s=1800)
        stop.set()
        if with_interactive:
            live.join(600)
        results = [json.loads(x) for x in _mget(r, [_keys(run).result(q.rid) for q in reqs])]
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


def main() -> None:
    # the knob phases live in their own module, which imports this one
    from tests.benchmarks.bench_knobs import (
        KNOB_WORKLOADS,
        KNOBS,
        KnobOptions,
        knobs_report,
        merge_knobs,
        phase_knob,
        phase_knobs,
    )

    parser = argparse.ArgumentParser(description="Workload W: raw vLLM vs qbatch")
    parser.add_argument(
        "phase",
        choices=[
            "full",
            "static",
            "continuous",
            "knobs",
            "knob",
            "knobs-report",
            "lanes",
            "external",
            "report",
        ],
    )
    parser.add_argument("knob", nargs="?", help="knob: the configuration to run (internal)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    parser.add_argument("--n", type=int, default=1500, help="requests of W for A and C")
    parser.add_argument("--b64", type=int, default=640, help="requests of W for B64")
    parser.add_argument("--b16", type=int, default=320, help="requests of W for B16")
    parser.add_argument("--sweep", type=int, default=400, help="requests per wait; 0 = skip")
    parser.add_argument(
        "--warmup", type=int, default=0, help="untimed requests through each engine first"
    )
    parser.add_argument("--lone", type=int, default=20, help="lone requests per wait; 0 = skip")
    parser.add_argument(
        "--every-s", type=float, default=1.0, help="lanes: seconds between interactive requests"
    )
    parser.add_argument(
        "--bulk-max-inflight",
        default="default",
        help="lanes: the worker's bulk cap; a comma-separated list runs one worker per cap "
        'on the same engine ("default": the worker\'s own)',
    )
    parser.add_argument(
        "--configs", default=",".join(KNOBS), help=f"knobs to run, of {', '.join(KNOBS)}"
    )
    parser.add_argument(
        "--budget-s", type=float, default=540, help="full/knobs: stop children after this"
    )
    parser.add_argument(
        "--workloads",
        default=None,
        help=f"knobs: run only these of each config's workloads, of {', '.join(KNOB_WORKLOADS)}",
    )
    parser.add_argument(
        "--merge",
        default="",
        help="knobs-report: knobs.json files (comma-separated) of calls on one machine",
    )
    parser.add_argument(
        "--drift",
        type=int,
        default=0,
        help="knobs: greedy drift probe over this many prompts per engine (0 = none)",
    )
    parser.add_argument(
        "--label", default="external", help="external: the run's name (dp2, tp2, ...)"
    )
    parser.add_argument(
        "--engine", choices=["vllm", "echo"], default="vllm", help="echo: CPU dry run"
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dry = args.engine == "echo"
    from worker.logs import configure

    configure("info", "console")
    if args.phase == "report":
        report(args.out)
        return
    if args.phase == "knobs-report":  # knobs.json of several calls -> one knobs.md
        sources = [Path(p) for p in args.merge.split(",") if p]
        knobs_report(args.out, merge_knobs([json.loads(p.read_text()) for p in sources]))
        return
    if args.phase == "full":
        phase_full(args.out, args.n, dry, args.budget_s, args.b64, args.b16, args.warmup)
        return
    workloads = None if args.workloads is None else tuple(w for w in args.workloads.split(",") if w)
    knob_opts = KnobOptions(args.warmup, workloads, args.drift)
    if args.phase == "knobs":
        names = [x for x in args.configs.split(",") if x]
        unknown = set(names) - set(KNOBS) | set(workloads or ()) - set(KNOB_WORKLOADS)
        if unknown:
            parser.error(f"unknown knob configs or workloads: {sorted(unknown)}")
        phase_knobs(args.out, names, dry, args.budget_s, knob_opts)
        return
    if args.phase == "external":
        phase_external(args.out, args.n, args.label, args.budget_s, args.warmup)
        return
    if args.phase == "lanes":
        caps = [None if c == "default" else int(c) for c in args.bulk_max_inflight.split(",")]
        phase_lanes(args.out, args.n, dry, args.warmup, args.every_s, caps)
    elif args.phase == "static":
        phase_static(args.out, args.n, dry, args.b64, args.b16, args.warmup)
    elif args.phase == "continuous":
        phase_continuous(args.out, args.n, args.sweep, args.lone, dry, args.warmup)
    else:
        phase_knob(args.out, args.knob, dry, knob_opts)
    exit_now()


def exit_now() -> NoReturn:
    """End a phase whose results are on disk. vLLM's engine teardown at interpreter exit
    can hang for minutes (seen with the LLM class): do not spend device time waiting for
    it, but do not leave the engine-core process holding the GPU for the next phase."""
    for child in multiprocessing.active_children():
        child.kill()
        child.join(10)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def cli_env(run: str) -> dict[str, str]:
    """The environment of a `qbatch` CLI subprocess aimed at the workers of topic
    `bench.<run>` (bulk lane `bench.<run>.bulk`, key prefix `<run>`), this repo first."""
    env = dict(os.environ)
    env.update(
        QBATCH_TOPIC=f"bench.{run}",
        QBATCH_BULK_TOPIC=f"bench.{run}.bulk",
        QBATCH_PREFIX=run,
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
    )
    return env


if __name__ == "__main__":
    main()
