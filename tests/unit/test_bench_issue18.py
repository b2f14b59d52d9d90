"""The pure parts of the issue-18 benchmarks: workload P, the chat version of W, run-batch's
progress line, output counting, the ratios against the targets, and the physical limits.

The progress lines are vLLM's own: one captured from a published run-batch log, and the
others rendered by tqdm with the `bar_format` of vLLM 0.24's run_batch.py (what run-batch
prints is tqdm's rendering of that format, so that is the real thing, not a guess).
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path

import pytest

from tests.benchmarks import bench_gpu_prefix as bp
from tests.benchmarks import bench_runbatch as rb
from tests.benchmarks import ceiling
from tests.benchmarks.runbatch_standin import BAR_FORMAT, answer

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "qwen3-14b"


@pytest.fixture(scope="module")
def words() -> list[str]:
    return rb.vocab_words()


# ---------------------------------------------------------------------------- workload P


def test_p_has_the_issue_shape(words: list[str]) -> None:
    lines = bp.p_lines(words)
    assert len(lines) == 400 * 8
    families = Counter(bp.family_of(x["custom_id"]) for x in lines)
    assert len(families) == 400 and set(families.values()) == {8}
    by_family: dict[str, set[str]] = {}
    for x in lines:
        body = x["body"]
        assert x["url"] == "/v1/chat/completions" and body["model"] == "Qwen3-14B"
        system, user = body["messages"]
        assert system["role"] == "system" and user["role"] == "user"
        assert 100 <= len(user["content"].split()) <= 300
        assert len(system["content"].split()) == 2000
        assert 32 <= body["max_tokens"] <= 256
        assert body["ignore_eos"] is True and body["top_k"] == 20
        by_family.setdefault(bp.family_of(x["custom_id"]), set()).add(system["content"])
    assert all(len(s) == 1 for s in by_family.values())  # one prefix a family
    assert len({next(iter(s)) for s in by_family.values()}) == 400  # and its own
    # shuffled: a family's 8 lines are scattered over the file
    first_family = [i for i, x in enumerate(lines) if bp.family_of(x["custom_id"]) == "f0000"]
    assert max(first_family) - min(first_family) > 400
    neighbours = sum(
        bp.family_of(a["custom_id"]) == bp.family_of(b["custom_id"])
        for a, b in itertools.pairwise(lines)
    )
    assert neighbours < 40  # ~8 expected at random; sorted would be 2,800


def test_p_is_deterministic_per_seed(words: list[str]) -> None:
    a = bp.p_lines(words, families=10, per_family=3, prefix_tokens=50)
    assert a == bp.p_lines(words, families=10, per_family=3, prefix_tokens=50)
    other = bp.p_lines(words, families=10, per_family=3, prefix_tokens=50, seed=4)
    assert [x["custom_id"] for x in a] != [x["custom_id"] for x in other]


def test_p_prefix_is_2000_tokens_of_the_qwen3_tokenizer(words: list[str], tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    from tests.summarize_fixtures import qwen3_tokenizer_json

    tok = Tokenizer.from_file(str(qwen3_tokenizer_json(tmp_path)))
    lines = bp.p_lines(words, families=5, per_family=2)
    for x in lines:
        system, user = x["body"]["messages"]
        n = len(tok.encode(system["content"]).ids)
        assert 2000 <= n <= 2004, n  # one token a word; the first, without its space, <= 4
        words_user = len(user["content"].split())
        assert words_user <= len(tok.encode(user["content"]).ids) <= words_user + 3


def test_w_chat_lines_keep_ws_lengths_and_tools_every_tenth(words: list[str]) -> None:
    from tests.benchmarks.gpu_runs import workload

    lines = rb.w_chat_lines(100, words)
    w = workload(100)
    assert [x["body"]["max_tokens"] for x in lines] == [r.max_tokens for r in w]
    assert [len(x["body"]["messages"][0]["content"].split()) for x in lines] == [
        len(r.prompt) for r in w
    ]
    tools = [i for i, x in enumerate(lines) if "tools" in x["body"]]
    assert tools == list(range(9, 100, 10))
    assert not any("tools" in x["body"] for x in rb.w_chat_lines(20, words, tools_every=0))


# ---------------------------------------------------------------------------- run-batch's progress


def _tqdm_line(n: int, total: int, elapsed: float) -> str:
    from tqdm import tqdm

    return tqdm.format_meter(
        n, total, elapsed, prefix="Running batch", unit="req", bar_format=BAR_FORMAT
    ).strip()


def test_progress_line_captured_from_a_run_batch_log() -> None:
    line = "Running batch: 100% Completed | 256/256 [01:10<00:00,  3.62req/s]"
    assert rb.parse_progress(line) == rb.Progress(100, 256, 256, 70)


def test_progress_lines_as_tqdm_renders_vllms_format() -> None:
    first = _tqdm_line(0, 1500, 0.0)
    assert first.startswith("Running batch:   0% Completed | 0/1500 [00:00<")
    assert rb.parse_progress(first) == rb.Progress(0, 0, 1500, 0)
    assert rb.parse_progress(_tqdm_line(750, 1500, 42.4)) == rb.Progress(50, 750, 1500, 42)
    assert rb.parse_progress(_tqdm_line(1500, 1500, 3723.0)) == rb.Progress(
        100, 1500, 1500, 3723
    )  # 1:02:03


def test_other_progress_bars_of_vllm_are_not_run_batchs() -> None:
    # vLLM's checkpoint loader uses the same format with another description
    loader = "Loading safetensors checkpoint shards:   0% Completed | 0/57 [00:00<?, ?it/s]"
    assert rb.parse_progress(loader) is None
    assert rb.parse_progress("INFO 12-03 10:00:00 [run_batch.py:811] Reading batch") is None


def test_progress_timing_from_the_first_to_the_last_progress_line() -> None:
    lines = [
        (1.0, "INFO vLLM batch processing API version 0.24.0"),
        (2.5, "Loading safetensors checkpoint shards:   0% Completed | 0/57 [00:00<?, ?it/s]"),
        (84.25, _tqdm_line(0, 1500, 0.0)),
        (89.3, _tqdm_line(90, 1500, 5.0)),
        (163.75, _tqdm_line(1500, 1500, 79.5)),
        (170.0, "INFO Writing outputs to local file out.jsonl"),
    ]
    t = rb.progress_timing(lines)
    assert t["engine_start_s"] == 84.25 and t["processing_s"] == 79.5
    assert t["processing_s_tqdm"] == 79 and t["progress_lines"] == 3
    assert (t["completed"], t["total"]) == (1500, 1500)
    assert rb.progress_timing(lines[:2]) == {"progress_lines": 0}


# ---------------------------------------------------------------------------- output counting


def test_count_output_counts_answered_tool_lines_and_usage(words: list[str]) -> None:
    lines = rb.w_chat_lines(20, words)
    tool_ids = {x["custom_id"] for x in lines if "tools" in x["body"]}
    refused = [json.dumps(answer(x, auto_tools=False)) for x in lines]
    c = rb.count_output(refused, tool_ids)
    assert (c["lines"], c["answered"], c["tool_lines"], c["tool_answered"]) == (20, 18, 2, 0)
    assert c["completion_tokens"] == sum(
        x["body"]["max_tokens"] for x in lines if "tools" not in x["body"]
    )
    c = rb.count_output([json.dumps(answer(x, auto_tools=True)) for x in lines], tool_ids)
    assert (c["answered"], c["tool_answered"]) == (20, 2)


def test_count_output_reads_qbatch_output_lines_with_cached_tokens() -> None:
    line = {
        "id": "batch_req_1",
        "custom_id": "f0001-3",
        "response": {
            "status_code": 200,
            "request_id": "r1",
            "body": {
                "usage": {
                    "prompt_tokens": 2200,
                    "completion_tokens": 100,
                    "prompt_tokens_details": {"cached_tokens": 2000},
                }
            },
        },
        "error": None,
    }
    failed = {"custom_id": "x", "response": {"status_code": 500}, "error": {"code": "e"}}
    c = rb.count_output([json.dumps(line), json.dumps(failed), ""], set())
    assert (c["lines"], c["answered"], c["cached_tokens"], c["prompt_tokens"]) == (2, 1, 2000, 2200)
    assert rb.rates(c, 2.0, 4.0)["prefix_cache_hit_rate"] == round(2000 / 2200, 4)


# ---------------------------------------------------------------------------- targets


def _run(out_tok_s: float) -> dict[str, float]:
    return {"out_tok_per_s": out_tok_s}


def test_ratios_check_both_prefix_targets_and_the_w_check() -> None:
    raw = {"P": _run(1000), "W": _run(5000)}
    q = {"P-none": _run(1000), "P-prefix": _run(1500), "W-prefix": _run(4900)}
    r = bp.ratios(raw, q)
    assert r["P prefix/raw"] == 1.5 and r["target P prefix >= 1.4x raw"] is True
    assert r["P prefix/none"] == 1.5 and r["target P prefix >= 1.4x none"] is True
    assert r["W qbatch/raw"] == 0.98 and r["target W >= 0.97x raw"] is True
    q["P-prefix"], q["W-prefix"] = _run(1300), _run(4800)
    r = bp.ratios(raw, q)
    assert r["target P prefix >= 1.4x raw"] is False and r["target W >= 0.97x raw"] is False
    assert bp.ratios({}, {"P-prefix": _run(1)}) == {}


# ---------------------------------------------------------------------------- physical limits


def test_kv_column_names_each_phases_engines_caches() -> None:
    # two engines on one card each load the weights: the report says what cache each had
    assert bp.kv_column(271_472) == "271,472"
    assert bp.kv_column([37_968, 37_968]) == "2 x 37,968"
    assert bp.kv_column([37_968, 36_000]) == "37,968 + 36,000"
    assert bp.kv_column(None) == bp.kv_column([None, 1]) == bp.kv_column([]) == "-"


def test_qwen3_14b_parameter_count_from_its_config() -> None:
    params = ceiling.model_params(FIXTURE)
    assert 14.7e9 < params < 14.9e9  # Qwen3-14B: 14.8B (13.2B without the embeddings)
    small = json.loads((FIXTURE / "config-0.6b.json").read_text())
    assert 0.59e9 < ceiling.qwen3_params(small) < 0.61e9  # Qwen3-0.6B, tied embeddings


def test_the_bf16_ceiling_is_the_issues_27k_on_an_h200() -> None:
    params = ceiling.model_params(FIXTURE)
    h200 = ceiling.limits(params, ceiling.DEVICES["H200"])
    assert h200["tflops"] == 790.0
    assert 26_500 < h200["ceiling_total_tok_s"] < 27_000
    # a decode step reads 29.5 GB of bf16 weights: 6.2 ms at 4.8 TB/s, 8.8 ms at 3.35
    assert h200["weight_read_floor_ms"] == pytest.approx(6.15, abs=0.05)
    h100 = ceiling.limits(params, ceiling.DEVICES["H100"])
    assert h100["ceiling_total_tok_s"] == h200["ceiling_total_tok_s"]  # same compute die
    assert h100["weight_read_floor_ms"] == pytest.approx(8.82, abs=0.05)
    pcie = ceiling.limits(params, ceiling.DEVICES["H100 PCIe"])
    assert pcie["ceiling_total_tok_s"] == pytest.approx(
        h200["ceiling_total_tok_s"] * 756 / 989.4, rel=1e-3
    )
    assert ceiling.limits(params, ceiling.DEVICES["H200"], tflops=395)["ceiling_total_tok_s"] == (
        pytest.approx(h200["ceiling_total_tok_s"] / 2, rel=1e-3)
    )


def test_device_names_and_the_table_cell() -> None:
    assert ceiling.device_for("1x NVIDIA H200") is ceiling.DEVICES["H200"]
    assert ceiling.device_for("NVIDIA H100 80GB HBM3") is ceiling.DEVICES["H100"]
    assert ceiling.device_for("NVIDIA H100 PCIe") is ceiling.DEVICES["H100 PCIe"]
    assert ceiling.device_for("no GPU") is None
    params = ceiling.model_params(FIXTURE)
    assert ceiling.column(13_360, "1x NVIDIA H200", params) == "13,360 = 50% of 26.7K"
    assert ceiling.column(1.0, "no GPU", params).startswith("n/a")
    assert ceiling.share_of_ceiling(1.0, 0.0) == 0.0


def test_prefix_cache_hits_are_not_computed_tokens() -> None:
    """The ceiling bounds what the GPU computes: P with placement served 2,794,000 of its
    3,552,518 prompt tokens from the cache (H200, 2026-12-06), so its total tokens/s was
    205% of the ceiling and its computed tokens/s 54%."""
    row = {"prompt_tokens": 3_552_518, "cached_tokens": 2_794_000, "completion_tokens": 234_558}
    assert ceiling.computed_tokens(3_552_518, 2_794_000, 234_558) == 993_076
    assert ceiling.computed_rate(row, 69.117) == pytest.approx(14_368, abs=1)
    assert ceiling.computed_rate(row | {"cached_tokens": None}, 1.0) == 3_787_076
    assert ceiling.computed_rate(row, 0.0) == 0.0
    params = ceiling.model_params(FIXTURE)
    cell = ceiling.column(ceiling.computed_rate(row, 69.117), "1x NVIDIA H200", params)
    assert cell == "14,368 = 54% of 26.7K"
