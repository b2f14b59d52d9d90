"""`qbatch serve` against the queue directly: a Batch through the OpenAI SDK vs `qbatch
bulk run` on the same file, and sync chat through the server vs `QBatchClient`.

    .venv/bin/python tests/benchmarks/bench_serve.py --lines 100000 --sync-requests 1000

Needs the local stack (deploy/local/stack.sh up; QBATCH_KAFKA_BOOTSTRAP / QBATCH_REDIS_URL
pick another one). Echo engine, so what is measured is qbatch and the server, not a model.

(a) batch: one OpenAI Batch file of `--lines` short chat requests. The server side
(`qbatch serve` and `--workers` echo workers on their own private lane) is timed from the
start of `files.create` to the output file downloaded by `files.content`, with the real
`openai` SDK; the bulk side is `tests/benchmarks/bench_bulk.py` on the same file (its own
lane and workers): `bulk submit` start -> job finished -> `bulk collect` written. One run
each, one after the other, on the same machine; lines/s of each and the ratio.

(b) sync: `--sync-requests` sequential chat requests through the server
(`chat.completions.create`) and the same through `QBatchClient.submit` + `wait`, on the
server's lane and worker; req/s, p50/p99 latency of each and the server's added p50.

Prints the figures, and a JSON line with them at the end (`--json-out FILE`: also there).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[2]))

from tests.benchmarks.bench_bulk import run_file  # noqa: E402
from tests.integration.workers import Lane, start_worker, stop_worker  # noqa: E402
from tests.serve_fixtures import Server, batch_lines, jsonl, keys_file, wait_batch  # noqa: E402

WARMUP = 5


def timed(calls: int, one: Callable[[int], Any]) -> dict[str, float]:
    """`calls` sequential calls of `one(i)` after WARMUP untimed ones: req/s, p50, p99."""
    for i in range(WARMUP):
        one(-1 - i)
    lat: list[float] = []
    t0 = time.perf_counter()
    for i in range(calls):
        t = time.perf_counter()
        one(i)
        lat.append(time.perf_counter() - t)
    wall = time.perf_counter() - t0
    lat.sort()
    return {
        "requests": calls,
        "req_per_s": round(calls / wall, 1),
        "p50_ms": round(statistics.median(lat) * 1000, 2),
        "p99_ms": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1000, 2),
    }


def serve_side(
    src: Path, lines: int, sync_requests: int, workers: int, timeout: float, tmp: Path
) -> dict[str, Any]:
    lane = Lane.new("bserve")
    lane.create_topics()
    procs = [start_worker(lane, log=tmp / "worker.log") for _ in range(workers)]
    server = Server(lane, tmp / "files", keys_file(tmp / "keys.json"), tmp / "serve.log")
    try:
        server.start()
        time.sleep(1.0)
        client = server.client(timeout=timeout)
        t0 = time.monotonic()
        with src.open("rb") as fh:
            up = client.files.create(file=("in.jsonl", fh), purpose="batch")
        t_upload = time.monotonic() - t0
        batch = client.batches.create(
            input_file_id=up.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        done = wait_batch(client, batch.id, {"completed", "failed"}, timeout, poll_s=0.1)
        if done.status != "completed" or done.output_file_id is None:
            raise SystemExit(f"batch {done.status}: {done}")
        t_done = time.monotonic() - t0
        out = tmp / "serve-out.jsonl"
        client.files.content(done.output_file_id).write_to_file(out)
        t_total = time.monotonic() - t0
        written = sum(1 for _ in out.open())
        if written != lines:
            raise SystemExit(f"output has {written} lines, not {lines}")
        figures: dict[str, Any] = {
            "upload_s": round(t_upload, 2),
            "completed_s": round(t_done, 2),
            "total_s": round(t_total, 2),
            "total_lines_per_s": round(lines / t_total, 1),
        }
        if sync_requests:
            figures["sync"] = sync_side(server, lane, sync_requests)
        return figures
    finally:
        server.stop()
        for proc in procs:
            stop_worker(proc)
        lane.delete_topics()
        lane.clean_redis()


def sync_side(server: Server, lane: Lane, calls: int) -> dict[str, dict[str, float]]:
    client = server.client(max_retries=0)

    def via_server(i: int) -> None:
        resp = client.chat.completions.create(
            model="echo", messages=[{"role": "user", "content": f"say {i}"}], max_tokens=16
        )
        assert resp.choices[0].message.content is not None

    qb = lane.client()

    def via_client(i: int) -> None:
        body = {"messages": [{"role": "user", "content": f"say {i}"}], "max_tokens": 16}
        result = qb.wait(qb.submit(body), timeout=30)
        assert result is not None, "no result in 30s"

    try:
        return {"server": timed(calls, via_server), "client": timed(calls, via_client)}
    finally:
        qb.close()
        client.close()


def run(lines: int, sync_requests: int, workers: int, chunk: int, timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        src = tmp / "in.jsonl"
        src.write_bytes(jsonl(batch_lines(lines)))
        serve = serve_side(src, lines, sync_requests, workers, timeout, tmp)
        bulk = run_file(src, lines, workers, chunk, timeout)
    figures: dict[str, Any] = {
        "lines": lines,
        "workers": workers,
        "serve_batch": {k: v for k, v in serve.items() if k != "sync"},
        "bulk_run": {k: bulk[k] for k in ("total_s", "total_lines_per_s", "end_to_end_s")},
        "batch_ratio_serve_over_bulk": round(
            serve["total_lines_per_s"] / bulk["total_lines_per_s"], 3
        ),
    }
    if "sync" in serve:
        sync = serve["sync"]
        figures["sync"] = sync
        figures["sync_added_p50_ms"] = round(sync["server"]["p50_ms"] - sync["client"]["p50_ms"], 2)
        figures["sync_ratio_req_per_s_server_over_client"] = round(
            sync["server"]["req_per_s"] / sync["client"]["req_per_s"], 3
        )
    return figures


def report(f: dict[str, Any]) -> None:
    s, b = f["serve_batch"], f["bulk_run"]
    print(f"lines: {f['lines']:,}  echo workers: {f['workers']} (each side its own lane)")
    print(
        f"batch via serve (openai SDK): {s['total_lines_per_s']:>10,.0f} lines/s  "
        f"({s['total_s']}s upload start -> output downloaded; upload {s['upload_s']}s, "
        f"completed at {s['completed_s']}s)"
    )
    print(
        f"qbatch bulk run:              {b['total_lines_per_s']:>10,.0f} lines/s  "
        f"({b['total_s']}s submit start -> collect written; job done at {b['end_to_end_s']}s)"
    )
    print(f"ratio serve / bulk:           {f['batch_ratio_serve_over_bulk']:.3f}")
    if "sync" in f:
        for name, label in (("server", "sync via serve (openai SDK)"), ("client", "QBatchClient")):
            d = f["sync"][name]
            print(
                f"{label + ':':<29} {d['req_per_s']:>10,.1f} req/s  "
                f"p50 {d['p50_ms']:.2f} ms  p99 {d['p99_ms']:.2f} ms  ({d['requests']} sequential)"
            )
        print(
            f"server adds (p50):            {f['sync_added_p50_ms']:>10.2f} ms  "
            f"(req/s ratio serve / client {f['sync_ratio_req_per_s_server_over_client']:.3f})"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=100_000)
    parser.add_argument("--sync-requests", type=int, default=1_000, help="0: skip (b)")
    parser.add_argument("--workers", type=int, default=1, help="echo workers per side")
    parser.add_argument("--chunk", type=int, default=5_000, help="bulk submit --chunk")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--json-out", type=Path, help="also write the figures here")
    args = parser.parse_args()
    figures = run(args.lines, args.sync_requests, args.workers, args.chunk, args.timeout)
    report(figures)
    line = json.dumps(figures)
    print(line)
    if args.json_out is not None:
        args.json_out.write_text(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
