"""The knob benchmark's greedy drift comparison (tests/benchmarks/drift.py), pure."""

from __future__ import annotations

from typing import Any

from tests.benchmarks.drift import agreement, common_prefix, drift_rows, drift_table


def test_common_prefix_counts_tokens_before_the_first_difference() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 3]) == 3
    assert common_prefix([1, 2, 3], [1, 9, 3]) == 1
    assert common_prefix([5], [6]) == 0
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0


def test_agreement_over_the_requests_both_answered() -> None:
    base = {"a": [1, 2, 3, 4], "b": [5, 6, 7, 8], "c": [9, 9, 9, 9], "only-base": [1]}
    other = {"a": [1, 2, 3, 4], "b": [5, 6, 0, 0], "c": [0, 9, 9, 9], "only-other": [1]}
    got = agreement(base, other)
    assert got["n"] == 3
    assert got["identical_frac"] == round(1 / 3, 4)
    assert got["first_token_frac"] == round(2 / 3, 4)  # c differs at its first token
    assert got["common_prefix_mean"] == 2.0  # 4, 2, 0
    assert got["common_prefix_median"] == 2
    assert got["common_prefix_share"] == round(6 / 12, 4)


def test_agreement_without_common_requests_says_so() -> None:
    assert agreement({"a": [1]}, {"b": [1]}) == {"n": 0}


def test_empty_outputs_never_count_as_a_first_token_match() -> None:
    assert agreement({"a": []}, {"a": []})["first_token_frac"] == 0.0


def test_rows_read_the_base_floor_first_then_each_other_config() -> None:
    configs: list[dict[str, Any]] = [
        {"config": "base", "drift": [{"a": [1, 2], "b": [3, 4]}, {"a": [1, 2], "b": [3, 0]}]},
        {"config": "fp8", "drift": [{"a": [1, 7], "b": [8, 4]}]},
        {"config": "no-drift", "runs": []},
    ]
    rows = drift_rows(configs)
    assert [r["compare"] for r in rows] == ["base vs base (rerun)", "fp8 vs base"]
    assert rows[0]["identical_frac"] == 0.5
    assert rows[1]["identical_frac"] == 0.0
    assert rows[1]["first_token_frac"] == 0.5
    table = drift_table(rows, 2)
    assert "| fp8 vs base | 0.0% | 50.0% |" in table
    assert "2 prompts of W, 2 tokens each" in table


def test_no_rows_without_a_base_probe() -> None:
    assert drift_rows([{"config": "fp8", "drift": [{"a": [1]}]}]) == []
    assert drift_table([], 64) == ""


def test_knobs_of_two_calls_merge_and_a_later_measurement_replaces_a_failed_one() -> None:
    from tests.benchmarks.bench_knobs import knobs_table, merge_knobs

    def run(tok_s: float) -> dict[str, object]:
        return {"workload": "w400", "req_per_s": 1, "out_tok_per_s": tok_s, "latency_s": {}}

    first = {
        "max_model_len": 16384,
        "configs": [
            {"config": "base", "runs": [run(100.0)], "drift": [{"a": [1]}, {"a": [1]}]},
            {"config": "fp8", "runs": [], "exit": 1},
        ],
    }
    second = {"configs": [{"config": "fp8", "runs": [run(125.0)], "exit": 0}]}
    merged = merge_knobs([first, second])
    assert [c["config"] for c in merged["configs"]] == ["base", "fp8"]
    assert merged["configs"][1]["exit"] == 0 and merged["max_model_len"] == 16384
    assert "fp8/base on w400: 1.250x" in knobs_table(merged)
    assert "exit 1" not in knobs_table(merged)
    # a measured config is never replaced by a later call's
    again = merge_knobs([merged, {"configs": [{"config": "base", "runs": [run(1.0)]}]}])
    assert again["configs"][0]["runs"][0]["out_tok_per_s"] == 100.0
    assert drift_rows(again["configs"])[0]["compare"] == "base vs base (rerun)"
