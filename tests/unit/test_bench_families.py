"""The job-families generator of the GPU benchmarks (tests/benchmarks/families.py) keeps
the shape its docstring promises."""

from __future__ import annotations

import collections
import random

from tests.benchmarks import families as fam

WORDS = [f"w{i}" for i in range(500)]


def test_sizes_total_exactly_and_stay_in_range() -> None:
    for seed in range(5):
        sizes = fam.family_sizes(random.Random(seed))
        assert len(sizes) == fam.FAMILIES and sum(sizes) == fam.LINES
        assert min(sizes) >= 1 and max(sizes) <= 16
        assert sorted(sizes)[len(sizes) // 2] <= 5  # most families are small


def test_lines_share_a_system_prompt_per_family_and_are_shuffled() -> None:
    lines = fam.night_lines(WORDS, families=40, lines=180, seed=3)
    assert lines == fam.night_lines(WORDS, families=40, lines=180, seed=3)
    assert len(lines) == 180
    by_family: dict[str, list[dict]] = collections.defaultdict(list)
    for line in lines:
        by_family[line["custom_id"].split("-")[0]].append(line["body"])
    assert len(by_family) == 40
    for bodies in by_family.values():
        assert len({b["messages"][0]["content"] for b in bodies}) == 1
        assert len({"tools" in b for b in bodies}) == 1
        for b in bodies:
            assert 700 <= len(b["messages"][0]["content"].split()) <= 2400
            assert 40 <= len(b["messages"][1]["content"].split()) <= 250
            assert 32 <= b["max_tokens"] <= 200 and b["ignore_eos"] is True
    ids = [line["custom_id"] for line in lines]
    assert ids != sorted(ids)
