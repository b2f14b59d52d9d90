"""The level planner: chunk sizes from the context, single-pass documents, greedy reduce
groups of at least two, convergence, and the request body."""

from __future__ import annotations

import random

import pytest

from producer.summarize.plan import (
    Budget,
    PlanError,
    Summary,
    check_budget,
    chunk_sizes,
    map_task,
    reduce_tasks,
    request_body,
)
from producer.summarize.templates import Templates
from tests.summarize_fixtures import WhitespaceTokenizer

WS = WhitespaceTokenizer()
PLAIN = Templates(map="{text}", reduce="{text}", single="{text}", instructions="")


def words(n: int, tag: str = "w") -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def test_chunk_sizes_from_the_context() -> None:
    # 100 - 10 summary - 0 margin - 14 (room for part/parts digits) = 76; overlap 76 // 16
    assert chunk_sizes(Budget(100, 10, 0), WS, PLAIN, "") == (76, 4)
    big = Budget(context=32_768)
    assert chunk_sizes(big, WS, Templates(), "")[0] == 8_192
    assert chunk_sizes(big, WS, Templates(), "")[1] == 256
    assert chunk_sizes(Budget(100, 10, 0, chunk_tokens=20, overlap_tokens=0), WS, PLAIN, "") == (
        20,
        0,
    )
    # instructions count: longer ones leave less room
    assert (
        chunk_sizes(
            Budget(100, 10, 0),
            WS,
            Templates(map="{instructions} {text}", single="{text}"),
            words(6),
        )[0]
        == 70
    )
    with pytest.raises(PlanError, match="does not fit"):
        chunk_sizes(Budget(100, 10, 0, chunk_tokens=77), WS, PLAIN, "")
    with pytest.raises(PlanError, match="size must be > overlap"):
        chunk_sizes(Budget(100, 10, 0, chunk_tokens=20, overlap_tokens=20), WS, PLAIN, "")


def test_budget_must_admit_two_summaries() -> None:
    check_budget(Budget(100, 33, 0), WS, PLAIN)  # 2 * 33 <= 100 - 33
    with pytest.raises(PlanError, match="cannot converge"):
        check_budget(Budget(100, 34, 0), WS, PLAIN)
    check_budget(Budget(100, 33, 1), WS, PLAIN)
    with pytest.raises(PlanError, match="cannot converge"):
        check_budget(Budget(100, 33, 2), WS, PLAIN)


def test_single_pass_and_map_tasks() -> None:
    one = map_task(Templates(), "Be brief.", "TEXT", 0, 1)
    assert one.final and one.level == 1 and one.prompt.startswith("Summarise this document.")
    part = map_task(Templates(), "Be brief.", "TEXT", 2, 5)
    assert not part.final and part.covers == (2, 3)
    assert part.prompt.startswith("This is part 3 of 5 ") and part.prompt.endswith("TEXT")


def test_reduce_fits_one_pass_or_groups_greedily() -> None:
    budget = Budget(context=30, summary_tokens=4, margin=0)  # prompts of <= 26 tokens
    summaries = [words(4, f"s{i}_") for i in range(10)]
    (final,) = reduce_tasks(summaries[:6], 2, WS, PLAIN, "", budget)
    assert final.final and final.covers == (0, 6) and final.prompt == "\n\n".join(summaries[:6])
    groups = reduce_tasks(summaries, 2, WS, PLAIN, "", budget)
    assert [(t.covers, t.final, t.index, t.level) for t in groups] == [
        ((0, 6), False, 0, 2),
        ((6, 10), False, 1, 2),
    ]
    # a lone last summary that does not fit the group before it is reduced on its own
    seven = reduce_tasks(summaries[:7], 2, WS, PLAIN, "", budget)
    assert [t.covers for t in seven] == [(0, 6), (6, 7)]
    # over-long summaries still pair up (at least two a group)
    long = [words(20, f"l{i}_") for i in range(5)]
    assert [t.covers for t in reduce_tasks(long, 3, WS, PLAIN, "", budget)] == [
        (0, 2),
        (2, 4),
        (4, 5),
    ]


@pytest.mark.parametrize("seed", range(5))
def test_reduce_converges(seed: int) -> None:
    rng = random.Random(seed)
    budget = Budget(context=200, summary_tokens=30, margin=5)
    check_budget(budget, WS, PLAIN)
    summaries = [words(rng.randint(1, 30), f"x{i}_") for i in range(rng.randint(2, 200))]
    level = 2
    while True:
        tasks = reduce_tasks(summaries, level, WS, PLAIN, "", budget)
        assert all(WS.count(t.prompt) <= budget.prompt_limit for t in tasks)
        assert [t.covers[0] for t in tasks] == [0, *[t.covers[1] for t in tasks[:-1]]]
        assert tasks[-1].covers[1] == len(summaries)
        if tasks[0].final:
            assert len(tasks) == 1
            break
        assert len(tasks) <= (len(summaries) + 1) // 2
        summaries = [words(30, f"y{level}_{t.index}_") for t in tasks]  # max-length answers
        level += 1
    assert level < 12


def test_request_body_and_summary_line() -> None:
    assert request_body("P", summary_tokens=64) == {
        "messages": [{"role": "user", "content": "P"}],
        "max_tokens": 64,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    thinking = request_body("P", summary_tokens=8, model="m", system="S", thinking=True)
    assert (
        thinking["messages"][0] == {"role": "system", "content": "S"} and thinking["model"] == "m"
    )
    assert "chat_template_kwargs" not in thinking
    s = Summary(custom_id="a", chunks=3, levels=2, summary="x")
    s.add_usage(10, 2)
    s.add_usage(5, 1)
    assert s.as_dict()["usage"] == {"prompt_tokens": 15, "completion_tokens": 3, "total_tokens": 18}
