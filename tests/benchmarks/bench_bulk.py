"""Bulk throughput: `qbatch bulk submit` lines/s and `qbatch bulk collect` results/s.

    .venv/bin/python tests/benchmarks/bench_bulk.py --lines 100000
    .venv/bin/python tests/benchmarks/bench_bulk.py --night --runs 3

`--night`: instead, `qbatch bulk run` (submit and collect in one command, as a user runs it)
of the night of job families (tests/benchmarks/families.py: 1,438 lines, 21 MB of long
system prompts) through an echo worker that answers at once: the wall time is what the
pipeline itself costs for that file (CLI start-up, scan, placement, publish, the worker's
intake and rendering, the writes, collect), the floor under the GPU's `bulk run` figure.

Needs the local stack (deploy/local/stack.sh up). Starts one echo-engine worker on a
private topic/prefix (or uses `--workers 0` plus your own), submits an OpenAI Batch file
of short chat requests through the real CLI (a subprocess, as cron would), waits for the
job to finish, then times `bulk collect` into a JSONL file. Prints the figures, and a
JSON line with them at the end.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import pytest
import redis

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1] / "integration"))
sys.path.insert(0, str(HERE.parents[2]))

from workers import Lane, qbatch, start_worker, stop_worker  # noqa: E402


def write_file(path: Path, n: int) -> None:
    with path.open("w") as fh:
        for i in range(n):
            body = {"messages": [{"role": "user", "content": f"say {i}"}], "max_tokens": 16}
            line = {
                "custom_id": f"c{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": body,
            }
            fh.write(json.dumps(line) + "\n")


def run(lines: int, workers: int, chunk: int, timeout: float) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "in.jsonl"
        write_file(src, lines)
        return run_file(src, lines, workers, chunk, timeout)


def run_file(src: Path, lines: int, workers: int, chunk: int, timeout: float) -> dict[str, float]:
    """`bulk submit` of `src` (`lines` lines), the job through `workers` echo workers on
    a private lane, `bulk collect`; the figures (also used by bench_serve.py)."""
    lane = Lane.new("bench")
    lane.create_topics()
    job = "bench"
    procs = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "out.jsonl"
            for _ in range(workers):
                procs.append(start_worker(lane, log=Path(tmp) / "worker.log"))
            time.sleep(1.0)
            t0 = time.monotonic()
            sub = qbatch(
                lane,
                "-q",
                "--json",
                "bulk",
                "submit",
                str(src),
                "--job",
                job,
                "--chunk",
                str(chunk),
                timeout=timeout,
            )
            t_submit = time.monotonic() - t0
            if sub.returncode != 0:
                raise SystemExit(f"submit failed ({sub.returncode}): {sub.stderr[-2000:]}")
            inner = json.loads(sub.stdout.splitlines()[-1])["submit"]
            r = redis.Redis.from_url(lane.redis_url, decode_responses=True)
            key = f"{lane.prefix}:job:{job}"
            while True:
                h = r.hgetall(key)
                if h.get("status") in ("completed", "completed_with_errors", "cancelled"):
                    break
                if time.monotonic() - t0 > timeout:
                    raise SystemExit(f"job not finished after {timeout}s: {h}")
                time.sleep(0.05)
            t_done = time.monotonic() - t0
            r.close()
            t1 = time.monotonic()
            col = qbatch(
                lane, "-q", "--json", "bulk", "collect", job, "--out", str(out), timeout=timeout
            )
            t_collect = time.monotonic() - t1
            if col.returncode != 0:
                raise SystemExit(f"collect failed ({col.returncode}): {col.stderr[-2000:]}")
            written = sum(1 for _ in out.open())
            assert written == lines, (written, lines)
            inner_col = json.loads(col.stdout.splitlines()[-1])["collect"]
    finally:
        for proc in procs:
            stop_worker(proc)
        lane.delete_topics()
        lane.clean_redis()
    figures = {
        "lines": lines,
        "total_s": round(t_done + t_collect, 2),
        "total_lines_per_s": round(lines / (t_done + t_collect), 1),
        "submit_wall_s": round(t_submit, 2),
        "submit_lines_per_s": round(lines / t_submit, 1),
        "submit_publish_s": inner["seconds"],
        "submit_publish_lines_per_s": inner["lines_per_s"],
        "end_to_end_s": round(t_done, 2),
        "end_to_end_per_s": round(lines / t_done, 1),
        "collect_wall_s": round(t_collect, 2),
        "collect_results_per_s": round(lines / t_collect, 1),
        "collect_inner_results_per_s": inner_col["results_per_s"],
    }
    return figures


def run_night(runs: int, timeout: float) -> dict[str, object]:
    """`qbatch bulk run` of the night file, `runs` times (a fresh job each), one echo worker."""
    from tests.benchmarks import bench_runbatch as rb
    from tests.benchmarks import families

    lane = Lane.new("night")
    lane.create_topics()
    walls: list[float] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "night.jsonl"
            lines = families.night_lines(rb.vocab_words())
            rb.write_jsonl(src, lines)
            proc = start_worker(
                lane, "--served-model-name", rb.SERVED, log=Path(tmp) / "worker.log"
            )
            try:
                time.sleep(1.0)
                for k in range(runs):
                    out = Path(tmp) / f"out-{k}.jsonl"
                    t0 = time.monotonic()
                    done = qbatch(
                        lane, "-q", "bulk", "run", str(src), "--job", f"night-{k}",
                        "--out", str(out), timeout=timeout,
                    )  # fmt: skip
                    walls.append(round(time.monotonic() - t0, 3))
                    if done.returncode != 0:
                        raise SystemExit(
                            f"bulk run failed ({done.returncode}): {done.stderr[-2000:]}"
                        )
                    assert sum(1 for _ in out.open()) == len(lines)
            finally:
                stop_worker(proc)
            size = src.stat().st_size
    finally:
        lane.delete_topics()
        lane.clean_redis()
    return {
        "lines": len(lines),
        "file_bytes": size,
        "bulk_run_wall_s": walls,
        "render_s": render_seconds(lines),
        "render_whole_text_s": render_seconds(lines, cache=False),
    }


def render_seconds(lines: list[dict[str, object]], cache: bool = True) -> float:
    """Rendering every line as a vLLM worker does (Qwen3's chat template and tokenizer, the
    fixtures'), on one thread: the dispatcher's share the echo worker does not pay.
    `cache=False`: each prompt tokenized whole (worker/segment_tokens.py off)."""
    from transformers import AutoTokenizer

    from schemas import RequestEnvelope
    from tests.benchmarks.bench_runbatch import SERVED
    from worker.rendering import PromptRenderer

    fixture = HERE.parents[1] / "fixtures" / "qwen3-14b"
    renderer = PromptRenderer(
        AutoTokenizer.from_pretrained(fixture), max_model_len=4096, served_names={SERVED}
    )
    if not cache:
        renderer.prompt_encoder = None
    envs = [
        RequestEnvelope.model_validate(
            {"request_id": line["custom_id"], "endpoint": line["url"], "body": line["body"]}
        )
        for line in lines
    ]
    t0 = time.perf_counter()
    for env in envs:
        renderer.render(env)
    return round(time.perf_counter() - t0, 3)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--night", action="store_true", help="bulk run of the night file")
    parser.add_argument("--runs", type=int, default=3, help="--night: runs, one after another")
    parser.add_argument("--lines", type=int, default=100_000)
    parser.add_argument("--workers", type=int, default=1, help="echo workers to start")
    parser.add_argument("--chunk", type=int, default=5_000)
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args()
    if args.night:
        print(json.dumps(run_night(args.runs, args.timeout)))
        return 0
    f = run(args.lines, args.workers, args.chunk, args.timeout)
    print(f"lines:             {f['lines']:,}")
    print(
        f"bulk submit:       {f['submit_lines_per_s']:,.0f} lines/s  "
        f"({f['submit_wall_s']}s wall incl. start-up and validation; "
        f"publish loop {f['submit_publish_lines_per_s']:,.0f} lines/s)"
    )
    print(
        f"through the worker: {f['end_to_end_per_s']:,.0f} results/s end to end "
        f"({f['end_to_end_s']}s from submit start to job finished, {args.workers} echo worker)"
    )
    print(
        f"bulk collect:      {f['collect_results_per_s']:,.0f} results/s "
        f"({f['collect_wall_s']}s wall)"
    )
    print(json.dumps(f))
    return 0


@pytest.mark.benchmark
def test_bench_bulk() -> None:
    figures = run(20_000, 1, 5_000, 600)
    print(json.dumps(figures))
    assert figures["collect_results_per_s"] > 0


if __name__ == "__main__":
    sys.exit(main())
