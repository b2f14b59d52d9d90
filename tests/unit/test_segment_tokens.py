"""worker/segment_tokens.py gives exactly the ids of encoding the whole text, with the long
stretches between added tokens cached: checked on the real Qwen3 tokenizer over rendered
prompts (the night of job families, tools included) and texts built to stress the edges
(stretches touching added tokens, whitespace and Unicode at the cut, added tokens back to
back, an added token's text split by a stretch); a tokenizer whose added tokens strip or
normalize is encoded whole; the cache stays under its bound."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import RequestEnvelope
from tests.benchmarks import bench_runbatch as rb
from tests.benchmarks import families
from worker.rendering import PromptRenderer
from worker.segment_tokens import SegmentEncoder, plain_added_tokens

WORDS = ["alpha", "beta", " gamma", "δέλτα", "\n", "  ", "\t", "emoji 🙂", "x" * 40, "日本語"]


def whole(tok: Any, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def test_qwen3_added_tokens_split_the_raw_text(qwen3_tokenizer: Any) -> None:
    added = plain_added_tokens(qwen3_tokenizer)
    assert added is not None and added["<|im_start|>"] == 151644
    assert SegmentEncoder(qwen3_tokenizer).enabled


def test_rendered_family_prompts_match_and_hit_the_cache(qwen3_tokenizer: Any) -> None:
    lines = families.night_lines(rb.vocab_words(), families=12, lines=48, seed=5)
    renderer = PromptRenderer(qwen3_tokenizer, max_model_len=8192, served_names={rb.SERVED})
    plain = PromptRenderer(qwen3_tokenizer, max_model_len=8192, served_names={rb.SERVED})
    plain.prompt_encoder = None  # the whole-text path, as before
    for line in lines:
        env = RequestEnvelope.model_validate(
            {"request_id": line["custom_id"], "endpoint": line["url"], "body": line["body"]}
        )
        fast, slow = renderer.render(env), plain.render(env)
        assert fast.token_ids == slow.token_ids
        assert fast.token_ids == whole(qwen3_tokenizer, fast.text)
    encoder = renderer.prompt_encoder
    assert encoder is not None and encoder.hits >= 48 - 12  # a family's prompt after its first


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 10_000), min_size=1, max_size=12), st.randoms())
def test_any_mix_of_stretches_and_added_tokens_matches(
    qwen3_tokenizer: Any, seeds: list[int], rng: random.Random
) -> None:
    added = sorted(plain_added_tokens(qwen3_tokenizer) or {})
    pieces = []
    for seed in seeds:
        kind = seed % 4
        if kind == 0:
            pieces.append(rng.choice(added))
        elif kind == 1:
            pieces.append(rng.choice(added)[: rng.randint(1, 5)])  # a token's text cut short
        else:
            pieces.append("".join(rng.choice(WORDS) for _ in range(rng.randint(0, 60))))
    text = "".join(pieces)
    encoder = SegmentEncoder(qwen3_tokenizer, min_chars=8)
    assert encoder.encode(text) == whole(qwen3_tokenizer, text)
    assert encoder.encode(text) == whole(qwen3_tokenizer, text)  # from the cache too


def test_edges_at_the_cuts(qwen3_tokenizer: Any) -> None:
    encoder = SegmentEncoder(qwen3_tokenizer, min_chars=4)
    for text in [
        "<|im_start|>system\n  leading and trailing  \n<|im_end|>\n",
        "<|im_start|><|im_end|><|im_start|>user\n\n\n\n<|im_end|>",
        "no added tokens at all, long enough to be cached " * 3,
        '<tool_call>\n{"name": "f"}\n</tool_call><think>\n\n</think>\n\nok',
        "x<|im_end|>y",
        "<|im_start|>" * 3,
    ]:
        assert encoder.encode(text) == whole(qwen3_tokenizer, text), text


class _Added:
    def __init__(self, content: str, **flags: bool) -> None:
        self.content = content
        self.normalized = flags.get("normalized", False)
        self.lstrip = flags.get("lstrip", False)
        self.rstrip = flags.get("rstrip", False)
        self.single_word = flags.get("single_word", False)


@pytest.mark.parametrize("flag", ["normalized", "lstrip", "rstrip", "single_word"])
def test_a_stripping_or_normalized_added_token_means_whole_text(flag: str) -> None:
    calls: list[str] = []
    tok = SimpleNamespace(
        is_fast=True,
        added_tokens_decoder={1: _Added("<a>"), 2: _Added("<b>", **{flag: True})},
        encode=lambda text, add_special_tokens: calls.append(text) or [len(text)],
    )
    encoder = SegmentEncoder(tok, min_chars=1)
    assert not encoder.enabled
    assert encoder.encode("x" * 50 + "<a>" + "y" * 50) == [103]
    assert calls == ["x" * 50 + "<a>" + "y" * 50]


def test_the_cache_keeps_under_its_bound(qwen3_tokenizer: Any) -> None:
    encoder = SegmentEncoder(qwen3_tokenizer, min_chars=16, max_cached_tokens=200)
    for i in range(40):
        text = f"<|im_start|>system\n{'word ' * 60}{i}<|im_end|>"
        assert encoder.encode(text) == whole(qwen3_tokenizer, text)
        assert encoder._cached_tokens <= 200
    assert encoder.misses == 40 and len(encoder._cache) <= 3
