"""A/B of the echo-worker benchmark: this checkout against an earlier commit, in one run.

    .venv/bin/python -m tests.benchmarks.ab_worker_echo --base ff124c6 --pairs 12 --n 30000

The base commit is checked out into a temporary git worktree; both sides run the same
harness (this checkout's `bench_worker_echo.py` is copied over the base's) with their own
worker code, one after the other, the order alternating every pair so that neither side
always runs on a warmer machine. Prints each run (req/s and the worker's CPU us per
request, the less noisy of the two on a machine whose cores Kafka and Redis share), then
the per-pair ratios new/base with their median and geometric mean. Needs the local stack
(`deploy/local/stack.sh up`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
HARNESS = Path(__file__).resolve().parent / "bench_worker_echo.py"


def _run(tree: Path, n: int, scratch: Path) -> dict[str, Any]:
    out = scratch / "run.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.benchmarks.bench_worker_echo",
            "--n",
            str(n),
            "--sinks",
            "redis",
            "--json-out",
            str(out),
        ],
        cwd=tree,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    rows = json.loads(out.read_text())
    out.unlink()
    row = rows[0]
    return {"req_per_s": row["req_per_s"], "cpu_us": row["worker_cpu_us_per_req"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="git ref to compare against")
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--n", type=int, default=20_000)
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="qbatch-ab-"))
    base = tmp / "base"
    subprocess.run(
        ["git", "worktree", "add", "--detach", str(base), args.base],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    try:
        shutil.copy(HARNESS, base / "tests" / "benchmarks" / HARNESS.name)
        runs: list[dict[str, Any]] = []
        for pair in range(args.pairs):
            order = [("base", base), ("new", REPO)]
            for side, tree in order if pair % 2 == 0 else order[::-1]:
                row = {"pair": pair + 1, "side": side, **_run(tree, args.n, tmp)}
                runs.append(row)
                print(
                    f"{row['pair']:>4} {side:>4} {row['req_per_s']:>9} req/s {row['cpu_us']:>7} us"
                )
        report(runs, args)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=REPO, check=False)
        shutil.rmtree(tmp, ignore_errors=True)


def report(runs: list[dict[str, Any]], args: argparse.Namespace) -> None:
    by_pair: dict[int, dict[str, dict[str, Any]]] = {}
    for row in runs:
        by_pair.setdefault(row["pair"], {})[row["side"]] = row
    summary: dict[str, Any] = {"base": args.base, "n": args.n, "pairs": args.pairs, "runs": runs}
    for key, label in (("req_per_s", "throughput"), ("cpu_us", "worker CPU per request")):
        ratios = [
            p["new"][key] / p["base"][key]
            for p in by_pair.values()
            if p["base"][key] and p["new"][key]  # a run too short for a CPU tick: left out
        ]
        means = {
            s: statistics.mean(r[key] or 0 for r in runs if r["side"] == s) for s in ("base", "new")
        }
        if not ratios:
            print(f"{label}: no pair measured it (runs too short)")
            continue
        summary[key] = {
            "mean_base": round(means["base"], 1),
            "mean_new": round(means["new"], 1),
            "ratio_median": round(statistics.median(ratios), 3),
            "ratio_geomean": round(statistics.geometric_mean(ratios), 3),
        }
        print(
            f"{label}: base {means['base']:.1f}, new {means['new']:.1f}; new/base per pair "
            f"median {statistics.median(ratios):.3f}, geometric mean "
            f"{statistics.geometric_mean(ratios):.3f}"
        )
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
