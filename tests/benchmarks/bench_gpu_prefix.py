"""Workload P on a GPU (issue 18): prefix families in a shuffled file, raw `LLM.generate`
vs `qbatch bulk run --placement none` vs `--placement prefix`, one worker and two.

Runs on the lent GPU machine with the stack up (deploy/gpu/README.md, "run-batch and
workload P"). `LLM` (raw) and the workers' engines cannot share the GPU, so each phase is
its own call or child, one engine set each:

    B="python3 -m tests.benchmarks.bench_gpu_prefix"
    $B raw    --out /tmp/p --warmup 64 --w 1500             # raw P (and raw W)
    $B qbatch --out /tmp/p --warmup 64 --workers 1 --w 1500 # prefix, none (and W with prefix)
    $B qbatch --out /tmp/p --warmup 64 --workers 2 --gpu-mem 0.45
    $B report --out /tmp/p                                  # reads the phases' JSON

(`--out` outside `$OUT`, so that a later call on the same warm machine finds the earlier
phases' JSON; copy it into `$OUT` to bring it back. The input files go to `--work`.)

Workload P (`p_lines`, pure and seeded): `--families` (400) x `--per-family` (8) chat lines;
each family shares a system message of `--prefix-tokens` (2,000) one-token words, each line
adds a user message of 100-300 of its own and asks for 32-256 tokens (`ignore_eos`, the
sampling of bench_runbatch); the file is shuffled, so a family's lines are scattered. The
family prefixes together (800K tokens) exceed the KV cache (~630K on an H200 at 0.9), so
whether a line finds its prefix cached depends on the order the lines are run in.

`--night` adds file N, the night of job families of issue 43 (tests/benchmarks/families.py:
1,438 lines of 300 families of 1-16, 700-2,400-word system prompts, a third with tools).

- raw: the file's lines rendered by the worker's renderer into token ids, one
  `LLM.generate` in the file's (shuffled) order, after `--warmup` requests and a
  prefix-cache reset; with `--sorted` also P and N sorted by family (`P-sorted`,
  `N-sorted`: the careful user's order). Timed around `LLM.generate` only.
- qbatch: `--workers` continuous engines in this process (`--gpu-mem` each: 0.45 for two
  on one GPU), one worker each, one group, one topic; `--warmup` requests through each
  engine; then per placement (`--placements prefix,none`): every engine's prefix cache
  reset, `qbatch bulk run FILE --placement P --job <fresh>` (the CLI, as a user runs it),
  processing = its wall time.

Each run: req/s, output tok/s, total tok/s, computed tok/s (cached prompt tokens cost no
prefill) against the bf16 ceiling (tests/benchmarks/ceiling.py), the prefix-cache hit rate
(cached / prompt tokens, vLLM's per-request counts: `num_cached_tokens` for raw, `usage.prompt_tokens_details.cached_tokens` of each output
line for qbatch; plus the worker counters `qbatch_engine_prefix_cache_{queries,hits}_tokens
_total` where the worker has them). `--w N` adds workload W (N chat lines, bench_runbatch)
to raw and, with `--placement prefix`, to qbatch: placement must cost nothing where there
are no families (target >= 0.97x raw). The report checks the targets: with placement >=
1.4x raw and >= 1.4x without placement, for one worker and two. `--dry`: the echo engine on
the CPU (a check of the harness; figures meaningless); `--echo-prefix-cache-tokens N` there
is passed to the echo engine where it supports it (a simulated prefix cache).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from tests.benchmarks import bench_runbatch as rb
from tests.benchmarks import ceiling, families
from tests.benchmarks import gpu_harness as h
from tests.benchmarks import gpu_runs as gr

REPO = Path(__file__).resolve().parents[2]
TARGET_VS_RAW = 1.4
TARGET_VS_NONE = 1.4
TARGET_W = 0.97
TARGET_VS_SORTED = 1.0
TARGET_PAST_SORTED = 1.15
PREFIX_METRICS = (
    "qbatch_engine_prefix_cache_queries_tokens_total",
    "qbatch_engine_prefix_cache_hits_tokens_total",
)

# ---------------------------------------------------------------------------- workload P


def p_lines(
    words: list[str],
    families: int = 400,
    per_family: int = 8,
    prefix_tokens: int = 2000,
    own: tuple[int, int] = (100, 300),
    out: tuple[int, int] = (32, 256),
    seed: int = 3,
) -> list[dict[str, Any]]:
    """Workload P as OpenAI Batch chat lines, shuffled (custom_id `f<family>-<k>`)."""
    rng = random.Random(seed)
    lines = []
    for fam in range(families):
        system = rb.words_text(rng, words, prefix_tokens)
        for k in range(per_family):
            messages = [
                {"role": "system", "content": system},
                {"role": "user", "content": rb.words_text(rng, words, rng.randint(*own))},
            ]
            lines.append(rb.batch_line(f"f{fam:04d}-{k}", messages, rng.randint(*out)))
    rng.shuffle(lines)
    return lines


def family_of(custom_id: str) -> str:
    return custom_id.split("-", 1)[0]


def _files(out: Path, args: argparse.Namespace) -> dict[str, Path]:
    """The input files, in `--work` (rewritten by every phase, identical for the same flags)."""
    out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    words = rb.vocab_words()
    files = {"P": args.work / "p.jsonl"}
    rb.write_jsonl(
        files["P"],
        p_lines(words, args.families, args.per_family, args.prefix_tokens, seed=args.seed),
    )
    if args.w:
        files["W"] = args.work / "w-plain.jsonl"
        rb.write_jsonl(files["W"], rb.w_chat_lines(args.w, words, tools_every=0))
    if args.night:
        files["N"] = args.work / "night.jsonl"
        rb.write_jsonl(files["N"], families.night_lines(words, seed=args.night_seed))
    if args.only:
        wanted = set(args.only.split(","))
        files = {name: path for name, path in files.items() if name in wanted}
    return files


SORTABLE = ("P", "N")
"""The files of families: raw also runs them sorted by family (`--sorted`), what a careful
user does by hand before `LLM.generate`."""


# ---------------------------------------------------------------------------- raw


def _rendered(engine: Any, path: Path, by_family: bool = False) -> list[Any]:
    """Each line as the worker renders it (`RenderedPrompt`: token ids on vLLM; on the echo
    engine the echoed text and the conversation its simulated prefix cache keys on);
    `by_family`: the lines sorted by family first (stable: file order within a family)."""
    from schemas import RequestEnvelope
    from worker.rendering import PromptRenderer

    renderer = PromptRenderer(
        engine.tokenizer,
        max_model_len=engine.max_model_len,
        served_names={rb.SERVED},
        generation_defaults=getattr(engine, "generation_defaults", None),
    )
    lines = [json.loads(raw) for raw in path.read_text().splitlines()]
    if by_family:
        lines.sort(key=lambda line: family_of(line["custom_id"]))
    out = []
    for line in lines:
        env = {"request_id": line["custom_id"], "endpoint": line["url"], "body": line["body"]}
        out.append(renderer.render(RequestEnvelope.model_validate(env)))
    return out


def _generate(engine: Any, rendered: list[Any]) -> dict[str, int]:
    """One `LLM.generate` over all requests, in order (dry: all through the echo engine)."""
    if hasattr(engine, "_llm"):
        from worker.engines.vllm_engine import sampling_params

        outs = engine._llm.generate(
            [{"prompt_token_ids": r.token_ids} for r in rendered],
            [sampling_params(r.sampling) for r in rendered],
            use_tqdm=False,
        )
        return {
            "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
            "completion_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
            "cached_tokens": sum(int(o.num_cached_tokens or 0) for o in outs),
        }
    done = threading.Semaphore(0)
    got: list[Any] = []

    def on_done(output: Any) -> None:
        got.append(output)
        done.release()

    engine.submit([r.engine_request(f"r{i}") for i, r in enumerate(rendered)], on_done)
    for _ in rendered:
        done.acquire()
    return {
        "prompt_tokens": sum(o.prompt_tokens for o in got),
        "completion_tokens": sum(o.total_completion_tokens for o in got),
        "cached_tokens": sum(o.cached_tokens or 0 for o in got),
    }


def run_summary(name: str, n: int, counts: dict[str, int], elapsed: float) -> dict[str, Any]:
    total = counts["prompt_tokens"] + counts["completion_tokens"]
    return {
        "name": name,
        "n": n,
        "elapsed_s": round(elapsed, 3),
        "req_per_s": round(n / elapsed, 3),
        "out_tok_per_s": round(counts["completion_tokens"] / elapsed, 1),
        "total_tok_per_s": round(total / elapsed, 1),
        "prefix_cache_hit_rate": round(counts["cached_tokens"] / counts["prompt_tokens"], 4)
        if counts["prompt_tokens"]
        else None,
    } | counts


def phase_raw(out: Path, args: argparse.Namespace) -> None:
    files = _files(out, args)
    h.wait_for_free_gpu()  # phases chained in one detached job (deploy/gpu/bg.sh)
    started = time.perf_counter()
    engine = _engine("static", args, args.gpu_mem)
    doc: dict[str, Any] = {"engine_start_s": round(time.perf_counter() - started, 1)}
    doc |= {"gpu_memory_utilization": args.gpu_mem, "kv_cache_tokens": h.kv_cache_tokens(engine)}
    doc |= {"warmup": args.warmup, "runs": {}}
    gr.warm_up(engine, args.warmup, "static")
    try:
        plan = [(name, path, False) for name, path in files.items()]
        if args.sorted:
            plan += [(f"{name}-sorted", files[name], True) for name in SORTABLE if name in files]
        for name, path, by_family in plan:
            rendered = _rendered(engine, path, by_family)
            reset_cache(engine)
            t0 = time.perf_counter()
            counts = _generate(engine, rendered)
            doc["runs"][name] = run_summary(f"raw {name}", len(rendered), counts,
                                            time.perf_counter() - t0)  # fmt: skip
            h.write_json(out / "raw.json", doc)
            print(json.dumps(doc["runs"][name]), flush=True)
    finally:
        engine.close()


# ---------------------------------------------------------------------------- qbatch


def _engine(mode: str, args: argparse.Namespace, gpu_mem: float) -> Any:
    if args.dry:
        # the echo engine measures prompts without a tokenizer: give it the room it needs
        engine = _echo_engine(max(args.max_model_len, 32_768), args.echo_prefix_cache_tokens)
    else:
        engine = h.make_engine(
            mode, False, max_model_len=args.max_model_len, gpu_memory_utilization=gpu_mem
        )
    engine.start()
    return engine


def _echo_engine(max_model_len: int, prefix_cache_tokens: int) -> Any:
    """gpu_harness's dry-run echo engine, with the simulated prefix cache of issue 18 where
    this checkout's echo engine has one (`prefix_cache_tokens`); a note otherwise."""
    import inspect

    from worker.engines.echo import EchoEngine

    kwargs: dict[str, Any] = {}
    if prefix_cache_tokens:
        if "prefix_cache_tokens" in inspect.signature(EchoEngine).parameters:
            kwargs["prefix_cache_tokens"] = prefix_cache_tokens
        else:
            print("bench_gpu_prefix: this echo engine simulates no prefix cache", file=sys.stderr)
    return EchoEngine(
        served_name=rb.SERVED, max_model_len=max_model_len, delay_ms=h.DRY_DELAY_MS, **kwargs
    )


def reset_cache(engine: Any) -> None:
    """vLLM's prefix cache reset (gpu_harness); on the echo engine, its simulated cache emptied."""
    h.reset_prefix_cache(engine)
    cache = getattr(engine, "prefix_cache", None)
    if cache is not None:
        cache.clear()


def supports_placement() -> bool:
    """Whether this checkout's `qbatch bulk run` has `--placement` (issue 18)."""
    proc = subprocess.run(
        [sys.executable, "-m", "producer.cli", "bulk", "run", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=os.environ | {"COLUMNS": "200"},
    )
    return "--placement" in proc.stdout


def worker_prefix_counters() -> dict[str, float] | None:
    """The workers' prefix-cache token counters (summed over labels and workers of this
    process), or None where the worker does not export them."""
    from worker.metrics import REGISTRY

    found: dict[str, float] = {}
    for family in REGISTRY.collect():
        for sample in family.samples:
            if sample.name in PREFIX_METRICS:
                found[sample.name] = found.get(sample.name, 0.0) + float(sample.value)
    return found if len(found) == len(PREFIX_METRICS) else None


def _qbatch_run(
    engines: list[Any], file: Path, run: str, name: str, placement: str | None, timeout_s: float
) -> dict[str, Any]:
    for engine in engines:
        reset_cache(engine)
    before = worker_prefix_counters()
    result = file.with_name(f"{name}.out.jsonl")
    extra = ["--job", f"{name}-{uuid.uuid4().hex[:6]}"]
    if placement is not None:
        extra += ["--placement", placement]
    rc, wall, err = rb.bulk_run(file, result, run, timeout_s, extra)
    if rc not in (0, 1):
        raise SystemExit(f"qbatch bulk run ({name}) exited {rc}: {err}")
    counts = rb.count_output(result.read_text().splitlines(), set())
    row = run_summary(name, counts["lines"], counts, wall)
    row |= {"placement": placement, "answered": counts["answered"], "exit": rc}
    after = worker_prefix_counters()
    if before is not None and after is not None:
        queries = after[PREFIX_METRICS[0]] - before[PREFIX_METRICS[0]]
        hits = after[PREFIX_METRICS[1]] - before[PREFIX_METRICS[1]]
        row["worker_metrics_hit_rate"] = round(hits / queries, 4) if queries else None
    result.unlink()  # thousands of lines of noise; the counts are what matter
    return row


def phase_qbatch(out: Path, args: argparse.Namespace) -> None:
    files = _files(out, args)
    path = out / f"qbatch-{args.workers}w.json"
    doc: dict[str, Any] = {"workers": args.workers, "gpu_memory_utilization": args.gpu_mem}
    doc |= {"warmup": args.warmup, "engine_start_s": [], "kv_cache_tokens": [], "runs": {}}
    engines = []
    h.wait_for_free_gpu()  # the raw phase's engine, when chained right before this one
    for _ in range(args.workers):  # one after the other: each sizes its KV cache from what is free
        started = time.perf_counter()
        engines.append(_engine("continuous", args, args.gpu_mem))
        doc["engine_start_s"].append(round(time.perf_counter() - started, 1))
        doc["kv_cache_tokens"].append(h.kv_cache_tokens(engines[-1]))
    for engine in engines:
        gr.warm_up(engine, args.warmup, "continuous")
    placements: list[str | None] = [p for p in args.placements.split(",") if p]
    if not supports_placement():
        doc["note"] = "qbatch bulk run has no --placement in this checkout: one run, without"
        placements = [None]
    run = f"pfx-{uuid.uuid4().hex[:6]}"
    h.create_topic(f"bench.{run}")
    workers = [
        h.start_worker(e, run, served_model_name=rb.SERVED, worker_id=f"{run}-w{i}")
        for i, e in enumerate(engines)
    ]
    try:
        time.sleep(3 if args.dry else 8)  # the group join and the partition assignment
        plan = [("P", p) for p in placements] if "P" in files else []
        if "N" in files:
            plan += [("N", p) for p in placements]
        if "W" in files:
            plan.append(("W", "prefix" if "prefix" in placements else placements[-1]))
        for wl, placement in plan:
            name = f"{wl}-{placement or 'default'}"
            doc["runs"][name] = _qbatch_run(
                engines, files[wl], run, name, placement, args.timeout_s
            )
            h.write_json(path, doc)
            print(json.dumps(doc["runs"][name]), flush=True)
    finally:
        for worker, _thread in workers:
            worker.request_stop()
        for _worker, thread in workers:
            thread.join(timeout=120)
        for engine in engines:
            engine.close()


# ---------------------------------------------------------------------------- report


def ratios(raw: dict[str, Any], q: dict[str, Any]) -> dict[str, Any]:
    """The issue's ratios (output tok/s) and whether each target is met, for one worker
    count. Pure: raw.json's and qbatch-Nw.json's `runs`."""
    out: dict[str, Any] = {}
    p_prefix, p_none, raw_p = q.get("P-prefix"), q.get("P-none"), raw.get("P")
    if p_prefix and raw_p:
        x = round(p_prefix["out_tok_per_s"] / raw_p["out_tok_per_s"], 3)
        out["P prefix/raw"] = x
        out["target P prefix >= 1.4x raw"] = x >= TARGET_VS_RAW
    if p_prefix and p_none:
        x = round(p_prefix["out_tok_per_s"] / p_none["out_tok_per_s"], 3)
        out["P prefix/none"] = x
        out["target P prefix >= 1.4x none"] = x >= TARGET_VS_NONE
    night = q.get("N-prefix") or q.get("N-default")
    for base in ("N", "N-sorted"):
        if night and raw.get(base):
            x = round(raw[base]["elapsed_s"] / night["elapsed_s"], 3)
            out[f"N qbatch/raw {base} (wall)"] = x
    if night and raw.get("N-sorted"):
        x = out["N qbatch/raw N-sorted (wall)"]
        out["target N >= 1.0x raw sorted"] = x >= TARGET_VS_SORTED
        out["target N >= 1.15x raw sorted"] = x >= TARGET_PAST_SORTED
    w = q.get("W-prefix") or q.get("W-none") or q.get("W-default")
    if w and raw.get("W"):
        x = round(w["out_tok_per_s"] / raw["W"]["out_tok_per_s"], 3)
        out["W qbatch/raw"] = x
        out["target W >= 0.97x raw"] = x >= TARGET_W
    return out


def kv_column(tokens: int | list[int | None] | None) -> str:
    """The KV cache each phase's engines had ("2 x 37,968"): two engines on one card each
    load the weights, so their caches, not the placement, can decide a comparison."""
    sizes = tokens if isinstance(tokens, list) else [tokens]
    if not sizes or any(t is None for t in sizes):
        return "-"
    if len(set(sizes)) == 1:
        one = f"{sizes[0]:,}"
        return one if len(sizes) == 1 else f"{len(sizes)} x {one}"
    return " + ".join(f"{t:,}" for t in sizes)


def report(out: Path, gpu_name: str | None = None) -> dict[str, Any]:
    raw_doc = h.load_json(out / "raw.json")
    raw = raw_doc.get("runs", {})
    docs = {
        int(p.stem.split("-")[1][:-1]): h.load_json(p) for p in sorted(out.glob("qbatch-*w.json"))
    }
    by_workers = {k: doc.get("runs", {}) for k, doc in docs.items()}
    gpu = gpu_name or h.gpu_name()
    params = ceiling.model_params(h.MODEL_DIR)
    lines = [
        "| workers | run | KV cache tokens | requests | req/s | output tok/s | total tok/s |"
        " computed tok/s vs bf16 ceiling | prefix-cache hit rate | (worker counters) |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |",
    ]
    raw_kv = kv_column(raw_doc.get("kv_cache_tokens"))
    rows = [("-", f"raw {k}", raw_kv, r) for k, r in raw.items()]
    rows += [
        (str(k), name, kv_column(docs[k].get("kv_cache_tokens")), r)
        for k, runs in by_workers.items()
        for name, r in runs.items()
    ]
    for workers, name, kv, r in rows:
        lines.append(
            f"| {workers} | {name} | {kv} | {r['n']} | {r['req_per_s']} | {r['out_tok_per_s']} | "
            f"{r['total_tok_per_s']} | "
            f"{ceiling.column(ceiling.computed_rate(r, r['elapsed_s']), gpu, params)} | "
            f"{r['prefix_cache_hit_rate']} | {r.get('worker_metrics_hit_rate', '-')} |"
        )
    summary: dict[str, Any] = {"device": gpu, "ratios": {}}
    for k, runs in by_workers.items():
        summary["ratios"][f"{k} worker(s)"] = ratios(raw, runs)
    text = "\n".join(lines) + "\n\n" + json.dumps(summary["ratios"], indent=2)
    print(text)
    (out / "report.md").write_text(text + "\n")
    h.write_json(out / "summary.json", summary | {"raw": raw, "qbatch": by_workers})
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", choices=["raw", "qbatch", "report"])
    h.add_phase_args(parser, "JSON and report", "the input files (megabytes: kept out of --out)")
    parser.add_argument("--families", type=int, default=400)
    parser.add_argument("--per-family", type=int, default=8)
    parser.add_argument("--prefix-tokens", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--w", type=int, default=0, help="lines of W for the no-loss check")
    parser.add_argument(
        "--night",
        action="store_true",
        help="also the night of job families (tests/benchmarks/families.py), file N",
    )
    parser.add_argument("--night-seed", type=int, default=7)
    parser.add_argument(
        "--only", default="", help="run only these files (comma-separated of P, W, N)"
    )
    parser.add_argument("--sorted", action="store_true", help="raw: also P and N sorted by family")
    parser.add_argument("--warmup", type=int, default=64)
    parser.add_argument("--workers", type=int, default=1, help="qbatch: engines on the GPU")
    parser.add_argument("--gpu-mem", type=float, default=0.9, help="per engine")
    parser.add_argument(
        "--placements",
        default="prefix,none",
        help="in this order; each run's JSON is written as it ends, so a device budget "
        "running out in the long unplaced run still leaves the placed one",
    )
    parser.add_argument("--timeout-s", type=float, default=1500)
    parser.add_argument("--dry", action="store_true", help="echo engine on the CPU")
    parser.add_argument("--echo-prefix-cache-tokens", type=int, default=0)
    args = parser.parse_args()
    from worker.logs import configure

    configure("warning", "console")
    if args.phase == "raw":
        phase_raw(args.out, args)
    elif args.phase == "qbatch":
        phase_qbatch(args.out, args)
    else:
        report(args.out, args.gpu_name)
        return
    h.exit_now()


if __name__ == "__main__":
    main()
