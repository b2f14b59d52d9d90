"""Prefix-aware placement (producer/placement.py): family keys, the planner, and the client
applying them (a fake producer: which partition each record was sent to, in which order)."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from producer.client import QBatchClient, Request
from producer.jobs import planner_for
from producer.placement import (
    DEFAULT_MAX_RUN,
    DEFAULT_PREFIX_CHARS,
    PlacementMode,
    PrefixPlanner,
    arrange,
    canonical_prefix,
    family_key,
    home_partition,
    placement_mode,
    plan_window,
)
from schemas import validate_envelope

REPO = Path(__file__).resolve().parents[2]
POLICY = "Follow the policy. " * 300  # ~5,700 characters: a long shared system prompt


def chat(system: str, user: str, **extra: Any) -> dict[str, Any]:
    return {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        **extra,
    }


# ---------------------------------------------------------------- family key


def test_lines_sharing_a_long_prefix_are_one_family() -> None:
    a = family_key(chat(POLICY, "question one"))
    b = family_key(chat(POLICY, "a different question"))
    assert a is not None and a == b
    assert len(a) == 32 and int(a, 16) >= 0  # a hex digest
    assert family_key(chat(POLICY.replace("policy", "rules"), "question one")) != a


def test_a_short_prompt_has_no_family() -> None:
    assert family_key(chat("You are a helpful assistant.", "hi")) is None
    assert family_key({"prompt": "x" * 100}) is None
    assert family_key({"prompt": "x" * 100}, prefix_chars=50) is not None


def test_the_key_covers_only_the_first_prefix_chars() -> None:
    body = chat(POLICY, "q")
    text = canonical_prefix(body, DEFAULT_PREFIX_CHARS)
    assert len(text) == DEFAULT_PREFIX_CHARS
    # lines that differ only after the first prefix_chars characters are one family
    assert family_key(chat(POLICY + "tail one", "q")) == family_key(chat(POLICY + "tail 2", "q"))
    # the order is the template's: model, tools, then the messages
    assert text.startswith("model\x1f")
    assert text.index("\x1esystem\x1f") > 0


def test_model_salt_and_tools_split_families() -> None:
    base = family_key(chat(POLICY, "q"))
    assert family_key(chat(POLICY, "q", model="other-model")) != base
    assert family_key(chat(POLICY, "q", cache_salt="tenant-a")) != base
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with_tools = family_key(chat(POLICY, "q", tools=[tool]))
    assert with_tools not in (None, base)
    # sampling fields are not part of the prompt
    assert family_key(chat(POLICY, "q", temperature=0.2, max_tokens=9)) == base


def test_a_validated_body_and_its_json_give_the_same_family() -> None:
    tool = {
        "type": "function",
        "function": {"name": "lookup", "description": "Look up.", "parameters": {"type": "object"}},
    }
    body = {
        "model": "m",
        "tools": [tool],
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": POLICY}]},
            {"role": "user", "content": "q", "name": "ann"},
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "content": "42", "tool_call_id": "c1"},
        ],
    }
    envelope = validate_envelope({"request_id": "r1", "body": body})
    assert family_key(body, prefix_chars=64) == family_key(envelope.body, prefix_chars=64)
    # text parts flatten to the same text as a plain string
    plain = {**body, "messages": [{"role": "system", "content": POLICY}, *body["messages"][1:]]}
    assert canonical_prefix(plain, 10_000) == canonical_prefix(envelope.body, 10_000)


def test_completions_prompts() -> None:
    long = "Translate: " + "word " * 1_000
    assert family_key({"prompt": long + "a"}) == family_key({"prompt": long + "b"})
    assert family_key({"prompt": [long, "other"]}) == family_key({"prompt": long})
    assert family_key({"prompt": list(range(2_000))}) is not None  # token ids


def test_a_huge_conversation_is_cut_early() -> None:
    body = chat("s" * 2_000_000, "q")
    assert len(canonical_prefix(body, 100)) == 100


def test_family_keys_and_partitions_are_stable_across_processes() -> None:
    """No Python hash(): another interpreter (another PYTHONHASHSEED) agrees."""
    here = (family_key(chat(POLICY, "q")), home_partition("fam", 7))
    code = (
        "from producer.placement import family_key, home_partition\n"
        f"print(family_key({chat(POLICY, 'q')!r}), home_partition('fam', 7))"
    )
    for seed in ("1", "2"):
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            cwd=REPO,
            env={"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"},
            check=True,
        ).stdout.split()
        assert (out[0], int(out[1])) == here


# ---------------------------------------------------------------- planner


def window_of(families: Sequence[str | None]) -> list[tuple[str, str | None]]:
    return [(f"r{i}", fam) for i, fam in enumerate(families)]


def test_lines_are_grouped_by_family_in_order_of_first_appearance() -> None:
    window = window_of(["A", "B", "A", None, "C", "B", "A"])
    placed = plan_window(window, 4)
    assert [p.request_id for p in placed] == ["r0", "r2", "r6", "r1", "r5", "r3", "r4"]
    by_family: dict[str | None, set[int | None]] = {}
    for p in placed:
        by_family.setdefault(p.family, set()).add(p.partition)
    assert by_family[None] == {None}  # no family: Kafka's key partitioner, as before
    for fam in "ABC":
        assert by_family[fam] == {home_partition(fam, 4)}
    assert sorted(p.index for p in placed) == list(range(len(window)))


def test_a_family_over_the_cap_rotates_over_partitions_in_runs() -> None:
    window = window_of(["big"] * 10 + ["small"] * 2 + ["big"] * 3)
    placed = plan_window(window, 3, max_run=4)
    home = home_partition("big", 3)
    big = [p for p in placed if p.family == "big"]
    runs = [home, (home + 1) % 3, (home + 2) % 3, home]
    assert [p.partition for p in big] == [runs[i // 4] for i in range(13)]
    # file order inside the family; runs interleaved with the other families' first runs
    assert [p.request_id for p in big] == [f"r{i}" for i in (*range(10), 12, 13, 14)]
    order = [p.family for p in placed]
    assert order == ["big"] * 4 + ["small"] * 2 + ["big"] * 9
    assert placed[4].partition == placed[5].partition == home_partition("small", 3)


def test_a_huge_family_is_spread_evenly_and_does_not_starve_the_others() -> None:
    window = window_of(["huge"] * 1_000 + ["x"] * 5)
    placed = plan_window(window, 6)
    counts = Counter(p.partition for p in placed if p.family == "huge")
    assert len(counts) == 6 and max(counts.values()) - min(counts.values()) <= DEFAULT_MAX_RUN
    huge = [p.partition for p in placed if p.family == "huge"]
    runs = [huge[i : i + DEFAULT_MAX_RUN] for i in range(0, 1_000, DEFAULT_MAX_RUN)]
    assert all(len(set(run)) == 1 for run in runs)  # runs of 64 consecutive lines
    assert all(a[0] != b[0] for a, b in pairwise(runs))  # each on the next partition
    # the small family goes right after the first run, not behind all 1,000 lines
    assert [p.index for p in placed].index(1_000) == DEFAULT_MAX_RUN


def test_runs_continue_across_windows_with_one_planner() -> None:
    planner = PrefixPlanner(max_run=4)
    parts = []
    for _chunk in range(5):  # a family of 3 lines in each of 5 chunks
        parts += [p.partition for p in planner.plan(window_of(["f"] * 3), 5)]
    home = home_partition("f", 5)
    assert parts == [(home + i // 4) % 5 for i in range(15)]
    assert planner.families == 1 and planner.placed == 15
    # a fresh planner (plan_window) starts at the home partition every time
    assert {p.partition for p in plan_window(window_of(["f"] * 3), 5)} == {home}


@pytest.mark.parametrize("partitions", [1, 2, 3, 7, 13])
def test_small_and_odd_partition_counts(partitions: int) -> None:
    window = window_of([f"fam{i % 9}" for i in range(200)] + [None] * 3)
    placed = plan_window(window, partitions, max_run=8)
    assert sorted(p.index for p in placed) == list(range(len(window)))
    assert all(p.partition is None or 0 <= p.partition < partitions for p in placed)
    if partitions == 1:
        assert {p.partition for p in placed if p.family} == {0}


def test_plans_are_deterministic() -> None:
    window = window_of([f"f{i % 5}" if i % 7 else None for i in range(300)])
    assert plan_window(window, 4, max_run=16) == plan_window(window, 4, max_run=16)


@given(
    st.lists(st.one_of(st.none(), st.sampled_from("abcde")), max_size=80),
    st.integers(1, 9),
    st.integers(1, 10),
)
def test_every_line_is_placed_once_and_families_keep_file_order(
    families: list[str | None], partitions: int, max_run: int
) -> None:
    placed = plan_window(window_of(families), partitions, max_run=max_run)
    assert sorted(p.index for p in placed) == list(range(len(families)))
    for fam in set(families) - {None}:
        indexes = [p.index for p in placed if p.family == fam]
        assert indexes == sorted(indexes)
    lone = [p.index for p in placed if p.family is None]
    assert lone == sorted(lone)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        plan_window(window_of(["a"]), 0)
    with pytest.raises(ValueError):
        PrefixPlanner(max_run=0)
    with pytest.raises(ValueError):
        family_key(chat(POLICY, "q"), prefix_chars=0)
    with pytest.raises(ValueError, match="prefix, none"):
        placement_mode("sticky")
    assert placement_mode("none") is PlacementMode.none
    assert planner_for("none") is None and isinstance(planner_for("prefix"), PrefixPlanner)


def test_arrange_plans_each_topic_and_asks_partitions_only_when_needed() -> None:
    asked: list[str] = []

    def partitions(topic: str) -> int | None:
        asked.append(topic)
        return {"t1": 4}.get(topic)

    order = arrange(
        ["a", "b", "c", "d", "e"],
        ["F", None, "F", None, "G"],
        ["t1", "t1", "t1", "t2", "t3"],
        partitions,
        PrefixPlanner(),
    )
    f, g = home_partition("F", 4), None
    assert order == [(0, f), (2, f), (1, None), (3, None), (4, g)]
    assert asked == ["t1", "t3"]  # t2 has no family; t3's count is unknown: left as is


# ---------------------------------------------------------------- the client


class Future:
    is_done = True

    def get(self, timeout: float | None = None) -> None:
        return None


class Producer:
    def __init__(self, partitions: int) -> None:
        self.partitions = partitions
        self.sent: list[tuple[str, str, int | None]] = []

    def send(self, topic: str, key: bytes, value: bytes, partition: int | None = None) -> Future:
        self.sent.append((topic, key.decode(), partition))
        return Future()

    def partitions_for(self, topic: str) -> set[int]:
        return set(range(self.partitions))

    def flush(self, timeout: float | None = None) -> None:
        return None


def test_submit_many_places_only_when_asked() -> None:
    producer = Producer(partitions=5)
    qb = QBatchClient(producer=producer, topic="req")
    bodies = [chat(POLICY if i % 2 else POLICY.upper(), f"q{i}") for i in range(6)]
    requests = [Request(b, request_id=f"r{i}") for i, b in enumerate(bodies)]
    ids = qb.submit_many(requests, placement="prefix")
    assert ids == [f"r{i}" for i in range(6)]  # ids come back in the caller's order
    assert [key for _t, key, _p in producer.sent] == ["r0", "r2", "r4", "r1", "r3", "r5"]
    odd, even = family_key(bodies[1]), family_key(bodies[0])
    assert odd is not None and even is not None
    assert {p for _t, k, p in producer.sent if k in ("r1", "r3", "r5")} == {home_partition(odd, 5)}
    assert {p for _t, k, p in producer.sent if k in ("r0", "r2", "r4")} == {home_partition(even, 5)}
    producer.sent.clear()
    qb.submit_many([Request(b, request_id=f"s{i}") for i, b in enumerate(bodies)])
    assert producer.sent == [("req", f"s{i}", None) for i in range(6)]  # default: as before
