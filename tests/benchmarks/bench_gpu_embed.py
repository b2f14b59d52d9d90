"""A nightly embedding job on a GPU (issue 44): `qbatch bulk run` of /v1/embeddings lines
through a `--task embed` worker against raw vLLM pooling (`LLM.embed` on the same inputs,
in one call), on one machine.

    B="python3 -m tests.benchmarks.bench_gpu_embed"
    $B raw    --out /tmp/e --model 0.6b          # LLM.embed, one call, all inputs
    $B qbatch --out /tmp/e --model 0.6b          # bulk run through a worker (same process)
    $B report --out /tmp/e                       # figures and the ratio, from their JSON

(each phase its own process: the two engines cannot share the GPU. `--model 14b` is the
14B config in pooling mode, the stand-in for Qwen3-Embedding-8B; 0.6b stands in for
Qwen3-Embedding-0.6B; dummy weights either way.)

The workload (`inputs`, pure and seeded): `--n` (20,000) inputs of 32-512 token ids drawn
from the vocabulary, one per OpenAI Batch line. raw: the ids as `{"prompt_token_ids"}`,
timed around `LLM.embed`. qbatch: a continuous `VllmEmbedder` built once, a worker on it
in this process, `qbatch bulk run` as a user runs it (its wall time: publish, embed,
results in Redis, the output file written). Each reports inputs/s and prompt tokens/s;
the report checks qbatch >= 0.97x raw on both. `--dry`: the echo engine with --task embed
on the CPU, raw calling it directly (a check of the harness; figures meaningless).
"""

from __future__ import annotations

import argparse
import json
import random
import time
import uuid
from pathlib import Path
from typing import Any

from tests.benchmarks import bench_runbatch as rb
from tests.benchmarks import gpu_harness as h

TARGET = 0.97
VOCAB_LOW, VOCAB_HIGH = 1_000, 150_000  # ordinary tokens of Qwen3's vocabulary


def inputs(n: int, low: int = 32, high: int = 512, seed: int = 44) -> list[list[int]]:
    """`n` inputs of `low`-`high` token ids, seeded."""
    rng = random.Random(seed)
    return [
        [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(rng.randint(low, high))]
        for _ in range(n)
    ]


def write_lines(path: Path, items: list[list[int]], model: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        for i, ids in enumerate(items):
            body = {"model": model, "input": ids}
            line = {"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings", "body": body}
            out.write(json.dumps(line) + "\n")
    return path


def summary(name: str, n: int, tokens: int, seconds: float) -> dict[str, Any]:
    return {
        "run": name,
        "inputs": n,
        "prompt_tokens": tokens,
        "seconds": round(seconds, 3),
        "inputs_per_s": round(n / seconds, 1),
        "tokens_per_s": round(tokens / seconds, 1),
    }


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    return {"max_model_len": args.max_model_len, "gpu_memory_utilization": args.gpu_mem}


def phase_raw(args: argparse.Namespace) -> None:
    items = inputs(args.n)
    h.wait_for_free_gpu()
    if args.dry:
        row = _raw_dry(items)
        h.write_json(args.out / "raw.json", {"model": h.MODEL, "gpu": "cpu (dry)", **row})
        print(json.dumps(row), flush=True)
        return
    from vllm import LLM, PoolingParams

    from worker.engines.vllm_embed import embed_kwargs

    kwargs = embed_kwargs(_worker_settings(args))
    kwargs.pop("scheduling_policy", None)  # LLM.embed takes no priorities
    llm = LLM(**kwargs)
    llm.embed([{"prompt_token_ids": ids} for ids in items[:64]], use_tqdm=False)  # warm-up
    prompts = [{"prompt_token_ids": ids} for ids in items]
    params = PoolingParams(task="embed")
    t0 = time.perf_counter()
    results = llm.embed(prompts, pooling_params=params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(r.prompt_token_ids) for r in results)
    row = summary("raw LLM.embed", len(results), tokens, elapsed)
    row["dimensions"] = len(results[0].outputs.embedding)
    h.write_json(args.out / "raw.json", {"model": h.MODEL, "gpu": h.gpu_name(), **row})
    print(json.dumps(row), flush=True)


def _raw_dry(items: list[list[int]]) -> dict[str, Any]:
    """The echo engine's vectors for every input in one submit (the harness's check)."""
    from worker.engines.base import EmbedSpec, EngineOutput, EngineRequest, SamplingSpec
    from worker.engines.echo import EchoEngine

    engine = EchoEngine(task="embed")
    outputs: list[EngineOutput] = []
    spec = SamplingSpec(max_tokens=1)
    batch = [
        EngineRequest(f"k{i}", "", None, spec, embed=EmbedSpec(inputs=(ids,)))
        for i, ids in enumerate(items)
    ]
    t0 = time.perf_counter()
    engine.submit(batch, outputs.append)
    elapsed = time.perf_counter() - t0
    return summary("raw (echo)", len(outputs), sum(o.prompt_tokens for o in outputs), elapsed)


def _worker_settings(args: argparse.Namespace) -> Any:
    from worker.config import WorkerSettings

    return WorkerSettings(
        engine="vllm",
        task="embed",
        model=str(h.MODEL_DIR),
        served_model_name=h.served_name(),
        load_format="dummy",
        dtype="bfloat16",
        **_settings(args),
    )


def phase_qbatch(args: argparse.Namespace) -> None:
    items = inputs(args.n)
    run = f"emb{uuid.uuid4().hex[:6]}"
    file = write_lines(args.work / f"{run}.jsonl", items, h.served_name())
    h.wait_for_free_gpu()
    if args.dry:
        from worker.engines.echo import EchoEngine

        engine: Any = EchoEngine(served_name=h.served_name(), task="embed", max_model_len=4096)
    else:
        from worker.engines.vllm_embed import VllmEmbedder

        engine = VllmEmbedder.from_settings(_worker_settings(args))
    engine.start()
    h.create_topic(f"bench.{run}")
    worker, _thread = h.start_worker(engine, run, task="embed", batch_max_size=args.batch)
    try:
        warm = write_lines(args.work / f"{run}-warm.jsonl", items[:64], h.served_name())
        rb.bulk_run(warm, warm.with_suffix(".out"), run, 600, ["--job", f"{run}-warm"])
        out = args.work / f"{run}.out.jsonl"
        rc, wall, err = rb.bulk_run(file, out, run, args.timeout, ["--job", run])
        if rc not in (0, 1):
            raise SystemExit(f"qbatch bulk run exited {rc}: {err}")
        counts = rb.count_output(out.read_text().splitlines(), set())
        row = summary("qbatch bulk run", counts["answered"], counts["prompt_tokens"], wall)
        row |= {"lines": counts["lines"], "exit": rc}
        out.unlink()
    finally:
        worker.request_stop()
        engine.close()
    h.write_json(args.out / "qbatch.json", {"model": h.MODEL, "dry": args.dry, **row})
    print(json.dumps(row), flush=True)


def report(out: Path) -> dict[str, Any]:
    raw, q = h.load_json(out / "raw.json"), h.load_json(out / "qbatch.json")
    ratios = {
        "inputs_per_s": round(q["inputs_per_s"] / raw["inputs_per_s"], 3),
        "tokens_per_s": round(q["tokens_per_s"] / raw["tokens_per_s"], 3),
    }
    met = all(value >= TARGET for value in ratios.values())
    print(f"model {raw.get('model')} on {raw.get('gpu')}: {raw['inputs']} inputs")
    for row in (raw, q):
        print(
            f"  {row['run']:<18} {row['inputs_per_s']:>9} inputs/s "
            f"{row['tokens_per_s']:>11} tokens/s  ({row['seconds']} s)"
        )
    print(f"  qbatch / raw: {ratios} (target >= {TARGET}: {'met' if met else 'NOT met'})")
    doc = {"raw": raw, "qbatch": q, "ratios": ratios, "target": TARGET, "met": met}
    h.write_json(out / "report.json", doc)
    return doc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("phase", choices=["raw", "qbatch", "report"])
    h.add_phase_args(parser, "phase JSON goes here", "input and output files go here")
    parser.add_argument("--model", choices=sorted(h.MODEL_CONFIGS), default="0.6b")
    parser.add_argument("--n", type=int, default=20_000)
    parser.add_argument("--gpu-mem", type=float, default=0.9)
    parser.add_argument("--batch", type=int, default=256, help="the worker's batch_max_size")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--dry", action="store_true")
    args = parser.parse_args()
    h.select_model(args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.phase == "raw":
        phase_raw(args)
    elif args.phase == "qbatch":
        phase_qbatch(args)
    else:
        report(args.out)


if __name__ == "__main__":
    main()
