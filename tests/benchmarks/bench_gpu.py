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
import json
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.benchmarks import gpu_harness as h
from tests.benchmarks.bench_gpu_lanes_start import phase_lanes_start
from tests.benchmarks.bench_gpu_latency import lone_latency, phase_lanes
from tests.benchmarks.bench_knobs import (
    KNOB_WORKLOADS,
    KNOBS,
    KnobOptions,
    knobs_report,
    merge_knobs,
    phase_knob,
    phase_knobs,
)
from tests.benchmarks.gpu_harness import (
    exit_now,
    gpu_name,
    load_json,
    make_engine,
    run_child,
    write_json,
)
from tests.benchmarks.gpu_runs import (
    Req,
    preload,
    run_qbatch,
    run_raw,
    summary,
    wait_job,
    warm_up,
    workload,
)

# ---------------------------------------------------------------------------- phases


def phase_static(
    out: Path, n: int, dry: bool, b64: int = 640, b16: int = 320, warmup: int = 0
) -> None:
    reqs = workload(n)
    engine = make_engine("static", dry)
    t0 = time.perf_counter()
    engine.start()
    doc: dict[str, Any] = {
        "startup_s": round(time.perf_counter() - t0, 1),
        "model": h.MODEL,
        "runs": [],
    }
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
        write_json(out / "static.json", doc)


def phase_continuous(out: Path, n: int, sweep: int, lone: int, dry: bool, warmup: int = 0) -> None:
    engine = make_engine("continuous", dry)
    t0 = time.perf_counter()
    engine.start()
    doc: dict[str, Any] = {
        "startup_s": round(time.perf_counter() - t0, 1),
        "model": h.MODEL,
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
        write_json(out / "continuous.json", doc)
    if lone:
        doc["lone"] = lone_latency(engine, [0, 10, 50], lone)
        write_json(out / "continuous.json", doc)
    if sweep:
        reqs = workload(sweep)
        for wait in (0, 10, 50):
            doc["sweep"].append(
                run_qbatch(engine, reqs, f"C-wait{wait}", batch_max_size=64, batch_max_wait_ms=wait)
            )
            print(json.dumps(doc["sweep"][-1]), flush=True)
            write_json(out / "continuous.json", doc)
    write_json(out / "continuous.json", doc)


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
        preload(topic, prefix, warm_job, warm)
        wait_job(prefix, warm_job, len(warm), timeout_s)
    job = f"{label}-{uuid.uuid4().hex[:6]}"
    reqs = [Req(f"{job}-{q.rid}", q.prompt, q.max_tokens) for q in workload(n)]
    preload(topic, prefix, job, reqs)
    seen_all = wait_job(prefix, job, len(reqs), timeout_s)
    doc = summary(label, prefix, reqs, seen_all) | {"topic": topic}
    print(json.dumps(doc), flush=True)
    write_json(out / f"external-{label}.json", doc)


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


# ---------------------------------------------------------------------------- report


def _ceiling_cell(row: dict[str, Any]) -> str:
    """The run's total (prompt + output) tokens/s against the bf16 compute ceiling of this
    GPU (tests/benchmarks/ceiling.py). The first n requests of W are the run's requests
    (workload() draws them in order), so their prompt lengths are known exactly."""
    from tests.benchmarks import ceiling

    prompt = sum(len(r.prompt) for r in workload(row["n"]))
    total = row["out_tok_per_s"] + prompt / row["elapsed_s"]
    return ceiling.column(total, gpu_name(), ceiling.model_params(h.MODEL_DIR))


def report(out: Path) -> None:
    """Tables (markdown), ratios and a plot from whatever static/continuous JSON is there."""
    static, cont = load_json(out / "static.json"), load_json(out / "continuous.json")
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
    write_json(out / "summary.json", {"device": gpu_name(), "runs": runs, "ratios": ratios})
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
    ax.set_title(f"Workload W, {h.served_name()} (dummy weights), {gpu_name()}")
    for i, x in enumerate(names):
        ax.text(i, runs[x]["req_per_s"], f"{runs[x]['req_per_s']:.2f}", ha="center", va="bottom")
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=120)


def main() -> None:
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
            "lanes-start",
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
        "--variants",
        default="off,on",
        help="lanes-start: off, on (the engine gate) or capN (gate on, step cap N), one "
        "worker run each, side by side on one engine",
    )
    parser.add_argument(
        "--model",
        choices=sorted(h.MODEL_CONFIGS),
        default=None,
        help="the model's shape (dummy weights): the fixtures' 14B (default) or 0.6B config; "
        "every engine of the phase, its child phases included",
    )
    parser.add_argument(
        "--workload",
        default="w",
        choices=["w", "families"],
        help="lanes-start: the bulk job, W (--n requests) or the night of job families",
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
    if args.model is not None:
        h.select_model(args.model)
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
    if args.phase == "lanes-start":
        phase_lanes_start(
            args.out, args.n, dry, args.warmup, args.variants.split(","), args.workload
        )
    elif args.phase == "lanes":
        caps = [None if c == "default" else int(c) for c in args.bulk_max_inflight.split(",")]
        phase_lanes(args.out, args.n, dry, args.warmup, args.every_s, caps)
    elif args.phase == "static":
        phase_static(args.out, args.n, dry, args.b64, args.b16, args.warmup)
    elif args.phase == "continuous":
        phase_continuous(args.out, args.n, args.sweep, args.lone, dry, args.warmup)
    else:
        phase_knob(args.out, args.knob, dry, knob_opts)
    exit_now()


if __name__ == "__main__":
    main()
