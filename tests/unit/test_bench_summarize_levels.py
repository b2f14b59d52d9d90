"""bench_gpu_summarize's raw phase in two calls (`--levels`): parsing and the merge guard."""

from __future__ import annotations

import pytest

from tests.benchmarks.bench_gpu_summarize import kept_levels, parse_levels, raw_totals

LEVELS = [[([1, 2, 3], None), ([4, 5], None)], [([6], None)]]  # 2 levels: 2 + 1 requests


def test_levels_parse_to_numbers_and_refuse_nonsense() -> None:
    assert parse_levels("") is None
    assert parse_levels("1") == {1}
    assert parse_levels("2, 3") == {2, 3}
    for bad in ("0", "x", ",", "-1"):
        with pytest.raises(SystemExit):
            parse_levels(bad)


def test_a_level_of_this_job_is_kept_and_totals_add_up() -> None:
    row = {"requests": 2, "prompt_tokens": 5, "generate_s": 1.5, "completion_tokens": 10}
    kept = kept_levels({"per_level": {"1": row}}, LEVELS)
    assert kept == {"1": row}
    partial = raw_totals(kept, 2)
    assert not partial["complete"] and partial["requests"] == 2
    kept["2"] = {"requests": 1, "prompt_tokens": 1, "generate_s": 0.5, "completion_tokens": 6}
    whole = raw_totals(kept, 2)
    assert whole["complete"] and whole["requests_per_level"] == [2, 1]
    assert whole["generate_s"] == 2.0 and whole["out_tok_per_s"] == 8.0
    assert whole["total_tok_per_s"] == 11.0  # (5 + 1 + 16) / 2


def test_a_level_of_another_run_is_refused() -> None:
    other = {"requests": 2, "prompt_tokens": 999, "generate_s": 1.0, "completion_tokens": 1}
    with pytest.raises(SystemExit, match="not this job's"):
        kept_levels({"per_level": {"1": other}}, LEVELS)
    with pytest.raises(SystemExit, match="this job has 2"):
        kept_levels({"per_level": {"3": other}}, LEVELS)
    assert kept_levels({}, LEVELS) == {}
