"""Tool loop on the CPU (echo engine): loops/s and the latency a tool round adds per turn.

    .venv/bin/python -m tests.benchmarks.bench_tool_loop                   # 1,000 loops of 3 turns
    .venv/bin/python -m tests.benchmarks.bench_tool_loop --loops 5000 --turns 4

Needs the local stack (`bash deploy/local/stack.sh up`). One worker (echo engine) and one
`qbatch tools serve` (the `hop` tool of `tests.tool_fixtures`, which scripts the echo
"model" into calling again until the last turn, and does nothing else), started fresh for every phase on fresh
topics, all on this machine:

1. `plain, one at a time`: `--sequential` single-turn requests, each waited for;
2. `loop, one at a time`: the same number of loops of `--turns` model turns, each waited for;
3. `plain, concurrent`: `--loops` single-turn requests submitted together;
4. `loop, concurrent`: `--loops` loops submitted together.

A loop of T turns is T model turns and T-1 tool rounds (worker -> tool-calls topic ->
executor -> requests topic -> worker). The *added latency per turn* is
(loop latency - plain latency) / (T - 1): unloaded, per loop against the median plain
request; concurrent, at the same percentile of the two phases (the cost of a turn
including its queueing behind the other loops' turns). loops/s: loops / (last final
result - first submit).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from producer.client import QBatchClient
from schemas import Status
from tests.integration.workers import Lane, start_executor, start_worker, stop_worker
from tests.tool_fixtures import call_block, registry

TOOLS = registry.openai_tools("hop")


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _body(i: int, turns: int, loop: bool) -> dict[str, Any]:
    if not loop:
        return {"messages": [{"role": "user", "content": f"plain {i}"}], "max_tokens": 16}
    block = call_block("hop", n=1, until=turns - 1)
    return {"messages": [{"role": "user", "content": block}], "tools": TOOLS}


def _options(turns: int, loop: bool) -> dict[str, Any]:
    return {"tool_loop": {"max_turns": turns}} if loop else {}


def _check(result: Any, turns: int, loop: bool) -> None:
    if result is None or result.status is not Status.succeeded:
        raise SystemExit(f"a request did not succeed: {result}")
    if loop and (result.tool_loop is None or result.tool_loop.turns != turns):
        raise SystemExit(f"a loop ran {result.tool_loop} turns, not {turns}")


def _one_at_a_time(client: QBatchClient, n: int, turns: int, loop: bool) -> list[float]:
    latencies = []
    for i in range(n):
        t0 = time.monotonic()
        rid = client.submit(_body(i, turns, loop), **_options(turns, loop))
        result = client.wait(rid, timeout=120)
        latencies.append(time.monotonic() - t0)
        _check(result, turns, loop)
    return latencies[1:]  # the first warms the path


def _concurrent(client: QBatchClient, n: int, turns: int, loop: bool) -> tuple[list[float], float]:
    t0 = time.monotonic()
    ids = [
        client.submit(_body(i, turns, loop), flush=False, **_options(turns, loop)) for i in range(n)
    ]
    client.flush()
    done: dict[str, float] = {}
    pending = set(ids)
    while pending and time.monotonic() - t0 < 900:
        for rid, result in client.get_many(sorted(pending)).items():
            if result is not None:
                done[rid] = time.monotonic() - t0
                pending.discard(rid)
                _check(result, turns, loop)
        time.sleep(0.02)
    if pending:
        raise SystemExit(f"{len(pending)} of {n} did not finish in 900 s")
    latencies = list(done.values())
    return latencies, n / max(latencies)


def _phase(name: str, args: argparse.Namespace, loop: bool, concurrent: bool) -> dict[str, Any]:
    lane = Lane.new("bloop")
    lane.create_topics(8)
    log = Path(os.environ.get("QBATCH_BENCH_LOG", "/dev/null"))
    worker = start_worker(lane, "--echo-delay-ms", str(args.delay_ms), log=log)
    executor = start_executor(lane, "tests.tool_fixtures:registry", log=log)
    try:
        with lane.client(poll_s=0.01) as client:
            warm = client.submit(_body(-1, args.turns, True), **_options(args.turns, True))
            _check(client.wait(warm, timeout=120), args.turns, True)  # both joined their groups
            if concurrent:
                latencies, rate = _concurrent(client, args.loops, args.turns, loop)
            else:
                latencies = _one_at_a_time(client, args.sequential, args.turns, loop)
                rate = len(latencies) / sum(latencies)
    finally:
        stop_worker(executor)
        stop_worker(worker)
        lane.clean_redis()
        lane.delete_topics()
    return {
        "phase": name,
        "n": len(latencies),
        "per_s": round(rate, 1),
        "p50_s": round(statistics.median(latencies), 4),
        "p99_s": round(_pct(latencies, 0.99), 4),
        "max_s": round(max(latencies), 4),
        "latencies_s": latencies,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loops", type=int, default=1_000, help="concurrent loops")
    parser.add_argument("--turns", type=int, default=3, help="model turns per loop (>= 2)")
    parser.add_argument("--sequential", type=int, default=101, help="one-at-a-time samples")
    parser.add_argument("--delay-ms", type=float, default=0, help="echo engine delay")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    if args.turns < 2:
        parser.error("--turns must be >= 2 (one tool round at least)")
    rounds = args.turns - 1
    print(f"machine: {platform.node()} {os.cpu_count()} cores, python {platform.python_version()}")
    print(f"echo engine, {args.delay_ms} ms per answer; loops of {args.turns} turns")
    plain_seq = _phase("plain, one at a time", args, loop=False, concurrent=False)
    loop_seq = _phase("loop, one at a time", args, loop=True, concurrent=False)
    plain_con = _phase("plain, concurrent", args, loop=False, concurrent=True)
    loop_con = _phase("loop, concurrent", args, loop=True, concurrent=True)
    rows = [plain_seq, loop_seq, plain_con, loop_con]
    print(f"{'phase':>22} {'n':>6} {'req|loop/s':>11} {'p50 s':>8} {'p99 s':>8} {'max s':>8}")
    for row in rows:
        print(
            f"{row['phase']:>22} {row['n']:>6} {row['per_s']:>11} {row['p50_s']:>8}"
            f" {row['p99_s']:>8} {row['max_s']:>8}"
        )
    base = statistics.median(plain_seq["latencies_s"])
    added = [(x - base) / rounds for x in loop_seq["latencies_s"]]
    unloaded = {"p50_ms": round(statistics.median(added) * 1000, 1)}
    unloaded["p99_ms"] = round(_pct(added, 0.99) * 1000, 1)
    loaded = {
        f"{q}_ms": round(
            (_pct(loop_con["latencies_s"], p) - _pct(plain_con["latencies_s"], p)) / rounds * 1000,
            1,
        )
        for q, p in (("p50", 0.5), ("p99", 0.99))
    }
    print(
        f"added latency per turn, one at a time: p50 {unloaded['p50_ms']} ms, p99"
        f" {unloaded['p99_ms']} ms (loop minus the median plain request, / {rounds} rounds)"
    )
    print(
        f"added latency per turn, {args.loops} concurrent: p50 {loaded['p50_ms']} ms, p99"
        f" {loaded['p99_ms']} ms (same percentile, loop minus plain, / {rounds} rounds)"
    )
    print(
        f"{args.loops} concurrent loops of {args.turns} turns: {loop_con['per_s']} loops/s ="
        f" {round(loop_con['per_s'] * args.turns, 1)} model turns/s; plain requests alone"
        f" {plain_con['per_s']} req/s; turns/s ratio"
        f" {round(loop_con['per_s'] * args.turns / plain_con['per_s'], 2)}"
    )
    if args.json_out:
        report = {
            "args": vars(args),
            "machine": f"{platform.node()} {os.cpu_count()} cores",
            "rows": [{k: v for k, v in r.items() if k != "latencies_s"} for r in rows],
            "added_per_turn_one_at_a_time": unloaded,
            "added_per_turn_concurrent": loaded,
        }
        Path(args.json_out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
