"""The chaos soak's verdicts that need no socket: a bulk job's bookkeeping against its
results, and how long each kind of fault held answers back. soak.py reads Redis and
Kafka and hands the values here, so these rules are unit-tested on made-up runs
(tests/unit/test_soak_report.py)."""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Mapping
from typing import Any

JOB_COUNTERS = ("succeeded", "failed", "expired", "cancelled")


def job_verdict(
    job: str,
    lines: int,
    job_hash: Mapping[str, str],
    stream_len: int,
    statuses: Mapping[str, str],
) -> tuple[dict[str, Any], list[str]]:
    """The job's row of the report and what is wrong with it: its counters must equal the
    statuses of its lines' answers (line i's request id is `{job}.{i}`; `statuses` maps a
    request id to its answer's status, from its result or, for a job whose results expire
    before the check, from its stream), its `total` and the counters' sum must be the line
    count, and its progress stream holds one entry a line."""
    by_status: dict[str, int] = {}
    for i in range(1, lines + 1):
        status = statuses.get(f"{job}.{i}")
        if status is not None:
            by_status[status] = by_status.get(status, 0) + 1
    counters = {s: int(job_hash.get(s, 0)) for s in JOB_COUNTERS}
    problems = []
    if {k: v for k, v in counters.items() if v} != by_status:
        problems.append(f"job {job}: counters {counters} but results {by_status}")
    if int(job_hash.get("total", -1)) != lines or sum(counters.values()) != lines:
        problems.append(
            f"job {job}: total {job_hash.get('total')} counted {sum(counters.values())}"
        )
    if stream_len != lines:
        problems.append(f"job {job}: stream holds {stream_len} entries for {lines} lines")
    return {"status": job_hash.get("status"), **counters, "stream": stream_len}, problems


def statuses_of(results: Mapping[str, bytes | None]) -> dict[str, str]:
    """request id -> status, of the results found."""
    return {rid: json.loads(raw)["status"] for rid, raw in results.items() if raw is not None}


def recovery_times(
    applied: Iterable[tuple[str, float, float]],
    published: Mapping[str, float],
    first_seen: Mapping[str, float],
) -> dict[str, dict[str, float]]:
    """Per fault kind, over its faults (kind, start, end; seconds from the run's start,
    end < 0: never undone, left out): `from_start`, seconds from the fault's start until
    every request published before it had its answer (the backlog it caught), and
    `after_end`, how much of that came after the fault was undone (0: the rest of the
    cluster had answered everything by then). `published` and `first_seen` are on the
    same clock as the faults; a request never seen counts as infinitely late."""
    out: dict[str, dict[str, list[float]]] = {}
    for kind, start, end in applied:
        if end < 0:
            continue
        before = [first_seen.get(r, float("inf")) for r, t in published.items() if t < start]
        last = max(before, default=0.0)
        series = out.setdefault(kind, {"from_start": [], "after_end": []})
        series["from_start"].append(round(max(0.0, last - start), 2))
        series["after_end"].append(round(max(0.0, last - end), 2))
    return {
        kind: {
            f"{k}_{stat}": round(fn(v), 2)
            for k, v in series.items()
            for stat, fn in (("p50", statistics.median), ("max", max))
        }
        for kind, series in out.items()
    }
