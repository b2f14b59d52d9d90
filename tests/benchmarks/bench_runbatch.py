"""Head-to-head with `vllm run-batch` (issue 18): one OpenAI Batch JSONL file of workload W,
through `python -m vllm.entrypoints.openai.run_batch` and through `qbatch bulk run`.

Runs on the lent GPU machine with the stack up and the run-batch kit installed
(deploy/gpu/README.md, "run-batch and workload P"). `run-batch` and the qbatch worker each
take 90% of the GPU, so they run one after the other, each with its own engine start
(reported apart from the processing):

    B="python3 -m tests.benchmarks.bench_runbatch"
    $B qbatch   --out /tmp/rb --warmup 64            # engine + worker, then `qbatch bulk run`
    $B runbatch --out /tmp/rb --variants tools,defaults
    $B report   --out /tmp/rb                        # reads qbatch.json and runbatch.json

(`--out` outside `$OUT`, so that a later call on the same warm machine finds the earlier
phases' JSON; copy it into `$OUT` to bring it back.)

The file (`--work`/`w-chat.jsonl`, written by every phase, identical for the same flags): `--n`
(1,500) chat lines with W's lengths (user text of 256-1,024 one-token words, `max_tokens`
16-512, `ignore_eos`) and the same explicit sampling on every line (temperature 0.7, top_p
0.95, top_k 20, thinking off), every `--tools-every` (10th) line with one function tool.

- qbatch: one continuous-mode engine in this process and a worker on a fresh topic (the
  harness of bench_gpu), `--warmup` requests through it first, the prefix cache reset, then
  `qbatch bulk run FILE --out ...` as a subprocess; processing = the CLI's wall time (the
  engine is up before it starts).
- run-batch, two variants: `defaults` (vLLM refuses the tool lines without a tool parser:
  they count as not answered) and `tools` (`--enable-auto-tool-choice --tool-call-parser
  hermes`). Each is a fresh process: wall = the whole process; processing = from its first
  progress line (`Running batch:   0% Completed | 0/1500 ...`, printed when the requests
  start) to its last (100%); engine start = process start to the first progress line.
  A fresh engine has an empty prefix cache. Triton's kernels are cached on disk by the
  first engine of the machine: run the qbatch phase first (the JSON says whether the
  cache was warm).

Both sides: lines answered (status 200), tool lines answered, output tokens (usage of each
output line), output tok/s over processing and over wall, and the ratios qbatch/run-batch.
`--dry` runs on the CPU: the echo engine for qbatch and, for run-batch, a STAND-IN
(tests/benchmarks/runbatch_standin.py: vLLM's progress-line format, echo answers, no
vLLM), labelled so in the JSON and the table; none of its figures mean anything.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.benchmarks import ceiling
from tests.benchmarks import gpu_harness as h
from tests.benchmarks import gpu_runs as gr

REPO = Path(__file__).resolve().parents[2]
SERVED = "Qwen3-14B"
SAMPLING: dict[str, Any] = {
    "temperature": 0.7,
    "top_p": 0.95,
    "top_k": 20,
    "ignore_eos": True,
    "chat_template_kwargs": {"enable_thinking": False},
}
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
VARIANTS: dict[str, list[str]] = {
    "defaults": [],
    "tools": ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
}

# ---------------------------------------------------------------------------- pure parts


def vocab_words(seed: int = 0) -> list[str]:
    """Lower-case ASCII words of the Qwen3 vocabulary that are one token with their space
    (ASCII: a byte-level vocabulary entry such as `ł` stands for a byte, not a letter)."""
    from tests.benchmarks.bench_gpu_summarize import _words

    return [w for w in _words(seed) if w.isascii()]


def words_text(rng: random.Random, words: list[str], n: int) -> str:
    """`n` words, space-separated: about `n` tokens (each word is one token with its
    leading space; the first may split in two)."""
    return " ".join(rng.choice(words) for _ in range(n))


def batch_line(custom_id: str, messages: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    """One OpenAI Batch input line, the same body for run-batch and qbatch."""
    body = {"model": SERVED, "messages": messages, "max_tokens": max_tokens, **SAMPLING}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def w_chat_lines(
    n: int, words: list[str], tools_every: int = 10, seed: int = 0
) -> list[dict[str, Any]]:
    """Workload W as chat lines: W's prompt and output lengths (gpu_runs.workload),
    user text of that many words; every `tools_every`-th line (0: none) offers a tool."""
    rng = random.Random(1000 + seed)
    lines = []
    for i, req in enumerate(gr.workload(n, seed=seed)):
        line = batch_line(
            f"w{i:05d}",
            [{"role": "user", "content": words_text(rng, words, len(req.prompt))}],
            req.max_tokens,
        )
        if tools_every and i % tools_every == tools_every - 1:
            line["body"]["tools"] = [TOOL]
        lines.append(line)
    return lines


def write_jsonl(path: Path, lines: Iterable[dict[str, Any]]) -> None:
    with path.open("w") as fh:
        for line in lines:
            fh.write(json.dumps(line, separators=(",", ":")) + "\n")


@dataclass(frozen=True)
class Progress:
    percent: int
    done: int
    total: int | None
    elapsed_s: int


# vLLM 0.24 run_batch.py: tqdm(desc="Running batch", unit="req", bar_format=
# "{desc}: {percentage:3.0f}% Completed | {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}]\n")
_PROGRESS = re.compile(
    r"Running batch:\s*(\d+)% Completed \| (\d+)/(\d+|\?|None) \[((?:\d+:)?\d+:\d\d)<"
)


def _clock_s(text: str) -> int:
    """tqdm's elapsed: `MM:SS` or `H:MM:SS`."""
    s = 0
    for part in text.split(":"):
        s = s * 60 + int(part)
    return s


def parse_progress(line: str) -> Progress | None:
    """run-batch's progress line (None for any other line, e.g. the checkpoint loader's
    `Loading safetensors checkpoint shards: 0% Completed | ...`, same format, other desc)."""
    m = _PROGRESS.search(line)
    if m is None:
        return None
    total = int(m.group(3)) if m.group(3).isdigit() else None
    return Progress(int(m.group(1)), int(m.group(2)), total, _clock_s(m.group(4)))


def progress_timing(lines: list[tuple[float, str]]) -> dict[str, Any]:
    """From (seconds since the process started, line) pairs: when processing began (the
    first progress line), ended (the last) and tqdm's own final elapsed (1 s steps)."""
    seen = [(t, p) for t, line in lines if (p := parse_progress(line)) is not None]
    if not seen:
        return {"progress_lines": 0}
    (t0, _first), (t1, last) = seen[0], seen[-1]
    return {
        "progress_lines": len(seen),
        "engine_start_s": round(t0, 3),
        "processing_s": round(t1 - t0, 3),
        "processing_s_tqdm": last.elapsed_s,
        "completed": last.done,
        "total": last.total,
    }


def count_output(lines: Iterable[str], tool_ids: set[str]) -> dict[str, int]:
    """Answered lines (status 200, no error), tool lines answered, and usage totals of an
    OpenAI Batch output file (run-batch's and qbatch's have the same shape)."""
    out = {"lines": 0, "answered": 0, "tool_answered": 0, "tool_lines": len(tool_ids)}
    out |= {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}
    for raw in lines:
        if not raw.strip():
            continue
        line = json.loads(raw)
        out["lines"] += 1
        response = line.get("response") or {}
        if response.get("status_code") != 200 or line.get("error"):
            continue
        out["answered"] += 1
        out["tool_answered"] += line.get("custom_id") in tool_ids
        usage = (response.get("body") or {}).get("usage") or {}
        out["prompt_tokens"] += int(usage.get("prompt_tokens") or 0)
        out["completion_tokens"] += int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        out["cached_tokens"] += int(details.get("cached_tokens") or 0)
    return out


def rates(counts: dict[str, int], processing_s: float, wall_s: float) -> dict[str, Any]:
    total = counts["prompt_tokens"] + counts["completion_tokens"]
    return {
        "out_tok_per_s": round(counts["completion_tokens"] / processing_s, 1),
        "out_tok_per_s_wall": round(counts["completion_tokens"] / wall_s, 1),
        "total_tok_per_s": round(total / processing_s, 1),
        "prefix_cache_hit_rate": round(counts["cached_tokens"] / counts["prompt_tokens"], 4)
        if counts["prompt_tokens"]
        else None,
    }


# ---------------------------------------------------------------------------- the two sides


def tool_ids(path: Path) -> set[str]:
    return {
        line["custom_id"]
        for line in map(json.loads, path.read_text().splitlines())
        if line["body"].get("tools")
    }


def bulk_run(
    file: Path, out: Path, run: str, timeout_s: float, extra: list[str] | None = None
) -> tuple[int, float, str]:
    """`qbatch bulk run FILE --out OUT` against the workers of topic `bench.<run>` (prefix
    `<run>`), as a user runs it; (exit status, wall seconds, stderr tail)."""
    env = h.cli_env(run)
    cmd = [sys.executable, "-m", "producer.cli", "--quiet", "bulk", "run", str(file),
           "--out", str(out), "--timeout", str(timeout_s), "--allow-failures", *(extra or [])]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
    return proc.returncode, time.perf_counter() - t0, proc.stderr[-2000:]


def scheduler_limits(engine: Any) -> dict[str, Any]:
    """The engine's max_num_seqs / max_num_batched_tokens (run-batch's come from its log):
    the two sides' scheduler limits differ by usage context, and matter for throughput."""
    llm = getattr(engine, "_llm", None)
    config = getattr(llm, "vllm_config", None) or getattr(
        getattr(llm, "llm_engine", None), "vllm_config", None
    )
    sched = getattr(config, "scheduler_config", None)
    if sched is None:
        return {}
    return {
        "max_num_seqs": sched.max_num_seqs,
        "max_num_batched_tokens": sched.max_num_batched_tokens,
    }


def phase_qbatch(out: Path, args: argparse.Namespace) -> dict[str, Any]:
    file = _input(args)
    started = time.perf_counter()
    # dry: the echo engine measures prompts without a tokenizer; give it the room it needs
    mml = max(args.max_model_len, 32_768) if args.dry else args.max_model_len
    engine = h.make_engine("continuous", args.dry, max_model_len=mml)
    engine.start()
    doc: dict[str, Any] = {"engine_start_s": round(time.perf_counter() - started, 1)}
    doc |= {"kv_cache_tokens": h.kv_cache_tokens(engine)} | scheduler_limits(engine)
    gr.warm_up(engine, args.warmup, "continuous")
    doc["warmup"] = args.warmup
    run = f"rb-{uuid.uuid4().hex[:6]}"
    h.create_topic(f"bench.{run}")
    worker, thread = h.start_worker(engine, run, served_model_name=SERVED)
    try:
        time.sleep(3 if args.dry else 5)  # the group join, before the clock starts
        h.reset_prefix_cache(engine)
        result = args.work / "qbatch.out.jsonl"
        rc, wall, err = bulk_run(file, result, run, args.timeout_s, args.qbatch_args.split())
        if rc not in (0, 1):
            raise SystemExit(f"qbatch bulk run exited {rc}: {err}")
        counts = count_output(result.read_text().splitlines(), tool_ids(file))
        doc |= {"exit": rc, "wall_s": round(wall, 3), "processing_s": round(wall, 3)}
        doc |= counts | rates(counts, wall, wall)
    finally:
        worker.request_stop()
        thread.join(timeout=120)
        engine.close()
    h.write_json(out / "qbatch.json", doc)
    print(json.dumps(doc), flush=True)
    return doc


def runbatch_cmd(args: argparse.Namespace, file: Path, result: Path, variant: str) -> list[str]:
    if args.dry:
        module = "tests.benchmarks.runbatch_standin"
    else:
        module = "vllm.entrypoints.openai.run_batch"
    engine = ["--model", str(h.MODEL_DIR), "--served-model-name", SERVED, "--load-format", "dummy",
              "--dtype", "bfloat16", "--max-model-len", str(args.max_model_len),
              "--gpu-memory-utilization", "0.9", *args.runbatch_args.split()]  # fmt: skip
    return [sys.executable, "-m", module, "-i", str(file), "-o", str(result), *engine,
            *VARIANTS[variant]]  # fmt: skip


def run_runbatch(out: Path, args: argparse.Namespace, variant: str) -> dict[str, Any]:
    """One run-batch process; its output lines timestamped as they come."""
    file = _input(args)
    result = args.work / f"runbatch-{variant}.out.jsonl"
    result.unlink(missing_ok=True)
    cmd = runbatch_cmd(args, file, result, variant)
    triton = Path.home() / ".triton" / "cache"
    warm = triton.is_dir() and any(triton.iterdir())
    h.wait_for_free_gpu()
    lines: list[tuple[float, str]] = []
    t0 = time.perf_counter()
    with (out / f"runbatch-{variant}.log").open("w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True,
                                env=os.environ | {"PYTHONUNBUFFERED": "1"})  # fmt: skip

        def pump() -> None:
            assert proc.stdout is not None
            for raw in proc.stdout:  # universal newlines: tqdm's "\r" splits lines too
                line = raw.strip()
                if line:
                    lines.append((time.perf_counter() - t0, line))
                    log.write(f"{lines[-1][0]:9.3f} {line}\n")
                    log.flush()

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        n = len(file.read_text().splitlines())
        ended = _wait_or_kill(proc, lines, t0, args.timeout_s, result, n)
        reader.join(timeout=30)
    wall = ended["wall_s"]
    doc: dict[str, Any] = {"variant": variant, "cmd": " ".join(cmd[1:])} | ended
    doc["triton_cache_warm_before"] = warm
    doc["standin"] = bool(args.dry)
    doc |= progress_timing(lines)
    kv = [m.group(1) for _, line in lines if (m := h.KV_LINE.search(line))]
    doc["kv_cache_tokens"] = int(kv[-1].replace(",", "")) if kv else None
    mnbt = [m.group(1) for _, line in lines if (m := _MNBT.search(line))]
    doc["max_num_batched_tokens"] = int(mnbt[-1]) if mnbt else None
    if result.exists() and doc.get("processing_s"):
        counts = count_output(result.read_text().splitlines(), tool_ids(file))
        doc |= counts | rates(counts, doc["processing_s"], wall)
    else:
        doc["error"] = "no output file or no progress line: see " + f"runbatch-{variant}.log"
        print("\n".join(line for _, line in lines[-30:]), file=sys.stderr)
    h.wait_for_free_gpu()
    return doc


_MNBT = re.compile(r"max_num_batched_tokens=(\d+)")


def _line_count(path: Path) -> int:
    try:
        with path.open("rb") as fh:
            return sum(1 for _ in fh)
    except FileNotFoundError:
        return 0


def _wait_or_kill(
    proc: subprocess.Popen[str],
    lines: list[tuple[float, str]],
    t0: float,
    timeout_s: float,
    result: Path,
    n: int,
) -> dict[str, Any]:
    """Wait for the process: its exit status, and when its output file held all `n` lines.
    Its process group is killed (exit None) at `timeout_s`, or 120 s after the output is
    complete (vLLM's teardown at exit can hang for minutes; the device call is short)."""
    complete: float | None = None
    while True:
        rc = proc.poll()
        now = time.perf_counter() - t0
        if complete is None and _finished(lines) and _line_count(result) >= n:
            complete = now
        if rc is not None:
            done_s = round(complete, 3) if complete is not None else None
            return {"exit": rc, "wall_s": round(now, 3), "output_complete_s": done_s}
        why = None
        if now > timeout_s:
            why = f"timeout after {timeout_s:.0f} s"
        elif complete is not None and now - complete > 120:
            why = "still running 120 s after its output was complete: killed"
        if why:
            os.killpg(proc.pid, 9)
            proc.wait()
            # a hang at exit is not processing: the wall then ends at the complete output
            wall = complete if complete is not None else now
            return {"exit": None, "killed": why, "wall_s": round(wall, 3),
                    "output_complete_s": round(wall, 3) if complete is not None else None}  # fmt: skip
        time.sleep(0.5)


def _finished(lines: list[tuple[float, str]]) -> bool:
    """Whether run-batch has printed its 100% line."""
    return any(p is not None and p.done == p.total for _, x in lines if (p := parse_progress(x)))


def phase_runbatch(out: Path, args: argparse.Namespace) -> None:
    path = out / "runbatch.json"
    doc = h.load_json(path) or {"runs": {}}
    for variant in [v for v in args.variants.split(",") if v]:
        if variant not in VARIANTS:
            raise SystemExit(f"unknown variant {variant!r}: {sorted(VARIANTS)}")
        doc["runs"][variant] = run_runbatch(out, args, variant)
        h.write_json(path, doc)
        print(json.dumps(doc["runs"][variant]), flush=True)


def _input(args: argparse.Namespace) -> Path:
    args.work.mkdir(parents=True, exist_ok=True)
    path = args.work / "w-chat.jsonl"
    write_jsonl(path, w_chat_lines(args.n, vocab_words(), args.tools_every))
    return path


# ---------------------------------------------------------------------------- report


def report(out: Path, gpu_name: str | None = None) -> dict[str, Any]:
    q, rb = h.load_json(out / "qbatch.json"), h.load_json(out / "runbatch.json").get("runs", {})
    gpu = gpu_name or h.gpu_name()
    params = ceiling.model_params(h.MODEL_DIR)
    rows = [("qbatch bulk run", q)] + [(f"run-batch {v}", r) for v, r in sorted(rb.items())]
    table = [
        "| run | engine start s | wall s | processing s | lines answered | tool lines answered"
        " | output tok/s (processing) | output tok/s (wall) | computed tok/s vs bf16 ceiling |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for name, r in rows:
        if not r or "answered" not in r:
            table.append(f"| {name} | {r.get('error', 'not run') if r else 'not run'} |")
            continue
        label = name + (" (STAND-IN, not vLLM)" if r.get("standin") else "")
        table.append(
            f"| {label} | {r.get('engine_start_s')} | {r['wall_s']} | {r['processing_s']} | "
            f"{r['answered']}/{r['lines']} | {r['tool_answered']}/{r['tool_lines']} | "
            f"{r['out_tok_per_s']} | {r['out_tok_per_s_wall']} | "
            f"{ceiling.column(ceiling.computed_rate(r, r['processing_s']), gpu, params)} |"
        )
    ratios = {}
    for variant, r in rb.items():
        if q.get("out_tok_per_s") and r.get("out_tok_per_s"):
            ratios[variant] = {
                "processing_out_tok_s": round(q["out_tok_per_s"] / r["out_tok_per_s"], 3),
                "wall_out_tok_s": round(q["out_tok_per_s_wall"] / r["out_tok_per_s_wall"], 3),
            }
    targets = {
        v: {
            "qbatch_ge_1.2x_processing": x["processing_out_tok_s"] >= 1.2,
            "every_line_answered": q.get("answered") == q.get("lines"),
        }
        for v, x in ratios.items()
    }
    text = "\n".join(table) + "\n\nqbatch / run-batch: " + json.dumps(ratios)
    text += (
        "\n\nwall: qbatch = the `qbatch bulk run` command against a worker already running"
        " (its engine start apart); run-batch = the whole process, its engine start included."
        " processing: qbatch = the same command; run-batch = its first to its last progress line."
    )
    if any(r.get("standin") for r in rb.values()):
        text += "\n\nrun-batch here is the CPU STAND-IN: no figure of this run means anything."
    print(text)
    (out / "report.md").write_text(text + "\n")
    summary = {"device": gpu, "qbatch": q, "runbatch": rb, "ratios": ratios, "targets": targets}
    h.write_json(out / "summary.json", summary)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", choices=["qbatch", "runbatch", "report", "all"])
    h.add_phase_args(
        parser,
        "JSON, logs, report",
        "the input and output JSONL files (megabytes: kept out of --out)",
    )
    parser.add_argument("--n", type=int, default=1500, help="lines of W")
    parser.add_argument("--tools-every", type=int, default=10, help="every Nth line has tools")
    parser.add_argument("--warmup", type=int, default=64, help="qbatch: untimed requests first")
    parser.add_argument("--variants", default="tools,defaults", help="run-batch variants")
    parser.add_argument("--runbatch-args", default="", help="more run-batch engine flags")
    parser.add_argument(
        "--qbatch-args", default="", help="more `qbatch bulk run` flags (e.g. --placement none)"
    )
    parser.add_argument("--timeout-s", type=float, default=1200)
    parser.add_argument("--dry", action="store_true", help="CPU: echo engine, run-batch stand-in")
    args = parser.parse_args()
    from worker.logs import configure

    configure("warning", "console")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.phase in ("qbatch", "all"):
        phase_qbatch(args.out, args)
    if args.phase in ("runbatch", "all"):
        phase_runbatch(args.out, args)
    if args.phase in ("report", "all"):
        report(args.out, args.gpu_name)
    h.exit_now()


if __name__ == "__main__":
    main()
