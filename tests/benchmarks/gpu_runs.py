"""The measured runs of workload W and its variants, shared by the GPU benchmarks: the
workloads (pure, seeded), raw `LLM.generate` over them, and qbatch over them end to end
(records pre-loaded on Kafka, a worker sharing the loaded engine, results read back from
Redis, timed by the results' own timings), plus the warm-up every engine gets first.
"""

from __future__ import annotations

import collections
import json
import random
import re
import statistics
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from tests.benchmarks.gpu_harness import (
    bootstrap,
    create_topic,
    keys_for,
    mget_all,
    percentiles,
    redis_client,
    reset_prefix_cache,
    served_name,
    start_worker,
)

VOCAB_TOP = 151_000  # plain BPE tokens only; the added special tokens start at 151643


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
        served_names={served_name()},
        generation_defaults=getattr(engine, "generation_defaults", None),
    )
    return [
        renderer.render(RequestEnvelope.model_validate(envelope(r, i))).sampling
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


def envelope(req: Req, seed: int, job: str | None = None) -> dict[str, Any]:
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
    create_topic(topic)
    preload(topic, run, run, reqs)
    reset_prefix_cache(engine)
    worker, thread = start_worker(engine, run, **worker_settings)
    seen_all = wait_job(run, run, len(reqs), timeout_s=1800)
    worker.request_stop()
    thread.join(timeout=120)
    return summary(name, run, reqs, seen_all) | {"settings": dict(worker_settings)}


def preload(
    topic: str, prefix: str, job: str, reqs: list[Req], extra: dict[str, Any] | None = None
) -> None:
    """The requests on `topic` before any worker takes them, as one job of `prefix`;
    `extra`: envelope fields every request gets (e.g. a priority)."""
    envs = [envelope(req, i, job) | (extra or {}) for i, req in enumerate(reqs)]
    preload_envelopes(topic, prefix, job, envs)


def preload_envelopes(topic: str, prefix: str, job: str, envs: list[dict[str, Any]]) -> None:
    """Envelopes on `topic` as one job of `prefix` (each gets the `job_id`)."""
    from kafka import KafkaProducer

    redis_client().hset(
        keys_for(prefix).job(job), mapping={"total": len(envs), "status": "running"}
    )
    producer = KafkaProducer(bootstrap_servers=bootstrap(), linger_ms=20, acks="all")
    for env in envs:
        value = json.dumps(env | {"job_id": job}).encode()
        producer.send(topic, key=env["request_id"].encode(), value=value)
    producer.flush()
    producer.close()


def wait_job(prefix: str, job: str, n: int, timeout_s: float) -> float:
    """Until `n` of the job's requests succeeded; the wall time (epoch s) when they had."""
    r = redis_client()
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if int(r.hget(keys_for(prefix).job(job), "succeeded") or 0) >= n:
            break
        time.sleep(0.02)
    return time.time()


def summary(name: str, prefix: str, reqs: list[Req], seen_all: float) -> dict[str, Any]:
    """Throughput and latency of one run, from the results' own timings (epoch ms)."""
    results = [
        json.loads(raw)
        for raw in mget_all(redis_client(), [keys_for(prefix).result(req.rid) for req in reqs])
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
