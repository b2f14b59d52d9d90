"""Engine knobs on a GPU: one engine per configuration, each measured on the workloads it
matters for, through the same pipeline as bench_gpu's C (records on Kafka, results read
back from Redis); and the greedy drift probe that compares configurations' outputs.

Run through bench_gpu's CLI (each configuration in a child process of its own, because
each engine takes 90% of the GPU's memory):

    python3 -m tests.benchmarks.bench_gpu knobs --out $OUT [--configs base,fp8]
        [--workloads w400] [--warmup 64] [--drift 64]
    python3 -m tests.benchmarks.bench_gpu knobs-report --out D --merge a/knobs.json,b/knobs.json
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.benchmarks.drift import drift_rows, drift_table
from tests.benchmarks.gpu_harness import (
    KV_LINE,
    kv_cache_tokens,
    make_engine,
    run_child,
    write_json,
)
from tests.benchmarks.gpu_runs import (
    Req,
    long_workload,
    prefix_workload,
    run_qbatch,
    warm_up,
    workload,
)

# Engine knobs: one engine per configuration, each measured on the workloads it matters
# for; "base" is vLLM's defaults under qbatch (LLM-class limits, prefix caching and
# chunked prefill on, bf16 KV cache). max_model_len is 16384 in all of them so that the
# 8K-16K prompts fit.
KNOB_MAX_MODEL_LEN = 16384
KNOB_WORKLOADS: dict[str, Callable[[], list[Req]]] = {
    "prefix": lambda: prefix_workload(400),
    "w400": lambda: workload(400),
    "long": lambda: long_workload(12, 240),
}
KNOBS: dict[str, tuple[dict[str, Any], list[str]]] = {
    "base": ({}, ["prefix", "w400", "long"]),
    "no-prefix-caching": ({"enable_prefix_caching": False}, ["prefix"]),
    "no-chunked-prefill": (
        {"enable_chunked_prefill": False, "max_num_batched_tokens": KNOB_MAX_MODEL_LEN},
        ["long"],
    ),
    "max-num-seqs-256": ({"max_num_seqs": 256}, ["w400"]),
    "fp8-kv-cache": ({"kv_cache_dtype": "fp8"}, ["w400"]),
    # fp8 weights, quantized online from the bf16 checkpoint (issue 18): a throughput
    # profile, off by default; with dummy weights only its speed means anything.
    "fp8": ({"quantization": "fp8"}, ["w400"]),
}


@dataclass(frozen=True)
class KnobOptions:
    """What every knob engine runs besides its own workloads; `knobs` hands it to each
    `knob` child as flags."""

    warmup: int = 0
    workloads: tuple[str, ...] | None = None
    """Only these of each config's workloads (None: all of them)."""
    drift: int = 0
    """Prompts of the greedy drift probe (0: none)."""

    def picked(self, config: str) -> list[str]:
        """The workloads `config` runs: its own, narrowed to `workloads` where given."""
        return [w for w in KNOBS[config][1] if self.workloads is None or w in self.workloads]

    def argv(self) -> list[str]:
        picked = [] if self.workloads is None else ["--workloads", ",".join(self.workloads)]
        return ["--warmup", str(self.warmup), "--drift", str(self.drift), *picked]


def phase_knob(out: Path, name: str, dry: bool, opts: KnobOptions) -> None:
    """One knob configuration in this process: start its engine, warm it up, run its
    workloads (those of `opts.workloads` only, where given), then the greedy drift probe."""
    overrides = KNOBS[name][0]
    engine = make_engine("continuous", dry, max_model_len=KNOB_MAX_MODEL_LEN, **overrides)
    t0 = time.perf_counter()
    engine.start()
    doc: dict[str, Any] = {
        "config": name,
        "engine_overrides": overrides,
        "startup_s": round(time.perf_counter() - t0, 1),
        "kv_cache_tokens": kv_cache_tokens(engine),
        "warmup": opts.warmup,
        "runs": [],
    }
    warm_up(engine, opts.warmup, "continuous")
    for wl in opts.picked(name):
        row = run_qbatch(
            engine, KNOB_WORKLOADS[wl](), f"{name}-{wl}", batch_max_size=64, batch_max_wait_ms=50
        )
        row["workload"] = wl
        doc["runs"].append(row)
        print(json.dumps(row), flush=True)
        write_json(out / f"knob-{name}.json", doc)
    if opts.drift:
        # twice on the reference engine: its self-agreement is the floor (drift.py)
        doc["drift_max_tokens"] = DRIFT_MAX_TOKENS
        runs = 2 if name == "base" else 1
        probes = [drift_probe(engine, opts.drift, i) for i in range(runs)]
        doc["drift"] = [outputs for outputs, _ in probes]
        doc["drift_failed"] = [failed for _, failed in probes]
    write_json(out / f"knob-{name}.json", doc)


DRIFT_MAX_TOKENS = 64


def drift_probe(
    engine: Any, n: int, probe: int = 0, timeout_s: float = 300
) -> tuple[dict[str, list[int]], int]:
    """Greedy token ids of n fixed prompts (W's seed 7, 64 tokens each, EOS ignored), all
    submitted at once straight to the engine: the probe measures the engine's numerics, not
    the pipeline. Returns the outputs by request id and how many requests failed; failed or
    unanswered (within `timeout_s`) requests are left out, so an error never reads as drift.
    Keys carry the probe's number: a rerun's requests never meet the last one's in vLLM."""
    from worker.engines.base import EngineOutput, EngineRequest, SamplingSpec

    spec = SamplingSpec(max_tokens=DRIFT_MAX_TOKENS, temperature=0.0, ignore_eos=True)
    reqs = workload(n, seed=7)
    got: dict[str, list[int]] = {}
    failed = [0]
    left = threading.Semaphore(0)

    def on_done(output: EngineOutput) -> None:
        if output.finish == "error":
            failed[0] += 1
        else:
            got[output.key.rsplit("/", 1)[0]] = list(output.token_ids or [])
        left.release()

    engine.submit(
        [EngineRequest(f"{r.rid}/drift{probe}", "", r.prompt, spec) for r in reqs], on_done
    )
    until = time.monotonic() + timeout_s
    for _ in reqs:
        if not left.acquire(timeout=max(0.0, until - time.monotonic())):
            break
    return dict(got), failed[0]


def phase_knobs(out: Path, names: list[str], dry: bool, budget_s: float, opts: KnobOptions) -> None:
    deadline = time.time() + budget_s
    parts = Path(tempfile.mkdtemp(prefix="qbatch-knobs-"))
    doc: dict[str, Any] = {"max_model_len": KNOB_MAX_MODEL_LEN, "configs": []}
    with (out / "knobs.log").open("a") as log:
        for name in names:
            if deadline - time.time() < 120:
                doc["configs"].append({"config": name, "skipped": "out of time budget"})
                continue
            if not opts.picked(name) and not opts.drift:  # an engine start (80-110 s) for nothing
                doc["configs"].append({"config": name, "skipped": "none of its workloads picked"})
                continue
            args = ["knob", name, "--out", str(parts), *opts.argv()] + (
                ["--engine", "echo"] if dry else []
            )
            rc, lines = run_child(args, log, deadline)
            part = parts / f"knob-{name}.json"
            entry = json.loads(part.read_text()) if part.exists() else {"config": name, "runs": []}
            entry["exit"] = rc
            kv = [m.group(1) for line in lines if (m := KV_LINE.search(line))]
            if kv and entry.get("kv_cache_tokens") is None:
                entry["kv_cache_tokens"] = int(kv[-1].replace(",", ""))
            doc["configs"].append(entry)
            write_json(out / "knobs.json", doc)
    knobs_report(out, doc)  # writes knobs.json once more, with the drift rows


def knobs_report(out: Path, doc: dict[str, Any]) -> None:
    """knobs.md (and the drift rows in knobs.json) from the configs measured."""
    text = knobs_table(doc)
    rows = drift_rows(doc["configs"])
    if rows:
        doc["drift"] = rows
        tokens = {c.get("drift_max_tokens") for c in doc["configs"] if c.get("drift")}
        text += "\n\n" + drift_table(rows, tokens.pop() if len(tokens) == 1 else None)
    write_json(out / "knobs.json", doc)
    print(text)
    (out / "knobs.md").write_text(text + "\n")


def merge_knobs(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """Configs of several knobs.json (calls on one warm machine) as one document, in the
    order first seen; a config measured in a later call replaces a failed or empty entry
    of an earlier one, never a measured one."""
    merged: dict[str, dict[str, Any]] = {}
    for doc in docs:
        for cfg in doc.get("configs", []):
            had = merged.get(cfg["config"])
            if had is None or (not had.get("runs") and cfg.get("runs")):
                merged[cfg["config"]] = dict(cfg)
    first = docs[0] if docs else {}
    return {"max_model_len": first.get("max_model_len"), "configs": list(merged.values())}


def knobs_table(doc: dict[str, Any]) -> str:
    lines = [
        "| workload | config | req/s | output tok/s | p50 s | p99 s | by group p50 / p99 s | KV cache tokens | engine start s |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: |",
    ]  # fmt: skip
    rows = [
        (run.get("workload", "?"), cfg, run)
        for cfg in doc["configs"]
        for run in cfg.get("runs", [])
    ]
    for wl, cfg, run in sorted(rows, key=lambda x: (x[0], x[1]["config"] != "base")):
        groups = "; ".join(
            f"{g} {v.get('p50')} / {v.get('p99')}"
            for g, v in run.get("latency_s_by_group", {}).items()
        )
        lat = run["latency_s"]
        lines.append(
            f"| {wl} | {cfg['config']} | {run['req_per_s']} | {run['out_tok_per_s']} | "
            f"{lat.get('p50')} | {lat.get('p99')} | {groups} | {cfg.get('kv_cache_tokens')} | "
            f"{cfg.get('startup_s')} |"
        )
    base = {wl: run for wl, cfg, run in rows if cfg["config"] == "base"}
    ratios = [
        f"{cfg['config']}/base on {wl}: {run['out_tok_per_s'] / base[wl]['out_tok_per_s']:.3f}x"
        for wl, cfg, run in rows
        if cfg["config"] != "base" and wl in base and base[wl]["out_tok_per_s"]
    ]
    if ratios:
        lines.append("\nOutput tok/s against base: " + "; ".join(ratios))
    for cfg in doc["configs"]:
        if cfg.get("skipped") or cfg.get("exit") not in (0, None) or not cfg.get("runs"):
            lines.append(
                f"\n{cfg['config']}: {cfg.get('skipped') or 'exit ' + str(cfg.get('exit'))}"
            )
    return "\n".join(lines)
