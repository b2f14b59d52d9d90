"""How far two engine configurations' greedy outputs drift apart on the same prompts.

fp8 weights (issue 18) are a throughput profile; what they cost is output drift. The knob
benchmark decodes the same prompts greedily on each engine and records the token ids;
this module compares two such recordings. The bf16 engine is probed twice and its
self-agreement is the floor any other configuration is read against; both probes are the
same batch on the same engine, so the floor shows run-to-run nondeterminism, not what a
different batch shape would change. Pure: no engine, no GPU, unit-tested in tests/unit/test_bench_drift.py.
"""

from __future__ import annotations

import statistics
from typing import Any

Outputs = dict[str, list[int]]
"""Greedy output token ids by request id."""


def common_prefix(a: list[int], b: list[int]) -> int:
    """Tokens the two outputs agree on before they first differ."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def agreement(base: Outputs, other: Outputs) -> dict[str, Any]:
    """Compare `other` with `base` over the requests both answered.

    identical_frac: outputs equal token for token; first_token_frac: the first generated
    token agrees (one forward pass over the prompt, no compounding); common_prefix_*:
    tokens generated before the first difference, as a share of the output's length.
    """
    ids = sorted(set(base) & set(other))
    if not ids:
        return {"n": 0}
    prefixes = [common_prefix(base[i], other[i]) for i in ids]
    lengths = [max(len(base[i]), len(other[i]), 1) for i in ids]
    return {
        "n": len(ids),
        "identical_frac": round(sum(base[i] == other[i] for i in ids) / len(ids), 4),
        "first_token_frac": round(
            sum(bool(base[i]) and bool(other[i]) and base[i][0] == other[i][0] for i in ids)
            / len(ids),
            4,
        ),
        "common_prefix_mean": round(statistics.fmean(prefixes), 2),
        "common_prefix_median": statistics.median(prefixes),
        "common_prefix_share": round(sum(prefixes) / sum(lengths), 4),
    }


def drift_rows(configs: list[dict[str, Any]], base_name: str = "base") -> list[dict[str, Any]]:
    """One row per comparison: the base engine against its own second probe (the floor),
    then every other configuration's first probe against the base's first.

    A config's `drift` holds its probes as a list of Outputs; configs without it, or a
    missing base, give no rows.
    """
    probes = {c["config"]: c["drift"] for c in configs if c.get("drift")}
    base = probes.get(base_name)
    if not base:
        return []
    rows = []
    if len(base) > 1:
        rows.append(
            {"compare": f"{base_name} vs {base_name} (rerun)", **agreement(base[0], base[1])}
        )
    for name, runs in probes.items():
        if name != base_name:
            rows.append({"compare": f"{name} vs {base_name}", **agreement(base[0], runs[0])})
    return rows


def drift_table(rows: list[dict[str, Any]], max_tokens: int | None) -> str:
    """Markdown for the knob report; empty without rows."""
    if not rows:
        return ""
    lines = [
        f"Greedy drift ({rows[0].get('n')} prompts of W, {max_tokens} tokens each, temperature 0):",
        "",
        "| comparison | identical outputs | first token agrees | common prefix mean / median "
        "tokens | common prefix share |",
        "| --- | ---: | ---: | --- | ---: |",
    ]
    for row in rows:
        if not row.get("n"):
            lines.append(f"| {row['compare']} | no common requests | | | |")
            continue
        lines.append(
            f"| {row['compare']} | {row['identical_frac']:.1%} | {row['first_token_frac']:.1%} | "
            f"{row['common_prefix_mean']} / {row['common_prefix_median']} | "
            f"{row['common_prefix_share']:.1%} |"
        )
    return "\n".join(lines)
