"""Summarisation jobs on a GPU (issue 15): map-reduce vs one cut request, and a nightly job
of many documents against raw vLLM on the very same prompts.

Runs on the lent GPU machine with the stack up (deploy/gpu/README.md), in two calls because
`AsyncLLM` (the worker) and `LLM` (raw) each take 90% of the GPU:

    python3 -m tests.benchmarks.bench_gpu_summarize qbatch --out $OUT/sum   # 1 and 2 below
    python3 -m tests.benchmarks.bench_gpu_summarize raw    --out $OUT/sum   # 3
    python3 -m tests.benchmarks.bench_gpu_summarize report --out $OUT/sum

1. `longdoc`: one document of `--long-tokens` (100K) tokens through `qbatch bulk summarize`
   (the CLI, as a user runs it: chunks, map, reduce levels) vs one chat request of the same
   text cut to the context by the `truncate_middle` context policy. Wall time and tokens.
2. `nightly`: `--docs` documents of `--doc-tokens` (20K) tokens as one `qbatch bulk
   summarize` job: documents/hour, output tok/s (completion tokens / job wall time, the CLI
   started to the output file written).
3. `raw`: the round files that job wrote (`L1.jsonl`, `L2.jsonl`: every request it ran, in
   the same rounds) rendered by the worker's own renderer and run with `LLM.generate`, one
   call per round; output tok/s over the sum of the generate calls. The ratio qbatch/raw is
   what the job layer costs (target >= 0.95).

Documents are words drawn from the model's vocabulary (one token a word, about), so the
token counts are what the flags say; the weights are random (`load_format=dummy`), so the
summaries are noise of `--summary-tokens` tokens. `--dry` runs everything with the echo
engine on the CPU (a check of the harness; its figures mean nothing).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from tests.benchmarks import gpu_harness as h
from tests.benchmarks import gpu_runs as gr

REPO = Path(__file__).resolve().parents[2]


def _words(seed: int) -> list[str]:
    """Plain lower-case words of the Qwen3 vocabulary that are one token with their space."""
    vocab = json.loads((h.MODEL_DIR / "vocab.json").read_text(encoding="utf-8"))
    words = sorted(
        t[1:] for t in vocab if t.startswith("Ġ") and t[1:].isalpha() and t[1:].islower()
    )
    random.Random(seed).shuffle(words)
    return words[:20_000]


def _document(rng: random.Random, words: list[str], tokens: int) -> str:
    sentences = []
    n = 0
    while n < tokens:
        length = rng.randint(8, 24)
        sentences.append(" ".join(rng.choice(words) for _ in range(length)).capitalize() + ".")
        n += length + 1
    return " ".join(sentences)


def make_inputs(out: Path, docs: int, doc_tokens: int, long_tokens: int) -> None:
    words = _words(0)
    rng = random.Random(7)
    (out / "longdoc.jsonl").write_text(
        json.dumps({"custom_id": "long", "text": _document(rng, words, long_tokens)}) + "\n"
    )
    with (out / "nightly.jsonl").open("w") as fh:
        for i in range(docs):
            text = _document(rng, words, doc_tokens)
            fh.write(json.dumps({"custom_id": f"doc{i:04d}", "text": text}) + "\n")


def _tokenizer_dir(out: Path) -> Path:
    from tests.summarize_fixtures import qwen3_tokenizer_json

    return qwen3_tokenizer_json(out / "tok").parent


def _summarize(out: Path, name: str, run: str, args: argparse.Namespace) -> dict[str, Any]:
    """`qbatch bulk summarize` on `{name}.jsonl` as a subprocess; wall time and totals."""
    env = h.cli_env(run)
    result = out / f"{name}.out.jsonl"
    cmd = [sys.executable, "-m", "producer.cli", "--quiet", "bulk", "summarize",
           str(out / f"{name}.jsonl"), "--out", str(result), "--work-dir", str(out / f"work-{name}"),
           "--tokenizer", str(_tokenizer_dir(out)), "--context-tokens", str(args.context),
           "--summary-tokens", str(args.summary_tokens), "--timeout", str(args.timeout_s)]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"summarize {name} exited {proc.returncode}: {proc.stderr[-2000:]}")
    lines = [json.loads(x) for x in result.read_text().splitlines() if x.strip()]
    prompt = sum(x["usage"]["prompt_tokens"] for x in lines)
    completion = sum(x["usage"]["completion_tokens"] for x in lines)
    return {
        "documents": len(lines),
        "succeeded": sum(x["status"] == "succeeded" for x in lines),
        "chunks": sum(x["chunks"] for x in lines),
        "levels_max": max(x["levels"] for x in lines),
        "wall_s": round(wall, 3),
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "out_tok_per_s": round(completion / wall, 1),
        "total_tok_per_s": round((prompt + completion) / wall, 1),
        "docs_per_hour": round(len(lines) / wall * 3600, 1),
    }


def _one_cut_request(out: Path, run: str, args: argparse.Namespace) -> dict[str, Any]:
    from producer.client import QBatchClient

    text = json.loads((out / "longdoc.jsonl").read_text())["text"]
    body = {
        "messages": [{"role": "user", "content": "Summarise this document.\n\n" + text}],
        "max_tokens": args.summary_tokens,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    with QBatchClient(topic=f"bench.{run}", prefix=run) as qb:
        t0 = time.perf_counter()
        rid = qb.submit(body, context={"strategy": "truncate_middle"})
        res = qb.wait(rid, timeout=args.timeout_s)
        wall = time.perf_counter() - t0
    if res is None or not res.ok or res.response is None or res.context is None:
        raise SystemExit(f"the cut request did not succeed: {res}")
    usage = res.response.usage
    return {
        "wall_s": round(wall, 3),
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "context": res.context.model_dump(mode="json", exclude={"dropped"}),
    }


def phase_qbatch(out: Path, args: argparse.Namespace) -> None:
    out.mkdir(parents=True, exist_ok=True)
    make_inputs(out, args.docs, args.doc_tokens, args.long_tokens)
    h.wait_for_free_gpu()  # an engine of a phase chained right before this one
    started = time.perf_counter()
    engine = h.make_engine("continuous", args.dry, max_model_len=args.context)
    engine.start()
    figures: dict[str, Any] = {"engine_start_s": round(time.perf_counter() - started, 1)}
    gr.warm_up(engine, args.warmup, "continuous")
    run = f"sum-{uuid.uuid4().hex[:6]}"
    h.create_topic(f"bench.{run}")
    worker, thread = h.start_worker(engine, run, served_model_name="Qwen3-14B")
    try:
        if not args.skip_longdoc:
            h.reset_prefix_cache(engine)
            figures["longdoc_mapreduce"] = _summarize(out, "longdoc", run, args)
            h.reset_prefix_cache(engine)
            figures["longdoc_one_cut_request"] = _one_cut_request(out, run, args)
            h.write_json(out / "qbatch.json", figures)
        h.reset_prefix_cache(engine)
        figures["nightly"] = _summarize(out, "nightly", run, args)
        h.write_json(out / "qbatch.json", figures)
    finally:
        worker.request_stop()
        thread.join(timeout=120)
        engine.close()
    print(json.dumps(figures, indent=2))


def _level_prompts(engine: Any, work: Path) -> list[list[tuple[Any, Any]]]:
    """Every request of the job, rendered as the worker rendered them, one list per level.

    The job publishes level 1 in several waves (round files L1, L2 ... while it plans);
    raw vLLM gets each level in one `generate` call, as its user would run it, so the
    baseline never pays a wave's tail that qbatch's continuous worker does not."""
    from schemas import RequestEnvelope
    from worker.rendering import PromptRenderer

    renderer = PromptRenderer(
        engine.tokenizer,
        max_model_len=engine.max_model_len,
        served_names={"Qwen3-14B"},
        generation_defaults=getattr(engine, "generation_defaults", None),
    )
    levels: dict[int, list[tuple[Any, Any]]] = {}
    for path in sorted(work.glob("L*.jsonl"), key=lambda p: int(p.stem[1:])):
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            body = json.loads(line)  # round files leave request_id to the bulk job
            r = renderer.render(RequestEnvelope.model_validate({**body, "request_id": "r"}))
            levels.setdefault(body["metadata"]["level"], []).append(
                (r.token_ids or r.text, r.sampling)
            )
    return [levels[k] for k in sorted(levels)]


def phase_raw(out: Path, args: argparse.Namespace) -> None:
    """`--levels 1` / `--levels 2,3` run part of the job's levels and merge them into the
    raw.json an earlier call left, so a job too long for one device call is measured in
    two (each level is one `generate` either way; the engine start is outside the timing).
    The prefix cache is reset before every level, split or not, so both give the same."""
    only = parse_levels(args.levels)  # before the engine: a typo costs no device time
    path = out / "raw.json"
    figures: dict[str, Any] = json.loads(path.read_text()) if only and path.exists() else {}
    h.wait_for_free_gpu()  # the qbatch phase's engine, when chained right before this one
    started = time.perf_counter()
    engine = h.make_engine("static", args.dry, max_model_len=args.context)
    engine.start()
    figures["engine_start_s"] = round(time.perf_counter() - started, 1)
    gr.warm_up(engine, args.warmup, "static")
    try:
        for name in ("nightly",) if args.skip_longdoc else ("longdoc", "nightly"):
            levels = _level_prompts(engine, out / f"work-{name}")
            if only and max(only) > len(levels):
                raise SystemExit(f"{name}: --levels {args.levels}, the job has {len(levels)}")
            done = kept_levels(figures.get(name, {}), levels) if only else {}
            for number, requests in enumerate(levels, start=1):
                if only is not None and number not in only:
                    continue
                h.reset_prefix_cache(engine)
                t0 = time.perf_counter()
                tokens = _generate(engine, requests)
                done[str(number)] = {
                    "requests": len(requests),
                    "generate_s": round(time.perf_counter() - t0, 3),
                    "prompt_tokens": sum(len(ids) for ids, _ in requests),
                    "completion_tokens": tokens,
                }
                figures[name] = raw_totals(done, len(levels))
                h.write_json(path, figures)
    finally:
        engine.close()
    print(json.dumps(figures, indent=2))


def parse_levels(text: str) -> set[int] | None:
    """`--levels`: None for all, else the level numbers (1-based)."""
    if not text:
        return None
    try:
        levels = {int(x) for x in text.split(",") if x.strip()}
    except ValueError:
        raise SystemExit(f"--levels {text!r}: level numbers, e.g. 1 or 2,3") from None
    if not levels or min(levels) < 1:
        raise SystemExit(f"--levels {text!r}: level numbers start at 1")
    return levels


def kept_levels(earlier: dict[str, Any], levels: list[list[tuple[Any, Any]]]) -> dict[str, Any]:
    """The levels an earlier call measured, where they are this job's: same requests and
    prompt tokens as the round files now (a raw.json of another run must not be mixed in)."""
    kept = {}
    for number, row in earlier.get("per_level", {}).items():
        index = int(number) - 1
        if index >= len(levels):
            raise SystemExit(f"raw.json has level {number}; this job has {len(levels)}")
        requests = levels[index]
        if (row["requests"], row["prompt_tokens"]) != (
            len(requests),
            sum(len(ids) for ids, _ in requests),
        ):
            raise SystemExit(f"raw.json's level {number} is not this job's: remove it")
        kept[number] = row
    return kept


def raw_totals(per_level: dict[str, dict[str, Any]], levels: int) -> dict[str, Any]:
    """The raw side's figures over the levels measured so far; `complete` says whether all
    `levels` are in (the report refuses a partial one)."""
    order = sorted(per_level, key=int)
    elapsed = sum(per_level[k]["generate_s"] for k in order)
    tokens = sum(per_level[k]["completion_tokens"] for k in order)
    prompt = sum(per_level[k]["prompt_tokens"] for k in order)
    return {
        "levels": levels,
        "complete": len(order) == levels,
        "per_level": per_level,
        "requests_per_level": [per_level[k]["requests"] for k in order],
        "generate_s_per_level": [per_level[k]["generate_s"] for k in order],
        "requests": sum(per_level[k]["requests"] for k in order),
        "generate_s": round(elapsed, 3),
        "prompt_tokens": prompt,
        "completion_tokens": tokens,
        "out_tok_per_s": round(tokens / elapsed, 1) if elapsed else 0.0,
        "total_tok_per_s": round((prompt + tokens) / elapsed, 1) if elapsed else 0.0,
    }


def _generate(engine: Any, requests: list[tuple[Any, Any]]) -> int:
    """One `LLM.generate` over a round (dry: the echo engine); completion tokens."""
    if hasattr(engine, "_llm"):
        from worker.engines.vllm_engine import sampling_params

        outs = engine._llm.generate(
            [{"prompt_token_ids": ids} for ids, _ in requests],
            [sampling_params(spec) for _, spec in requests],
            use_tqdm=False,
        )
        return sum(len(o.outputs[0].token_ids) for o in outs)
    import threading

    from worker.engines.base import EngineRequest

    done = threading.Semaphore(0)
    tokens = []

    def on_done(output: Any) -> None:
        tokens.append(output.total_completion_tokens)
        done.release()

    batch = [
        EngineRequest(f"r{i}", str(ids), None, spec)  # dry: the echo renderer's text
        for i, (ids, spec) in enumerate(requests)
    ]
    engine.submit(batch, on_done)
    for _ in requests:
        done.acquire()
    return sum(tokens)


def report(out: Path) -> dict[str, Any]:
    q = json.loads((out / "qbatch.json").read_text())
    r = json.loads((out / "raw.json").read_text())
    night, raw = q["nightly"], r["nightly"]
    if not raw.get("complete", True):
        raise SystemExit(f"raw.json has levels {sorted(raw['per_level'])} of {raw['levels']}")
    lines: dict[str, Any] = {}
    if "longdoc_mapreduce" in q:
        lines["longdoc"] = {
            "mapreduce": q["longdoc_mapreduce"],
            "one_cut_request": q["longdoc_one_cut_request"],
            "wall_ratio_mapreduce_over_cut": round(
                q["longdoc_mapreduce"]["wall_s"] / q["longdoc_one_cut_request"]["wall_s"], 2
            ),
        }
    lines["nightly"] = {
        "documents": night["documents"],
        "docs_per_hour": night["docs_per_hour"],
        "qbatch_out_tok_per_s": night["out_tok_per_s"],
        "raw_out_tok_per_s": raw["out_tok_per_s"],
        "ratio_out_tok_per_s": round(night["out_tok_per_s"] / raw["out_tok_per_s"], 3),
        "qbatch_total_tok_per_s": night["total_tok_per_s"],
        "raw_total_tok_per_s": raw["total_tok_per_s"],
        "ratio_total_tok_per_s": round(night["total_tok_per_s"] / raw["total_tok_per_s"], 3),
        "same_requests": raw["requests"] == night["chunks"] + _reduce_requests(out, "nightly"),
        # token-exact on the GPU; the dry engine counts characters, so False there
        "same_prompt_tokens": raw["prompt_tokens"] == night["prompt_tokens"],
    }
    h.write_json(out / "summary.json", lines)
    print(json.dumps(lines, indent=2))
    return lines


def _reduce_requests(out: Path, name: str) -> int:
    """Requests past level 1 (by each line's metadata: level 1 spans several round files
    when it is published in waves), to check raw ran what qbatch ran."""
    work = out / f"work-{name}"
    return sum(
        1
        for p in work.glob("L*.jsonl")
        for x in p.read_text().splitlines()
        if x.strip() and json.loads(x)["metadata"]["level"] > 1
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", choices=["qbatch", "raw", "report"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--docs", type=int, default=100)
    parser.add_argument("--doc-tokens", type=int, default=20_000)
    parser.add_argument("--long-tokens", type=int, default=100_000)
    parser.add_argument("--context", type=int, default=32_768)
    parser.add_argument("--summary-tokens", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=64)
    parser.add_argument("--timeout-s", type=float, default=1500)
    parser.add_argument("--dry", action="store_true", help="echo engine on the CPU")
    parser.add_argument("--skip-longdoc", action="store_true", help="only the nightly job")
    parser.add_argument(
        "--levels", default="", help="raw: only these levels (e.g. 1 or 2,3), merged into raw.json"
    )
    args = parser.parse_args()
    if args.phase == "qbatch":
        phase_qbatch(args.out, args)
    elif args.phase == "raw":
        phase_raw(args.out, args)
    else:
        report(args.out)


if __name__ == "__main__":
    main()
